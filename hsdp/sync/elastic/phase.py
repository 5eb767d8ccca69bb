"""The phases of an elastic replica's life and every transition between them (docs/design.md §9).

One rank's view of its replica (all the replica's ranks go through the same phases: they take part in the
same rounds). `ElasticReplica` (replica.py) owns the phase; every other object of the wing asks it.

    phase        what the replica does                                    → next phases (why)
    -----------  -------------------------------------------------------  ----------------------------------------
    starting     the process is up; no manager, no quorum yet              joining (its manager heartbeats)
    joining      asks its first quorum: meets a fresh run's replicas, or   training (met them; or healed inside a
                 finds live ones to heal from (a restart)                  grad-sync round), healing (a peer's
                                                                           offer at a param sync)
    healing      a peer's state crosses out of band: spectates the round   training (state loaded, caught up),
                 it was healed in (its part does not count), fetches the   healing (the serving peer died: heal
                 state, skips the steps the peers trained meanwhile        again at the next round)
    training     counts in every round                                     cut off (no quorum), healing (a round
                                                                           healed it: it fell behind), leaving
    cut off      no quorum answers (its link or the lighthouse is down):   training (a quorum again, nothing
                 paused at its sync, retrying                              missed), healing (the peers went on:
                                                                           healed when back), leaving (elastic.
                                                                           partition_timeout_s: fails, restarted)
    leaving      finished (or failing): its manager shut down              -

A failure in any phase ends the process; its launcher restarts the replica (a new life: starting again).
"""

from __future__ import annotations

import enum
from typing import Protocol


class Phase(enum.Enum):
    STARTING = "starting"
    JOINING = "joining"
    HEALING = "healing"
    TRAINING = "training"
    CUT_OFF = "cut off"
    LEAVING = "leaving"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.JOINING, Phase.LEAVING}),
    Phase.JOINING: frozenset({Phase.TRAINING, Phase.HEALING, Phase.LEAVING}),
    Phase.HEALING: frozenset({Phase.TRAINING, Phase.HEALING, Phase.LEAVING}),
    Phase.TRAINING: frozenset({Phase.CUT_OFF, Phase.HEALING, Phase.LEAVING}),
    Phase.CUT_OFF: frozenset({Phase.TRAINING, Phase.HEALING, Phase.LEAVING}),
    Phase.LEAVING: frozenset(),
}


class BadTransition(RuntimeError):
    """A transition the table does not list: a bug in the wing, named with both phases."""


class Life(Protocol):
    """What the wing's parts ask of the replica's life: its phase, and the one way to change it."""

    @property
    def phase(self) -> Phase: ...

    @property
    def has_trained(self) -> bool: ...

    def enter(self, phase: Phase, why: str) -> None: ...


class PhaseLog:
    """A phase with its checked transitions and their history (the summary's `elastic_phases`)."""

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._has_trained = False
        self.history: list[tuple[str, str]] = [(Phase.STARTING.value, "process started")]

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def has_trained(self) -> bool:
        """Past its join: it has been training (a later heal is a rejoin, served out of band)."""
        return self._has_trained

    def enter(self, phase: Phase, why: str) -> None:
        if phase not in TRANSITIONS[self._phase]:
            raise BadTransition(f"elastic replica: {self._phase.value} → {phase.value} is not a transition ({why})")
        self._phase = phase
        self._has_trained = self._has_trained or phase is Phase.TRAINING
        self.history.append((phase.value, why))
