"""Run an ablation sweep and print its results as a markdown table.

    python -m hsdp.sweep configs/ablations/sync.yaml [--set key=value ...] [--only run,run] [--plot]
                                                     [--no-run] [--resume]

The sweep file, the no-comm twins, the outputs and the exit codes: hsdp/bench/sweep.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from hsdp.bench.spec import load_sweep, parse_only
from hsdp.bench.sweep import run_sweep

__all__ = ["load_sweep", "main"]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="run an ablation sweep")
    p.add_argument("sweep")
    p.add_argument("--set", action="append", default=[], help="extra override for every run")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated runs to (re)run; the others' existing summaries are reused in the table",
    )
    p.add_argument(
        "--plot",
        action="store_true",
        help="also write PNGs of val loss vs tokens, sync bytes and wall-clock next to the table (needs matplotlib)",
    )
    p.add_argument("--no-run", action="store_true", help="run nothing: table (and plots) from existing run folders")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted sweep: keep finished runs, resume a run from its checkpoint, start the rest",
    )
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    return run_sweep(
        args.sweep, args.set, parse_only(args.only), plot=args.plot, no_run=args.no_run, resume=args.resume
    )


if __name__ == "__main__":
    sys.exit(main())
