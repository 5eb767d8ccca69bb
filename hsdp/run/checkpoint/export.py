"""Reading one model's full params out of a checkpoint, in one process (no process group): what
`python -m hsdp.export` and `python -m hsdp.sample` load (docs/design.md §12.1, Export)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from hsdp.config.schema import ConfigError
from hsdp.engines.registry import saved_engine_class
from hsdp.models.gpt import GPT
from hsdp.run.checkpoint.integrity import first_non_finite
from hsdp.run.checkpoint.keys import export_prefix
from hsdp.run.checkpoint.validate import read_dcp_metadata, read_meta, read_saved_config, verify_files


def read_model(checkpoint: Path, replica: Optional[int], use_global: bool) -> tuple[dict[str, torch.Tensor], str]:
    """GPT's full fp32 state dict from a complete checkpoint, and what it is: θ_g by default where the sync
    state has it, else replica 0; `replica` m's own params, or `use_global` θ_g (ConfigError if absent).
    DCP assembles each full tensor from whatever shards the checkpoint holds."""
    meta = read_meta(checkpoint, key="checkpoint")
    cfg = read_saved_config(checkpoint, key="checkpoint")
    read_dcp_metadata(checkpoint, key="checkpoint")  # fails early (ConfigError) on missing or truncated files
    verify_files(checkpoint, key="checkpoint")  # and on files whose bytes changed since the save
    prefix, what = export_prefix(saved_engine_class(meta["engine"]).state_per_replica, meta, replica, use_global)
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
