"""The sharded training step in traceable form: what torch.compile captures (docs/design.md §10).

Per unit, in the graph:

    ag_in  = cast_shard(held, param_dtype)                          # pack: hsdp_kernels::cast_shard
    full   = wait_tensor(all_gather_into_tensor(ag_in, S, shard))   # _c10d_functional ops
    params = unpack_params(full, layout)                            # views/copies of the gathered buffer
    (compile.bucket_mb > 0: neighbouring units share one all-gather of their concatenated shards)
    x      = functional_call(unit, params, x)

and in backward (`_GatherShards.backward`), the same reduction as the eager
engine (`hsdp.core.layout.ReducePlan`):

    g = scale_grad(grad, reduce_dtype, 1/pre) → wait(reduce_scatter(sum, shard))
      → reduce_across_replicas (sync_grads: all_reduce(sum, sync); three-level: the site's too)
      → scaled_grad_shard(g, 1/post)

The pack and the reduction epilogue are the project's kernels (kernels/pack.py,
kernels/reduce.py) as functional `hsdp_kernels::` ops: one call each in the
generated code, running the Triton kernel or the torch reference by
`kernels.backend` at run time, as the eager engine's calls do.

The all-gathers and what is unpacked from them are tagged MUST_RECOMPUTE by
`hsdp.compile.passes.recompute_gathers`, so backward re-gathers instead of
saving full params (release); a unit whose backward needs no weights (the
embedding) saves nothing and is not re-gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.func import functional_call

from hsdp.core.layout import ReducePlan, UnitLayout
from hsdp.models.gpt import loss_fn
from hsdp.torch_compat import C10D_FUNCTIONAL, reusable_compile_region
from kernels.pack import cast_shard
from kernels.reduce import scale_grad, scaled_grad_shard

C = C10D_FUNCTIONAL


@dataclass(frozen=True)
class Groups:
    """The process groups the graph's collectives run on (names are baked into the graph)."""

    shard: str
    shard_size: int
    sync: str
    sync_size: int
    replicate: str = ""  # a three-level mesh's in-site replicate group ("" on a two-level mesh)
    replicate_size: int = 1


class _GatherShards(torch.autograd.Function):
    """Forward: all-gather the cast held shard. Backward: reduce-scatter (+ sync all-reduce) its grad.

    Gradient accumulation (the engine's `set_reduce_grads(False)`): with `acc` (a leaf of the
    gathered size) the backward reduces nothing and hands the scaled full grad to `acc` instead,
    where autograd sums it over micro-steps; the final micro-step passes that sum as `pending`,
    which is added before its one reduce-scatter, as the eager engine does.
    """

    @staticmethod
    def forward(
        ctx,
        held: torch.Tensor,
        acc: Optional[torch.Tensor],
        pending: Optional[torch.Tensor],
        param_dtype: torch.dtype,
        groups: Groups,
        plan: ReducePlan,
    ) -> torch.Tensor:
        ctx.groups, ctx.plan, ctx.accumulate, ctx.has_pending = groups, plan, acc is not None, pending is not None
        if pending is not None:
            ctx.save_for_backward(pending)
        ag_in = cast_shard(held, param_dtype)
        if groups.shard_size == 1:
            return ag_in
        return C.wait_tensor(C.all_gather_into_tensor(ag_in, groups.shard_size, groups.shard))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        groups, plan = ctx.groups, ctx.plan
        g = scale_grad(grad, plan.reduce_dtype, 1.0 / plan.pre)
        if ctx.accumulate:
            return None, g, None, None, None, None
        if ctx.has_pending:
            (pending,) = ctx.saved_tensors
            g = pending + g  # the earlier micro-steps' sum first: the eager engine's order
        if groups.shard_size > 1:
            g = C.wait_tensor(C.reduce_scatter_tensor(g, "sum", groups.shard_size, groups.shard))
        g = reduce_across_replicas(g, groups, plan.sync_grads)
        g = scaled_grad_shard(g, 1.0 / plan.post)
        return g, None, None, None, None, None


