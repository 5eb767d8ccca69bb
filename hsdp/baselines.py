"""Baseline engines with the HSDP engine's interface: PyTorch FSDP2 (HSDP mesh) and DDP.

Same model, data, optimizer and metrics; `mesh.engine` picks one, so every
comparison is one flag. The interface the training loop uses:

    engine(idx) -> logits            engine.named_parameters()
    engine.reduce_grads = bool       engine.set_grad_sync(bool)   (hsdp only differs)
    engine.clip_grad_norm_(max)      engine.zero_grad()           engine.full_state_dict()
"""

import functools
import inspect
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from hsdp.comm import ring_bytes
from hsdp.mesh import Mesh
from hsdp.shard import DTYPES


class FSDP2Model:
    """`fully_shard` on every unit over the 2-D mesh: replicate over "sync", shard over "shard"."""

    def __init__(self, model: nn.Module, mesh: Mesh, param_dtype: str, reduce_dtype: str) -> None:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
        for unit in model.units:
            fully_shard(unit, mesh=mesh.device_mesh, mp_policy=policy)
        self.module = fully_shard(model, mesh=mesh.device_mesh, mp_policy=policy)
        self.mesh = mesh
        # FSDP2 issues its collectives itself; count them too, for the same metrics.
        self._counting = CountCollectives(mesh.comm)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx)

    @property
    def reduce_grads(self) -> bool:
        return True

    @reduce_grads.setter
    def reduce_grads(self, value: bool) -> None:
        self.module.set_requires_gradient_sync(value)

    def set_grad_sync(self, sync_grads: bool) -> None:
        assert sync_grads, "fsdp2 always averages grads across replicas"

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
        return {n: p.full_tensor().float().cpu() for n, p in self.module.named_parameters()}


class DDPModel:
    """DistributedDataParallel over all ranks; its all-reduces are counted through Comm."""

    def __init__(self, model: nn.Module, mesh: Mesh) -> None:
        self.module = DistributedDataParallel(model, device_ids=[mesh.device.index] if mesh.device.type == "cuda"
                                              else None)
        self.mesh = mesh
        self.module.register_comm_hook(mesh.comm, _counted_allreduce_hook)

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx)

    @property
    def reduce_grads(self) -> bool:
        return self.module.require_backward_grad_sync

    @reduce_grads.setter
    def reduce_grads(self, value: bool) -> None:
        self.module.require_backward_grad_sync = value  # what DDP.no_sync() toggles

    def set_grad_sync(self, sync_grads: bool) -> None:
        assert sync_grads, "ddp always averages grads"

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.module.named_parameters())

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(),
                                                    max_norm if max_norm > 0 else float("inf")))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.module.module.named_parameters()}


# No `from __future__ import annotations` here: DDP checks this hook's annotations at runtime.
def _counted_allreduce_hook(comm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduce (average), routed through Comm so its bytes are counted."""
    buf = bucket.buffer()
    if comm.size("world") == 1:
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buf)
        return done
    buf.div_(comm.size("world"))
    work = comm.all_reduce(buf, "world", async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class CountCollectives:
    """Counts the collectives FSDP2 issues itself, by group, with Comm's ring formula.

    Wraps torch.distributed's collective entry points for the life of the process
    (only collective calls pay for it, unlike a dispatch mode that sees every
    op). hsdp.comm captured its own references at import, so our collectives
    are not counted twice; a thread-local depth guard skips nested calls.
    """

    OPS = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
           "all_reduce": "all_reduce"}

    def __init__(self, comm) -> None:
        self.comm = comm
        self._depth = threading.local()
        for name in self.OPS:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn):
        op, sig = self.OPS[name], inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self._count(op, sig.bind(*args, **kwargs).arguments)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def _count(self, op: str, a: dict) -> None:
        group = a.get("group") or dist.group.WORLD
        values = list(a.values())  # (output, input, ...) for the gathers and scatters, (tensor, ...) for all_reduce
        t = values[1] if op == "all_gather" else values[0]
        self.comm.count(self.comm.label(group), op, ring_bytes(op, dist.get_world_size(group), t))
