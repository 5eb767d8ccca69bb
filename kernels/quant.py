"""int8 block quantization for the quantized param sync (docs/design.md §8.5, `quantize: int8`).

quantize_int8:   per block of `block` elements, scale = absmax / 127 and
                 q = clamp(round_half_away(x / scale), -127, 127) (scale 0 -> q 0).
dequantize_mean: out = (Σ_m q[m] * scale[m, block(e)]) / M, summed m = 0..M-1.

Division is correctly rounded on both sides (tl.div_rn; Triton's `/` is an
approximate divide on GPUs), rounding is done the same explicit way, and FMA
contraction is off, so kernel and reference agree exactly. x must be finite.
"""

from __future__ import annotations

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

_TILE = 4096  # elements per program (several quant blocks when block is small)
_BLOCK = 4096
MAX_BLOCK = 16384  # one quant block is one register tile row in the kernel


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ----------------------------------------------------------------------------- quantize_int8


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, n, nb, block, ROWS: tl.constexpr, COLS: tl.constexpr):
    # a [ROWS, COLS] tile holds ROWS quant blocks (COLS = block rounded up to a power of 2)
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    idx = b[:, None] * block + c[None, :]
    mask = (b[:, None] < nb) & (c[None, :] < block) & (idx < n)
    x = tl.load(x_ptr + idx, mask=mask, other=0.0)
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    safe = tl.where(scale > 0.0, scale, 1.0)  # an all-zero block gives 0 / 1 = 0
    y = tl.div_rn(x, safe[:, None])
    # round half away from zero; a - floor(a) is exact, unlike floor(a + 0.5)
    a = tl.abs(y)
    r = tl.floor(a)
    r = r + tl.where(a - r >= 0.5, 1.0, 0.0)
    r = tl.minimum(r, 127.0)
    q = tl.where(y < 0.0, -r, r)
    tl.store(q_ptr + idx, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + b, scale, mask=b < nb)


def quantize_int8_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = absmax/127; q = clamp(round_half_away(x/scale), ±127) (0 where scale is 0)."""
    n = x.numel()
    nb = -(-n // block)
    if n % block:  # zero-pad the last block (zeros change neither absmax nor q)
        xb = x.new_zeros(nb * block)
        xb[:n] = x
        xb = xb.view(nb, block)
    else:
        xb = x.view(nb, block)
    scales = torch.linalg.vector_norm(xb, ord=float("inf"), dim=1).div_(127.0)  # absmax, no |x| temporary
    safe = torch.where(scales > 0, scales, 1.0)[:, None]  # an all-zero block gives 0 / 1 = 0
    y = xb.div_(safe) if n % block else xb / safe
    # round half away from zero; a - floor(a) is exact, unlike floor(a + 0.5)
    a = y.abs()
    r = a.floor()
    r.add_(a.sub_(r).ge_(0.5))
    r.clamp_(max=127.0).copysign_(y)
    return r.view(-1)[:n].to(torch.int8), scales


def _quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return quantize_int8_ref(x, block)
    n = x.numel()
    nb = -(-n // block)
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        cols = _next_pow2(block)
        rows = max(1, _TILE // cols)
        launch(
            _quantize_kernel,
            (triton.cdiv(nb, rows),),
            x,
            q,
            scales,
            n,
            nb,
            block,
            ROWS=rows,
            COLS=cols,
            num_warps=8,
            enable_fp_fusion=False,
            device=x.device,
        )
    return q, scales


_quantize_int8_op = register_op("quantize_int8", _quantize_int8, mutates_args=())


@_quantize_int8_op.register_fake
def _(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = -(-x.numel() // block)
    return x.new_empty(x.numel(), dtype=torch.int8), x.new_empty(nb, dtype=torch.float32)


@no_grad
def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 x [n] to (q int8 [n], scales fp32 [ceil(n/block)]), one scale per block. One launch."""
    check_tensor("quantize_int8", "x", x, dtypes=(torch.float32,), ndim=1)
    if not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
        fail(f"quantize_int8: block must be an int in [1, {MAX_BLOCK}], got {block!r}")
    return call(_quantize_int8_op, _quantize_int8, x, block)


# ----------------------------------------------------------------------------- dequantize_mean


@triton.jit
def _dequantize_mean_kernel(q_ptr, scale_ptr, out_ptr, n, nb, block, M, M_f, BLOCK: tl.constexpr):
    # n + BLOCK < 2**31 is checked on the host, so int32 offsets suffice (and keep the division cheap)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    blk = offs // block
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _m in range(M):  # fixed order m = 0..M-1, as in the reference
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
        s = tl.load(scale_ptr + blk, mask=mask, other=0.0)
        acc = acc + q * s
        q_ptr += n  # next row; advancing the pointer avoids an int32 m*n overflow
        scale_ptr += nb
    tl.store(out_ptr + offs, tl.div_rn(acc, M_f), mask=mask)


def dequantize_mean_ref(q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out = (q[0]*s[0] + q[1]*s[1] + ... + q[M-1]*s[M-1]) / M, s expanded from per-block scales."""
    M, n = q.shape
    full = (n // block) * block  # elements in whole blocks; the tail shares the last scale
    acc = torch.zeros(n, dtype=torch.float32, device=q.device)
    for m in range(M):
        prod = q[m].to(torch.float32)
        prod[:full].view(-1, block).mul_(scales[m, : full // block, None])
        if full < n:
            prod[full:].mul_(scales[m, -1])
        acc.add_(prod)
    torch.div(acc, M, out=out)


def _dequantize_mean(q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    if not use_triton(q, scales, out):
        return dequantize_mean_ref(q, scales, block, out)
    M, n = q.shape
    if n:
        launch(
            _dequantize_mean_kernel,
            (triton.cdiv(n, _BLOCK),),
            q,
            scales,
            out,
            n,
            scales.shape[1],
            block,
            M,
            float(M),
            BLOCK=_BLOCK,
            num_warps=8,
            enable_fp_fusion=False,
            device=out.device,
        )


_dequantize_mean_op = register_op("dequantize_mean", _dequantize_mean, mutates_args=("out",))


@no_grad
def dequantize_mean(q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (fp32 [n]) = mean over m of q[m] (int8 [M, n]) * scales[m] (fp32 [M, nb], one per block). One launch."""
    if not isinstance(block, int) or block < 1:
        fail(f"dequantize_mean: block must be an int >= 1, got {block!r}")
    check_tensor("dequantize_mean", "q", q, dtypes=(torch.int8,), ndim=2)
    M, n = q.shape
    if M < 1 or n + _BLOCK >= 2**31:
        fail(f"dequantize_mean: q must have M >= 1 rows of n < 2**31 - {_BLOCK} elements, got {tuple(q.shape)}")
    nb = -(-n // block)
    check_tensor("dequantize_mean", "scales", scales, dtypes=(torch.float32,), shape=(M, nb), device=q.device)
    check_tensor("dequantize_mean", "out", out, dtypes=(torch.float32,), shape=(n,), device=q.device)
    call(_dequantize_mean_op, _dequantize_mean, q, scales, block, out)


__all__ = ["quantize_int8", "quantize_int8_ref", "dequantize_mean", "dequantize_mean_ref"]
