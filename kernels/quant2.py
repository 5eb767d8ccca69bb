"""2-bit block quantization, four values per byte, for a sparse sync codec (docs/design.md §8.5, `int2`).

quantize_int2:        per block of `block` (a multiple of 4) elements, over the magnitudes a = |x|:
                          lo = min a,  hi = max a,  d = (hi − lo)·0.5,  t = lo + d
                          level0 = lo + d·0.5,  level1 = lo + d·1.5          (fp32, each op rounded once)
                      code = (a ≥ t) | (x < 0) << 1: bit 0 picks the level (a tie a = t takes level1),
                      bit 1 the sign (−0.0 counts as positive). Element 4i+j sits in bits 2j..2j+1 of
                      byte i (a last partial byte has zero high bits). The block's table is (level0,
                      level1), fp32: what the receiver decodes with, no arithmetic.
dequantize_int2_mean: out = (Σ_m ±table[m, block(e), bit0]) / M, summed m = 0..M−1.
dequantize_int2:      the same for one replica (M = 1: out = ±level exactly).

Levels at the middle of the two halves of [lo, hi] suit top-k's selected values, whose magnitudes
all lie above the chunk's k-th: the error is at most (hi − lo)/4 per value, and a block whose values
share one magnitude is sent exactly. FMA contraction is off so kernel and reference agree bit for bit.
x must be finite.

The kernels work on [rows, next_pow2(block)] tiles, one quant block a row: contiguous loads and stores of
values and of packed bytes (a byte's four codes are one thread's registers), lo and hi row reductions.
"""

from __future__ import annotations

import torch

from kernels._util import PackedCodec, byte_rows, load_block_rows, pack_pairs, store_block_bytes, store_mean_rows
from kernels.backend import tl, triton

# about 2048 values a program (top-k payloads are small: many programs); one quant block is one tile row
CODEC = PackedCodec(bits=2, width=2, table_name="table", tile=2048, mean_tile=2048, num_warps=4)
MAX_BLOCK = CODEC.max_block


# ----------------------------------------------------------------------------- quantize_int2


