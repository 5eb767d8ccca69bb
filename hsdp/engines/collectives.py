"""The two collective sequences of a unit, each step a small named function (docs/design.md §11.1).

    gather:  pack_for_gather (cast held → param_dtype) → all-gather on the shard group
             → unpack_gathered (rank-major [S, N] → param-major full_flat)
    reduce:  pack_grads_for_reduce (cast → reduce_dtype, pre-divide, accumulate micro-steps)
             → reduce-scatter on the shard group → the replicas' stages (`replica_stages`:
             [sync_grads] all-reduce on the sync group; on a three-level mesh the site's
             all-reduce, split around the slow link when the sites sync grads too)
             → accumulate_reduced (post-divide, add into the fp32 grad shard)

Both run asynchronously: `start_gather` / `start_reduce` launch and return a
pending object that finishes later, so the engine can overlap them with compute.
The eager engine and `full_state_dict` use these; the compiled path expresses
the same steps with functional collectives (hsdp/compile/graph.py) and shares
`ReducePlan` (hsdp/core/layout.py), so both divide and sync grads the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from hsdp.comm.groups import Comm, TimedWork
from hsdp.core.layout import ReducePlan, UnitLayout
from kernels.pack import pack_shards, unpack_full
from kernels.reduce import accumulate_grad_shards, pack_grads


# ---------------------------------------------------------------- gather
def pack_for_gather(held_flat: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """This rank's all-gather input: the held shard itself (fp32) or one cast of it."""
    if param_dtype == held_flat.dtype:
        return held_flat
    ag_in = torch.empty(held_flat.numel(), dtype=param_dtype, device=held_flat.device)
    pack_shards(held_flat, ag_in)
    return ag_in


def unpack_gathered(ag_out: torch.Tensor, layout: UnitLayout, full_flat: torch.Tensor) -> None:
    """Gathered [S·N] (rank-major) → full_flat [S·N] (param-major)."""
    unpack_full(ag_out.view(layout.S, layout.N), layout.shard_sizes, full_flat)


class PendingGather:
    """A unit's all-gather in flight; `finish` waits and unpacks it."""

    def __init__(self, work, ag_out: torch.Tensor, layout: UnitLayout) -> None:
        self.work, self.ag_out, self.layout = work, ag_out, layout

    def finish(self, full_flat: torch.Tensor) -> None:
        self.work.wait()
        unpack_gathered(self.ag_out, self.layout, full_flat)


def start_gather(comm: Comm, held_flat: torch.Tensor, layout: UnitLayout, param_dtype: torch.dtype) -> PendingGather:
    """Pack the held shard and launch its all-gather on the shard group."""
    ag_in = pack_for_gather(held_flat, param_dtype)
    ag_out = torch.empty(layout.S * layout.N, dtype=param_dtype, device=held_flat.device)
    return PendingGather(comm.all_gather(ag_out, ag_in, "shard", async_op=True), ag_out, layout)


def gather_full(comm: Comm, held_flat: torch.Tensor, layout: UnitLayout, dtype: torch.dtype) -> torch.Tensor:
    """Blocking gather into a new param-major buffer (checkpoint export, full_state_dict)."""
    full = torch.empty(layout.S * layout.N, dtype=dtype, device=held_flat.device)
    start_gather(comm, held_flat, layout, dtype).finish(full)
    return full


# ---------------------------------------------------------------- reduce
def pack_grads_for_reduce(
    grads: list[Optional[torch.Tensor]], layout: UnitLayout, plan: ReducePlan, rs_in: Optional[torch.Tensor]
) -> torch.Tensor:
    """Add this micro-step's full grads (pre-divided, in reduce_dtype) into the [S, N] reduce-scatter input."""
    first = rs_in is None
    if rs_in is None:
        rs_in = torch.empty(layout.S, layout.N, dtype=plan.reduce_dtype, device=grads_device(grads))
    grads = [None if g is None else g.contiguous() for g in grads]
    pack_grads(grads, layout.shard_sizes, rs_in, 1.0 / plan.pre, accumulate=not first)
    return rs_in


def grads_device(grads: list[Optional[torch.Tensor]]) -> torch.device:
    return next(g.device for g in grads if g is not None)


def accumulate_reduced(reduced: torch.Tensor, grad_flat: torch.Tensor, plan: ReducePlan) -> None:
    """grad_flat += reduced / post (fp32)."""
    accumulate_grad_shards(reduced, grad_flat, 1.0 / plan.post)


class PendingReduce:
    """A unit's grad reduction in flight: reduce-scatter, then the replicas' stages (`replica_stages`).

    Each stage is launched async; `advance` waits for the current one and starts
    the next, so a caller that advances once per unit overlaps every stage with
    the next unit's backward.
    """

    def __init__(self, comm: Comm, rs_in: torch.Tensor, grad_flat: torch.Tensor, plan: ReducePlan) -> None:
        self.comm, self.grad_flat, self.plan = comm, grad_flat, plan
        self.out = torch.empty(grad_flat.numel(), dtype=plan.reduce_dtype, device=grad_flat.device)
        self.work = comm.reduce_scatter(self.out, rs_in.view(-1), "shard", async_op=True)
        self.rs_in: Optional[torch.Tensor] = rs_in  # kept alive until the reduce-scatter is done
        self.stages = replica_stages(comm, self, plan.sync_grads)

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once the grad shard holds the result."""
        self.work.wait()
        self.rs_in = None
        if self.stages:
            self.work = self.stages.pop(0)()
            return False
        accumulate_reduced(self.out, self.grad_flat, self.plan)
        return True

    def finish(self) -> None:
        while not self.advance():
            continue


def replica_stages(comm: Comm, red: PendingReduce, sync_grads: bool) -> list[Callable[[], TimedWork]]:
    """The collectives after the shard group's reduce-scatter, each a launcher of one async stage.

    Two-level mesh: [sync_grads] all-reduce on the sync group. Three-level (docs/design.md §4.1): the
    in-site replicas' all-reduce every step; when the sites sync grads too it is split around the slow
    link — reduce-scatter in the site, all-reduce of the 1/R slice across sites, all-gather in the
    site — so each site's grads cross the slow link once, as a two-level replica's do.
    """
    replicate, sites = comm.size("replicate"), comm.size("sync")
    if not sync_grads or sites == 1:
        return [lambda: comm.all_reduce(red.out, "replicate", async_op=True)] if replicate > 1 else []
    if replicate == 1:
        return [lambda: comm.all_reduce(red.out, "sync", async_op=True)]
    n = red.out.numel()
    c = -(-n // replicate)  # ceil: every replica's slice the same length
    padded = torch.zeros(replicate * c, dtype=red.out.dtype, device=red.out.device)
    part = torch.empty(c, dtype=red.out.dtype, device=red.out.device)

    def scatter_in_site() -> TimedWork:
        padded[:n] = red.out
        return comm.reduce_scatter(part, padded, "replicate", async_op=True)

    def gather_in_site() -> TimedWork:
        red.out = padded[:n]  # the all-gather writes the site's sum here
        return comm.all_gather(padded, part, "replicate", async_op=True)

    return [scatter_in_site, lambda: comm.all_reduce(part, "sync", async_op=True), gather_in_site]


def start_reduce(comm: Comm, rs_in: torch.Tensor, grad_flat: torch.Tensor, plan: ReducePlan) -> PendingReduce:
    """Launch the reduce-scatter of a unit's packed grads; the rest follows as it is advanced."""
    return PendingReduce(comm, rs_in, grad_flat, plan)
