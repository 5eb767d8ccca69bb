"""Over what Δ travels: the sync group's collectives, behind one small protocol.

A transport moves tensors among the M replicas of one shard position. The
policy and the codecs only call `all_reduce_sum` and `all_gather` and wait on
what they return, so another implementation (e.g. a fault-tolerant group whose
membership changes between syncs) plugs in without touching them. Every
collective is counted (bytes, calls, wait time) under the "sync" label.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hsdp.comm.groups import Comm


class Work(Protocol):
    """An in-flight collective: `wait()` returns when its output is ready."""

    def wait(self) -> None: ...


class Transport(Protocol):
    """The replicas' collectives (sum and gather), sync or async."""

    @property
    def size(self) -> int:
        """M: the number of replicas taking part."""

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Work:
        """t ← Σ over replicas of t, in place."""

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        """out ← concat over replicas (in replica order) of inp."""


class GroupTransport:
    """The c10d sync group of the mesh, through `Comm` (so its bytes are counted as "sync")."""

    def __init__(self, comm: Comm, group: str = "sync") -> None:
        self.comm, self.group = comm, group

    @property
    def size(self) -> int:
        return self.comm.size(self.group)

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Work:
        return self.comm.all_reduce(t, self.group, async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        return self.comm.all_gather(out, inp, self.group, async_op=async_op)
