"""Traceable gather and reduce-scatter: torch.library custom ops with fake impls and autograd.

`torch.compile` cannot see inside the eager engine's hooks, so the compiled
path expresses a unit functionally (as SimpleFSDP does):

    full = hsdp::gather_full(held)            # all-gather + unpack; backward =
    params = split(full)                      #   hsdp::reduce_scatter_full
    out = functional_call(unit, params, x)

The ops call the same packing steps (kernels.pack / kernels.reduce) and the
same Comm as the eager engine, so bytes are counted either way. The compile
passes (later) decide where each gather starts and which full params are
re-gathered in backward instead of saved.
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from hsdp.comm import Comm
from kernels.pack import pack_shards, unpack_full
from kernels.reduce import accumulate_grad_shards, pack_grads

# group name → (Comm, its name for that group); filled by register_comm.
_GROUPS: dict[str, tuple[Comm, str]] = {}


def register_comm(comm: Comm) -> None:
    """Let the custom ops find the run's Comm from a process-group name (ops take only plain args)."""
    for group_name, label in comm.labels.items():
        _GROUPS[group_name] = (comm, label)


def _full_chunks(full: torch.Tensor, shard_sizes: list[int], S: int) -> list[torch.Tensor]:
    return list(torch.split(full, [S * n for n in shard_sizes]))


@torch.library.custom_op("hsdp::gather_full", mutates_args=())
def gather_full(held: torch.Tensor, shard_sizes: list[int], group_name: str, group_size: int,
                param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.Tensor:
    """held [N] fp32 → all ranks' shards, param-major [S·N] in param_dtype (reduce_dtype: for backward)."""
    comm, label = _GROUPS[group_name]
    N = held.numel()
    ag_in = torch.empty(N, dtype=param_dtype, device=held.device)
    pack_shards(held, ag_in)
    ag_out = torch.empty(group_size * N, dtype=param_dtype, device=held.device)
    comm.all_gather(ag_out, ag_in, label)
    full = torch.empty(group_size * N, dtype=param_dtype, device=held.device)
    unpack_full(ag_out.view(group_size, N), shard_sizes, full)
    return full


@gather_full.register_fake
def _(held, shard_sizes, group_name, group_size, param_dtype, reduce_dtype):
    return held.new_empty(group_size * held.numel(), dtype=param_dtype)


@torch.library.custom_op("hsdp::reduce_scatter_full", mutates_args=())
def reduce_scatter_full(grad_full: torch.Tensor, shard_sizes: list[int], group_name: str, group_size: int,
                        reduce_dtype: torch.dtype, divisor: float) -> torch.Tensor:
    """grad of the param-major full buffer [S·N] → this rank's mean grad shard [N] fp32."""
    comm, label = _GROUPS[group_name]
    S, N = group_size, grad_full.numel() // group_size
    rs_in = torch.empty(S, N, dtype=reduce_dtype, device=grad_full.device)
    pack_grads(_full_chunks(grad_full.contiguous(), shard_sizes, S), shard_sizes, rs_in, 1.0)
    rs_out = torch.empty(N, dtype=reduce_dtype, device=grad_full.device)
    comm.reduce_scatter(rs_out, rs_in.view(-1), label)
    grad = torch.zeros(N, dtype=torch.float32, device=grad_full.device)
    accumulate_grad_shards(rs_out, grad, 1.0 / divisor)
    return grad


@reduce_scatter_full.register_fake
def _(grad_full, shard_sizes, group_name, group_size, reduce_dtype, divisor):
    return grad_full.new_empty(grad_full.numel() // group_size, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    _, ctx.shard_sizes, ctx.group_name, ctx.group_size, _, ctx.reduce_dtype = inputs


def _backward(ctx, grad_full):
    # Mean over the shard group (the eager engine's divisor when replicas do not sync grads).
    grad = reduce_scatter_full(grad_full, ctx.shard_sizes, ctx.group_name, ctx.group_size, ctx.reduce_dtype,
                               float(ctx.group_size))
    return grad, None, None, None, None, None


gather_full.register_autograd(_backward, setup_context=_setup_context)


def functional_unit_forward(unit, held: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Run a `ShardedUnit`'s module from a held shard, all in traceable ops."""
    group = unit.comm.groups["shard"]
    full = gather_full(held, unit.shard_sizes, group.group_name, unit.S, unit.param_dtype, unit.engine.reduce_dtype)
    chunks = _full_chunks(full, unit.shard_sizes, unit.S)
    params = {s.name: c[: s.numel].view(s.shape) for s, c in zip(unit.specs, chunks)}
    # tie_weights=False: between uses every param of the module points at one empty placeholder.
    return functional_call(unit.module, params, (x,), tie_weights=False)
