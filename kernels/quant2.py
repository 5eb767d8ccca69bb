"""2-bit block quantization, four values per byte, for a sparse sync codec (docs/design.md §2.5, `int2`).

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
"""

from __future__ import annotations

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

_TILE = 2048  # bytes (element quads) per program in quantize_int2
_BLOCK = 4096  # elements per program in dequantize_int2_mean
MAX_BLOCK = 16384  # one quant block is one register-tile row (of block/4 quads) in the kernel


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _check_block(op: str, block: object) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or not 4 <= block <= MAX_BLOCK or block % 4:
        fail(f"{op}: block must be a multiple of 4 in [4, {MAX_BLOCK}] (four per byte), got {block!r}")


# ----------------------------------------------------------------------------- quantize_int2


@triton.jit
def _code(x, t, valid):
    """2-bit code of x against its block's threshold t (0 where not valid)."""
    c = tl.where(tl.abs(x) >= t[:, None], 1, 0) | tl.where(x < 0.0, 2, 0)
    return tl.where(valid, c, 0)


@triton.jit
def _quantize2_kernel(x_ptr, p_ptr, table_ptr, n, nb, block, ROWS: tl.constexpr, QUADS: tl.constexpr):
    # a [ROWS, QUADS] tile holds ROWS quant blocks; column j is the quad (4j .. 4j+3) of its block
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, QUADS)
    quarter = block // 4
    base = b[:, None] * block + 4 * j[None, :]
    in_blk = (b[:, None] < nb) & (j[None, :] < quarter)
    m0 = in_blk & (base < n)
    m1 = in_blk & (base + 1 < n)
    m2 = in_blk & (base + 2 < n)
    m3 = in_blk & (base + 3 < n)
    x0 = tl.load(x_ptr + base, mask=m0, other=0.0)
    x1 = tl.load(x_ptr + base + 1, mask=m1, other=0.0)
    x2 = tl.load(x_ptr + base + 2, mask=m2, other=0.0)
    x3 = tl.load(x_ptr + base + 3, mask=m3, other=0.0)
    hi = tl.maximum(
        tl.maximum(tl.max(tl.abs(x0), axis=1), tl.max(tl.abs(x1), axis=1)),
        tl.maximum(tl.max(tl.abs(x2), axis=1), tl.max(tl.abs(x3), axis=1)),
    )
    inf = float("inf")
    lo = tl.minimum(
        tl.minimum(tl.min(tl.where(m0, tl.abs(x0), inf), axis=1), tl.min(tl.where(m1, tl.abs(x1), inf), axis=1)),
        tl.minimum(tl.min(tl.where(m2, tl.abs(x2), inf), axis=1), tl.min(tl.where(m3, tl.abs(x3), inf), axis=1)),
    )
    lo = tl.where(b < nb, lo, 0.0)  # rows past the last block: no inf − inf
    d = (hi - lo) * 0.5
    t = lo + d
    byte = _code(x0, t, m0) | (_code(x1, t, m1) << 2) | (_code(x2, t, m2) << 4) | (_code(x3, t, m3) << 6)
    tl.store(p_ptr + b[:, None] * quarter + j[None, :], byte.to(tl.uint8), mask=m0)
    tl.store(table_ptr + 2 * b, lo + d * 0.5, mask=b < nb)
    tl.store(table_ptr + 2 * b + 1, lo + d * 1.5, mask=b < nb)


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


