"""Export a checkpoint as a plain full state dict of `hsdp.models.gpt.GPT`, or as a Hugging Face folder (one process).

    python -m hsdp.export <checkpoint> <out> [--replica m | --global] [--format pt | safetensors | hf]

Default: θ_g, the global model, if the checkpoint has one (DiLoCo, int8 or a
delayed sync), else replica 0. `--replica m` picks replica m's own params (they
differ from θ_g and from each other between param syncs); baselines (fsdp2,
ddp) have one model. DCP assembles each full tensor from whatever shards the
checkpoint holds, so the mesh it was saved on does not matter. The output loads
with `GPT(cfg.model).load_state_dict(torch.load(out))`.

`--format safetensors` writes the same tensors as a `.safetensors` file;
`--format hf` writes a folder `transformers.AutoModelForCausalLM.from_pretrained`
loads with no custom code (GPT2LMHeadModel or LlamaForCausalLM, hsdp/models/hf.py): config.json,
model.safetensors, generation_config.json and, when the run's data has a tokenizer.json,
the tokenizer files AutoTokenizer loads. Every format can be `model.init_from` of a run.

A checkpoint path that does not exist (pruned by `run.keep_checkpoints`, or never
saved) or is unfinished is refused with the run's complete checkpoints listed; one
pruned while it is being read (a run still training) is reported as such.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from hsdp.config.schema import Config, ConfigError
from hsdp.core.atomic import temp_name
from hsdp.data.tokens import tokenizer_path
from hsdp.models.hf import write_hf_folder
from hsdp.run.checkpoint import (
    CHECKPOINTS,
    COMPLETE,
    complete_checkpoints,
    free_bytes,
    read_saved_config,
    save_failure,
    state_bytes,
    step_of,
)
from hsdp.run.checkpoint.export import read_model
from hsdp.run.rundir import FORBIDDEN_ROOTS


class CheckpointGone(ConfigError):
    """The checkpoint folder vanished or lost its marker while it was read (pruned by a run still training)."""


def run_checkpoints(run: Path) -> list[Path]:
    """A run folder's complete checkpoints: its own, then each elastic replica's (replica<m>/checkpoints)."""
    homes = [run, *sorted((p for p in run.glob("replica[0-9]*") if p.is_dir()), key=lambda p: int(p.name[7:]))]
    return [c for home in homes for c in complete_checkpoints(home)]


def available(run: Path) -> str:
    """The run's complete checkpoints, for a one-line error (the newest few, relative to the run)."""
    found = run_checkpoints(run)
    if not found:
        return f"{run} has no complete checkpoint"
    names = [str(c.relative_to(run)) for c in found]
    more = f"{len(names) - 6} older and " if len(names) > 6 else ""
    return f"{run}'s complete checkpoints: {more}{', '.join(names[-6:])}"


def run_of(path: Path) -> Optional[Path]:
    """The run folder of a path named like <run>/[replica<m>/]checkpoints/step_N, if it exists."""
    if path.parent.name != CHECKPOINTS:
        return None
    run = path.parent.parent
    if run.name.startswith("replica") and run.name[7:].isdigit():
        run = run.parent
    return run if run.is_dir() else None


def check_checkpoint_path(path: Path) -> None:
    """ConfigError (one line, with the run's checkpoints where known) unless `path` is a complete checkpoint."""
    run = run_of(path)
    if not path.exists():
        why = "pruned by run.keep_checkpoints, or never saved" if step_of(path) is not None else "no such folder"
        where = f"; {available(run)}" if run else ""
        raise CheckpointGone(f"checkpoint: {path} does not exist ({why}){where}")
    if not path.is_dir():
        raise ConfigError(f"checkpoint: {path} is a file; give a checkpoint folder (<run>/checkpoints/step_N)")
    if (path / COMPLETE).is_file():
        return
    if (path / CHECKPOINTS).is_dir() or any(path.glob(f"replica[0-9]*/{CHECKPOINTS}")):  # a run folder
        raise ConfigError(f"checkpoint: {path} is a run folder; give one of its checkpoints ({available(path)})")
    where = f"; {available(run)}" if run else ""
    raise ConfigError(
        f"checkpoint: {path} is not a complete checkpoint (no {COMPLETE} marker: a save in progress or one "
        f"that never finished){where}"
    )


