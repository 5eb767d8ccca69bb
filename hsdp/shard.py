"""The HSDP engine: units, held shards, gather/release with prefetch, reduce-scatter.

Per unit (DESIGN §1, §4):

    held_flat  [N]       fp32, this rank's dim-0 shard of every param, padded
    gather:    pack_shards(held_flat → param_dtype) → all_gather (shard group)
               → unpack_full into full_flat [S·N] (param-major, padded)
    release:   full_flat's storage is resized to 0 (views keep their identity)
    backward:  pack_grads(full grads → [S, N] reduce_dtype, pre-divided)
               → reduce_scatter (shard group) → [warmup] all_reduce (sync group)
               → accumulate_grad_shards(post-divide, → fp32 grad_flat)

Autograd wiring: `_GatherFn` turns held shards into full params; its backward
is the reduce-scatter. Saved tensors that alias a unit's full params are
replaced by a marker in forward (saved_tensors_hooks), so release really frees
them, and the first unpack in backward re-gathers the unit (and prefetches the
previous one that saved any). A unit whose backward needs no weights (the
embedding) is never re-gathered. Everything collective goes through `hsdp.comm.Comm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from hsdp.comm import Comm
from hsdp.mesh import Mesh
from kernels.pack import pack_shards, unpack_full
from kernels.reduce import accumulate_grad_shards, pack_grads

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- layout
@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in its unit's shard and full buffers."""

    name: str  # name inside the unit, e.g. "attn.qkv.weight"
    owner: nn.Module  # the submodule that holds it
    attr: str  # attribute name on the owner
    shape: torch.Size
    rows: int  # dim-0 rows per rank: ceil(d0 / S)
    row_numel: int  # elements per dim-0 row
    offset: int  # start in the per-rank shard [N]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return self.rows * self.row_numel

    def held_rows(self, shard_rank: int) -> int:
        """Rows of real (unpadded) data on `shard_rank`."""
        return max(0, min(self.rows, self.shape[0] - shard_rank * self.rows))


