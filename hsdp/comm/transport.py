"""Over what Δ travels: the sync group's collectives, behind one small protocol (docs/design.md §8, §9).

A transport moves tensors among the M replicas of one shard position. The
policy and the codecs only call `all_reduce_sum` and `all_gather`, wait on
what they return, and ask it whose parts count in a mean, so another
implementation (the elastic replicas' torchft group, hsdp/sync/elastic/)
plugs in without touching them. Every collective is counted (bytes, calls,
wait time) under the "sync" label. The mesh is built with its transport
(`Mesh.sync_transport`): `GroupTransport` here, the c10d sync group.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hsdp.comm.groups import Comm


class Work(Protocol):
    """An in-flight collective: `wait()` returns when its output is ready."""

    def wait(self) -> None: ...


class Transport(Protocol):
    """The replicas' collectives (sum and gather), sync or async, in rounds.

    A round is one param sync (all units of the fragments due at a step), or on a transport that may
    fail one grad-sync step's grads: `begin_round()` before its first collective, `commit_round()`
    after its last wait; the policy applies the round only if that returns True. On the c10d group a
    round always commits; on the elastic (torchft) transport the membership is agreed at
    `begin_round` and a round a replica failed in does not commit.
    """

    may_fail: bool  # rounds can fail to commit: the one place that says so (the policy asks it)
    counted: bool  # whether this replica's part counts in the current round's means (False: it spectates)

    @property
    def size(self) -> int:
        """The number of replicas in the group (in the current round): a gather's rows."""

    @property
    def contributors(self) -> list[int]:
        """The group ranks whose parts count in this round's mean (M = its length): all of them, or on the
        elastic transport all but a replica that spectates (its all-reduce part is zero)."""

    def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """A gather's output as one row per replica whose part counts (the rows of `contributors`)."""

    def begin_round(self) -> None:
        """Agree on who takes part, before a round's first collective (nothing if a round is open)."""

    def commit_round(self) -> bool:
        """After a round's last wait: whether every replica in it got its results (apply them only then)."""

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Work:
        """t ← Σ over replicas of t, in place."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        """out ← concat over replicas (in replica order) of inp."""


class GroupTransport:
    """The c10d sync group of the mesh, through `Comm` (so its bytes are counted as "sync")."""

    may_fail = False  # a failed collective raises and ends the run (launch stops every rank)
    counted = True  # every replica's part counts

    def __init__(self, comm: Comm, group: str = "sync") -> None:
        self.comm, self.group = comm, group

    @property
    def size(self) -> int:
        return self.comm.size(self.group)

    @property
    def contributors(self) -> list[int]:
        return list(range(self.size))

    def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        return gathered.view(self.size, -1)

    def begin_round(self) -> None:
        """Nothing to agree on: the c10d group's membership is fixed for the run."""

    def commit_round(self) -> bool:
        return True

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Work:
        return self.comm.all_reduce(t, self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        return self.comm.all_gather(out, inp, self.group, async_op=async_op)
