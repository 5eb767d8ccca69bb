"""FTTransport: a round's collectives among the live replicas' ranks of one shard position, through torchft.

    begin_round   the quorum: asked (paused while cut off), who counts agreed (quorum.py)
    all_reduce    manager.allreduce(SUM)   (all-gather: the group's allgather)
    commit_round  manager.should_commit()  False if any participant failed: the policy drops the round

A round's life is phase.py's round table (`round`: idle → quorum → open → sent → committed | dropped, then
the next round's quorum); this module owns it, and keeps each round's record (its quorum wait, size,
contributors, whether a failure touched it or it was dropped). A replica catching up after a heal spectates
rounds: it takes part in every collective (its peers need each quorum member in them) with a part that does
not count, agreed at each round's start (`contributors`), so the peers' mean is over the peers alone.

A replica closing the run (replica.py `_close`; closing.py) runs rounds that meet and compare, or do the last
round again (`kind`: training → closing meeting ⇄ closing sync): the same first collective says which, and a
round whose members disagree (a peer still in its last param round meets one that closes) is dropped on every
side at once instead of waiting out elastic.timeout_s in collectives that do not pair up. The sync
collectives' wait is timed into the comm counters ("sync"), as the c10d transport's are.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from hsdp.comm.groups import Comm, ring_bytes_of
from hsdp.sync.elastic.phase import (
    OPEN_ROUNDS,
    ROUND_KIND_TRANSITIONS,
    ROUND_TRANSITIONS,
    Checked,
    Round,
    RoundKind,
)
from hsdp.sync.elastic.quorum import Count, PartitionTimeout, Quorum, RoundFields, RoundSettings
from hsdp.sync.elastic.seam import Manager, ProcessGroup, Work

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Done", "FTTransport", "PartitionTimeout", "RoundSettings", "lost_in_touched_steps"]


class Done:
    """A finished collective (torchft already waited, or an errored manager made it a no-op)."""

    def wait(self) -> None:
        pass


class _Timed:
    """A sync collective's work whose wait is counted in `comm`'s seconds for (sync, `op`), as Comm times its own."""

    def __init__(self, work: Work, comm: Comm, op: str) -> None:
        self.work: Optional[Work] = work
        self.comm, self.op = comm, op

    def wait(self) -> None:
        if self.work is None:
            return
        t0 = time.perf_counter()
        try:
            self.work.wait()
        finally:
            self.comm.seconds[("sync", self.op)] += time.perf_counter() - t0
            self.work = None


class _Guarded:
    """An allgather on torchft's group whose failure is reported to the manager instead of raised."""

    def __init__(self, work: Work, manager: Manager) -> None:
        self.work: Optional[Work] = work
        self.manager = manager

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except Exception as e:  # a peer died mid-collective: the round will not commit
            self.manager.report_error(e)
        self.work = None


