"""Wall-clock marks of a restarted elastic replica's way back to training (docs/results/restart.md).

A restart crosses three processes: the launcher sees the death and starts the replica again (its marks travel
to the new life in its `ReplicaSeat`), the zygote forks the worker, and the worker marks each phase boundary
of its start (`mark`) until its first trained step. Each mark is `time.time()`: the processes share no other
clock once a replica runs on another machine (on one machine CLOCK_MONOTONIC would do, torchrun's would not).
`phases` turns the marks into the time of each phase, named by the mark that ends it; they sum to the first
mark's distance from the last by construction, so the check worth making (tests/test_elastic.py) is that
marks taken in different processes come in order.

The marks, in order (a restart's; a first start has only the worker's):

    killed        the previous life died (known only when a fault killed it: faults/died.*, hsdp/sync/elastic/faults.py)
    detected      the launcher read the death from its pool
    restart       the launcher asks the zygote for the new life's workers (after elastic.restart_delay_s)
    forked        the worker runs (run_forked_rank: forked, the launcher's request unpickled)
    world         its replica's own process group is up (dist.init_process_group)
    manager       its torchft manager heartbeats to the lighthouse (torchft imported, faults, heal server)
    model         model, optimizer and data built
    quorum        its first quorum answered (a state inside the round crossed with it)
    healed        the peer's state loaded and caught up (an out-of-band fetch; = quorum when it crossed inside)
    trained       its first training step done (forward, backward, update, its sync)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

Marks = tuple[tuple[str, float], ...]  # (name, time.time()) in the order taken
ORDER = ("killed", "detected", "restart", "forked", "world", "manager", "model", "quorum", "healed", "trained")

_marks: list[tuple[str, float]] = []  # this process's (a forked worker starts with the zygote's: none)
_clock = time.time  # a test's fake replaces it


def begin(name: str, before: Sequence[tuple[str, float]] = ()) -> None:
    """Start this process's marks: `before` (the launcher's, from the seat), then `name` now. Clears any left
    from an earlier run in the same process (a world of 1 runs in the launcher)."""
    _marks[:] = [*before, (name, _clock())]


def mark(name: str) -> None:
    """Mark `name` now, once: a later pass of the same boundary (a second heal, every step) keeps the first."""
    if all(n != name for n, _ in _marks):
        _marks.append((name, _clock()))


def marks() -> Marks:
    return tuple(_marks)


def summary() -> dict[str, Any]:
    """The summary's fields: `start_marks` ([name, time.time()] in order), `start_phases_s` (`phases`) and
    `start_s` (the first mark to the last: a restart's kill → trained)."""
    taken = marks()
    return {
        "start_marks": [[name, round(t, 4)] for name, t in taken],
        "start_phases_s": phases(taken),
        "start_s": round(taken[-1][1] - taken[0][1], 4) if taken else None,
    }


def phases(taken: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Each phase's seconds, named by the mark that ends it (the first mark starts the clock), in mark order."""
    return {name: round(t - prev, 4) for (_, prev), (name, t) in zip(taken, taken[1:])}
