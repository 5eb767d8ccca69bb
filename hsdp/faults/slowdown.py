"""run.slowdown: a slow Fault (hsdp/faults/spec.py) done by a rank itself, after each trained step.

The slow-link benchmark's `--slow` and `slow:` put these keys on one node's command line, and tests and
scripts/elastic_straggler.py set them directly; train.py's loop calls `SlowSpell.after_step` once per step.
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

from hsdp.faults.spec import RunKeys, run_slowdown

SLOW_STEPS = 5  # run.slowdown's median: of a rank's last this-many trained steps


class SlowSpell:
    """run.slowdown on this rank (fault injection): on run.slow_replica's ranks (-1: every rank), from step
    run.slow_from (a fraction of run.steps when < 1) for run.slow_for_s seconds (0: to the end); the slow Fault
    those keys compile to (`run_slowdown`)."""

    def __init__(self, run: RunKeys, replica: int) -> None:
        fault = run_slowdown(run, replica)
        self.factor = fault.factor if fault is not None else 1.0
        self.start = fault.at.step_of(run.steps) if fault is not None else 0
        self.for_s = fault.seconds if fault is not None else 0.0
        self.began: Optional[float] = None
        self.recent: list[float] = []  # this rank's last trained steps' own times (s), before any sleep

    def factor_at(self, step: int) -> float:
        if self.factor == 1.0 or step < self.start:
            return 1.0
        now = time.perf_counter()
        self.began = now if self.began is None else self.began
        return self.factor if not self.for_s or now - self.began < self.for_s else 1.0

    def after_step(self, step: int, step_s: float) -> None:
        """Sleep (factor − 1)× the smaller of this step's time (`step_s`) and this rank's recent median step: a
        device that much slower. Not the step's own time alone: a host hiccup is not the device's pace, and 150×
        a 0.4 s hiccup on a loaded box is a minute's sleep that stalls every peer at the next round. Not the
        median alone: right after a long first step (a compile) the median of two steps is half of it."""
        if self.factor == 1.0:  # not slowed (every run but a fault-injection one): no bookkeeping in the step
            return
        self.recent = [*self.recent[1 - SLOW_STEPS :], step_s]
        slow_down(self.factor_at(step), min(step_s, statistics.median(self.recent)))


def slow_down(factor: float, step_s: float) -> None:
    """run.slowdown: make a step of `step_s` last `factor`× as long, by sleeping the rest."""
    if factor > 1:
        time.sleep((factor - 1) * step_s)
