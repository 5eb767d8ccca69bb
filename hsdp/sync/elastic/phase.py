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
                 it was healed in (its part does not count), fetches the   healing (its source lost: healed again
                 state, skips the steps the peers trained meanwhile        from another at the next quorum)
    training     counts in every round                                     cut off (no quorum), healing (a round
                                                                           healed it: it fell behind), leaving
    cut off      no quorum answers (its link or the lighthouse is down):   training (a quorum again, nothing
                 paused at its sync, retrying                              missed), healing (the peers went on:
                                                                           healed when back), leaving (elastic.
                                                                           partition_timeout_s: fails, restarted)
    leaving      finished (or failing): its manager shut down              -

A failure in any phase ends the process; its launcher restarts the replica (a new life: starting again).

Inside a life two smaller machines are checked the same way (`Checked`: an illegal change raises
BadTransition naming both states). One rank's round (transport.py owns it, quorum.py settles its members):

    round        what the rank's current round is doing                   → next states (why)
    -----------  -------------------------------------------------------  ----------------------------------------
    idle         no round yet in this life                                 quorum (begin_round)
    quorum       asking torchft (paused while cut off, §9.6)               open (answered; who counts agreed)
    open         its collectives may run (a meeting only compares)         sent (first payload collective done),
                                                                           committed, dropped (should_commit)
    sent         this replica's part is out (the after_send point)         committed, dropped
    committed    applied; the next round may begin                         quorum
    dropped      not applied on this replica (the next round is touched)   quorum

Its kind (`RoundKind`, the control row's last value): training → closing meeting (the close begins),
closing meeting ⇄ closing sync (the last round done again, or a sync with a peer still training).

One rank's heal (heal.py owns it; a peer's state, or its offer, comes in a quorum):

    heal         the rank's state                                          → next states (why)
    -----------  -------------------------------------------------------  ----------------------------------------
    none         no peer's state taken                                     offered (out of band), loaded (inside
                                                                           the round)
    offered      a peer offers its state out of band: spectating           fetching (the offer taken)
    fetching     its round spectated, the state being fetched              loaded, source lost (it died, stopped,
                                                                           broke the transfer or serves no more)
    source lost  asking the quorum again, for another live peer            offered (another's offer), loaded (whole,
                                                                           from a peer closing the run)
    loaded       a peer's state loaded (from a training, joining or        offered, loaded (healed again: cut off,
                 closing peer)                                             behind, or whole at the close)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

S = TypeVar("S", bound=enum.Enum)


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
    """A transition the table does not list: a bug in the wing, named with both states."""


def check(what: str, table: Mapping[S, frozenset[S]], now: S, to: S, why: str) -> None:
    """BadTransition unless `table` lists now → to (`what`: whose state, for the message)."""
    if to not in table[now]:
        raise BadTransition(f"{what}: {now.value} → {to.value} is not a transition ({why})")


class Checked(Generic[S]):
    """A state of `what` that changes only along `table` (`enter`), starting at `start`."""

    def __init__(self, what: str, table: Mapping[S, frozenset[S]], start: S) -> None:
        self.what, self.table, self._state = what, table, start

    @property
    def state(self) -> S:
        return self._state

    def enter(self, to: S, why: str) -> None:
        check(self.what, self.table, self._state, to, why)
        self._state = to


class Round(enum.Enum):
    """One rank's current round (module docstring's round table)."""

    IDLE = "idle"
    QUORUM = "quorum"
    OPEN = "open"
    SENT = "sent"
    COMMITTED = "committed"
    DROPPED = "dropped"


ROUND_TRANSITIONS: dict[Round, frozenset[Round]] = {
    Round.IDLE: frozenset({Round.QUORUM}),
    Round.QUORUM: frozenset({Round.OPEN}),
    Round.OPEN: frozenset({Round.SENT, Round.COMMITTED, Round.DROPPED}),
    Round.SENT: frozenset({Round.COMMITTED, Round.DROPPED}),
    Round.COMMITTED: frozenset({Round.QUORUM}),
    Round.DROPPED: frozenset({Round.QUORUM}),
}
OPEN_ROUNDS = frozenset({Round.QUORUM, Round.OPEN, Round.SENT})  # begun and not yet committed


class RoundKind(enum.Enum):
    """What a rank's rounds are: training rounds, then the close's meetings and syncs (closing.py)."""

    TRAINING = "training"
    MEETING = "closing meeting"
    RESYNC = "closing sync"


ROUND_KIND_TRANSITIONS: dict[RoundKind, frozenset[RoundKind]] = {
    RoundKind.TRAINING: frozenset({RoundKind.MEETING}),
    RoundKind.MEETING: frozenset({RoundKind.RESYNC}),
    RoundKind.RESYNC: frozenset({RoundKind.MEETING}),
}


class Heal(enum.Enum):
    """One rank's heal (module docstring's heal table)."""

    NONE = "none"
    OFFERED = "offered"
    FETCHING = "fetching"
    LOST = "source lost"
    LOADED = "loaded"


HEAL_TRANSITIONS: dict[Heal, frozenset[Heal]] = {
    Heal.NONE: frozenset({Heal.OFFERED, Heal.LOADED}),
    Heal.OFFERED: frozenset({Heal.FETCHING}),
    Heal.FETCHING: frozenset({Heal.LOADED, Heal.LOST}),
    Heal.LOST: frozenset({Heal.OFFERED, Heal.LOADED}),
    Heal.LOADED: frozenset({Heal.OFFERED, Heal.LOADED}),
}


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
        check("elastic replica", TRANSITIONS, self._phase, phase, why)
        self._phase = phase
        self._has_trained = self._has_trained or phase is Phase.TRAINING
        self.history.append((phase.value, why))
