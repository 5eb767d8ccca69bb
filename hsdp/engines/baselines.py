"""Baseline engines behind the same `Engine` interface: PyTorch FSDP2 (HSDP mesh) and DDP.

Same model, data, optimizer and metrics; `mesh.engine` picks one, so every
comparison is one flag. Their collectives are counted through `Comm` like ours:
FSDP2's all-gathers and reduce-scatters through its own custom-comm hooks
(`set_custom_all_gather` / `set_custom_reduce_scatter`), its replica all-reduce
by its all-reduce hook (`set_all_reduce_hook`, called with the all-reduced
tensor after each), and DDP's bucket all-reduces through a comm hook. No torch
function is replaced: nothing process-global changes while an engine lives.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from hsdp.comm.groups import Comm, ring_bytes
from hsdp.comm.mesh import Mesh
from hsdp.config.schema import Config
from hsdp.core.layout import DTYPES
from hsdp.engines.base import Batch, Engine, EngineState, SavedCheckpoint
from hsdp.engines.clock import CompileClock, compile_blocks_in_place
from hsdp.models.gpt import GPT
from hsdp.models.init_from import initial_model
from hsdp.sync.policy import NoSync
from hsdp.torch_compat import FSDPAllGather, FSDPReduceScatter

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

# The custom-comm interfaces (torch >= 2.9); older torch leaves FSDP2's own comms in place, uncounted.
AllGather, ReduceScatter = FSDPAllGather, FSDPReduceScatter


class _CountedAllGather(AllGather or object):  # type: ignore[misc]  # the base is chosen at import time
    """FSDP2's all-gather, issued through Comm (so it is counted under our group label)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ):
        return self.comm.all_gather(output_tensor, input_tensor, self.comm.label(group), async_op=async_op)


