"""Quorum: who takes part in an elastic round and whose part counts (docs/design.md §9.1, §9.5, §9.6).

transport.py's FTTransport runs a round's collectives; this module settles its membership first:

    ask          torchft's `start_quorum`, retried while no quorum answers: the replica pauses at its sync
                 while it is cut off (its link, or the lighthouse, down), and ends with PartitionTimeout after
                 elastic.partition_timeout_s; a restarted lighthouse is asked once the last quorum's replicas
                 heartbeat to it
    who_counts   the round's first collective, a tiny control all-gather (counted, work, full period, round
                 kind per member): the replicas whose parts count (not spectating, not late for the straggler
                 bound, straggler.py), and whether every member closes the run (a round mixing both is dropped)

`RoundSettings` groups how a rank's rounds meet (the lighthouse's probes, the partition bound, the replica's
hooks); the replica builds one (replica.py `_build`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple, Optional, TypedDict

import torch

from hsdp import torch_compat
from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.lighthouse import QuorumStatus, in_words
from hsdp.sync.elastic.phase import RoundKind
from hsdp.sync.elastic.seam import Manager, Work
from hsdp.sync.elastic.straggler import RoundBound

HEARTBEAT_POLL_S = 0.1  # between reads of a restarted lighthouse's status page (torchft heartbeats every 0.1 s)
CONTROL = 4  # the values each replica puts in a round's first collective: counted, work, full period, round kind
KIND_ROW = {RoundKind.TRAINING: 0.0, RoundKind.MEETING: 1.0, RoundKind.RESYNC: 2.0}  # the control row's kind


class PartitionTimeout(RuntimeError):
    """This replica got no quorum for longer than elastic.partition_timeout_s (its link stayed cut, or the
    lighthouse stayed down): it ends with this one line, and its launcher restarts it like any failure."""


def _never_unreachable() -> Optional[OSError]:
    return None


def _no_status() -> Optional[QuorumStatus]:
    """No lighthouse status page to read (the default: nothing watches it)."""
    return None


def _not_spectating() -> bool:
    """The default: this replica never spectates."""
    return False


def _ignore_cut(cut: bool) -> None:
    """The default: nobody is told when the replica is cut off or back."""


@dataclass(frozen=True)
class RoundSettings:
    """How one rank's rounds meet (defaults: a test's transport that never pauses nor times anything).

    `partition_timeout_s`: how long a round's quorum may keep failing before PartitionTimeout.
    `heartbeat_window_s`: the most waited for the last quorum's replicas to heartbeat to a lighthouse that refused
    connections (its process gone: a fresh one when it is back) once it accepts again (elastic.timeout_s: their
    managers reconnect in their own time, not the lighthouse's heartbeat timeout, elastic.heartbeat_timeout_s).
    `lighthouse_unreachable()`: why the lighthouse does not accept a connection now (an OSError), or None
    (asked before each quorum attempt: lighthouse.py says why a quorum must not be asked for then).
    `lighthouse_status()`: the lighthouse's QuorumStatus, read before each quorum: a quorum id lower than the
    one read before the last quorum means a restarted lighthouse (its ids start over), asked once the last
    quorum's replicas heartbeat to it (at most the window), whether or not this replica saw it refuse.
    `clock` (seconds, monotonic) times the quorum waits, dropped rounds and cuts; tests pass a fake.
    `spectating()`: whether this replica spectates (asked at each round's start: its heal state knows).
    `on_cut(cut)`: told when no quorum answers (True) and when one does again (False).
    `bound`: elastic.round_timeout_s, who counts in a param round (straggler.py); `faults`: elastic.faults,
    the points a round passes (before_quorum ... before_commit).
    """

    partition_timeout_s: float = 120.0
    heartbeat_window_s: float = 0.0
    lighthouse_unreachable: Callable[[], Optional[OSError]] = _never_unreachable
    lighthouse_status: Callable[[], Optional[QuorumStatus]] = _no_status
    clock: Callable[[], float] = time.perf_counter
    spectating: Callable[[], bool] = _not_spectating
    on_cut: Callable[[bool], None] = _ignore_cut
    bound: RoundBound = field(default_factory=lambda: RoundBound(0.0))
    faults: Optional[FaultPoints] = None


class RoundFields(TypedDict, total=False):
    """RoundSettings' fields as keywords (FTTransport(manager, pg, comm, clock=...): a test's short call)."""

    partition_timeout_s: float
    heartbeat_window_s: float
    lighthouse_unreachable: Callable[[], Optional[OSError]]
    lighthouse_status: Callable[[], Optional[QuorumStatus]]
    clock: Callable[[], float]
    spectating: Callable[[], bool]
    on_cut: Callable[[bool], None]
    bound: RoundBound
    faults: Optional[FaultPoints]


class Count(NamedTuple):
    """Who counts in a round, as its control all-gather settled it (the same on every member)."""

    contributors: list[int]  # the quorum ranks whose parts count in the round's means
    counted: bool  # this replica's part counts (not spectating, not late)
    all_closing: bool  # every member closes the run (its rounds meet and compare, closing.py)


class Quorum:
    """The quorum of `manager`'s rounds under `settings` (module docstring): asked, paused, counted."""

    def __init__(self, manager: Manager, settings: RoundSettings) -> None:
        self.manager, self.settings = manager, settings
        self.clock = settings.clock
        self.sleep: Callable[[float], None] = time.sleep  # tests pass one that moves their fake clock
        self.pause_retry_s = 0.5  # between quorum attempts while cut off
        self._lighthouse_quorum_id: Optional[int] = None  # its quorum id before this replica's last quorum
        self.lighthouse_restarts = 0  # restarted lighthouses found by their quorum id (not by a refusal)
        # Rounds whose quorum failed at first (the lighthouse unreachable, or no quorum within the manager's
        # quorum timeout), and the time until one answered. A shorter cut shows as a long quorum wait only.
        self.failures = 0
        self.failed_s = 0.0

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    # ------------------------------------------------------------ asking: a quorum, or a pause while cut off
    def ask(self, expected: Optional[int]) -> None:
        """manager.start_quorum(), retried while it fails: this replica pauses at its sync while it is cut off
        (its link down, or the lighthouse gone) and goes on once a quorum answers again. Nothing else is
        needed for the heal: if the others committed rounds without it, its torchft step is behind theirs and
        the quorum that answers heals it from a live replica (replica.py finishes that heal); if they did not,
        they wait at the same sync. PartitionTimeout (one line) once the failures have lasted
        partition_timeout_s (a retry waits at most what is left of it). `expected`: the last quorum's size.

        No quorum is asked for while the lighthouse refuses connections (lost, restarting, or cut off): torchft
        would fail that quorum at once and still keep this process waiting out its whole quorum timeout, so a
        lighthouse back a second later would cost that timeout (30 s to 300 s) instead of a second. If it
        refused connections (its process was gone), the replica waits once it accepts again until the replicas
        of its last quorum heartbeat to it, at most one heartbeat window (`_await_heartbeats`): a restarted
        lighthouse knows only the replicas that heartbeated to it since, and asked at once it would form a
        quorum of this replica alone and make the others heal. After a cut link (unreachable, timed out) the
        lighthouse is the same one and knows them: no wait."""
        s = self.settings
        first: Optional[float] = None
        restarted = False  # the lighthouse refused a connection during this pause: it is a fresh one when back
        while True:
            try:
                # One call when the lighthouse answers: its status page (the quorum id, below); only when that
                # cannot be read, a connection attempt says why (refused: a lost lighthouse; unreachable: a cut).
                status = s.lighthouse_status()
                error = None if status is not None else s.lighthouse_unreachable()
                if error:
                    restarted = restarted or isinstance(error, ConnectionRefusedError)
                    raise ConnectionError(f"the lighthouse does not accept connections: {in_words(error)}")
                fresh = self._lighthouse_restarted(status)  # every time: it keeps the last quorum id
                if restarted or fresh:
                    self._await_heartbeats(status, expected)
                    restarted = False
                if first is None:
                    self.manager.start_quorum()
                else:
                    left = s.partition_timeout_s - (self.clock() - first)
                    self.manager.start_quorum(timeout=timedelta(seconds=max(1.0, min(left, self._quorum_timeout_s()))))
                break
            except Exception as e:  # the lighthouse unreachable, or no quorum within the manager's timeout
                now = self.clock()
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                if first is None:
                    first, self.failures = now, self.failures + 1
                    s.on_cut(True)
                    print(
                        f"elastic: no quorum ({why}); paused at this sync, retrying for up to "
                        f"elastic.partition_timeout_s={s.partition_timeout_s:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                if now - first >= s.partition_timeout_s:
                    bound = f"elastic.partition_timeout_s={s.partition_timeout_s:g}"
                    raise PartitionTimeout(
                        f"no quorum for {now - first:.0f} s ({bound}): this replica is cut off from the lighthouse "
                        f"and the other replicas; last error: {why}"
                    ) from None
                torch_compat.forget_failed_quorum(self.manager)
                self.sleep(self.pause_retry_s)
        if first is not None:
            s.on_cut(False)
            self.failed_s += self.clock() - first
            print(f"elastic: a quorum again after {self.clock() - first:.1f} s", file=sys.stderr, flush=True)

    def _lighthouse_restarted(self, status: Optional[QuorumStatus]) -> bool:
        """Whether the lighthouse's quorum id went back since this replica's last quorum: a lighthouse restarted
        while this replica trained (it never saw a refusal). Asked at once, that fresh lighthouse may have heard
        only this replica's heartbeats and form a quorum of it alone (torchft's rule wants more than half of
        the replicas it has heard), ahead of the others, who would then heal from it and lose their period.
        `status`: the status page read just now (None: not readable)."""
        if status is None:
            return False
        before, self._lighthouse_quorum_id = self._lighthouse_quorum_id, status.quorum_id
        if before is None or status.quorum_id >= before:
            return False
        self.lighthouse_restarts += 1
        print(
            f"elastic: the lighthouse was restarted (its quorum id went back from {before} to {status.quorum_id}); "
            f"asking it for a quorum once the replicas of the last quorum heartbeat to it (at most "
            f"{self.settings.heartbeat_window_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _await_heartbeats(self, status: Optional[QuorumStatus], expected: Optional[int]) -> None:
        """Before asking a restarted lighthouse for a quorum: wait until `expected` replicas (the last quorum's)
        heartbeat to it (each manager heartbeats every 0.1 s, so that is a fraction of a second when they are
        all alive), at most one heartbeat window (a replica of that quorum may have died since). `status`: its
        page as just read; one that does not say how many heartbeat: the whole window."""
        deadline = self.clock() + self.settings.heartbeat_window_s
        while (left := deadline - self.clock()) > 0:
            if status is None or status.heartbeating is None or not expected:
                self.sleep(left)
                return
            if status.heartbeating >= expected:
                return
            self.sleep(min(HEARTBEAT_POLL_S, left))
            status = self.settings.lighthouse_status()

    def _quorum_timeout_s(self) -> float:
        """torchft's own bound on one quorum (the manager's quorum_timeout; manager.py sets it)."""
        timeout = torch_compat.quorum_timeout_s(self.manager)
        return timeout if timeout is not None else self.settings.partition_timeout_s

    def watch_asked(self, round_: int) -> None:
        """Mark `asked_quorum` once this replica's request is at the lighthouse (another request pending, or
        the quorum formed): exact when the replicas that would race it wait for the mark before asking."""
        faults, status = self.settings.faults, self.settings.lighthouse_status
        if faults is None or not faults.watches("asked_quorum", round_):
            return
        before = status()

        def asked() -> bool:
            now = status()
            return before is not None and now is not None and (now.pending > 0 or now.quorum_id != before.quorum_id)

        faults.watch("asked_quorum", round_, asked)

    # ------------------------------------------------------------ who counts
    def who_counts(self, work: float, kind: RoundKind, gather: Callable[[torch.Tensor, torch.Tensor], Work]) -> Count:
        """Which of the round's replicas count in its means: each says whether it spectates, its `work` since
        the last meeting, whether that was a full period and its round's `kind` (four floats each, all-gathered
        by `gather(out, mine)`). Only this replica knows it is spectating (replica.py); the bound counts late
        ones out too. A round whose members disagree on closing is aborted here, on every side."""
        n, bound = self.size, self.settings.bound
        counted = not self.settings.spectating()
        closing = kind is not RoundKind.TRAINING
        full = 0.0 if bound.cut_this_period else 1.0
        mine = torch.tensor([1.0 if counted else 0.0, work, full, KIND_ROW[kind]])
        if n == 1:
            if not closing:
                bound.met()
            return Count([0], counted, closing)  # alone (a spectator's peer died: its zero part stands)
        rows = torch.zeros(n, CONTROL)
        # Not counted in the sync bytes: control traffic, like the quorum's own messages.
        gather(rows.view(-1), mine).wait()
        if self.manager.errored():  # the round is lost already: count everyone, its result is never applied
            return Count(list(range(n)), counted, False)
        kinds = rows[:, 3]
        if bool((kinds != kinds[0]).any()):
            # A replica still in its last param round met one that closes (or a closing check met a closing
            # sync): their next collectives would not pair up, and each would wait elastic.timeout_s for the
            # other's, or read the other's bytes as its own. Every member drops the round now.
            self.abort("the round's replicas disagree on closing the run")
            return Count(list(range(n)), counted, False)
        all_closing = bool(kinds[0] > 0)
        present = [i for i in range(n) if rows[i, 0] > 0]
        if closing:  # the close counts whoever came (no straggler bound: nothing is left to train)
            return Count(present, counted, all_closing)
        bound.met()
        if not bound.enabled:
            return Count(present, counted, all_closing)
        me = self.manager.participating_rank()
        keep = bound.contributors([bool(c > 0) for c in rows[:, 0]], rows[:, 1].tolist(), (rows[:, 2] > 0).tolist(), me)
        if counted and me not in keep:
            # late (elastic.round_timeout_s): its part is dropped, as a spectator's, and it adopts the result
            counted = False
            bound.own_late_rounds += 1
        return Count(keep, counted, all_closing)

    def abort(self, why: str) -> None:
        """Drop the current round on this replica: its manager errs, so every later collective of the round
        is a no-op and the round does not commit (nothing of it is applied)."""
        self.manager.report_error(RuntimeError(why))
