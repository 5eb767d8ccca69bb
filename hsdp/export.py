"""Export a checkpoint as a plain full state dict of `hsdp.model.GPT` (one process, no process group).

    python -m hsdp.export <checkpoint> <out.pt> [--replica m | --global]

Default: θ_g, the global model, if the checkpoint has one (DiLoCo, int8 or a
delayed sync), else replica 0. `--replica m` picks replica m's own params (they
differ from θ_g and from each other between param syncs); baselines (fsdp2,
ddp) have one model. DCP assembles each full tensor from whatever shards the
checkpoint holds, so the mesh it was saved on does not matter. The output loads
with `GPT(cfg.model).load_state_dict(torch.load(out))`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hsdp.config.schema import ConfigError
from hsdp.engines.registry import saved_engine_class
from hsdp.model import GPT
from hsdp.run.checkpoint import read_dcp_metadata, read_meta, read_saved_config, verify_files
from hsdp.run.integrity import first_non_finite


def export(checkpoint: Path, replica: Optional[int] = None, use_global: bool = False) -> tuple[dict, str]:
    """The full fp32 state dict of GPT from `checkpoint`, and what it is (θ_g or a replica)."""
    meta = read_meta(checkpoint, key="checkpoint")
    cfg = read_saved_config(checkpoint, key="checkpoint")
    read_dcp_metadata(checkpoint, key="checkpoint")  # fails early (ConfigError) on missing or truncated files
    verify_files(checkpoint, key="checkpoint")  # and on files whose bytes changed since the save
    prefix, what = saved_engine_class(meta["engine"]).export_source(meta, replica, use_global)
    with torch.device("meta"):
        model = GPT(cfg.model)
    # Checkpoint tensors have the held layout's shape (a 0-d param is stored as (1,)).
    targets = {
        prefix + n: torch.empty(tuple(p.shape) or (1,), dtype=torch.float32) for n, p in model.named_parameters()
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    state = {n: targets[prefix + n].reshape(p.shape) for n, p in model.named_parameters()}
    bad = first_non_finite(state)
    if bad is not None:
        raise ConfigError(f"checkpoint: {checkpoint} holds a non-finite value in {bad}; not exported")
    return state, what


def check_out_path(out: Path) -> None:
    """The output must be a file in an existing, writable folder (ConfigError before any work)."""
    if out.is_dir():
        raise ConfigError(f"out: {out} is a folder; give a file name such as {out / 'model.pt'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"out: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"out: the folder {parent} is not writable")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder (<run>/checkpoints/step_N)")
    p.add_argument("out", type=Path, help="output .pt file (torch.save of the state dict)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--replica", type=int, default=None, help="export replica m's own params")
    which.add_argument("--global", dest="use_global", action="store_true", help="export θ_g (the default if present)")
    args = p.parse_args(argv)
    try:
        check_out_path(args.out)
        state, what = export(args.checkpoint, args.replica, args.use_global)
        torch.save(state, args.out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. the disk filled up while writing
        print(f"error: out: cannot write {args.out} ({e.strerror})", file=sys.stderr)
        return 2
    print(
        f"wrote {what} from {args.checkpoint} to {args.out} ({sum(t.numel() for t in state.values()):,} params)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
