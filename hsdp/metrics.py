"""Run outputs: metrics.jsonl, summary.json, wandb (imported lazily), a tqdm bar.

Only rank 0 writes. wandb is imported only when `wandb.mode != disabled`, so a
machine without wandb runs with `--set wandb.mode=disabled`.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from hsdp.config import Config, to_dict

def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MetricsLogger:
    """Writes one JSON object per logged step; mirrors it to wandb and the progress bar."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.run_dir = run_dir
        self._wandb = None
        self._bar: Optional[tqdm] = None
        if not enabled:
            return
        self._file = open(run_dir / "metrics.jsonl", "w")
        if cfg.wandb.mode != "disabled":
            import wandb  # lazy: a GPU box without wandb can still run with mode=disabled

            self._wandb = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.run.name,
                                     mode=cfg.wandb.mode, dir=str(run_dir), config=to_dict(cfg))
        self._bar = tqdm(total=cfg.run.steps, desc=cfg.run.name, dynamic_ncols=True,
                         disable=os.environ.get("HSDP_NO_BAR") == "1")

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.n = step + 1
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.refresh()

    def summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update(summary)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
