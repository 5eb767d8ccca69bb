"""`@triton.jit` helpers shared by the kernels: exact float conversions to and from fp32.

Why the bf16 conversions are done by hand, on the bits:

* fp32 → bf16 must round to nearest, ties to even (RNE), because that is what
  torch's `.to(torch.bfloat16)` and the GPU's `cvt.rn.bf16.f32` do, and every
  kernel here is held to agree bit for bit with its torch reference. The Triton
  interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels on CPU) has
  no bf16 type of its own and casts by truncating the low 16 bits, so a plain
  ``x.to(tl.bfloat16)`` would round differently under test than on a GPU. The
  integer form below is RNE everywhere and compiles to a few integer ops.
* bf16 → fp32 is exact (bf16 is the top half of an fp32), so it is a 16-bit
  shift of the bits; that also avoids the interpreter's bf16 cast path.

fp16 and fp32 use Triton's own casts, which round correctly in both modes.
"""

from __future__ import annotations

from kernels.backend import tl, triton


@triton.jit
def bf16_to_fp32(x):
    """bf16 → fp32, exactly: the bf16 bits become the high half of the fp32 bits."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_rne(x):
    """fp32 → bf16, round to nearest, ties to even, on the bits; NaN stays a (quiet) NaN, ±inf stays ±inf.

    Adding 0x7FFF plus the lowest kept bit, then dropping the low 16 bits, rounds
    the discarded half up when it is above one half, and to the even neighbour
    when it is exactly one half; a carry into the exponent is the correct result
    (including overflow to inf).
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(x != x, 0x7FC0, bits)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_fp32(x):
    """Any float dtype → fp32, exactly (bf16 via `bf16_to_fp32`)."""
    if x.dtype == tl.bfloat16:
        y = bf16_to_fp32(x)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def from_fp32(x, dtype: tl.constexpr):
    """fp32 → `dtype` (fp32, bf16 or fp16), rounded to nearest even (bf16 via `fp32_to_bf16_rne`)."""
    if dtype == tl.bfloat16:
        y = fp32_to_bf16_rne(x)
    else:
        y = x.to(dtype)
    return y
