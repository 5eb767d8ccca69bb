"""4-bit block quantization, two values per byte, for a quantized sync codec (docs/design.md §2.5).

quantize_int4:        per block of `block` (even) elements, scale = absmax / 7 and
                      q = clamp(round_half_away(x / scale), -7, 7) (scale 0 -> q 0), stored as
                      the nibble q + 8 (1..15): element 2i in the low nibble of byte i, element
                      2i+1 in the high nibble; an odd n leaves the last high nibble 0.
dequantize_int4_mean: out = (Σ_m q[m] * scale[m, block(e)]) / M, summed m = 0..M-1.
dequantize_int4:      the same for one replica (M = 1: out = q * scale exactly).

The arithmetic is int8's (kernels/quant.py) with 7 for 127: correctly rounded
division (tl.div_rn), rounding as a - floor(a) >= 0.5, FMA contraction off, so
kernel and reference agree exactly. `block` is even so that a byte never holds
two blocks. x must be finite.
"""

from __future__ import annotations

import functools

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

_TILE = 4096  # bytes (element pairs) per program in quantize_int4
_BLOCK = 4096  # elements per program in dequantize_int4_mean
MAX_BLOCK = 16384  # one quant block is one register tile row (of block/2 pairs) in the kernel
QMAX = 7


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _check_block(op: str, block: object) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or not 2 <= block <= MAX_BLOCK or block % 2:
        fail(f"{op}: block must be an even int in [2, {MAX_BLOCK}] (a byte holds two of one block's), got {block!r}")


# ----------------------------------------------------------------------------- quantize_int4


@triton.jit
def _round_q(x, scale):
    """q = clamp(round_half_away(x / scale), -7, 7) as fp32; scale 0 gives 0 (x / 1 with x = 0)."""
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = tl.div_rn(x, safe[:, None])
    a = tl.abs(y)
    r = tl.floor(a)
    r = r + tl.where(a - r >= 0.5, 1.0, 0.0)  # a - floor(a) is exact, unlike floor(a + 0.5)
    r = tl.minimum(r, 7.0)
    return tl.where(y < 0.0, -r, r)


@triton.jit
def _quantize4_kernel(x_ptr, p_ptr, scale_ptr, n, nb, block, ROWS: tl.constexpr, PAIRS: tl.constexpr):
    # a [ROWS, PAIRS] tile holds ROWS quant blocks; column j is the pair (2j, 2j+1) of its block
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, PAIRS)
    half = block // 2
    lo = b[:, None] * block + 2 * j[None, :]
    in_blk = (b[:, None] < nb) & (j[None, :] < half)
    m_lo = in_blk & (lo < n)
    m_hi = in_blk & (lo + 1 < n)
    x_lo = tl.load(x_ptr + lo, mask=m_lo, other=0.0)
    x_hi = tl.load(x_ptr + lo + 1, mask=m_hi, other=0.0)
    absmax = tl.maximum(tl.max(tl.abs(x_lo), axis=1), tl.max(tl.abs(x_hi), axis=1))
    scale = tl.div_rn(absmax, 7.0)
    q_lo = _round_q(x_lo, scale).to(tl.int32) + 8
    q_hi = tl.where(m_hi, _round_q(x_hi, scale).to(tl.int32) + 8, 0)  # odd n: last high nibble 0
    byte = q_lo | (q_hi << 4)
    tl.store(p_ptr + b[:, None] * half + j[None, :], byte.to(tl.uint8), mask=m_lo)
    tl.store(scale_ptr + b, scale, mask=b < nb)