def export(checkpoint: Path, replica: Optional[int] = None, use_global: bool = False) -> tuple[dict, str]:
    """The full fp32 state dict of GPT from `checkpoint`, and what it is (θ_g or a replica).

    CheckpointGone if the folder is pruned before or while it is read (a run training with
    run.keep_checkpoints deletes older checkpoints as it saves new ones)."""
    check_checkpoint_path(checkpoint)
    try:
        return read_checkpoint(checkpoint, replica, use_global)
    except Exception:
        if (checkpoint / COMPLETE).is_file():
            raise
        run = run_of(checkpoint)
        where = f"; {available(run)}" if run else ""
        raise CheckpointGone(
            f"checkpoint: {checkpoint} was deleted while it was read (pruned by the run, still training){where}"
        ) from None


def read_checkpoint(checkpoint: Path, replica: Optional[int], use_global: bool) -> tuple[dict, str]:
    """export's reading, after the path was found complete (the checkpoint component's `read_model`)."""
    return read_model(checkpoint, replica, use_global)


FORMATS = ("pt", "safetensors", "hf")


def check_out_path(out: Path, fmt: str = "pt") -> None:
    """The output must be a file (an absent or empty folder for hf) whose folder exists or can be made (ConfigError
    before any work)."""
    if fmt == "hf":
        if out.exists() and not (out.is_dir() and not any(out.iterdir())):
            raise ConfigError(f"out: {out} exists; --format hf writes a new (or empty) folder")
    elif out.is_dir():
        raise ConfigError(f"out: {out} is a folder; give a file name such as {out / 'model.pt'}")
    # Missing folders on the way are created (`out/tiny-hf` on a fresh clone); the nearest one that exists must
    # be a writable folder, and not on a kernel file system (writable to root, but no place for a model).
    parent = out.parent if str(out.parent) else Path(".")
    existing = next(p for p in (parent, *parent.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        raise ConfigError(f"out: {existing} is not a folder")
    absolute = Path(os.path.abspath(out))
    for root in FORBIDDEN_ROOTS:
        if root in absolute.parents:
            raise ConfigError(f"out: {out} is under {root}, a kernel file system; choose a folder on disk")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"out: the folder {existing} is not writable")


def write_export(state: dict, cfg: Config, out: Path, fmt: str) -> None:
    """`state` to `out` in format `fmt` (hf: with the run's tokenizer, if its data has one). Every format appears
    only complete (a temp name, then renamed): a failed write leaves no partial file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        write_hf_folder(out, state, cfg.model, tokenizer_path(cfg))
        return
    tmp = temp_name(out)
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({n: t.contiguous() for n, t in state.items()}, str(tmp), metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_failure(out: Path, error: Exception, needed: int) -> Optional[str]:
    """The one line for a failed write of `out` (a full disk says so, with the bytes free: checkpoints' wording),
    or None when `error` is no write failure (a bug: its traceback is the report)."""
    folder = next((p for p in (out.parent, *out.parent.parents) if p.is_dir()), Path("."))
    line = save_failure(str(out), error, folder, free_bytes(folder), needed)
    if line is None and isinstance(error, RuntimeError) and str(error).startswith("[enforce fail at inline_container"):
        line = f"saving {out} failed: {str(error).splitlines()[0]}"  # torch.save's writer: no errno to go by
    return line


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsdp.export", description=__doc__.splitlines()[0])
    p.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder (<run>/checkpoints/step_N, <run>/replica<m>/checkpoints/...)"
    )
    p.add_argument("out", type=Path, help="output: a .pt / .safetensors file, or a new folder for --format hf")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--replica", type=int, default=None, help="export replica m's own params")
    which.add_argument("--global", dest="use_global", action="store_true", help="export θ_g (the default if present)")
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="pt",
        help="pt: torch.save of the state dict (default); safetensors: the same tensors; hf: a transformers folder",
    )
    args = p.parse_args(argv)
    try:
        check_out_path(args.out, args.format)
        state, what = export(args.checkpoint, args.replica, args.use_global)
        cfg = read_saved_config(args.checkpoint, key="checkpoint")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        write_export(state, cfg, args.out, args.format)
    except Exception as e:  # e.g. the disk filled up while writing: a failure, not bad input (exit 1, as train.py's)
        line = write_failure(args.out, e, state_bytes(state))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1
    print(
        f"wrote {what} from {args.checkpoint} to {args.out} ({sum(t.numel() for t in state.values()):,} params)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