def _quantize_int2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return quantize_int2_ref(x, block)
    n = x.numel()
    nb = -(-n // block)
    packed = torch.empty((n + 3) // 4, dtype=torch.uint8, device=x.device)
    table = torch.empty(2 * nb, dtype=torch.float32, device=x.device)
    if n:
        quads = _next_pow2(block // 4)
        rows = max(1, _TILE // quads)
        launch(
            _quantize2_kernel,
            (triton.cdiv(nb, rows),),
            x,
            packed,
            table,
            n,
            nb,
            block,
            ROWS=rows,
            QUADS=quads,
            num_warps=8,
            enable_fp_fusion=False,
            device=x.device,
        )
    return packed, table


_quantize_int2_op = register_op("quantize_int2", _quantize_int2, mutates_args=())


@_quantize_int2_op.register_fake
def _(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    return x.new_empty((n + 3) // 4, dtype=torch.uint8), x.new_empty(2 * -(-n // block), dtype=torch.float32)


@no_grad
def quantize_int2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x [n] → (packed uint8 [ceil(n/4)], table fp32 [2·ceil(n/block)]: (level0, level1) per block)."""
    check_tensor("quantize_int2", "x", x, dtypes=(torch.float32,), ndim=1)
    _check_block("quantize_int2", block)
    return call(_quantize_int2_op, _quantize_int2, x, block)


# ----------------------------------------------------------------------------- dequantize_int2_mean


@triton.jit
def _dequantize2_mean_kernel(p_ptr, table_ptr, out_ptr, n, nbytes, nb, block, M, M_f, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # n + BLOCK < 2**31: checked on the host
    mask = offs < n
    shift = (offs % 4) * 2
    blk = offs // block
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _m in range(M):  # fixed order m = 0..M-1, as in the reference
        code = (tl.load(p_ptr + offs // 4, mask=mask, other=0).to(tl.int32) >> shift) & 3
        level = tl.load(table_ptr + 2 * blk + (code & 1), mask=mask, other=0.0)
        acc = acc + tl.where((code & 2) != 0, -level, level)
        p_ptr += nbytes
        table_ptr += 2 * nb
    tl.store(out_ptr + offs, tl.div_rn(acc, M_f), mask=mask)


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


def _dequantize_int2_mean(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
    if not use_triton(packed, table, out):
        return dequantize_int2_mean_ref(packed, table, block, out)
    M, nbytes = packed.shape
    n = out.numel()
    if n:
        launch(
            _dequantize2_mean_kernel,
            (triton.cdiv(n, _BLOCK),),
            packed,
            table,
            out,
            n,
            nbytes,
            table.shape[1] // 2,
            block,
            M,
            float(M),
            BLOCK=_BLOCK,
            num_warps=8,
            enable_fp_fusion=False,
            device=out.device,
        )


_dequantize_int2_mean_op = register_op("dequantize_int2_mean", _dequantize_int2_mean, mutates_args=("out",))


@no_grad
def dequantize_int2_mean(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (fp32 [n]) = mean over m of replica m's values (packed uint8 [M, ceil(n/4)], table fp32 [M, 2·nb])."""
    _check_block("dequantize_int2_mean", block)
    check_tensor("dequantize_int2_mean", "out", out, dtypes=(torch.float32,), ndim=1)
    n = out.numel()
    if n + _BLOCK >= 2**31:
        fail(f"dequantize_int2_mean: out must have n < 2**31 - {_BLOCK} elements, got {n}")
    check_tensor("dequantize_int2_mean", "packed", packed, dtypes=(torch.uint8,), ndim=2, device=out.device)
    M = packed.shape[0]
    if M < 1 or packed.shape[1] != (n + 3) // 4:
        fail(
            f"dequantize_int2_mean: packed must be [M >= 1, ceil(n/4) = {(n + 3) // 4}] for out of {n} elements, "
            f"got {tuple(packed.shape)}"
        )
    nb = -(-n // block)
    check_tensor("dequantize_int2_mean", "table", table, dtypes=(torch.float32,), shape=(M, 2 * nb), device=out.device)
    call(_dequantize_int2_mean_op, _dequantize_int2_mean, packed, table, block, out)


def dequantize_int2(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (fp32 [n]) = one replica's decoded values (packed uint8 [ceil(n/4)], table fp32 [2·nb]), exactly."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 1:
        fail("dequantize_int2: packed must be a 1-D tensor (use dequantize_int2_mean for [M, ceil(n/4)])")
    if not isinstance(table, torch.Tensor) or table.dim() != 1:
        fail("dequantize_int2: table must be a 1-D tensor (use dequantize_int2_mean for [M, 2·nb])")
    dequantize_int2_mean(packed[None], table[None], block, out)


__all__ = ["quantize_int2", "quantize_int2_ref", "dequantize_int2_mean", "dequantize_int2_mean_ref", "dequantize_int2"]