@triton.jit
def _quantize2_kernel(
    x_ptr, p_ptr, table_ptr, n, nbytes, block, quarter, ROWS: tl.constexpr, BP: tl.constexpr, DENSE: tl.constexpr
):  # DENSE (whole tiles, aligned: see PackedCodec.quantize_op) is not used here: top-k payloads are small
    b, x, m = load_block_rows(x_ptr, n, block, ROWS, BP)
    a = tl.abs(x)
    hi = tl.max(a, axis=1)  # padding 0 never exceeds a real |x|
    lo = tl.min(tl.where(m, a, float("inf")), axis=1)
    real = b * block < n
    lo = tl.where(real, lo, 0.0)  # rows past the last block: no inf - inf
    d = (hi - lo) * 0.5
    t = lo + d
    code = tl.where(m, tl.where(a >= t[:, None], 1, 0) | tl.where(x < 0.0, 2, 0), 0)  # past n: 0
    # element 4i+j to bits 2j of byte i: neighbours' codes paired (2 bits -> 4), then pairs paired (4 -> 8)
    byte = pack_pairs(pack_pairs(code, 2, ROWS, BP), 4, ROWS, BP // 2)
    store_block_bytes(p_ptr, byte, b, quarter, nbytes, BP // 4)
    tl.store(table_ptr + 2 * b, lo + d * 0.5, mask=real)
    tl.store(table_ptr + 2 * b + 1, lo + d * 1.5, mask=real)


def quantize_int2_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: table (lo + d/2, lo + 3d/2) of its |x| range, code = (|x| ≥ lo + d) | sign << 1, four per byte."""
    n = x.numel()
    nb = -(-n // block)
    a = x.new_zeros(nb * block)
    a[:n] = x.abs()
    hi = a.view(nb, block).amax(dim=1)  # padding 0 never exceeds a real |x|
    a[n:] = float("inf")
    lo = a.view(nb, block).amin(dim=1)  # padding +inf never undercuts one
    d = (hi - lo).mul_(0.5)
    t = lo + d
    table = torch.stack((lo + d * 0.5, lo + d * 1.5), dim=1)
    code = (a[:n] >= t.repeat_interleave(block)[:n]).to(torch.uint8) | ((x < 0).to(torch.uint8) << 1)
    quads = torch.zeros(-(-n // 4) * 4, dtype=torch.uint8, device=x.device)
    quads[:n] = code
    q = quads.view(-1, 4)
    packed = q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)
    return packed, table.reshape(-1)


quantize_int2 = CODEC.quantize_op(
    _quantize2_kernel,
    quantize_int2_ref,
    "fp32 x [n] → (packed uint8 [ceil(n/4)], table fp32 [2·ceil(n/block)]: (level0, level1) per block).",
)


# ----------------------------------------------------------------------------- dequantize_int2_mean


@triton.jit
def _level(code, level0, level1):
    """±table[block, bit 0 of code] (bit 1: the sign) for a tile of 2-bit codes; level0/1: [ROWS, 1]."""
    level = tl.where((code & 1) != 0, level1, level0)
    return tl.where((code & 2) != 0, -level, level)


@triton.jit
def _dequantize2_mean_kernel(
    p_ptr, table_ptr, out_ptr, n, nbytes, nt, block, quarter, M, inv_m, M_f,
    EXACT_INV: tl.constexpr, ROWS: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    v0 = tl.zeros([ROWS, BP], dtype=tl.float32)  # values 4j, 4j+1, 4j+2, 4j+3 of the rows' bytes j
    v1 = tl.zeros([ROWS, BP], dtype=tl.float32)
    v2 = tl.zeros([ROWS, BP], dtype=tl.float32)
    v3 = tl.zeros([ROWS, BP], dtype=tl.float32)
    b, at, bmask = byte_rows(quarter, nbytes, ROWS, BP)
    for _m in range(M):  # fixed order m = 0..M-1, as in the reference
        byte = tl.load(p_ptr + at, mask=bmask, other=0).to(tl.int32)
        l0 = tl.load(table_ptr + 2 * b, mask=2 * b < nt, other=0.0)[:, None]
        l1 = tl.load(table_ptr + 2 * b + 1, mask=2 * b < nt, other=0.0)[:, None]
        v0 = v0 + _level(byte, l0, l1)
        v1 = v1 + _level(byte >> 2, l0, l1)
        v2 = v2 + _level(byte >> 4, l0, l1)
        v3 = v3 + _level(byte >> 6, l0, l1)
        p_ptr += nbytes
        table_ptr += nt
    vals = tl.interleave(tl.interleave(v0, v2), tl.interleave(v1, v3))  # 4j, 4j+1, 4j+2, 4j+3
    store_mean_rows(out_ptr, vals, b, n, block, inv_m, M_f, EXACT_INV, 4 * BP)


def _decode_ref(packed: torch.Tensor, table: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """One replica's values: ±table[block(e), bit0(e)]."""
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=packed.device)
    code = ((packed[:, None] >> shifts) & 3).reshape(-1)[:n].to(torch.int64)
    blk = torch.arange(n, device=packed.device) // block
    level = table[2 * blk + (code & 1)]
    return torch.where((code & 2) != 0, -level, level)


def dequantize_int2_mean_ref(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out = (v[0] + v[1] + ... + v[M−1]) / M with v[m] replica m's decoded values."""
    n = out.numel()
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for m in range(packed.shape[0]):
        acc.add_(_decode_ref(packed[m], table[m], block, n))
    torch.div(acc, packed.shape[0], out=out)


dequantize_int2_mean = CODEC.mean_op(
    _dequantize2_mean_kernel,
    dequantize_int2_mean_ref,
    "out (fp32 [n]) = mean over m of replica m's values (packed uint8 [M, ceil(n/4)], table fp32 [M, 2·nb]).",
)
dequantize_int2 = CODEC.one_replica_op(
    dequantize_int2_mean,
    "out (fp32 [n]) = one replica's decoded values (packed uint8 [ceil(n/4)], table fp32 [2·nb]), exactly.",
)

__all__ = ["quantize_int2", "quantize_int2_ref", "dequantize_int2_mean", "dequantize_int2_mean_ref", "dequantize_int2"]
