"""Train across a real slow link: each replica in its own network namespace, joined by shaped veths.

    python -m hsdp.slowlink --rate 20mbit[,100mbit,...] [--delay-ms 5] [--config C] [--set k=v ...]
                            --runs NAME=override,override ... [--out DIR] [--plot] [--kill 1@0.3]
                            [--partition 1@0.3:20] [--slow 1:3] [--chaos 7:30]   (faults: hsdp/faults/spec.py)
    python -m hsdp.slowlink configs/ablations/slowlink.yaml [--only run,run] [--rate ...] [--plot]
    python -m hsdp.slowlink SPEC --no-run --plot   # tables and plots again from the outputs (no root needed)
    python -m hsdp.slowlink --cleanup        # remove namespaces left by a slowlink that was SIGKILLed

Needs root and iproute2 (`ip`, `tc`); without them it exits 2 with one line. The spec file,
the outputs and the workflow: hsdp/bench/slowlink.py (network: hsdp/bench/netns.py; docs/design.md §14.1).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from hsdp.bench.plan import LinkOptions
from hsdp.bench.slowlink import run_benchmark


def parse_args(argv: Optional[list[str]]) -> LinkOptions:
    p = argparse.ArgumentParser(
        prog="python -m hsdp.slowlink", description="train across a shaped link between network namespaces"
    )
    p.add_argument("spec", nargs="?", help="YAML file with base, set, rates, runs (see hsdp/bench/slowlink.py)")
    p.add_argument("--rate", help="comma-separated rates: 20mbit, 1gbit, unshaped (overrides the spec's)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way netem delay (default 0)")
    p.add_argument("--config", help="base config (default: the spec's base, else configs/tiny.yaml)")
    p.add_argument(
        "--set", dest="shared", metavar="SET", action="append", default=[], help="override for every run (repeatable)"
    )
    p.add_argument("--runs", nargs="+", metavar="NAME=o,o", help="runs and their overrides (replaces the spec's)")
    p.add_argument("--only", default="", help="comma-separated runs to (re)run; others' outputs are reused")
    p.add_argument("--target", help="run whose final val loss is the target (default: the first)")
    p.add_argument("--name", help="prefix of run folders and the output folder (default: the spec's stem)")
    p.add_argument("--out", help="folder for slowlink.json/.md, PNGs, logs (default <run.out_dir>/<name>)")
    p.add_argument("--timeout-s", type=float, default=None, help="bound on each run (default 1200)")
    p.add_argument("--rdzv-timeout-s", type=int, default=120, help="bound on the torchrun rendezvous")
    p.add_argument("--probe-s", type=float, default=None, help="probe size in seconds at the rate (default 2)")
    p.add_argument("--probe-reps", type=int, default=3)
    p.add_argument("--no-probe", action="store_true")
    p.add_argument(
        "--kill",
        metavar="REPLICA@STEP",
        help="SIGKILL replica REPLICA's node at its step STEP (< 1: that fraction of run.steps; REPLICA@STEP:kill "
        "in the fault grammar) and start a replacement after elastic.restart_delay_s, in the runs whose spec names "
        "`kill:` (this value replaces theirs), else in every elastic run but the target",
    )
    p.add_argument(
        "--partition",
        metavar="REPLICA@AT:SECONDS",
        help="take replica REPLICA's link down once it logs step AT (< 1: that fraction of run.steps) for "
        "SECONDS (REPLICA@AT:partition=SECONDS), every process alive, in the runs whose spec names `partition:` "
        "(this value replaces theirs), else in every elastic run but the target",
    )
    p.add_argument(
        "--slow",
        metavar="REPLICA:FACTOR[@AT[:SECONDS]]",
        help="replica REPLICA's node trains FACTOR× slower (--set run.slowdown=FACTOR on its node only), from step "
        "AT for SECONDS (REPLICA@AT:slow=FACTORxSECONDS), in the runs whose spec names `slow:` (this value replaces "
        "theirs), else in every run but the target",
    )
    p.add_argument(
        "--chaos",
        metavar="SEED:MTBF_S",
        help="faults drawn as a Poisson process of mean gap MTBF_S over the group (kill, SIGSTOP, partition, "
        "slow spell, lighthouse restart; the same SEED, the same schedule), in the runs whose spec names "
        "`chaos:` (this value replaces theirs), else in every elastic run but the target (the calm baseline "
        "goodput is measured against)",
    )
    p.add_argument(
        "--pin-cores",
        action="store_true",
        help="run replica m's processes on CPU core m only (taskset), as if each had a machine of its own",
    )
    p.add_argument("--plot", action="store_true", help="also write PNGs (needs matplotlib: pip install -e .[plot])")
    p.add_argument(
        "--no-run",
        action="store_true",
        help="run nothing (no root needed): tables and plots from the run folders and slowlink.json",
    )
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by slowlink processes that died")
    return LinkOptions(**vars(p.parse_args(argv)))


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