def reduce_across_replicas(g: torch.Tensor, groups: Groups, sync_grads: bool) -> torch.Tensor:
    """The grad shard summed over the replicas: the eager engine's `replica_stages` as functional collectives.

    Two-level: [sync_grads] all-reduce on the sync group. Three-level: the site's all-reduce every step,
    split around the slow link (reduce-scatter in the site, all-reduce of the slice across sites,
    all-gather in the site) when the sites sync grads too.
    """
    replicate, sites = groups.replicate_size, groups.sync_size
    if not sync_grads or sites == 1:
        return C.wait_tensor(C.all_reduce(g, "sum", groups.replicate)) if replicate > 1 else g
    if replicate == 1:
        return C.wait_tensor(C.all_reduce(g, "sum", groups.sync))
    n = g.numel()
    padded = torch.nn.functional.pad(g.view(-1), (0, -(-n // replicate) * replicate - n))
    part = C.wait_tensor(C.reduce_scatter_tensor(padded, "sum", replicate, groups.replicate))
    part = C.wait_tensor(C.all_reduce(part, "sum", groups.sync))
    return C.wait_tensor(C.all_gather_into_tensor(part, replicate, groups.replicate))[:n]


def unpack_params(gathered: torch.Tensor, layout: UnitLayout) -> list[torch.Tensor]:
    """Rank-major gathered [S, N] (or [S·N]) → each param's full tensor (padding rows dropped); torch ops."""
    columns = gathered.view(layout.S, -1).split(layout.shard_sizes, dim=1)
    return [c.reshape(layout.S * s.rows, *s.shape[1:])[: s.shape[0]] for s, c in zip(layout.specs, columns)]


def plan_buckets(layouts: list[UnitLayout], param_dtype: torch.dtype, bucket_mb: float) -> list[list[int]]:
    """Consecutive units whose shards together stay ≤ bucket_mb share one all-gather (and reduce-scatter).

    0 means no bucketing (one unit per collective). Never one bucket for the whole model, which
    would mean every full param alive at once: a bucket that would hold every unit is split in two.
    """
    units = list(range(len(layouts)))
    if bucket_mb <= 0:
        return [[u] for u in units]
    cap = bucket_mb * 2**20
    buckets: list[list[int]] = []
    size = cap + 1.0
    for u, layout in zip(units, layouts):
        nbytes = layout.S * layout.N * param_dtype.itemsize  # the gathered bucket's size
        if size + nbytes > cap:
            buckets.append([])
            size = 0.0
        buckets[-1].append(u)
        size += nbytes
    if len(buckets) == 1 and len(units) > 1:
        buckets = [units[: len(units) // 2], units[len(units) // 2 :]]
    return buckets


def gather_bucket(
    helds: list[torch.Tensor],
    layouts: list[UnitLayout],
    param_dtype: torch.dtype,
    groups: Groups,
    plan: ReducePlan,
    acc: Optional[torch.Tensor] = None,
    pending: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """Each unit's gathered [S, N] of a bucket of units, from one all-gather of their concatenated shards.

    Its backward is one reduce-scatter (+ sync all-reduce) of the bucket; autograd splits the
    result back into each unit's grad shard.
    """
    held = helds[0] if len(helds) == 1 else torch.cat(helds)
    gathered = _GatherShards.apply(held, acc, pending, param_dtype, groups, plan).view(groups.shard_size, -1)
    return list(gathered.split([layout.N for layout in layouts], dim=1))


UnitRun = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, the unit's gathered [S, N]) -> output


def run_unit(module: nn.Module, layout: UnitLayout) -> UnitRun:
    """The unit's forward on its gathered shards: unpack the full params, then functional_call.

    The unpacking is inside so a region's one tensor input is the gathered buffer (its params as
    separate inputs would alias one another, which a nested compile region refuses).
    """
    names = [s.name for s in layout.specs]

    def run(x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        params = unpack_params(gathered, layout)
        # tie_weights=False: between uses every param of the module points at one empty placeholder.
        return functional_call(module, dict(zip(names, params)), (x,), tie_weights=False)

    return run


def region_key(x: torch.Tensor, gathered: torch.Tensor) -> int:
    """Which traced region a call of one kind of unit reuses: one per layout of its gathered input.

    Dynamo's own reuse check refuses any region with side effects, and functional_call's swapping of the
    module's params is one, so it would trace every layer anew. The swap leaves the module as it found
    it, and a kind's calls differ only in their tensors' values, so a key of the input's strides (which a
    bucket of units can change) is all that tells two calls apart; shapes are the kind's own.
    """
    return gathered.stride(0) * 1_000_003 + gathered.stride(1)


def unit_runs(units: list[tuple[nn.Module, UnitLayout]], regional: bool) -> list[UnitRun]:
    """Each unit's forward, as the graph calls it.

    regional: units of one class and one layout (the transformer blocks) share one
    `torch.compiler.nested_compile_region` on the first such unit's module, so dynamo traces the block
    once, AOTAutograd partitions it once and inductor compiles it once, whatever the depth; the outer
    graph keeps every collective (our passes schedule them as before). Without it every block is
    traced inline and the compile grows with the depth.
    """

    def kind(module: nn.Module, layout: UnitLayout) -> tuple:
        """Units of one kind run the same code on params of the same names and shapes."""
        return type(module), layout.S, tuple((s.name, s.shape, s.offset) for s in layout.specs)

    runs: list[UnitRun] = []
    shared: dict[tuple, UnitRun] = {}
    count: dict[tuple, int] = {}
    for module, layout in units:
        key = kind(module, layout)
        count[key] = count.get(key, 0) + 1
    for module, layout in units:
        key = kind(module, layout)
        if regional and count[key] > 1 and key not in shared:  # one region per kind: every call reuses it
            region = reusable_compile_region(run_unit(module, layout), count[key] + 1, region_key)
            if region is not None:  # None: this torch cannot reuse one (the unit is traced inline)
                shared[key] = region
        runs.append(shared.get(key) or run_unit(module, layout))
    return runs


def sharded_loss(
    units: list[tuple[nn.Module, UnitLayout]],
    helds: list[torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    param_dtype: torch.dtype,
    groups: Groups,
    plan: ReducePlan,
    buckets: list[list[int]],
    runs: list[UnitRun],
    accs: Optional[list[torch.Tensor]] = None,
    pendings: Optional[list[torch.Tensor]] = None,
) -> torch.Tensor:
    """The whole model's loss from the held shards: the function torch.compile captures.

    `accs` (one leaf per bucket): a micro-step that accumulates instead of reducing;
    `pendings` (one sum per bucket): the final micro-step after such steps.
    """
    for b, bucket in enumerate(buckets):
        layouts = [units[u][1] for u in bucket]
        acc, pending = accs[b] if accs else None, pendings[b] if pendings else None
        gathered = gather_bucket([helds[u] for u in bucket], layouts, param_dtype, groups, plan, acc, pending)
        for u, unit_gathered in zip(bucket, gathered):
            x = runs[u](x, unit_gathered)
    return loss_fn(x, y)