class FTTransport:
    """The sync collectives among the live replicas' ranks of one shard position, through torchft's `manager`
    and its group `pg`, counted in `comm`. `settings` (quorum.py's RoundSettings): how its rounds meet;
    keywords set single fields of it (FTTransport(manager, pg, comm, clock=...))."""

    may_fail = True

    def __init__(
        self,
        manager: Manager,
        pg: ProcessGroup,
        comm: Comm,
        settings: Optional[RoundSettings] = None,
        **fields: Unpack[RoundFields],
    ) -> None:
        self.settings = replace(settings or RoundSettings(), **fields)
        self.manager, self.pg, self.comm = manager, pg, comm
        self.clock, self.faults, self.bound = self.settings.clock, self.settings.faults, self.settings.bound
        self.quorum = Quorum(manager, self.settings)
        self._round = Checked("elastic round", ROUND_TRANSITIONS, Round.IDLE)
        self._kind = Checked("elastic round kind", ROUND_KIND_TRANSITIONS, RoundKind.TRAINING)
        self._count = Count([0], True, False)  # who counts in the current round (quorum.py `who_counts`)
        # elastic.faults number a life's rounds from its join: 0 while joining (however many meetings it takes),
        # then 1, 2, ... (set by the replica when its join ends)
        self.joined_at: Optional[int] = None
        # the rounds' record
        self.rounds = 0
        self.participants: Optional[int] = None  # the last round's contributors (quorum less spectators)
        self.quorum_waits: list[float] = []  # seconds each begin_round waited for its quorum
        # per round: did a failure touch it (the quorum changed size, a replica spectated, or the round
        # before was dropped)? Only those rounds' waits count as lost (lost_s), not the peers' usual jitter.
        self.touched: list[bool] = []
        # per round: [torchft step, quorum size, contributors] (summary.replicaN.json: a touched count read round
        # by round)
        self.quorums: list[list[int]] = []
        self._last_size: Optional[int] = None
        self.dropped_s = 0.0  # wall time of rounds that did not commit, after their quorum
        self.dropped: list[bool] = []  # per round: it did not commit
        self._round_start = 0.0

    # ------------------------------------------------------------ the round's state and kind (phase.py)
    @property
    def round(self) -> Round:
        return self._round.state

    @property
    def open(self) -> bool:
        """A round has begun and not been committed (e.g. one a healed replica joined)."""
        return self.round in OPEN_ROUNDS

    @property
    def kind(self) -> RoundKind:
        return self._kind.state

    @property
    def closing(self) -> bool:
        """This replica closes the run: its rounds meet and compare (closing.py)."""
        return self.kind is not RoundKind.TRAINING

    @closing.setter
    def closing(self, value: bool) -> None:
        if value != self.closing:
            self._kind.enter(RoundKind.MEETING if value else RoundKind.TRAINING, "the close begins")

    @property
    def syncing(self) -> bool:
        """A closing replica's round is a sync (the last round done again), not only a meeting."""
        return self.kind is RoundKind.RESYNC

    @contextmanager
    def resyncing(self, why: str) -> Iterator[None]:
        """A closing replica's sync round (the last round done again, or a sync with a peer still training)."""
        self._kind.enter(RoundKind.RESYNC, why)
        try:
            yield
        finally:
            self._kind.enter(RoundKind.MEETING, f"{why}: done")

    # ------------------------------------------------------------ who counts (quorum.py settles it at the start)
    @property
    def counted(self) -> bool:
        """This replica's part counts in the current round (set at begin_round)."""
        return self._count.counted

    @counted.setter
    def counted(self, value: bool) -> None:
        self._count = self._count._replace(counted=value)

    @property
    def all_closing(self) -> bool:
        """Every member of the current round said it closes too (a round that mixes both is dropped)."""
        return self._count.all_closing

    @property
    def contributors(self) -> list[int]:
        return self._count.contributors

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gather's rows less a spectating replica's (its part was sent, and is dropped here)."""
        rows = gathered.view(self.size, -1)
        keep = self.contributors
        return rows if len(keep) == rows.shape[0] else rows[keep]

    # ------------------------------------------------------------ a round: begin, collectives, commit
    def begin_round(self) -> None:
        if self.open:
            return
        after_drop = self.round is Round.DROPPED
        self._round.enter(Round.QUORUM, "begin_round")
        work = self.bound.work()  # before the quorum: a late replica's wait for it is not work
        self._fault("before_quorum", self.fault_round(self.rounds + 1))
        self.quorum.watch_asked(self.fault_round(self.rounds + 1))
        t0 = self.clock()
        self.quorum.ask(self._last_size)
        self._round_start = self.clock()  # the quorum's wait is counted in quorum_waits, not twice
        self.quorum_waits.append(self._round_start - t0)
        self._count = self.quorum.who_counts(work, self.kind, self._guarded_all_gather)
        self.participants = len(self._count.contributors)
        size = self.size
        changed = self._last_size is not None and size != self._last_size
        # a fresh run's meeting (one replica alone until the others start) is not a failure: only the rounds
        # after this life's join count
        joined = self.joined_at is not None
        self.touched.append(joined and (changed or self.participants < size or after_drop))
        self.quorums.append([self.manager.current_step(), size, self.participants])
        self._last_size = size
        self.rounds += 1
        self._round.enter(Round.OPEN, "the quorum answered and agreed who counts")
        self._fault("after_quorum", self.fault_round(self.rounds))

    def fault_round(self, rounds: int) -> int:
        """The fault points' number of the round that is the `rounds`-th of this process (0: the join's)."""
        return 0 if self.joined_at is None else rounds - self.joined_at

    def _fault(self, point: str, round_: int) -> None:
        if self.faults is not None:
            self.faults.at(point, round_)

    def _after_send(self, work: Work) -> None:
        """The round's first payload collective (open → sent): where an `after_send` fault is placed (once it
        is done)."""
        if self.round is not Round.OPEN:
            return
        self._round.enter(Round.SENT, "its first payload collective")
        if self.faults is None or not self.faults.mine:
            return
        round_ = self.fault_round(self.rounds)
        if any(f.at.point == "after_send" and f.at.round == round_ for f in self.faults.mine):
            work.wait()  # "after the pseudo-gradient is sent": the peers have this replica's part
        self._fault("after_send", round_)

    def gather(self, mine: torch.Tensor) -> Optional[torch.Tensor]:
        """Every member's `mine` (one row each, in the round's order), outside the sync bytes and times (control
        traffic: the close's fingerprints); None if the round is lost."""
        out = torch.zeros(self.size * mine.numel(), dtype=mine.dtype)
        self._guarded_all_gather(out, mine.reshape(-1)).wait()
        return None if self.manager.errored() else out.view(self.size, -1)

    def commit_round(self) -> bool:
        self._fault("before_commit", self.fault_round(self.rounds))
        error = self.manager.errored()
        step = self.manager.current_step()  # the round's number on every replica (a healed one takes its peers')
        ok = bool(self.manager.should_commit())
        self._round.enter(Round.COMMITTED if ok else Round.DROPPED, "should_commit")
        self.dropped.append(not ok)
        if not ok:
            self.dropped_s += self.clock() - self._round_start
            why = f"{type(error.original_exception).__name__}: {error.original_exception}" if error else "a peer failed"
            # A closing round that only met (no sync of its own) is no sync round: the logs' "sync round ...
            # dropped" lines stay one per dropped_syncs.
            kind = "closing round" if self.kind is RoundKind.MEETING else "sync round"
            print(f"elastic: {kind} {self.rounds} (torchft step {step}) dropped ({why})", file=sys.stderr)
        return ok

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Work:
        if not self.counted:  # a spectator's or a late replica's part is zero (as torchft's allreduce while healing)
            t.zero_()
        if self.manager.errored():  # the round is lost: torchft's allreduce is a no-op, nothing crosses
            return Done()
        self.comm.count("sync", "all_reduce", ring_bytes_of("all_reduce", self.size, t.numel() * t.element_size()))
        t0 = time.perf_counter()
        work = _Timed(self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM), self.comm, "all_reduce")
        self.comm.seconds[("sync", "all_reduce")] += time.perf_counter() - t0  # the issue (a quorum wait in it)
        self._after_send(work)
        if not async_op:
            work.wait()
            return Done()
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        if self.manager.errored():
            return Done()  # the round is lost already; its result is never applied
        self.comm.count("sync", "all_gather", ring_bytes_of("all_gather", self.size, inp.numel() * inp.element_size()))
        t0 = time.perf_counter()
        work = _Timed(self._guarded_all_gather(out, inp), self.comm, "all_gather")
        self.comm.seconds[("sync", "all_gather")] += time.perf_counter() - t0
        self._after_send(work)
        if not async_op:
            work.wait()
        return work

    def _guarded_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        if self.manager.errored():
            return Done()  # the round is lost already; its result is never applied
        try:
            return _Guarded(self.pg.allgather([list(out.chunk(self.size))], [inp], AllgatherOptions()), self.manager)
        except Exception as e:
            self.manager.report_error(e)
            return Done()

    # ------------------------------------------------------------ the rounds' record
    def touched_rounds(self) -> int:
        """How many rounds a failure touched (a count, unlike lost_s: what a test can bound on a busy box)."""
        return sum(self.touched)

    def lost_s(self) -> float:
        """Wall time lost to peers' failures: the quorum waits beyond the usual (median) one in the rounds a
        failure touched (detection, a rejoin, a spectating replica), and dropped rounds. Untouched rounds'
        excess waits are the replicas' ordinary jitter, not counted: over 144 grad-sync rounds (one per
        step) they summed to several seconds on a loaded box, more than the failure itself cost."""
        usual = statistics.median(self.quorum_waits) if self.quorum_waits else 0.0
        touched = [w for w, t in zip(self.quorum_waits, self.touched, strict=True) if t]
        return sum(max(0.0, w - usual) for w in touched) + self.dropped_s

    def failure_in_rounds_since(self, first: int) -> bool:
        """Whether a failure touched or dropped any round from index `first` on (a step's rounds)."""
        return any(self.touched[first:]) or any(self.dropped[first:])


def lost_in_touched_steps(step_times: list[float], synced: list[bool], touched: list[bool]) -> float:
    """A survivor's time lost to its peers' failures, from its own step times: Σ over the steps whose sync
    round a failure touched (or dropped) of (step time − the median time of its steps that held a round).

    The median is over round-holding steps only: a param-sync step costs more than a local one by design,
    and that is not a loss. From step times, not quorum waits: a failure's cost can sit anywhere in the
    step (a collective timing out, a heal served after the round), and a 9 s step must not read 0.0.
    """
    held = [t for t, s in zip(step_times, synced, strict=True) if s]
    if not held:
        return 0.0
    usual = statistics.median(held)
    return sum(max(0.0, t - usual) for t, hit in zip(step_times, touched, strict=True) if hit)
