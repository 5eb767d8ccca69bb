"""What checkpoint saves cost training: the same run with run.checkpoint_async=true and =false.

    python scripts/checkpoint_async.py [--shape tiny|124m] [--steps N] [--every K] [--out runs/ckpt-async]

Runs train.py twice per shape (one process each, wandb off, a checkpoint every K steps) and prints one
markdown table from the summaries: the checkpoints saved, the seconds the training thread spent in saves
(`checkpoint_save_s`: all of it when synchronous; the state's copy and any wait for the previous save when
asynchronous), the writes' own seconds (`checkpoint_write_s`), the state's size and the median step.
`124m` is configs/gpu-124m.yaml's model (llama, 12 × 768, its vocab set to 32768) on the CPU with short
sequences, so each step is quick and the saves (1.5 GB of params and Adam state) dominate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": ["--config", str(REPO / "configs/tiny.yaml"), "--set", "mesh.sync=1", "--set", "mesh.shard=1"],
    "124m": [
        *("--config", str(REPO / "configs/gpu-124m.yaml")),
        *("--set", "model.vocab_size=32768", "--set", "data.source=synthetic", "--set", "mesh.backend=gloo"),
        *("--set", "mesh.shard=1", "--set", "model.seq_len=64", "--set", "data.batch_size=1"),
        *("--set", "optim.grad_accum=1", "--set", "compile.enabled=false", "--set", "precision.param_dtype=fp32"),
    ],
}


def run(shape: str, asynchronous: bool, steps: int, every: int, out: Path) -> dict:
    name = f"{shape}-{'async' if asynchronous else 'sync'}"
    cmd = [sys.executable, str(REPO / "train.py"), *SHAPES[shape]]
    for o in [
        f"run.steps={steps}",
        f"run.checkpoint_every={every}",
        f"run.checkpoint_async={str(asynchronous).lower()}",
        "run.keep_checkpoints=1",
        "run.eval_every=0",
        "run.eval_batches=1",
        "run.log_every=1",
        "wandb.mode=disabled",
        f"run.out_dir={out}",
        f"run.name={name}",
        "run.overwrite=true",
    ]:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "HSDP_NO_BAR": "1"})
    summary = json.loads((out / name / "summary.json").read_text())
    ckpt = next((out / name / "checkpoints").iterdir())
    summary["state_mb"] = sum(f.stat().st_size for f in ckpt.iterdir()) / 2**20
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), action="append")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "runs" / "ckpt-async"))
    args = p.parse_args()
    rows = [
        "| shape | save | checkpoints | state | training waited (checkpoint_save_s) | writes (checkpoint_write_s) "
        "| per save, waited | median step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in args.shape or ["tiny", "124m"]:
        for asynchronous in (False, True):
            s = run(shape, asynchronous, args.steps, args.every, Path(args.out))
            n = s["checkpoints_saved"]
            rows.append(
                f"| {shape} | {'async' if asynchronous else 'sync'} | {n} | {s['state_mb']:.1f} MiB "
                f"| {s['checkpoint_save_s']:.3f} s | {s['checkpoint_write_s']:.3f} s "
                f"| {s['checkpoint_save_s'] / max(n, 1):.3f} s | {s['median_step_time_s']:.3f} s |"
            )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