def plan_layout(module: nn.Module, shard_size: int) -> list[ParamSpec]:
    """Dim-0 sharding of every param of `module`, padded to equal shards."""
    specs, offset = [], 0
    for name, p in module.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        shape = p.shape if p.dim() > 0 else torch.Size([1])
        rows = -(-shape[0] // shard_size)
        row_numel = math.prod(shape[1:])
        specs.append(ParamSpec(name, module.get_submodule(owner_name), attr, shape, rows, row_numel, offset))
        offset += rows * row_numel
    return specs


def divide_factors(divisor: int) -> tuple[float, float]:
    """Split a gradient divisor into pre- and post-reduction factors (pre·post = divisor).

    Dividing partly before the sum keeps fp16/bf16 sums from overflowing, and
    partly after keeps small grads from underflowing (as FSDP does).
    """
    pre = 1
    while divisor % pre == 0 and divisor / pre > pre:
        pre *= 2
    return float(pre), divisor / pre


# ---------------------------------------------------------------- one unit
class ShardedUnit:
    """One model unit: its held shard, full-param buffer and collectives."""

    def __init__(self, index: int, prefix: str, module: nn.Module, engine: "HSDPModel",
                 materialize: Optional[Callable[[int, nn.Module], None]] = None) -> None:
        mesh = engine.mesh
        if materialize is not None:  # meta-device unit: create its full params only now, one unit at a time
            materialize(index, module)
        self.index, self.prefix, self.module, self.engine = index, prefix, module, engine
        self.S = mesh.shard_size
        self.comm: Comm = mesh.comm
        self.specs = plan_layout(module, self.S)
        self.shard_sizes = [s.shard_numel for s in self.specs]
        self.N = sum(self.shard_sizes)
        self.param_dtype = engine.param_dtype
        device = mesh.device
        self.held_flat = torch.zeros(self.N, dtype=torch.float32, device=device)
        self.grad_flat = torch.zeros(self.N, dtype=torch.float32, device=device)
        self.full_flat = torch.empty(self.S * self.N, dtype=self.param_dtype, device=device)
        self.held_params: list[nn.Parameter] = []
        self._placeholder = torch.empty(0, device=device)
        self._shard_params(mesh.shard_rank)
        self.release()
        self.gathered = False
        self.saved_full = True  # whether its last forward saved full params for backward (see _pack_saved)
        self._gather_work = None
        self._ag_out: Optional[torch.Tensor] = None
        self._rs_in: Optional[torch.Tensor] = None  # [S, N] grads packed over micro-steps
        # A leaf that requires grad, so _GatherFn's outputs join the autograd graph.
        self.anchor = torch.empty(0, device=device, requires_grad=True)

    def _shard_params(self, shard_rank: int) -> None:
        """Copy this rank's rows of every param into held_flat; make held params views of it."""
        with torch.no_grad():
            for s in self.specs:
                full = getattr(s.owner, s.attr).detach().reshape(s.shape)
                rows = s.held_rows(shard_rank)
                start = shard_rank * s.rows
                seg = self.held_flat[s.offset: s.offset + rows * s.row_numel]
                seg.copy_(full[start: start + rows].reshape(-1))
                held = nn.Parameter(seg.view(rows, *s.shape[1:]))
                held.grad = self.grad_flat[s.offset: s.offset + rows * s.row_numel].view(rows, *s.shape[1:])
                self.held_params.append(held)

    # ------------------------------------------------------------ gather / release
    def start_gather(self) -> None:
        """Pack the held shard and launch the all-gather (async) unless already under way."""
        if self.gathered or self._gather_work is not None:
            return
        if self.param_dtype == torch.float32:
            ag_in = self.held_flat  # no cast needed: gather straight from the held shard
        else:
            ag_in = torch.empty(self.N, dtype=self.param_dtype, device=self.held_flat.device)
            pack_shards(self.held_flat, ag_in)
        self._ag_out = torch.empty(self.S * self.N, dtype=self.param_dtype, device=self.held_flat.device)
        self._gather_work = self.comm.all_gather(self._ag_out, ag_in, "shard", async_op=True)

    def wait_gather(self) -> None:
        """Finish the all-gather and unpack it into the full params."""
        if self.gathered:
            return
        self.start_gather()
        self._gather_work.wait()
        self._gather_work = None
        self.full_flat.untyped_storage().resize_(self.S * self.N * self.full_flat.element_size())
        unpack_full(self._ag_out.view(self.S, self.N), self.shard_sizes, self.full_flat)
        self._ag_out = None
        self.gathered = True

    def release(self) -> None:
        """Free the full params' storage and unhook them from the module (it holds nothing between uses)."""
        self.full_flat.untyped_storage().resize_(0)
        self.gathered = False
        for s in self.specs:
            s.owner._parameters[s.attr] = self._placeholder

    def full_views(self) -> list[torch.Tensor]:
        """Each param's full tensor: a view into full_flat (dropping the padding)."""
        return [self.full_flat[self.S * s.offset: self.S * s.offset + s.numel].view(s.shape) for s in self.specs]

    def aliases_full(self, t: torch.Tensor) -> bool:
        return (self.gathered and t.device == self.full_flat.device
                and t.untyped_storage().data_ptr() == self.full_flat.untyped_storage().data_ptr())

    # ------------------------------------------------------------ gradients
    def pack_unit_grads(self, grads: list[Optional[torch.Tensor]]) -> None:
        """Add this micro-step's full grads into the [S, N] reduce-scatter input."""
        first = self._rs_in is None
        if first:
            self._rs_in = torch.empty(self.S, self.N, dtype=self.engine.reduce_dtype, device=self.held_flat.device)
        grads = [None if g is None else g.contiguous() for g in grads]
        pack_grads(grads, self.shard_sizes, self._rs_in, 1.0 / self.engine.pre_divide, accumulate=not first)

    def reduce_scatter_grads(self) -> "_PendingReduce":
        """Launch the reduce-scatter of the packed grads on the shard group."""
        out = torch.empty(self.N, dtype=self.engine.reduce_dtype, device=self.held_flat.device)
        work = self.comm.reduce_scatter(out, self._rs_in.view(-1), "shard", async_op=True)
        return _PendingReduce(self, work, out)


class _PendingReduce:
    """A unit's grad reduction in flight: reduce-scatter, then (warmup) the sync all-reduce.

    Each stage is launched async and only waited on one unit later, so it
    overlaps with the next unit's backward compute.
    """

    def __init__(self, unit: ShardedUnit, work, out: torch.Tensor) -> None:
        self.unit, self.work, self.out = unit, work, out
        self.in_sync_group = False

    def advance(self) -> bool:
        """Wait for the current stage and start the next; True once the grad shard holds the result."""
        engine = self.unit.engine
        self.work.wait()
        if not self.in_sync_group:
            self.unit._rs_in = None  # the reduce-scatter input can go
            if engine.sync_grads:  # average across replicas (exact HSDP / warmup)
                self.work = self.unit.comm.all_reduce(self.out, "sync", async_op=True)
                self.in_sync_group = True
                return False
        accumulate_grad_shards(self.out, self.unit.grad_flat, 1.0 / engine.post_divide)
        return True

    def finish(self) -> None:
        while not self.advance():
            pass


class _GatherFn(torch.autograd.Function):
    """Forward: the unit's full params (gathered). Backward: reduce-scatter their grads."""

    @staticmethod
    def forward(ctx, unit: ShardedUnit, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ARG004
        unit.wait_gather()
        ctx.unit = unit
        return tuple(unit.full_views())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None, None]:
        unit: ShardedUnit = ctx.unit
        unit.engine.on_unit_backward(unit, list(grads))
        return None, None


# ---------------------------------------------------------------- the model
class HSDPModel:
    """Runs a model's units with sharded params. Owns the units and the backward bookkeeping."""

    def __init__(self, units: nn.ModuleList, mesh: Mesh, param_dtype: str = "fp32", reduce_dtype: str = "fp32",
                 prefetch: bool = True, materialize: Optional[Callable[[int, nn.Module], None]] = None) -> None:
        self.mesh = mesh
        self.param_dtype = DTYPES[param_dtype]
        self.reduce_dtype = DTYPES[reduce_dtype]
        self.prefetch = prefetch
        # Units are sharded in order, so a meta model's full params exist for one unit at a time.
        self.units = [ShardedUnit(i, f"units.{i}.", m, self, materialize) for i, m in enumerate(units)]
        self.sync_grads = True  # average grads across the sync group (exact HSDP / warmup)
        self.reduce_grads = True  # False on non-final micro-steps of gradient accumulation
        self._pending: list[_PendingReduce] = []
        self._callback_queued = False
        self.set_grad_sync(True)

    # ------------------------------------------------------------ step-level switches
    def set_grad_sync(self, sync_grads: bool) -> None:
        """Whether this step's grads are averaged across the sync group too (the sync policy's seam)."""
        self.sync_grads = sync_grads
        divisor = self.mesh.shard_size * (self.mesh.sync_size if sync_grads else 1)
        self.pre_divide, self.post_divide = divide_factors(divisor)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The held (sharded, fp32) params under the model's own names: what the optimizer updates."""
        return [(u.prefix + s.name, p) for u in self.units for s, p in zip(u.specs, u.held_params)]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    # ------------------------------------------------------------ forward
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for i, unit in enumerate(self.units):
            unit.wait_gather()
            if self.prefetch and i + 1 < len(self.units):
                self.units[i + 1].start_gather()  # overlaps with this unit's compute
            x = self._run_unit(unit, x)
            unit.release()
        return x

    def _run_unit(self, unit: ShardedUnit, x: torch.Tensor) -> torch.Tensor:
        fulls = _GatherFn.apply(unit, unit.anchor)
        for s, full in zip(unit.specs, fulls):
            s.owner._parameters[s.attr] = full  # plain tensor swap, as FSDP2 does
        if not torch.is_grad_enabled():
            return unit.module(x)
        unit.saved_full = False  # set by _pack_saved if backward will need the full params again
        with saved_tensors_hooks(partial(self._pack_saved, unit), self._unpack_saved):
            return unit.module(x)

    @staticmethod
    def _pack_saved(unit: ShardedUnit, t: torch.Tensor):
        """Replace a saved tensor that aliases the unit's full params by a marker (so release frees it)."""
        if unit.aliases_full(t):
            unit.saved_full = True
            return (unit, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack_saved(self, packed):
        if isinstance(packed, tuple):
            unit, size, stride, offset = packed
            self._regather_for_backward(unit)
            return unit.full_flat.as_strided(size, stride, offset)
        return packed

    def _regather_for_backward(self, unit: ShardedUnit) -> None:
        self._queue_final_callback()
        if unit.gathered:
            return
        unit.wait_gather()
        if self.prefetch:
            # The nearest earlier unit whose backward needs its params (an embedding's does not:
            # it saves only indices, so re-gathering it would be a wasted collective).
            earlier = next((u for u in reversed(self.units[:unit.index]) if u.saved_full), None)
            if earlier is not None:
                earlier.start_gather()

    # ------------------------------------------------------------ backward
    def on_unit_backward(self, unit: ShardedUnit, grads: list[Optional[torch.Tensor]]) -> None:
        """All of a unit's full grads are ready: pack, reduce-scatter (on the last micro-step), release."""
        self._queue_final_callback()
        unit.pack_unit_grads(grads)
        unit.release()
        if not self.reduce_grads:
            return
        # Move earlier units' reductions one stage on; this unit's reduce-scatter joins them.
        self._pending = [p for p in self._pending if not p.advance()]
        self._pending.append(unit.reduce_scatter_grads())

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of loss.backward(): land every pending reduction, drop stray gathers."""
        for pending in self._pending:
            pending.finish()
        self._pending = []
        for unit in self.units:
            if unit._gather_work is not None:
                unit.wait_gather()
            unit.release()
        self._callback_queued = False

    # ------------------------------------------------------------ optimizer-side helpers
    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_flat.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the true global norm over all shards (padding is zero, so it adds nothing)."""
        sq = torch.stack([u.grad_flat.pow(2).sum() for u in self.units]).sum()
        self.mesh.comm.all_reduce(sq, "shard")
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for u in self.units:
                u.grad_flat.mul_(coef)
        return norm

    def held_buffers(self) -> list[torch.Tensor]:
        """Each unit's flat fp32 held shard: what the sync policy averages."""
        return [u.held_flat for u in self.units]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 params of this replica (all-gathers on the shard group)."""
        out = {}
        for u in self.units:
            gathered = torch.empty(u.S * u.N, dtype=torch.float32, device=u.held_flat.device)
            u.comm.all_gather(gathered, u.held_flat, "shard")
            full = torch.empty(u.S * u.N, dtype=torch.float32, device=u.held_flat.device)
            unpack_full(gathered.view(u.S, u.N), u.shard_sizes, full)
            for s in u.specs:
                out[u.prefix + s.name] = full[u.S * s.offset: u.S * s.offset + s.numel].view(s.shape).clone().cpu()
        return out
