"""One compile per machine: the first rank on a machine compiles each graph, the others load it.

Why: every rank traces the same graphs (same shapes, and the same group names: the graphs name the
shard and sync groups by role, hsdp/engines/compiled.py), and ranks on one machine share inductor's
cache folder. Compiling them all at once costs S times the CPU of one
compile (on a 2-core box, four ranks each compiling for 30 s); when the first rank on the machine
compiles while the others wait, they find its graphs in the FX graph cache and only trace and load
(seconds). The others' wait is no loss: the leader's shard group could not run the step before it anyway
(the graph's collectives need every rank), and another shard group's own compile would take as long.

When is the leader's graph in the cache? Inductor writes the cache entry after it has generated and
built the code, before the graph runs, so the leader posts "compiled" when its graph issues its first
collective. That moment has a hook only where our kernels sit behind the graph's collectives (CPU,
hsdp/compile/gloo.py); elsewhere (NCCL) every rank compiles at once, as torch does.

A graph with no collective in it (a shard group of 1 between syncs) is posted once it has run.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from hsdp.compile import gloo
from hsdp.torch_compat import default_store


class CompileTurns:
    """Orders the first call of each compiled graph among the ranks of `group` on this machine."""

    # How long a follower waits for the leader's compile. Not mesh.timeout_s, which bounds a collective: a
    # cold compile took over 60 s on a loaded 2-core box (a test's mesh.timeout_s) and the follower failed.
    # A leader that dies instead ends the job through the launcher, so this bounds only a compile that hangs.
    COMPILE_WAIT_S = 3600.0

    def __init__(self, group: dist.ProcessGroup, timeout_s: float = COMPILE_WAIT_S) -> None:
        hosts: list[Optional[str]] = [None] * group.size()
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        me = group.rank()
        self.leader = hosts.index(hosts[me])  # the first rank of the group on this machine
        self.followers = sum(1 for h in hosts if h == hosts[me]) - 1
        self.is_leader = me == self.leader
        self.prefix = f"hsdp/compile-turns/{group.group_name}/{self.leader}/"
        self.timeout = timedelta(seconds=timeout_s)
        self.graphs = 0  # first calls so far: the same count on every rank (they run the same steps)

    @property
    def active(self) -> bool:
        """Whether any rank waits for another (ranks share a machine, and the leader can post)."""
        return self.followers > 0 and gloo.routed()

    @contextlib.contextmanager
    def first_call(self) -> Iterator[None]:
        """Around a graph's first call (its compile): the leader compiles and runs it; a follower waits
        until the leader's graph runs (so it is in the cache), then loads it."""
        if not self.active:
            yield
            return
        key = f"{self.prefix}{self.graphs}"
        self.graphs += 1
        store = default_store()
        if not self.is_leader:
            store.wait([key], self.timeout)
            yield
            return
        posted = False

        def post() -> None:
            nonlocal posted
            if not posted:
                posted = True
                store.set(key, "compiled")

        with gloo.on_next_collective(post):
            yield
        post()  # a graph without collectives: nothing waited on it to run
