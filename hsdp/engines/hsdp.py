"""The eager HSDP engine: units, held shards, gather/release with prefetch, reduce-scatter.

Per unit (docs/design.md §11.1):

    held_flat  [N]       fp32, this rank's dim-0 shard of every param, padded (hsdp/core/layout.py)
    gather:    pack → all-gather (shard group) → unpack into full_flat [S·N]   (hsdp/engines/collectives.py)
    release:   full_flat's storage is resized to 0 (views keep their identity)
    backward:  pack grads → reduce-scatter (shard group) → [warmup] all-reduce (sync group)
               → accumulate into the fp32 grad shard                          (hsdp/engines/collectives.py)

Autograd wiring: `_GatherFn` turns held shards into full params; its backward
hands the full grads to the unit's `on_backward` callback (the engine). Saved
tensors that alias a unit's full params are replaced by a marker in forward
(saved_tensors_hooks), so release really frees them, and the first unpack in
backward re-gathers the unit (and prefetches the previous one that saved any).
A unit whose backward needs no weights (the embedding) is never re-gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from hsdp.comm.groups import Comm
from hsdp.comm.mesh import Mesh
from hsdp.config.schema import Config, ConfigError, SyncConfig
from hsdp.core.layout import DTYPES, ParamSpec, ReducePlan, plan_layout, reduce_plan
from hsdp.engines.base import Engine, EngineState, SavedCheckpoint
from hsdp.engines.collectives import (
    PendingGather,
    PendingReduce,
    gather_full,
    pack_grads_for_reduce,
    start_gather,
    start_reduce,
)
from hsdp.engines.dtensor import init_optimizer_state, shard_dtensor
from hsdp.models.gpt import build_model
from hsdp.models.init_from import initial_unit_initializer
from hsdp.models.muon import RowSharding
from hsdp.sync.policy import NoSync, Sync, SyncPolicy, build_sync
from hsdp.torch_compat import queue_backward_callback, swap_parameter

BackwardCallback = Callable[["ShardedUnit", list[Optional[torch.Tensor]]], None]


# ---------------------------------------------------------------- one unit
class ShardedUnit:
    """One model unit: its held shard, full-param buffer, and its gather/release.

    It knows nothing of the engine: it gets its dtypes, its group (through
    `comm`) and `on_backward`, which receives its full grads in backward.
    """

    gathered: bool  # whether full_flat holds the full params (set by release, wait_gather)

    def __init__(
        self,
        index: int,
        prefix: str,
        module: nn.Module,
        mesh: Mesh,
        param_dtype: torch.dtype,
        on_backward: BackwardCallback,
    ) -> None:
        self.index, self.prefix, self.module = index, prefix, module
        self.comm: Comm = mesh.comm
        self.layout = plan_layout(module, mesh.shard_size)
        self.specs = self.layout.specs
        self.param_dtype = param_dtype
        self.on_backward = on_backward
        device = mesh.device
        N, S = self.layout.N, self.layout.S
        self.held_flat = torch.zeros(N, dtype=torch.float32, device=device)
        self.grad_flat = torch.zeros(N, dtype=torch.float32, device=device)
        self.full_flat = torch.empty(S * N, dtype=param_dtype, device=device)
        self.held_params: list[nn.Parameter] = []
        self._placeholder = torch.empty(0, device=device)
        self._shard_params(mesh.shard_rank)
        self.release()
        self.saved_full = True  # whether its last forward saved full params for backward (see _pack_saved)
        self._pending_gather: Optional[PendingGather] = None
        self.rs_in: Optional[torch.Tensor] = None  # [S, N] grads packed over micro-steps
        # A leaf that requires grad, so _GatherFn's outputs join the autograd graph.
        self.anchor = torch.empty(0, device=device, requires_grad=True)

    def _shard_params(self, shard_rank: int) -> None:
        """Copy this rank's rows of every param into held_flat; make held params views of it."""
        with torch.no_grad():
            for s in self.specs:
                full = getattr(s.owner, s.attr).detach().reshape(s.shape)
                rows = s.held_rows(shard_rank)
                start = shard_rank * s.rows
                seg = self.held_flat[s.offset : s.offset + rows * s.row_numel]
                seg.copy_(full[start : start + rows].reshape(-1))
                held = nn.Parameter(seg.view(rows, *s.shape[1:]))
                held.grad = self.grad_flat[s.offset : s.offset + rows * s.row_numel].view(rows, *s.shape[1:])
                self.held_params.append(held)

    # ------------------------------------------------------------ gather / release
    def start_gather(self) -> None:
        """Launch the all-gather (async) unless the unit is gathered or already gathering."""
        if not self.gathered and self._pending_gather is None:
            self._pending_gather = start_gather(self.comm, self.held_flat, self.layout, self.param_dtype)

    def wait_gather(self) -> None:
        """Finish the all-gather into full_flat (starting it first if needed)."""
        if self.gathered:
            return
        self.start_gather()
        pending = self._pending_gather
        assert pending is not None  # start_gather launched it
        self.full_flat.untyped_storage().resize_(self.full_flat.numel() * self.full_flat.element_size())
        pending.finish(self.full_flat)
        self._pending_gather = None
        self.gathered = True

    @property
    def gathering(self) -> bool:
        return self._pending_gather is not None

    def release(self) -> None:
        """Free the full params' storage and unhook them from the module (it holds nothing between uses)."""
        self.full_flat.untyped_storage().resize_(0)
        self.gathered = False
        for s in self.specs:
            swap_parameter(s.owner, s.attr, self._placeholder)

    def full_views(self) -> list[torch.Tensor]:
        """Each param's full tensor: a view into full_flat (dropping the padding)."""
        return self.layout.full_views(self.full_flat)

    def aliases_full(self, t: torch.Tensor) -> bool:
        return (
            self.gathered
            and t.device == self.full_flat.device
            and t.untyped_storage().data_ptr() == self.full_flat.untyped_storage().data_ptr()
        )

    def gather_full_fp32(self) -> dict[str, torch.Tensor]:
        """This replica's full fp32 params of the unit, by the model's names (blocking gather)."""
        full = gather_full(self.comm, self.held_flat, self.layout, torch.float32)
        return {self.prefix + s.name: v.clone().cpu() for s, v in zip(self.specs, self.layout.full_views(full))}

    # ------------------------------------------------------------ gradients
    def pack_grads(self, grads: list[Optional[torch.Tensor]], plan: ReducePlan) -> None:
        """Add this micro-step's full grads into the [S, N] reduce-scatter input."""
        self.rs_in = pack_grads_for_reduce(grads, self.layout, plan, self.rs_in)

    def start_reduce(self, plan: ReducePlan) -> PendingReduce:
        """Launch the reduction of the packed grads into grad_flat; the packed input is handed over."""
        rs_in, self.rs_in = self.rs_in, None
        assert rs_in is not None, "start_reduce before pack_grads"
        return start_reduce(self.comm, rs_in, self.grad_flat, plan)


