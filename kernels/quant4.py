"""4-bit block quantization, two values per byte, for a quantized sync codec (docs/design.md §8.5).

quantize_int4:        per block of `block` (even) elements, scale = absmax / 7 and
                      q = clamp(round_half_away(x / scale), -7, 7) (scale 0 -> q 0), stored as
                      the nibble q + 8 (1..15): element 2i in the low nibble of byte i, element
                      2i+1 in the high nibble; an odd n leaves the last high nibble 0.
dequantize_int4_mean: out = (Σ_m q[m] * scale[m, block(e)]) / M, summed m = 0..M-1.
dequantize_int4:      the same for one replica (M = 1: out = q * scale exactly).

The arithmetic is int8's (kernels/quant.py) with 7 for 127: correctly rounded
division (tl.div_rn), rounding half away from zero, FMA contraction off, so
kernel and reference agree exactly. `block` is even so that a byte never
holds two blocks. x must be finite.

The kernels work on [rows, next_pow2(block)] tiles, one quant block a row: contiguous
loads and stores of values and of packed bytes (a byte's two nibbles are one
thread's registers: quantize reads whole tiles as int64 value pairs), the block's
absmax a row reduction, and no float/int conversions (see `_nibbles`, `_centred`);
the mean multiplies by 1/M when M is a power of two (the same correctly rounded
result as dividing).
"""

from __future__ import annotations

import functools

import torch

from kernels._util import PackedCodec, byte_rows, load_block_rows, pack_pairs, store_block_bytes, store_mean_rows
from kernels.backend import tl, triton

# about 1024 values a program in quantize_int4, 4096 in the mean (best of a sweep on an H200); one quant block
# is one register tile row in the kernels
CODEC = PackedCodec(bits=4, width=1, table_name="scales", tile=1024, mean_tile=4096, num_warps=4)
MAX_BLOCK = CODEC.max_block
QMAX = 7


# ----------------------------------------------------------------------------- quantize_int4


@triton.jit
def _nibbles(x, scale):
    """q + 8 (int32, 1..15), q = clamp(round_half_away(RN(x / scale)), -7, 7); scale 0 gives 8 (x / 1, x = 0).

    y = tl.div_rn(x, scale); t = (a + 2**23) - 2**23 (a = |y| < 2**22) is a, rounded half to even; a tie
    rounded down (a - t = 0.5, exact) goes up. The nibble 8 ± r, an integer below 16, is the low bits of
    (8 ± r) + 2**23: no float-to-int conversion (a slow unit on the GPU).
    """
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = tl.div_rn(x, safe[:, None])
    a = tl.abs(y)
    t = (a + 8388608.0) - 8388608.0
    r = tl.minimum(t + tl.where(a - t == 0.5, 1.0, 0.0), 7.0)
    v = tl.where(y < 0.0, 8.0 - r, 8.0 + r)
    return (v + 8388608.0).to(tl.int32, bitcast=True) & 15


@triton.jit
def _quantize4_rows(x_ptr, p_ptr, scale_ptr, n, nbytes, block, half, ROWS: tl.constexpr, BP: tl.constexpr):
    """Any tile: values in order, masked; neighbours paired up in registers."""
    b, x, m = load_block_rows(x_ptr, n, block, ROWS, BP)
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), 7.0)
    nib = tl.where(m, _nibbles(x, scale), 0)  # odd n: the last high nibble is 0
    store_block_bytes(p_ptr, pack_pairs(nib, 4, ROWS, BP), b, half, nbytes, BP // 2)
    tl.store(scale_ptr + b, scale, mask=b * block < n)


@triton.jit
def _quantize4_pairs(x_ptr, p_ptr, scale_ptr, half, ROWS: tl.constexpr, BP: tl.constexpr):
    """A whole tile (block a power of two, x 8-byte aligned): value pairs (2j, 2j+1) loaded as int64s, so a
    byte's two values are one thread's from the load on (nothing to pair up, no masks)."""
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    at = b[:, None] * half + tl.arange(0, BP // 2)[None, :]  # pair j of a block is its byte j
    pair = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + at)
    lo = (pair & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)  # little-endian: value 2j is the low half
    hi = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    scale = tl.div_rn(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1), 7.0)
    tl.store(p_ptr + at, (_nibbles(lo, scale) | (_nibbles(hi, scale) << 4)).to(tl.uint8))
    tl.store(scale_ptr + b, scale)


@triton.jit
def _quantize4_kernel(
    x_ptr, p_ptr, scale_ptr, n, nbytes, block, half, ROWS: tl.constexpr, BP: tl.constexpr, DENSE: tl.constexpr
):
    if DENSE:
        if (tl.program_id(0).to(tl.int64) + 1) * ROWS * block <= n:
            _quantize4_pairs(x_ptr, p_ptr, scale_ptr, half, ROWS, BP)
        else:
            _quantize4_rows(x_ptr, p_ptr, scale_ptr, n, nbytes, block, half, ROWS, BP)
    else:
        _quantize4_rows(x_ptr, p_ptr, scale_ptr, n, nbytes, block, half, ROWS, BP)


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


quantize_int4 = CODEC.quantize_op(
    _quantize4_kernel,
    quantize_int4_ref,
    "Quantize fp32 x [n] to (packed uint8 [ceil(n/2)], scales fp32 [ceil(n/block)]); block even. One launch.",
)


# ----------------------------------------------------------------------------- dequantize_int4_mean


@triton.jit
def _centred(nib):
    """A nibble (int32, 0..15) minus 8 as fp32, exactly, with no int-to-float conversion: 2**23 + nib - (2**23 + 8)."""
    return (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _dequantize4_mean_kernel(
    p_ptr, scale_ptr, out_ptr, n, nbytes, nb, block, half, M, inv_m, M_f,
    EXACT_INV: tl.constexpr, ROWS: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    b, at, bmask = byte_rows(half, nbytes, ROWS, BP)
    lo = tl.zeros([ROWS, BP], dtype=tl.float32)  # values 2j
    hi = tl.zeros([ROWS, BP], dtype=tl.float32)  # values 2j+1
    for _m in range(M):  # fixed order m = 0..M-1, as in the reference
        byte = tl.load(p_ptr + at, mask=bmask, other=0).to(tl.int32)
        s = tl.load(scale_ptr + b, mask=b < nb, other=0.0)[:, None]
        lo = lo + _centred(byte & 15) * s
        hi = hi + _centred(byte >> 4) * s
        p_ptr += nbytes  # next row; advancing the pointer avoids an int32 m*n overflow
        scale_ptr += nb
    store_mean_rows(out_ptr, tl.interleave(lo, hi), b, n, block, inv_m, M_f, EXACT_INV, 2 * BP)


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


dequantize_int4_mean = CODEC.mean_op(
    _dequantize4_mean_kernel,
    dequantize_int4_mean_ref,
    "out (fp32 [n]) = mean over m of q[m] (packed uint8 [M, ceil(n/2)]) * scales[m] (fp32 [M, nb]). One launch.",
)
dequantize_int4 = CODEC.one_replica_op(
    dequantize_int4_mean,
    "out (fp32 [n]) = q * scale for one replica's packed uint8 [ceil(n/2)] and scales fp32 [nb] (exact).",
)

__all__ = [
    "quantize_int4",
    "quantize_int4_ref",
    "dequantize_int4_mean",
    "dequantize_int4_mean_ref",
    "dequantize_int4",
    "MAX_BLOCK",
]
