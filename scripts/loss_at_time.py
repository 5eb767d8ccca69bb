"""Val loss of run folders at equal training time: each run's loss at the shortest run's training time.

    python scripts/loss_at_time.py RUN_DIR [RUN_DIR ...] [--at-s SECONDS]

Training time is the cumulative step_time_s of metrics.jsonl (evals excluded; every step must be logged,
run.log_every=1), as the slow-link benchmark's time to target. Without --at-s the time is the shortest
run's whole training time, so every run is compared at a time each of them reached. A run's loss at a
time is read off its val-loss curve, linear between the two evals around it (the last eval at or before
it where no later eval exists). Prints a markdown table: run, steps, training time, final val loss, val
loss at the time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdp.bench.records import read_metrics, wall_clock  # noqa: E402

Curve = list[tuple[float, float]]  # (training seconds at the eval, val loss)


def val_curve(run_dir: Path) -> Curve:
    """(training time, val loss) at each eval of a run folder; a ValueError when its steps were not all logged."""
    steps = read_metrics(run_dir)
    wall = wall_clock(steps)
    if wall is None:
        raise ValueError(f"{run_dir}: not every step is in metrics.jsonl (needs run.log_every=1)")
    return [(wall[s.step], s.val_loss) for s in steps if s.val_loss is not None]


def loss_at(curve: Curve, t: float) -> Optional[float]:
    """The val loss at training time `t`: linear between the evals around it; None before the first eval."""
    before = [(x, y) for x, y in curve if x <= t]
    after = [(x, y) for x, y in curve if x > t]
    if not before:
        return None
    x0, y0 = before[-1]
    if not after:
        return y0
    x1, y1 = after[0]
    return y0 + (y1 - y0) * (t - x0) / (x1 - x0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--at-s", type=float, help="the training time (default: the shortest run's)")
    args = p.parse_args()
    try:
        curves = {r: val_curve(r) for r in args.runs}
        totals = {r: sum(s.step_time_s for s in read_metrics(r)) for r in args.runs}
    except ValueError as e:
        print(f"loss_at_time: {e}", file=sys.stderr)
        return 2
    empty = [str(r) for r, c in curves.items() if not c]
    if empty:
        print(f"loss_at_time: no val loss in {', '.join(empty)}", file=sys.stderr)
        return 2
    at = args.at_s if args.at_s is not None else min(totals.values())
    print(f"| run | steps | training time | final val loss | val loss at {at:.1f} s |")
    print("|---|---:|---:|---:|---:|")
    for r, curve in curves.items():
        got = loss_at(curve, at)
        steps = len(read_metrics(r))
        cell = "n/a" if got is None else f"{got:.4f}"
        print(f"| {r.name} | {steps} | {totals[r]:.1f} s | {curve[-1][1]:.4f} | {cell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
