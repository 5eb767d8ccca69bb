"""Every collective of a run goes through `Comm`, which counts bytes sent and time.

Bytes are what one rank sends under the ring algorithm, for a group of n ranks:

    all_gather(out, inp)      (n − 1) · inp.nbytes
    reduce_scatter(out, inp)  (n − 1) · out.nbytes
    all_reduce(t)             2 · (n − 1) · t.nbytes // n
    all_to_all(out, inp)      the bytes of inp's splits bound for the other ranks

A collective on a group of one rank (or on a group the mesh does not have) is
skipped and counts nothing. Counts are kept per (group name, op); `metrics.jsonl`
reports the "shard", "replicate" and "sync" totals.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

# torch >= 2.13 renames the tensor-in/tensor-out collectives; older torch (GPU boxes) has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce


def ring_bytes(op: str, n: int, t: torch.Tensor) -> int:
    """Bytes one rank sends for `op` on a group of n ranks (the formulas above).

    t is the all_gather input, the reduce_scatter output or the all_reduce tensor.
    """
    return ring_bytes_of(op, n, t.numel() * t.element_size())


def ring_bytes_of(op: str, n: int, nbytes: int) -> int:
    """`ring_bytes` from the tensor's size in bytes."""
    return 2 * (n - 1) * nbytes // n if op == "all_reduce" else (n - 1) * nbytes


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within mesh.timeout_s: a peer rank stopped answering."""


class TimedWork:
    """Wraps an async Work so the time spent waiting on it is counted, and bounded by the Comm's timeout."""

    def __init__(self, work: Optional[dist.Work], comm: Comm, key: tuple[str, str]) -> None:
        self.work, self.comm, self.key = work, comm, key

    def wait(self) -> None:
        if self.work is not None:
            t0 = time.perf_counter()
            timeout = self.comm.timeout
            if timeout is None:
                self.work.wait()
            else:  # gloo's own timeout does not bound a wait on a peer that is alive but stopped
                try:
                    self.work.wait(timeout)
                except RuntimeError as e:
                    if time.perf_counter() - t0 < timeout.total_seconds() and "Timed out" not in str(e):
                        raise  # failed for another reason (a peer died): its own error
                    group, op = self.key
                    raise CollectiveTimeout(
                        f"{op} on the {group} group did not complete within mesh.timeout_s="
                        f"{timeout.total_seconds():g} s (a peer rank stopped answering)"
                    ) from e
            self.comm.seconds[self.key] += time.perf_counter() - t0
            self.work = None

    def get_future(self) -> torch.futures.Future:
        """The underlying work's future (for DDP comm hooks); time is not counted here."""
        if self.work is None:
            raise RuntimeError("get_future() on a finished or skipped collective")
        return self.work.get_future()


class Comm:
    """The run's process groups by name, and the byte/time counters."""

    def __init__(self, groups: dict[str, Optional[dist.ProcessGroup]], timeout_s: Optional[float] = None) -> None:
        """`timeout_s`: the bound on any wait for a collective (mesh.timeout_s); None waits as long as torch does."""
        self.groups = groups
        self.timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        self.sizes = {name: dist.get_world_size(g) for name, g in groups.items()}
        # Process-group name → our label. One group can carry several labels (on a 1×S mesh the
        # shard group is the world group): the first, most specific one ("shard" before "world") wins.
        self.labels: dict[str, str] = {}
        for name, g in groups.items():
            if g is not None:
                self.labels.setdefault(g.group_name, name)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def size(self, group: str) -> int:
        """The group's ranks; 1 for a group the mesh does not have (no replicate group on a two-level mesh)."""
        return self.sizes.get(group, 1)

    def label(self, group: dist.ProcessGroup) -> str:
        """Our name for a process group (for collectives issued by other code, e.g. FSDP2)."""
        return self.labels.get(group.group_name, "other")

    def count(self, group: str, op: str, nbytes: int) -> None:
        """Record one collective's bytes (also used for collectives issued by FSDP2 itself)."""
        self.bytes[(group, op)] += nbytes
        self.calls[(group, op)] += 1

    def _run(self, group: str, op: str, nbytes: int, fn, async_op: bool) -> TimedWork:
        key = (group, op)
        self.count(group, op, nbytes)
        t0 = time.perf_counter()
        work = fn(True)  # always async: a blocking call could not be bounded by the timeout
        self.seconds[key] += time.perf_counter() - t0
        timed = TimedWork(work, self, key)
        if not async_op:
            timed.wait()
        return timed

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False) -> TimedWork:
        """out = concat over the group's ranks of inp (all_gather_into_tensor)."""
        n = self.size(group)
        if n == 1:
            out.copy_(inp)
            return TimedWork(None, self, (group, "all_gather"))
        return self._run(
            group,
            "all_gather",
            ring_bytes("all_gather", n, inp),
            lambda a: _all_gather_single(out, inp, group=self.groups[group], async_op=a),
            async_op,
        )

    def reduce_scatter(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        group: str,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> TimedWork:
        """out = this rank's chunk of the reduction (SUM by default) over the group of inp."""
        n = self.size(group)
        if n == 1:
            out.copy_(inp)
            return TimedWork(None, self, (group, "reduce_scatter"))
        return self._run(
            group,
            "reduce_scatter",
            ring_bytes("reduce_scatter", n, out),
            lambda a: _reduce_scatter_single(out, inp, op=op, group=self.groups[group], async_op=a),
            async_op,
        )

    def all_reduce(
        self, t: torch.Tensor, group: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False
    ) -> TimedWork:
        """In-place all-reduce of t over the group (SUM by default)."""
        n = self.size(group)
        if n == 1:
            return TimedWork(None, self, (group, "all_reduce"))
        return self._run(
            group,
            "all_reduce",
            ring_bytes("all_reduce", n, t),
            lambda a: _all_reduce(t, op=op, group=self.groups[group], async_op=a),
            async_op,
        )

    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: str
    ) -> TimedWork:
        """Rank r's inp split i goes to rank i; out split j is what rank j sent r (all_to_all_single, blocking)."""
        n = self.size(group)
        if n == 1:
            out.copy_(inp)
            return TimedWork(None, self, (group, "all_to_all"))
        rank = dist.get_rank(self.groups[group])
        sent = (sum(in_splits) - in_splits[rank]) * inp.element_size()
        return self._run(
            group,
            "all_to_all",
            sent,
            lambda a: dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.groups[group], async_op=a),
            False,
        )

    def group_bytes(self, group: str) -> int:
        """Total bytes this rank has sent on `group`, all ops."""
        return sum(b for (g, _), b in self.bytes.items() if g == group)

    def report(self) -> dict[str, dict[str, float]]:
        """{"group/op": {"bytes", "seconds", "calls"}} for summary.json."""
        return {
            f"{g}/{op}": {
                "bytes": self.bytes[(g, op)],
                "seconds": round(self.seconds[(g, op)], 4),
                "calls": self.calls[(g, op)],
            }
            for (g, op) in sorted(self.bytes)
        }
