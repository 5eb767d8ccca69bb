"""Shared test helpers: run train.py as a subprocess (with a timeout) and read its outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# A small GPT whose dims do not divide a shard group of 4 (vocab 257, seq_len 17 → padding).
SMALL = [
    "model.vocab_size=257",
    "model.seq_len=17",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=36",
    "data.source=synthetic",
    "data.batch_size=2",
    "run.log_every=1",
    "run.eval_every=0",
    "run.eval_batches=1",
    "wandb.mode=disabled",
    "optim.lr_warmup=3",
    "run.save_model=true",
    # No biases: the attention key bias has a mathematically zero grad, and Adam turns its
    # rounding noise into lr-sized steps, which would swamp a 1e-5 comparison.
    "model.bias=false",
    # Adam divides by sqrt(v) + eps: with eps=1e-8 the near-zero early grads of some weights turn
    # fp32 reduction-order noise into ~lr-sized steps (measured 1.1e-5 param error after 20 steps);
    # eps=1e-6 damps that 20x (6e-7) without changing what is being compared.
    "optim.eps=1e-6",
]


@dataclass
class RunResult:
    returncode: int
    stderr: str
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def params(self, replica: int = 0) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / f"model.replica{replica}.pt")


def run_train(
    out_dir: Path,
    name: str,
    overrides: list[str],
    config: str | None = None,
    timeout: float = 240,
    check: bool = True,
    env: dict[str, str] | None = None,
    script: list[str] | None = None,
) -> RunResult:
    """`python train.py [--config] --set ...` in a subprocess; a hang fails after `timeout` seconds.

    `script` replaces `train.py` (e.g. `["tests/faulty_train.py", "2", "3"]`).
    """
    script = script or ["train.py"]
    cmd = [sys.executable, str(REPO / script[0]), *script[1:]]
    if config:
        cmd += ["--config", str(REPO / config)]
    for o in [*overrides, f"run.out_dir={out_dir}", f"run.name={name}", "mesh.timeout_s=60"]:
        cmd += ["--set", o]
    env = {**os.environ, "HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    result = RunResult(proc.returncode, proc.stderr, out_dir / name)
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return result


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def max_param_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) for k in a)
