"""RoundBound: the straggler bound of an elastic run's param-sync rounds (elastic.round_timeout_s).

docs/design.md §9.5 (Stragglers). torchft's lighthouse cannot commit a round without a replica that still
heartbeats when there are two (its split-brain rule wants more than half of the heartbeating replicas), so
the bound is kept by the replicas themselves, in two parts:

    who counts   each round's first collective carries every replica's *work*: the time from the replicas'
                 last meeting (the end of that collective in the previous round, one instant for all) to its
                 arrival at this round. A replica whose work exceeds the reference's (the first arrival among
                 the replicas that did a full period: the pace-setter) by more than the bound is late: its
                 part is dropped from the round's means (as a spectator's) and it adopts the result.
    not waiting  a replica cuts its period short: before each local step it checks whether that step would
                 end past its deadline, the last meeting + the fastest recent full period (the *pace*)
                 + 3/4 of the bound; if so it skips the period's remaining steps (no forward, backward or
                 update: their batches are not seen) and goes to the round, arriving within the bound with
                 the steps it did. So a fast replica waits at most about 3/4 of the bound for a slow one.
                 The pace-setter never cuts: nobody would wait less for it.

Everything here is per rank (one shard position's rounds); the training loop agrees the cut over the
replica's own ranks (ElasticReplica.cut), so a replica's ranks skip the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

NOT_TIMED = -1.0  # a work not compared: a round the bound does not apply to, or no meeting yet
# A replica cuts its period to arrive by the pace + this share of the bound: the rest of the bound absorbs
# the error of its step-time estimate, so a replica that cut is not late, and the pace-setter's own jitter
# up to this share does not make it cut (it would lose steps for nothing).
DEADLINE_SHARE = 0.75
# How many recent periods the pace and the step estimate look back: the machine's load changes, and a stale
# estimate must age out (a replica whose every step was cut would never measure a step again).
RECENT_PERIODS = 3


class RoundBound:
    """This rank's view of the bound `bound_s` (seconds; 0 = off) over its rounds. `clock`: monotonic seconds."""

    def __init__(self, bound_s: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.bound_s, self.clock = bound_s, clock
        self.armed = False  # the round about to begin is a param-sync round (set around the loop's end_step)
        self.met_at: Optional[float] = None  # end of the last round's first collective, on this rank's clock
        self.paces: list[float] = []  # the reference works of the recent rounds where some replica did a full period
        self.cut_this_period = False  # this replica skipped steps since the last meeting (its work is not a pace)
        self.leads = False  # this replica set the pace: it never cuts (whoever waits, waits for it)
        self.late_rounds = 0  # param rounds in which some replica was counted out as late
        self.own_late_rounds = 0  # ... this one
        self.cut_steps = 0  # local steps this replica skipped to keep the bound
        self.works: list[float] = []  # per bounded round: the reference arrival's work
        self.meetings = 0
        self._step_times: list[tuple[int, float]] = []  # (meeting, seconds) of this replica's trained steps

    @property
    def pace(self) -> Optional[float]:
        """The fastest recent full period (the smallest of the recent rounds' references: if the load changes,
        the deadline follows the faster periods, where a late replica would cost the others most)."""
        return min(self.paces) if self.paces else None

    @property
    def enabled(self) -> bool:
        return self.bound_s > 0

    def work(self) -> float:
        """At the start of a round: this replica's work since the last meeting (NOT_TIMED if not compared)."""
        if not self.enabled or not self.armed or self.met_at is None:
            return NOT_TIMED
        return self.clock() - self.met_at

    def contributors(self, counted: list[bool], works: list[float], full: list[bool], me: Optional[int]) -> list[int]:
        """The replicas (quorum ranks) whose parts count: not spectating, and in within the bound of the
        reference arrival. `full`: each did its whole period (did not cut it); `me`: this replica's rank
        (None: not in the quorum).

        Every replica computes this from the same gathered values, so all agree. The reference is the first
        arrival among the replicas that did a full period (the round's pace; a replica that cut its period may
        arrive before the pace-setter, which must not be late for being on time), else the first one."""
        present = [i for i, c in enumerate(counted) if c]
        if not self.enabled or not present or any(works[i] == NOT_TIMED for i in present):
            return present
        paced = [i for i in present if full[i]]
        leader = min(paced or present, key=lambda i: works[i])
        keep = [i for i in present if works[i] <= works[leader] + self.bound_s]
        self.works.append(works[leader])
        if len(keep) < len(present):
            self.late_rounds += 1
        if paced:
            self.paces = [*self.paces[1 - RECENT_PERIODS :], works[leader]]
            self.leads = leader == me
        return keep

    def met(self) -> None:
        """The round's first collective ended: the replicas' common instant the next works are measured from."""
        self.met_at = self.clock()
        self.cut_this_period = False
        self.meetings += 1

    def trained(self, seconds: float) -> None:
        """A local step this replica trained took `seconds` (its sync included): what the next one may take."""
        self._step_times = [*self._step_times[-4:], (self.meetings, seconds)]

    def past_deadline(self) -> bool:
        """Whether a local step started now would end after this replica's deadline for the next round."""
        recent = [t for m, t in self._step_times if m > self.meetings - RECENT_PERIODS]
        if not self.enabled or self.leads or self.pace is None or self.met_at is None or not recent:
            return False  # no recent step measured: this one is trained (and measured)
        deadline = self.met_at + self.pace + DEADLINE_SHARE * self.bound_s
        # The longest recent step, not a typical one: overrating it costs only this replica's idle time at the
        # quorum; underrating it makes the others wait for the rest of its step (and it arrives late).
        return self.clock() + max(recent) > deadline
