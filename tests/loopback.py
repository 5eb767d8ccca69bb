"""M replicas' sync transports in one process, one thread per replica (tests of SyncPolicy and its codecs).

The i-th collective of every replica completes once all M issued theirs (each waits for the others, so
blocking rounds work); the results are the replicas' tensors in replica order. `sent[m]`: the bytes
replica m handed to its collectives. `gather_only`: an all-reduce fails the test (a lossy codec must only
gather)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class Done:
    """A collective that is already complete."""

    def wait(self) -> None:
        """Nothing left to wait for: the collective completed when it was issued."""


class ThreadedLoopback:
    def __init__(self, M: int, gather_only: bool = False) -> None:
        self.M, self.gather_only = M, gather_only
        self.cond = threading.Condition()
        self.slots: dict[int, list] = {}
        self.sent = [0] * M

    def _issue(self, m: int, i: int, t: torch.Tensor) -> list[torch.Tensor]:
        """Replica m's i-th collective with `t`: every replica's tensor once all M issued theirs."""
        self.sent[m] += t.numel() * t.element_size()
        with self.cond:
            slot = self.slots.setdefault(i, [None] * self.M)
            slot[m] = t.clone()
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: all(s is not None for s in slot), timeout=60)
        assert ok, f"a replica never issued its collective {i}"
        return slot

    def transport(self, m: int) -> Any:
        group, issued = self, [0]

        def issue(t: torch.Tensor) -> list[torch.Tensor]:
            issued[0] += 1
            return group._issue(m, issued[0] - 1, t)

        class Transport:
            may_fail, counted, size, contributors = False, True, group.M, list(range(group.M))

            def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
                return gathered.view(group.M, -1)

            def begin_round(self) -> None:
                """Nothing to agree on: the replicas are fixed, as on the c10d sync group."""

            def commit_round(self) -> bool:
                return True

            def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Done:
                assert not group.gather_only, "a lossy codec only gathers"
                slot = issue(t)
                t.copy_(sum(slot[1:], slot[0].clone()))  # replicas in order
                return Done()

            def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Done:
                out.copy_(torch.cat(issue(inp)))
                return Done()

        return Transport()


def run_in_threads(fns: list[Callable[[], Any]]) -> None:
    """Run each function in its own thread; fail with the first error, or if one hangs (120 s)."""
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "hang"
