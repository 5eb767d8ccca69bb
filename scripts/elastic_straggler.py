"""What one slow replica costs the others: the same elastic run undisturbed, with replica 1 slowed, and slowed
with the round bound (elastic.round_timeout_s), back to back so the three share the machine's load.

    python scripts/elastic_straggler.py [--config configs/tiny.yaml] [--slowdown 3] [--bound 0.5]
                                        [--repeat N] [--report-only] [--out DIR] [--set key=value ...]

Replica 1 is slowed by run.slowdown with run.slow_replica=1 (the slow-link benchmark's `--slow` sets
run.slowdown on its node instead). Prints one markdown
table: replica 0's mean and median time per step it trained (first step left out), ÷ undisturbed, mean ÷
median (what the rounds' waits add to its usual step: a figure the machine's load, which changes between
runs on a shared box, affects less), the rounds that counted a replica out as late, the steps each replica
trained, the quorum sizes replica 0 logged, the final val loss (after the last sync, the same for both)
and whether the replicas' final params are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = [
    "elastic.enabled=true",
    "elastic.timeout_s=5",
    "mesh.sync=2",
    "mesh.shard=1",
    "sync.warmup_steps=0",
    "sync.every=8",
    "sync.method=diloco",
    "run.checkpoint_every=0",  # configs/tiny.yaml keeps one every 100 steps; the timing runs save none
    "run.steps=96",
    "run.eval_every=0",
    "run.log_every=1",
    "run.save_model=true",
    "run.overwrite=true",
    "wandb.mode=disabled",
]


def run(config: str, run_dir: Path, overrides: list[str], slowdown: float) -> None:
    """One elastic run of train.py, replica 1 slowed by `slowdown` (1: undisturbed)."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config]
    slow = [f"run.slowdown={slowdown}", "run.slow_replica=1"]
    for o in [*DEFAULTS, *slow, *overrides, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]:
        cmd += ["--set", o]
    env = {**os.environ, "HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def report(run_dir: Path) -> dict:
    import torch

    records = [json.loads(line) for line in (run_dir / "metrics.replica0.jsonl").read_text().splitlines()]
    fast = json.loads((run_dir / "summary.replica0.json").read_text())
    # Replica 0's steps it trained (a step it cut takes no time and would flatter the mean), less the first
    # (it carries the start-up): their time includes every wait at a round.
    cut = {
        r["step"]
        for i, r in enumerate(records)
        if r.get("cut_steps", 0) > (records[i - 1] if i else {}).get("cut_steps", 0)
    }
    times = [r["step_time_s"] for r in records[1:] if r["step"] not in cut]
    slow = json.loads((run_dir / "summary.replica1.json").read_text())
    params = [torch.load(run_dir / f"model.replica{m}.pt") for m in (0, 1)]
    seen = [r["replicas"] for r in records]
    quorum = [q for i, q in enumerate(seen) if i == 0 or q != seen[i - 1]]
    return {
        "mean": statistics.mean(times),
        "median": statistics.median(times),
        "late": fast.get("late_rounds", 0),
        "rounds": fast["sync_rounds"],
        "quorum": "→".join(map(str, quorum)) if len(quorum) < 8 else f"{quorum[0]}, then 1 and 2 mixed",
        "val_loss": fast["final_val_loss"],  # after the last sync: the replicas' params are θ_g (equal)
        "trained": (len(records) - fast.get("cut_steps", 0), len(records) - slow.get("cut_steps", 0)),
        "equal": all(torch.equal(params[0][k], params[1][k]) for k in params[0]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs/tiny.yaml"))
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--bound", type=float, default=0.5, help="elastic.round_timeout_s of the bounded run")
    p.add_argument("--out", default="runs/elastic-straggler")
    p.add_argument("--repeat", type=int, default=1, help="the three runs this many times, interleaved")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--report-only", action="store_true", help="print the table of the runs already in --out")
    args = p.parse_args()
    out = Path(args.out)
    runs = [
        ("undisturbed", 1.0, []),
        (f"replica 1 {args.slowdown:g}× slower", args.slowdown, []),
        (f"… with round_timeout_s={args.bound:g}", args.slowdown, [f"elastic.round_timeout_s={args.bound}"]),
    ]
    rows = []  # (name, repeat, report)
    for k in range(args.repeat):  # interleaved, so a change in the machine's load hits all three alike
        for i, (name, slowdown, extra) in enumerate(runs):
            run_dir = out / f"repeat{k}" / f"run{i}"
            if not args.report_only:
                run(args.config, run_dir, [*args.set, *extra], slowdown)
            rows.append((name, k, report(run_dir)))
    # Each run against the undisturbed run of its own repeat (the load of the same minutes): its mean step, and
    # its mean ÷ median step (what the rounds' waits add to its usual step, which the load changes less).
    base = {k: r for name, k, r in rows if name == runs[0][0]}
    ratio = {(name, k): r["mean"] / base[k]["mean"] for name, k, r in rows}
    waits = {(name, k): (r["mean"] / r["median"]) / (base[k]["mean"] / base[k]["median"]) for name, k, r in rows}
    print(
        "| run | replica 0 mean step | ÷ undisturbed | its median step | mean ÷ median | ÷ undisturbed's "
        "| late rounds / rounds | steps trained (0, 1) | quorum sizes (replica 0) | final val loss "
        "| replicas bitwise equal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for name, k, r in rows:
        cells = [
            name if args.repeat == 1 else f"{name} (#{k + 1})",
            f"{r['mean']:.3f} s",
            f"{ratio[name, k]:.2f}×",
            f"{r['median']:.3f} s",
            f"{r['mean'] / r['median']:.2f}",
            f"{waits[name, k]:.2f}×",
            f"{r['late']} / {r['rounds']}",
            f"{r['trained'][0]}, {r['trained'][1]}",
            r["quorum"],
            f"{r['val_loss']:.4f}",
            "yes" if r["equal"] else "no",
        ]
        print("| " + " | ".join(cells) + " |")
    if args.repeat > 1:
        for what, values in (("mean step", ratio), ("mean ÷ median step", waits)):
            per_run = [
                f"{name}: {statistics.median(v for (n, _), v in values.items() if n == name):.2f}×"
                for name, _, _ in runs[1:]
            ]
            print(f"\nmedian over the repeats of the {what} ÷ the undisturbed run's: " + ", ".join(per_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