class _GatherFn(torch.autograd.Function):
    """Forward: the unit's full params (gathered). Backward: hand their grads to the unit's callback."""

    @staticmethod
    def forward(ctx, unit: ShardedUnit, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ARG004
        unit.wait_gather()
        ctx.unit = unit
        return tuple(unit.full_views())

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[None, None]:
        unit: ShardedUnit = ctx.unit
        unit.on_backward(unit, list(grads))
        return None, None


# ---------------------------------------------------------------- the engine
class HSDPEngine(Engine):
    """Runs a model's units with sharded params (eager). Owns the units and the backward bookkeeping."""

    name: ClassVar[str] = "hsdp"
    supports_compile: ClassVar[bool] = True
    supports_periodic_sync: ClassVar[bool] = True
    supports_replicate: ClassVar[bool] = True
    sync_class: ClassVar[type[NoSync | SyncPolicy]] = SyncPolicy

    def __init__(
        self,
        units: nn.ModuleList,
        mesh: Mesh,
        param_dtype: str = "fp32",
        reduce_dtype: str = "fp32",
        prefetch: bool = True,
        materialize: Optional[Callable[[int, nn.Module], None]] = None,
        sync_cfg: Optional[SyncConfig] = None,
    ) -> None:
        self.mesh = mesh
        self.param_dtype = DTYPES[param_dtype]
        self.reduce_dtype = DTYPES[reduce_dtype]
        self.prefetch = prefetch
        # Units are sharded in order, so a meta model's full params exist for one unit at a time.
        self.units: list[ShardedUnit] = []
        for i, m in enumerate(units):
            if materialize is not None:  # meta-device unit: create its full params only now
                materialize(i, m)
            self.units.append(ShardedUnit(i, f"units.{i}.", m, mesh, self.param_dtype, self._on_unit_backward))
        self.reduce_grads = True  # False on non-final micro-steps of gradient accumulation
        self.step = 0  # the step begun last (commit_grads asks the policy about it)
        self._pending: list[PendingReduce] = []
        self._callback_queued = False
        # Without a sync config (tests driving the engine directly) grads are always averaged.
        self.policy: Sync = (
            NoSync() if sync_cfg is None else build_sync(sync_cfg, self.held_buffers(), mesh.sync_transport)
        )
        self.set_grad_sync(True)

    @classmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> HSDPEngine:
        """The GPT built on meta, materialised and sharded one unit at a time, with its sync policy."""
        model = build_model(cfg.model, cfg.run.seed, materialize=False)
        return cls(
            model.units,
            mesh,
            cfg.precision.param_dtype,
            cfg.precision.reduce_dtype,
            cfg.mesh.prefetch,
            materialize=initial_unit_initializer(cfg.model, cfg.run.seed),  # model.init_from's, if set
            sync_cfg=cfg.sync,
            **cls.config_kwargs(cfg),
        )

    @classmethod
    def config_kwargs(cls, cfg: Config) -> dict[str, Any]:
        """Constructor arguments a subclass takes from the config (the compiled engine: its compile section)."""
        return {}

    # ------------------------------------------------------------ step-level switches
    def set_grad_sync(self, sync_grads: bool) -> None:
        m = self.mesh
        self.plan = reduce_plan(m.shard_size, m.sync_size, sync_grads, self.reduce_dtype, m.replicate_size)

    def set_reduce_grads(self, reduce: bool) -> None:
        self.reduce_grads = reduce

    def begin_step(self, step: int) -> None:
        # On a transport that may fail, a grad-sync step's backward averages over the shard group only and
        # commit_grads then takes the replicas' mean in a round of its own (the policy decides both).
        self.step = step
        self.set_grad_sync(self.policy.backward_grad_sync(step))

    def commit_grads(self) -> bool:
        return self.policy.commit_grads(self.step, [u.grad_flat for u in self.units])

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The held (sharded, fp32) params under the model's own names: what the optimizer updates."""
        return [(u.prefix + s.name, p) for u in self.units for s, p in zip(u.specs, u.held_params)]

    def row_sharding(self) -> RowSharding:
        """Each held param is its rows of the full param over the shard group (hsdp/core/layout.py)."""
        m = self.mesh
        shapes = {u.prefix + s.name: s.shape for u in self.units for s in u.specs}
        return RowSharding(shapes, m.comm, "shard", m.shard_size, m.shard_rank)

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
            swap_parameter(s.owner, s.attr, full)  # plain tensor swap, as FSDP2 does
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
            earlier = next((u for u in reversed(self.units[: unit.index]) if u.saved_full), None)
            if earlier is not None:
                earlier.start_gather()

    # ------------------------------------------------------------ backward
    def _on_unit_backward(self, unit: ShardedUnit, grads: list[Optional[torch.Tensor]]) -> None:
        """All of a unit's full grads are ready: pack, reduce (on the last micro-step), release."""
        self._queue_final_callback()
        unit.pack_grads(grads, self.plan)
        unit.release()
        if not self.reduce_grads:
            return
        # Move earlier units' reductions one stage on; this unit's reduce-scatter joins them.
        self._pending = [p for p in self._pending if not p.advance()]
        self._pending.append(unit.start_reduce(self.plan))

    def _queue_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            queue_backward_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        """End of loss.backward(): land every pending reduction, drop stray gathers."""
        for pending in self._pending:
            pending.finish()
        self._pending = []
        for unit in self.units:
            if unit.gathering:
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
        return {k: v for u in self.units for k, v in u.gather_full_fp32().items()}

    # ------------------------------------------------------------ checkpoints (hsdp/run/checkpoint/)
    # Each replica's params and inner optimizer state are its own (they differ between param syncs); every
    # tensor a Shard(0) DTensor of the param's full shape over the shard group. The keys: keys.py there.
    state_per_replica: ClassVar[bool] = True

    @classmethod
    def check_checkpoint(cls, path: Path, meta: dict[str, Any], saved: Config, cfg: Config) -> None:
        """Any mesh.shard loads (DCP reshards); another mesh.sync only if the replicas were identical."""
        m_old, m_new = meta["mesh"]["sync"], cfg.mesh.sync
        if m_old != m_new and not meta["replicas_identical"]:
            raise ConfigError(
                f"mesh.sync: checkpoint {path} holds {m_old} replicas that differ at step {meta['step']} "
                f"(between param syncs), config has {m_new}; resume with mesh.sync={m_old}"
            )
        super().check_checkpoint(path, meta, saved, cfg)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> EngineState:
        return self._state(optimizer, self.policy.state_dict())

    def load_checkpoint(self, optimizer: torch.optim.Optimizer, saved: SavedCheckpoint) -> None:
        self.zero_grad()  # init_optimizer_state's lr = 0 step needs zero grads
        init_optimizer_state(optimizer)
        sync = self.policy.empty_state_dict(saved.meta["sync"])  # zeroed buffers shaped after the saved ones
        saved.load(self._state(optimizer, sync))  # views of the live params and optimizer state: loaded in place
        self.policy.load_state_dict(sync)

    def _state(self, optimizer: torch.optim.Optimizer, sync: dict[str, Any]) -> EngineState:
        """The held params, their optimizer state and the policy's state_dict `sync` cut per param (views)."""
        shard_mesh = self.mesh.device_mesh["shard"]
        model: dict[str, Any] = {}
        optim: dict[str, dict[str, Any]] = {}
        for name, spec, p in self._held_specs():
            model[name] = shard_dtensor(p.detach(), spec.shape, shard_mesh)
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):  # param-shaped state is sharded like the param; `step` is a scalar
                    sharded = value.shape == p.shape
                    optim.setdefault(name, {})[key] = shard_dtensor(value, spec.shape, shard_mesh) if sharded else value
        return EngineState(
            model=model,
            optim=optim,
            sync_meta=sync["meta"],
            sync_buffers={name: self._per_param(flats) for name, flats in sync["buffers"].items()},
            replica_own=self.policy.replica_buffers,
        )

    def _held_specs(self) -> list[tuple[str, ParamSpec, torch.nn.Parameter]]:
        return [(u.prefix + s.name, s, p) for u in self.units for s, p in zip(u.specs, u.held_params)]

    def _per_param(self, flats: list[Optional[torch.Tensor]]) -> dict[str, Any]:
        """Per-unit flat buffers (the held layout) as per-param DTensors of the full shapes (views: padding rows
        left out); a unit whose buffer is None has none."""
        shard_mesh = self.mesh.device_mesh["shard"]
        pieces: dict[str, Any] = {}
        for unit, flat in zip(self.units, flats):
            if flat is None:
                continue
            for spec in unit.specs:
                rows = spec.held_rows(self.mesh.shard_rank)
                local = flat[spec.offset : spec.offset + rows * spec.row_numel].view(rows, *spec.shape[1:])
                pieces[unit.prefix + spec.name] = shard_dtensor(local, spec.shape, shard_mesh)
        return pieces