def _blocks_q_ref(x: torch.Tensor, block: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(q fp32 [nb*block], zero-padded; scales fp32 [nb]): int8's reference with qmax for 127."""
    n = x.numel()
    nb = -(-n // block)
    xb = x.new_zeros(nb * block)  # zeros change neither absmax nor q
    xb[:n] = x
    xb = xb.view(nb, block)
    scales = torch.linalg.vector_norm(xb, ord=float("inf"), dim=1).div_(qmax)
    safe = torch.where(scales > 0, scales, 1.0)[:, None]  # an all-zero block gives 0 / 1 = 0
    y = xb.div_(safe)
    a = y.abs()
    r = a.floor()
    r.add_(a.sub_(r).ge_(0.5))
    r.clamp_(max=qmax).copysign_(y)
    return r.view(-1), scales


def quantize_int4_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = absmax/7; nibble = clamp(round_half_away(x/scale), ±7) + 8, two per byte (low first)."""
    n = x.numel()
    q, scales = _blocks_q_ref(x, block, float(QMAX))
    nib = q[: n + (n & 1)].to(torch.int16).add_(8)  # block is even: the padded tail always has the odd slot
    if n & 1:
        nib[n] = 0
    packed = nib[0::2] | (nib[1::2] << 4)
    return packed.to(torch.uint8), scales


def _quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return quantize_int4_ref(x, block)
    n = x.numel()
    nb = -(-n // block)
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nb, dtype=torch.float32, device=x.device)
    if n:
        pairs = _next_pow2(block // 2)
        rows = max(1, _TILE // pairs)
        launch(
            _quantize4_kernel,
            (triton.cdiv(nb, rows),),
            x,
            packed,
            scales,
            n,
            nb,
            block,
            ROWS=rows,
            PAIRS=pairs,
            num_warps=8,
            enable_fp_fusion=False,
            device=x.device,
        )
    return packed, scales


_quantize_int4_op = register_op("quantize_int4", _quantize_int4, mutates_args=())


@_quantize_int4_op.register_fake
def _(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    return x.new_empty((n + 1) // 2, dtype=torch.uint8), x.new_empty(-(-n // block), dtype=torch.float32)


@no_grad
def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 x [n] to (packed uint8 [ceil(n/2)], scales fp32 [ceil(n/block)]); block even. One launch."""
    check_tensor("quantize_int4", "x", x, dtypes=(torch.float32,), ndim=1)
    _check_block("quantize_int4", block)
    return call(_quantize_int4_op, _quantize_int4, x, block)


# ----------------------------------------------------------------------------- dequantize_int4_mean


@triton.jit
def _dequantize4_mean_kernel(p_ptr, scale_ptr, out_ptr, n, nbytes, nb, block, M, M_f, BLOCK: tl.constexpr):
    # n + BLOCK < 2**31 is checked on the host, so int32 offsets suffice
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte_offs = offs // 2
    shift = (offs % 2) * 4
    blk = offs // block
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _m in range(M):  # fixed order m = 0..M-1, as in the reference
        byte = tl.load(p_ptr + byte_offs, mask=mask, other=0).to(tl.int32)
        q = ((byte >> shift) & 15) - 8
        s = tl.load(scale_ptr + blk, mask=mask, other=0.0)
        acc = acc + q.to(tl.float32) * s
        p_ptr += nbytes  # next row; advancing the pointer avoids an int32 m*n overflow
        scale_ptr += nb
    tl.store(out_ptr + offs, tl.div_rn(acc, M_f), mask=mask)


@functools.lru_cache(maxsize=8)
def _nibble_table(device: torch.device) -> torch.Tensor:
    """fp32 [256, 2]: byte -> (low nibble - 8, high nibble - 8)."""
    b = torch.arange(256, device=device)
    return torch.stack(((b & 15) - 8, (b >> 4) - 8), dim=1).to(torch.float32)


def _unpack_ref(packed: torch.Tensor, n: int) -> torch.Tensor:
    """packed uint8 [ceil(n/2)] -> q fp32 [n] in -8..7 (nibble - 8), one table lookup per byte."""
    return _nibble_table(packed.device).index_select(0, packed.to(torch.int32)).view(-1)[:n]


def dequantize_int4_mean_ref(packed: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out = (q[0]*s[0] + q[1]*s[1] + ... + q[M-1]*s[M-1]) / M, s expanded from per-block scales."""
    M = packed.shape[0]
    n = out.numel()
    full = (n // block) * block  # elements in whole blocks; the tail shares the last scale
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for m in range(M):
        prod = _unpack_ref(packed[m], n)
        prod[:full].view(-1, block).mul_(scales[m, : full // block, None])
        if full < n:
            prod[full:].mul_(scales[m, -1])
        acc.add_(prod)
    torch.div(acc, M, out=out)


def _dequantize_int4_mean(packed: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    if not use_triton(packed, scales, out):
        return dequantize_int4_mean_ref(packed, scales, block, out)
    M, nbytes = packed.shape
    n = out.numel()
    if n:
        launch(
            _dequantize4_mean_kernel,
            (triton.cdiv(n, _BLOCK),),
            packed,
            scales,
            out,
            n,
            nbytes,
            scales.shape[1],
            block,
            M,
            float(M),
            BLOCK=_BLOCK,
            num_warps=8,
            enable_fp_fusion=False,
            device=out.device,
        )


_dequantize_int4_mean_op = register_op("dequantize_int4_mean", _dequantize_int4_mean, mutates_args=("out",))


@no_grad
def dequantize_int4_mean(packed: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (fp32 [n]) = mean over m of q[m] (packed uint8 [M, ceil(n/2)]) * scales[m] (fp32 [M, nb]). One launch."""
    _check_block("dequantize_int4_mean", block)
    check_tensor("dequantize_int4_mean", "out", out, dtypes=(torch.float32,), ndim=1)
    n = out.numel()
    if n + _BLOCK >= 2**31:
        fail(f"dequantize_int4_mean: out must have n < 2**31 - {_BLOCK} elements, got {n}")
    check_tensor("dequantize_int4_mean", "packed", packed, dtypes=(torch.uint8,), ndim=2, device=out.device)
    M = packed.shape[0]
    if M < 1 or packed.shape[1] != (n + 1) // 2:
        fail(
            f"dequantize_int4_mean: packed must be [M >= 1, ceil(n/2) = {(n + 1) // 2}] for out of {n} elements, "
            f"got {tuple(packed.shape)}"
        )
    nb = -(-n // block)
    check_tensor("dequantize_int4_mean", "scales", scales, dtypes=(torch.float32,), shape=(M, nb), device=out.device)
    call(_dequantize_int4_mean_op, _dequantize_int4_mean, packed, scales, block, out)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (fp32 [n]) = q * scale for one replica's packed uint8 [ceil(n/2)] and scales fp32 [nb] (exact)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 1:
        fail("dequantize_int4: packed must be a 1-D tensor (use dequantize_int4_mean for [M, ceil(n/2)])")
    if not isinstance(scales, torch.Tensor) or scales.dim() != 1:
        fail("dequantize_int4: scales must be a 1-D tensor (use dequantize_int4_mean for [M, nb])")
    dequantize_int4_mean(packed[None], scales[None], block, out)


__all__ = [
    "quantize_int4",
    "quantize_int4_ref",
    "dequantize_int4_mean",
    "dequantize_int4_mean_ref",
    "dequantize_int4",
    "MAX_BLOCK",
]
