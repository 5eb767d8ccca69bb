"""FTTransport: the sync collectives among the live replicas' ranks of one shard position, through torchft.

    begin_round   manager.start_quorum()   who takes part; a replica behind the others heals here
    all_reduce    manager.allreduce(SUM)   (all-gather: the group's allgather)
    commit_round  manager.should_commit()  False if any participant failed: the policy drops the round

A replica catching up after a heal spectates rounds (`spectating()` is True): it takes part in every
collective (its peers need each quorum member in them) with a part that does not count, agreed at
each round's start (`contributors`), so the peers' mean is over the peers alone.

A replica closing the run (`closing`, replica.py `_close`; closing.py) runs rounds that meet and compare,
or do the last round again: the same first collective says which (`round_kind`), and a round whose members
disagree (a peer still in its last param round meets one that closes) is dropped on every side at once
instead of waiting out elastic.timeout_s in collectives that do not pair up. The sync collectives' wait is
timed into the comm counters ("sync"), as the c10d transport's are.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from hsdp import torch_compat
from hsdp.comm.groups import Comm, ring_bytes_of
from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.lighthouse import QuorumStatus, in_words
from hsdp.sync.elastic.straggler import RoundBound

HEARTBEAT_POLL_S = 0.1  # between reads of a restarted lighthouse's status page (torchft heartbeats every 0.1 s)


class Done:
    """A finished collective (torchft already waited, or an errored manager made it a no-op)."""

    def wait(self) -> None:
        pass


class _Timed:
    """A sync collective's work whose wait is counted in `comm`'s seconds for (sync, `op`), as Comm times its own."""

    def __init__(self, work: Any, comm: Comm, op: str) -> None:
        self.work, self.comm, self.op = work, comm, op

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

    def __init__(self, work: Any, manager: Any) -> None:
        self.work, self.manager = work, manager

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except Exception as e:  # a peer died mid-collective: the round will not commit
            self.manager.report_error(e)
        self.work = None


CONTROL = 4  # the values each replica puts in a round's first collective: counted, work, full period, round kind


class PartitionTimeout(RuntimeError):
    """This replica got no quorum for longer than elastic.partition_timeout_s (its link stayed cut, or the
    lighthouse stayed down): it ends with this one line, and its launcher restarts it like any failure."""


class FTTransport:
    """The sync collectives among the live replicas' ranks of one shard position, through torchft.

    `spectating()`: whether this replica spectates (asked at each round's start and collective: its heal
    state knows). `clock` (seconds, monotonic) times the quorum waits, dropped rounds and cuts; tests pass a
    fake. `partition_timeout_s`: how long a round's quorum may keep failing before PartitionTimeout.
    `lighthouse_unreachable()`: why the lighthouse does not accept a connection now (an OSError), or None
    (asked before each quorum attempt: manager.lighthouse_unreachable says why a quorum must not be asked
    for then). `heartbeat_window_s`: the lighthouse's heartbeat timeout (elastic.timeout_s), the most waited
    once a lighthouse that refused connections (its process gone: a fresh one when it is back) accepts again.
    `lighthouse_status()`: the lighthouse's QuorumStatus, read before each quorum: a quorum id lower than the
    one read before the last quorum means a restarted lighthouse (its ids start over), and it is asked once
    the last quorum's replicas heartbeat to it (at most the window), whether or not this replica saw it
    refuse a connection.
    """

    may_fail = True

    def __init__(
        self,
        manager: Any,
        pg: Any,
        comm: Comm,
        spectating: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.perf_counter,
        partition_timeout_s: float = 120.0,
        bound: Optional[RoundBound] = None,
        lighthouse_unreachable: Callable[[], Optional[OSError]] = lambda: None,
        lighthouse_status: Callable[[], Optional[QuorumStatus]] = lambda: None,
        heartbeat_window_s: float = 0.0,
        faults: Optional[FaultPoints] = None,
        on_cut: Callable[[bool], None] = lambda cut: None,
    ) -> None:
        self.manager, self.pg, self.comm, self.clock = manager, pg, comm, clock
        self.faults = faults  # elastic.faults: the points a round passes (before_quorum ... before_commit)
        self.on_cut = on_cut  # told when no quorum answers (True) and when one does again (False)
        self._sent = False  # the current round's first payload collective is done (after_send)
        # elastic.faults number a life's rounds from its join: 0 while joining (however many meetings it takes),
        # then 1, 2, ... (set by the replica when its join ends)
        self.joined_at: Optional[int] = None
        self.lighthouse_unreachable, self.heartbeat_window_s = lighthouse_unreachable, heartbeat_window_s
        self.lighthouse_status = lighthouse_status
        self._lighthouse_quorum_id: Optional[int] = None  # its quorum id before this replica's last quorum
        self.lighthouse_restarts = 0  # restarted lighthouses found by their quorum id (not by a refusal)
        self.sleep: Callable[[float], None] = time.sleep  # tests pass one that moves their fake clock
        self.partition_timeout_s = partition_timeout_s
        # Rounds whose quorum failed at first (the lighthouse unreachable, or no quorum within the manager's
        # quorum timeout), and the time until one answered. A shorter cut shows as a long quorum wait only.
        self.quorum_failures = 0
        self.quorum_failed_s = 0.0
        self.pause_retry_s = 0.5  # between quorum attempts while cut off
        self.spectating = spectating
        self.bound = bound or RoundBound(0.0)  # elastic.round_timeout_s: who counts in a param round (straggler.py)
        self.rounds = 0
        self.participants: Optional[int] = None  # the last round's contributors (quorum less spectators)
        self._contributors: list[int] = [0]
        self.quorum_waits: list[float] = []  # seconds each begin_round waited for its quorum
        # per round: did a failure touch it (the quorum changed size, a replica spectated, or the round
        # before was dropped)? Only those rounds' waits count as lost (lost_s), not the peers' usual jitter.
        self.touched: list[bool] = []
        # per round: [torchft step, quorum size, contributors] (summary.replicaN.json: a touched count read round
        # by round)
        self.quorums: list[list[int]] = []
        self._last_size: Optional[int] = None
        self._last_dropped = False
        self.dropped_s = 0.0  # wall time of rounds that did not commit, after their quorum
        self.dropped: list[bool] = []  # per round: it did not commit
        self._round_start = 0.0
        self.open = False  # a round has begun and not been committed (e.g. one a healed replica joined)
        self.counted = True  # this replica's part counts in the current round (set at begin_round)
        # Closing the run (replica.py `_close`): this replica's rounds meet and compare, and every member of the
        # current round said it closes too (`all_closing`; a round that mixes both is dropped on every side).
        self.closing = False
        self.all_closing = False
        self.syncing = False  # a closing replica's round is a sync (the last round done again), not only a meeting

    @property
    def round_kind(self) -> int:
        """What this replica's round is, as its first collective says: 0 training, 1 a closing meeting, 2 a
        closing sync (the run's last round done again). A round whose members say different kinds is dropped."""
        return 0 if not self.closing else 2 if self.syncing else 1

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    @property
    def contributors(self) -> list[int]:
        return self._contributors

    def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gather's rows less a spectating replica's (its part was sent, and is dropped here)."""
        rows = gathered.view(self.size, -1)
        keep = self._contributors
        return rows if len(keep) == rows.shape[0] else rows[keep]

    def begin_round(self) -> None:
        if self.open:
            return
        self.open = True
        work = self.bound.work()  # before the quorum: a late replica's wait for it is not work
        self._fault("before_quorum", self.fault_round(self.rounds + 1))
        self._watch_asked_quorum(self.fault_round(self.rounds + 1))
        t0 = self.clock()
        self._quorum_or_pause()
        self._round_start = self.clock()  # the quorum's wait is counted in quorum_waits, not twice
        self.quorum_waits.append(self._round_start - t0)
        self._contributors = self._agree_contributors(work)
        self.participants = len(self._contributors)
        size = self.size
        changed = self._last_size is not None and size != self._last_size
        # a fresh run's meeting (one replica alone until the others start) is not a failure: only the rounds
        # after this life's join count
        joined = self.joined_at is not None
        self.touched.append(joined and (changed or self.participants < size or self._last_dropped))
        self.quorums.append([self.manager.current_step(), size, self.participants])
        self._last_size, self._last_dropped = size, False
        self.rounds += 1
        self._sent = False
        self._fault("after_quorum", self.fault_round(self.rounds))

    def _watch_asked_quorum(self, round_: int) -> None:
        """Mark `asked_quorum` once this replica's request is at the lighthouse (another request pending, or
        the quorum formed): exact when the replicas that would race it wait for the mark before asking."""
        if self.faults is None or not self.faults.watches("asked_quorum", round_):
            return
        before = self.lighthouse_status()

        def asked() -> bool:
            now = self.lighthouse_status()
            return before is not None and now is not None and (now.pending > 0 or now.quorum_id != before.quorum_id)

        self.faults.watch("asked_quorum", round_, asked)

    def fault_round(self, rounds: int) -> int:
        """The fault points' number of the round that is the `rounds`-th of this process (0: the join's)."""
        return 0 if self.joined_at is None else rounds - self.joined_at

    def _fault(self, point: str, round_: int) -> None:
        if self.faults is not None:
            self.faults.at(point, round_)

    def _after_send(self, work: Any) -> None:
        """The round's first payload collective: where an `after_send` fault is placed (once it is done)."""
        if self._sent or self.faults is None or not self.faults.mine:
            return
        self._sent = True
        round_ = self.fault_round(self.rounds)
        if any(f.at.point == "after_send" and f.at.round == round_ for f in self.faults.mine):
            work.wait()  # "after the pseudo-gradient is sent": the peers have this replica's part
        self._fault("after_send", round_)

    def _quorum_or_pause(self) -> None:
        """manager.start_quorum(), retried while it fails: this replica pauses at its sync while it is cut off
        (its link down, or the lighthouse gone) and goes on once a quorum answers again. Nothing else is
        needed for the heal: if the others committed rounds without it, its torchft step is behind theirs and
        the quorum that answers heals it from a live replica (rejoin.py finishes that heal); if they did not,
        they wait at the same sync. PartitionTimeout (one line) once the failures have lasted
        partition_timeout_s (a retry waits at most what is left of it).

        No quorum is asked for while the lighthouse refuses connections (lost, restarting, or cut off): torchft
        would fail that quorum at once and still keep this process waiting out its whole quorum timeout, so a
        lighthouse back a second later would cost that timeout (30 s to 300 s) instead of a second. If it
        refused connections (its process was gone), the replica waits once it accepts again until the replicas
        of its last quorum heartbeat to it, at most one heartbeat window (`_await_heartbeats`): a restarted
        lighthouse knows only the replicas that heartbeated to it since, and asked at once it would form a
        quorum of this replica alone and make the others heal. After a cut link (unreachable, timed out) the
        lighthouse is the same one and knows them: no wait."""
        first: Optional[float] = None
        restarted = False  # the lighthouse refused a connection during this pause: it is a fresh one when back
        while True:
            try:
                # One call when the lighthouse answers: its status page (the quorum id, below); only when that
                # cannot be read, a connection attempt says why (refused: a lost lighthouse; unreachable: a cut).
                status = self.lighthouse_status()
                error = None if status is not None else self.lighthouse_unreachable()
                if error:
                    restarted = restarted or isinstance(error, ConnectionRefusedError)
                    raise ConnectionError(f"the lighthouse does not accept connections: {in_words(error)}")
                fresh = self._lighthouse_restarted(status)  # every time: it keeps the last quorum id
                if restarted or fresh:
                    self._await_heartbeats(status)
                    restarted = False
                if first is None:
                    self.manager.start_quorum()
                else:
                    left = self.partition_timeout_s - (self.clock() - first)
                    self.manager.start_quorum(timeout=timedelta(seconds=max(1.0, min(left, self._quorum_timeout_s()))))
                break
            except Exception as e:  # the lighthouse unreachable, or no quorum within the manager's timeout
                now = self.clock()
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                if first is None:
                    first, self.quorum_failures = now, self.quorum_failures + 1
                    self.on_cut(True)
                    print(
                        f"elastic: no quorum ({why}); paused at this sync, retrying for up to "
                        f"elastic.partition_timeout_s={self.partition_timeout_s:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                if now - first >= self.partition_timeout_s:
                    bound = f"elastic.partition_timeout_s={self.partition_timeout_s:g}"
                    raise PartitionTimeout(
                        f"no quorum for {now - first:.0f} s ({bound}): this replica is cut off from the lighthouse "
                        f"and the other replicas; last error: {why}"
                    ) from None
                torch_compat.forget_failed_quorum(self.manager)
                self.sleep(self.pause_retry_s)
        if first is not None:
            self.on_cut(False)
            self.quorum_failed_s += self.clock() - first
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
            f"{self.heartbeat_window_s:g} s)",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _await_heartbeats(self, status: Optional[QuorumStatus]) -> None:
        """Before asking a restarted lighthouse for a quorum: wait until as many replicas heartbeat to it as were
        in this replica's last quorum (each manager heartbeats every 0.1 s, so that is a fraction of a second
        when they are all alive), at most one heartbeat window (a replica of that quorum may have died
        since). `status`: its page as just read; one that does not say how many heartbeat: the whole window."""
        expected = self._last_size
        deadline = self.clock() + self.heartbeat_window_s
        while (left := deadline - self.clock()) > 0:
            if status is None or status.heartbeating is None or not expected:
                self.sleep(left)
                return
            if status.heartbeating >= expected:
                return
            self.sleep(min(HEARTBEAT_POLL_S, left))
            status = self.lighthouse_status()

    def _quorum_timeout_s(self) -> float:
        """torchft's own bound on one quorum (the manager's quorum_timeout; manager.py sets it)."""
        timeout = torch_compat.quorum_timeout_s(self.manager)
        return timeout if timeout is not None else self.partition_timeout_s

    def _agree_contributors(self, work: float) -> list[int]:
        """Which of the round's replicas count in its means: each says whether it spectates, its work since
        the last meeting, whether that was a full period and whether it closes the run (four floats each,
        all-gathered). Only this replica knows it is spectating (hsdp/sync/elastic/replica.py); the bound
        counts late ones out too. A round whose members disagree on closing is aborted here, on every side."""
        n = self.size
        self.counted = not self.spectating()
        full = 0.0 if self.bound.cut_this_period else 1.0
        mine = torch.tensor([1.0 if self.counted else 0.0, work, full, float(self.round_kind)])
        if n == 1:
            self.all_closing = self.closing
            if not self.closing:
                self.bound.met()
            return [0]  # alone (a spectator's peer died: its zero part stands, the round changes nothing)
        rows = torch.zeros(n, CONTROL)
        # Not counted in the sync bytes: control traffic, like the quorum's own messages.
        self._guarded_all_gather(rows.view(-1), mine).wait()
        if self.manager.errored():  # the round is lost already: count everyone, its result is never applied
            self.all_closing = False
            return list(range(n))
        kinds = rows[:, 3]
        if bool((kinds != kinds[0]).any()):
            # A replica still in its last param round met one that closes (or a closing check met a closing
            # sync): their next collectives would not pair up, and each would wait elastic.timeout_s for the
            # other's, or read the other's bytes as its own. Every member drops the round now.
            self.abort("the round's replicas disagree on closing the run")
            self.all_closing = False
            return list(range(n))
        self.all_closing = bool(kinds[0] > 0)
        present = [i for i in range(n) if rows[i, 0] > 0]
        if self.closing:  # the close counts whoever came (no straggler bound: nothing is left to train)
            return present
        self.bound.met()
        if not self.bound.enabled:
            return present
        me = self.manager.participating_rank()
        keep = self.bound.contributors(
            [bool(c > 0) for c in rows[:, 0]], rows[:, 1].tolist(), (rows[:, 2] > 0).tolist(), me
        )
        if self.counted and me not in keep:
            # late (elastic.round_timeout_s): its part is dropped, as a spectator's, and it adopts the result
            self.counted = False
            self.bound.own_late_rounds += 1
        return keep

    def abort(self, why: str) -> None:
        """Drop the current round on this replica: its manager errs, so every later collective of the round
        is a no-op and the round does not commit (nothing of it is applied)."""
        self.manager.report_error(RuntimeError(why))

    def gather(self, mine: torch.Tensor) -> Optional[torch.Tensor]:
        """Every member's `mine` (one row each, in the round's order), outside the sync bytes and times (control
        traffic: the close's fingerprints); None if the round is lost."""
        out = torch.zeros(self.size * mine.numel(), dtype=mine.dtype)
        self._guarded_all_gather(out, mine.reshape(-1)).wait()
        return None if self.manager.errored() else out.view(self.size, -1)

    def commit_round(self) -> bool:
        self._fault("before_commit", self.fault_round(self.rounds))
        self.open = False
        error = self.manager.errored()
        step = self.manager.current_step()  # the round's number on every replica (a healed one takes its peers')
        ok = bool(self.manager.should_commit())
        self.dropped.append(not ok)
        if not ok:
            self.dropped_s += self.clock() - self._round_start
            self._last_dropped = True
            why = f"{type(error.original_exception).__name__}: {error.original_exception}" if error else "a peer failed"
            # A closing round that only met (no sync of its own) is no sync round: the logs' "sync round ...
            # dropped" lines stay one per dropped_syncs.
            kind = "closing round" if self.closing and not self.syncing else "sync round"
            print(f"elastic: {kind} {self.rounds} (torchft step {step}) dropped ({why})", file=sys.stderr)
        return ok

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

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Any:
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

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Any:
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

    def _guarded_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        if self.manager.errored():
            return Done()  # the round is lost already; its result is never applied
        try:
            return _Guarded(self.pg.allgather([list(out.chunk(self.size))], [inp], AllgatherOptions()), self.manager)
        except Exception as e:
            self.manager.report_error(e)
            return Done()


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