class _CountedReduceScatter(ReduceScatter or object):  # type: ignore[misc]  # the base is chosen at import time
    """FSDP2's reduce-scatter, issued through Comm."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        return self.comm.reduce_scatter(output_tensor, input_tensor, self.comm.label(group), op=op, async_op=async_op)


def counted_all_reduce_hook(comm: Comm, group: dist.ProcessGroup) -> Callable[[torch.Tensor], None]:
    """FSDP2's all-reduce hook that counts its replica all-reduce (HSDP: called after each, with its tensor).

    FSDP2 issues that all-reduce itself, on `group` (the mesh's replicate dim), with no custom-comm hook.
    """
    label, n = comm.label(group), dist.get_world_size(group)

    def count(reduced: torch.Tensor) -> None:
        comm.count(label, "all_reduce", ring_bytes("all_reduce", n, reduced))

    return count


class _TorchCheckpoint:
    """Checkpoints through torch's own state-dict API (one model; FSDP2's DTensors reshard in DCP, DDP's full
    tensors are written once)."""

    module: nn.Module

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> EngineState:
        model_sd, optim_sd = get_state_dict(self.module, optimizer)
        return EngineState(model=model_sd, optim=optim_sd)

    def load_checkpoint(self, optimizer: torch.optim.Optimizer, saved: SavedCheckpoint) -> None:
        state = self.checkpoint_state(optimizer)  # creates the optimizer state (a zero-lr step) to load into
        saved.load(state)
        set_state_dict(self.module, optimizer, model_state_dict=state.model, optim_state_dict=state.optim)


class FSDP2Engine(_TorchCheckpoint, Engine):
    """`fully_shard` on every unit over the 2-D mesh: replicate over "sync", shard over "shard"."""

    name = "fsdp2"
    supports_compile = True  # each block compiled in place, as torchtitan does

    def __init__(self, model: GPT, mesh: Mesh, param_dtype: str, reduce_dtype: str) -> None:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
        # fully_shard wraps a module in place (its class becomes an FSDPModule too) and returns it.
        units = [fully_shard(unit, mesh=mesh.device_mesh, mp_policy=policy) for unit in model.units]
        # The embedding's backward needs only the token ids: no re-gather, as our engine does.
        units[0].set_unshard_in_backward(False)
        root = fully_shard(model, mesh=mesh.device_mesh, mp_policy=policy)
        self.module = cast(nn.Module, root)
        if AllGather is not None:
            for unit in [*units, root]:
                unit.set_custom_all_gather(_CountedAllGather(mesh.comm))
                unit.set_custom_reduce_scatter(_CountedReduceScatter(mesh.comm))
        # The mesh is 2-D ("sync", "shard"): FSDP2 runs HSDP, so the hook follows each replica all-reduce.
        count = counted_all_reduce_hook(mesh.comm, mesh.device_mesh.get_group("sync"))
        for unit in [*units, root]:
            unit.set_all_reduce_hook(count)
        self.mesh = mesh
        self.policy = NoSync()
        self.clock: CompileClock | None = None  # set when the blocks are compiled

    @classmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> "FSDP2Engine":
        model = initial_model(cfg.model, cfg.run.seed).to(mesh.device)
        if cfg.compile.enabled:
            # As torchtitan does: each transformer block compiled (in place, so parameter names stay),
            # FSDP2's hooks run around the compiled blocks, eagerly.
            compile_blocks_in_place(list(model.units))
        engine = cls(model, mesh, cfg.precision.param_dtype, cfg.precision.reduce_dtype)
        engine.clock = CompileClock() if cfg.compile.enabled else None
        return engine

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx)

    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        with self.clock.call() if self.clock else contextlib.nullcontext():
            return super().forward_backward(batches)

    def stats(self) -> dict[str, Any]:
        """Compiled blocks: compile time (the first step) and recompiles, as the hsdp compiled engine reports."""
        return {**super().stats(), **(self.clock.stats() if self.clock else {})}

    def set_reduce_grads(self, reduce: bool) -> None:
        cast("FSDPModule", self.module).set_requires_gradient_sync(reduce)

    def set_grad_sync(self, sync_grads: bool) -> None:
        if not sync_grads:
            raise ValueError("fsdp2 always averages grads across replicas (periodic sync needs mesh.engine=hsdp)")

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm if max_norm > 0 else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: cast("DTensor", p).full_tensor().float().cpu() for n, p in self.module.named_parameters()}


class DDPEngine(_TorchCheckpoint, Engine):
    """DistributedDataParallel over all ranks; its all-reduces are counted through Comm."""

    name = "ddp"
    module: DistributedDataParallel

    def __init__(self, model: nn.Module, mesh: Mesh) -> None:
        self.module = DistributedDataParallel(
            model, device_ids=[mesh.device.index] if mesh.device.type == "cuda" else None
        )
        self.mesh = mesh
        self.module.register_comm_hook(mesh.comm, _counted_allreduce_hook)
        self.policy = NoSync()

    @classmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> "DDPEngine":
        return cls(initial_model(cfg.model, cfg.run.seed).to(mesh.device), mesh)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx)

    def set_reduce_grads(self, reduce: bool) -> None:
        self.module.require_backward_grad_sync = reduce  # what DDP.no_sync() toggles

    def set_grad_sync(self, sync_grads: bool) -> None:
        if not sync_grads:
            raise ValueError("ddp always averages grads across replicas (periodic sync needs mesh.engine=hsdp)")

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.module.named_parameters())

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        return float(
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm if max_norm > 0 else float("inf"))
        )

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.module.module.named_parameters()}

    def load_checkpoint(self, optimizer: torch.optim.Optimizer, saved: SavedCheckpoint) -> None:
        super().load_checkpoint(optimizer, saved)
        self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        """Do DDP's first backward now, so a resumed run's first step uses the buckets of later steps.

        DDP rebuilds its gradient buckets after the first synced backward (in grad-ready order),
        and gloo's ring all-reduce sums each element in an order set by its offset in the bucket:
        without this, a resumed run's first step would round differently from an uninterrupted
        run's (~1e-9). A dummy batch; its grads are dropped and the Comm counters are restored
        from the checkpoint after this.
        """
        idx = torch.zeros(1, 1, dtype=torch.long, device=self.mesh.device)
        self.set_reduce_grads(True)
        self.module(idx).float().sum().backward()
        self.zero_grad()


# DDP checks this hook's annotations at runtime, so they must be real objects (no postponed evaluation here).
def _counted_allreduce_hook(comm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduce (average), routed through Comm so its bytes are counted."""
    buf = bucket.buffer()
    if comm.size("world") == 1:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buf)
        return done
    buf.div_(comm.size("world"))
    work = comm.all_reduce(buf, "world", async_op=True)
    return work.get_future().then(lambda _: buf)  # in place; (the fake backend's future carries no value)
