"""DiLoCo outer step on one held shard (docs/design.md §8.4), fp32 throughout.

    Δ   = θ_g − θ_m                  compute_delta (then all-reduce(avg) -> mean Δ)
    b   = Δ if first else μ·b + Δ
    s   = Δ + μ·b if nesterov else b
    θ_g = θ_g − η·s ;  θ_m = θ_g      outer_step, one pass

Every product and sum is rounded on its own (kernels launch with FMA
contraction off), so the kernel and the torch reference agree bit for bit.
"""

from __future__ import annotations

import math

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

_BLOCK = 4096


# ----------------------------------------------------------------------------- compute_delta


@triton.jit
def _delta_kernel(global_ptr, held_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(global_ptr + offs, mask=mask)
    h = tl.load(held_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, g - h, mask=mask)


def compute_delta_ref(global_params: torch.Tensor, held: torch.Tensor, out: torch.Tensor) -> None:
    """out = global_params - held."""
    torch.sub(global_params, held, out=out)


def _compute_delta(global_params: torch.Tensor, held: torch.Tensor, out: torch.Tensor) -> None:
    if not use_triton(global_params, held, out):
        return compute_delta_ref(global_params, held, out)
    n = out.numel()
    if n:
        launch(
            _delta_kernel,
            (triton.cdiv(n, _BLOCK),),
            global_params,
            held,
            out,
            n,
            BLOCK=_BLOCK,
            num_warps=8,
            device=out.device,
        )


_compute_delta_op = register_op("compute_delta", _compute_delta, mutates_args=("out",))


def _check_flat(op: str, **tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        check_tensor(op, name, t, dtypes=(torch.float32,), ndim=1)
        check_tensor(op, name, t, shape=first.shape, device=first.device)


@no_grad
def compute_delta(global_params: torch.Tensor, held: torch.Tensor, out: torch.Tensor) -> None:
    """out = global_params − held (all fp32 [n]). One launch."""
    _check_flat("compute_delta", global_params=global_params, held=held, out=out)
    call(_compute_delta_op, _compute_delta, global_params, held, out)


# ----------------------------------------------------------------------------- outer_step


@triton.jit
def _outer_step_kernel(
    held_ptr,
    global_ptr,
    mom_ptr,
    delta_ptr,
    n,
    lr,
    mu,
    NESTEROV: tl.constexpr,
    FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(delta_ptr + offs, mask=mask)
    if FIRST:
        b = d  # torch SGD: the buffer starts as a copy of the first grad
    else:
        b = mu * tl.load(mom_ptr + offs, mask=mask) + d
    if NESTEROV:
        step = d + mu * b
    else:
        step = b
    g = tl.load(global_ptr + offs, mask=mask) - lr * step
    tl.store(mom_ptr + offs, b, mask=mask)
    tl.store(global_ptr + offs, g, mask=mask)
    tl.store(held_ptr + offs, g, mask=mask)


def outer_step_ref(
    held: torch.Tensor,
    global_params: torch.Tensor,
    momentum: torch.Tensor,
    delta: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
    first: bool,
) -> None:
    """b = Δ if first else μb+Δ; θ_g -= η·(Δ+μb if nesterov else b); θ_m = θ_g."""
    if first:
        momentum.copy_(delta)
    else:
        momentum.mul_(mu).add_(delta)
    if nesterov:
        step = torch.mul(momentum, mu).add_(delta).mul_(lr)
    else:
        step = torch.mul(momentum, lr)
    global_params.sub_(step)
    held.copy_(global_params)


def _outer_step(
    held: torch.Tensor,
    global_params: torch.Tensor,
    momentum: torch.Tensor,
    delta: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
    first: bool,
) -> None:
    if not use_triton(held, global_params, momentum, delta):
        return outer_step_ref(held, global_params, momentum, delta, lr, mu, nesterov, first)
    n = held.numel()
    if n:
        launch(
            _outer_step_kernel,
            (triton.cdiv(n, _BLOCK),),
            held,
            global_params,
            momentum,
            delta,
            n,
            lr,
            mu,
            NESTEROV=nesterov,
            FIRST=first,
            BLOCK=_BLOCK,
            num_warps=8,
            enable_fp_fusion=False,
            device=held.device,
        )


_outer_step_op = register_op("outer_step", _outer_step, mutates_args=("held", "global_params", "momentum"))


@no_grad
def outer_step(
    held: torch.Tensor,
    global_params: torch.Tensor,
    momentum: torch.Tensor,
    delta: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
    first: bool,
) -> None:
    """One DiLoCo outer SGD step in one pass; writes momentum, global_params and held in place.

    delta is the sync-group mean of compute_delta's output. With first=True the
    momentum buffer's old contents are ignored (it starts at delta).
    """
    _check_flat("outer_step", held=held, global_params=global_params, momentum=momentum, delta=delta)
    if not (math.isfinite(lr) and math.isfinite(mu)):
        fail(f"outer_step: lr and mu must be finite, got {lr}, {mu}")
    call(
        _outer_step_op,
        _outer_step,
        held,
        global_params,
        momentum,
        delta,
        float(lr),
        float(mu),
        bool(nesterov),
        bool(first),
    )


__all__ = ["compute_delta", "compute_delta_ref", "outer_step", "outer_step_ref"]
