"""The divergence guard: a run whose loss or grad norm stops being finite ends at once, saying so.

Training on after a NaN wastes the rest of the budget, and worse, checkpoints the NaN state
and prunes the last good checkpoint. Every step each rank checks its own loss and the grad
norm (both already on the host: the loop logs them and clipping returns the norm), before
the optimizer applies anything. A non-finite value raises `Diverged`, which ends every rank
(the launcher's rule for any failing rank) with one line: the step, what went non-finite,
and the checkpoint to resume from with a smaller learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from hsdp.sync.elastic import ReplicasDiffer


class Diverged(RuntimeError):
    """The run diverged; the message is the one line the user sees."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the message names the rank and the OS error."""


# Exceptions whose message is the whole story: the launcher reports their last line, not a traceback.
# ReplicasDiffer: an elastic run whose replicas could not close level (hsdp/sync/elastic/closing.py).
ONE_LINE_ERRORS = tuple(f"{e.__module__}.{e.__qualname__}" for e in (Diverged, SaveFailed, ReplicasDiffer))


def check_finite(step: int, loss: float, grad_norm: float, rank: int, last_good: Callable[[], Optional[Path]]) -> None:
    """Raise Diverged if this rank's loss or grad norm of `step` is NaN or infinite (`last_good`: asked only then)."""
    bad = [
        f"{name} is {value}" for name, value in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(value)
    ]
    if bad:
        raise Diverged(f"step {step}: the {' and the '.join(bad)} on rank {rank}; {last_good_hint(last_good())}")


def last_good_hint(last_good: Optional[Path]) -> str:
    """Where to go on from: nothing non-finite is ever checkpointed, so the latest checkpoint is good."""
    if last_good is None:
        return "no checkpoint was saved before it"
    return f"the last good checkpoint is {last_good} (run.resume=<it>, perhaps with a lower optim.lr)"
