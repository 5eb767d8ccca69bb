"""Bit-packed indices for a sparse sync codec (docs/design.md §8.5): b bits per entry, no padding between.

pack_bits:   c non-negative ints v[j] < 2**b → ceil(c·b/8) bytes; entry j occupies bits j·b .. j·b+b−1 of
             the little-endian bit stream (stream bit t is bit t mod 8 of byte t // 8); the last byte's
             unused high bits are 0. b = 0 gives no bytes (every value is 0).
unpack_bits: the inverse, into an int tensor of any integer dtype.

A top-k chunk of C elements needs b = ceil(log2 C) bits per index (`index_bits`): 12 for 4096, instead
of the 16 of an int16. b ≤ MAX_BITS = 16, so one entry spans at most three bytes (the kernels read or
write a byte's entries, or an entry's bytes, with no search).
"""

from __future__ import annotations

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

MAX_BITS = 16
_BLOCK = 1024  # bytes (pack) or entries (unpack) per program
_INT_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def index_bits(chunk: int) -> int:
    """b = ceil(log2 chunk): the bits of an index within a chunk of `chunk` elements (0 for chunk 1)."""
    return (chunk - 1).bit_length()


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes of `count` entries of `bits` bits each, packed: ceil(count·bits/8)."""
    return -(-count * bits // 8)


def _check_bits(op: str, bits: object) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 0 <= bits <= MAX_BITS:
        fail(f"{op}: bits must be an int in [0, {MAX_BITS}], got {bits!r}")


# ----------------------------------------------------------------------------- pack


@triton.jit
def _pack_kernel(v_ptr, p_ptr, count, nbytes, BITS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # output bytes
    mask = t < nbytes
    first = (8 * t) // BITS  # the first entry with a bit in byte t
    byte = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(SPAN):  # at most SPAN entries touch one byte
        j = first + i
        sh = j * BITS - 8 * t  # where entry j's bit 0 lands relative to byte t's bit 0: in (−BITS, 8)
        ok = mask & (j < count) & (sh < 8)
        v = tl.load(v_ptr + j, mask=ok, other=0).to(tl.int32)
        up = tl.maximum(sh, 0).to(tl.int32)
        down = tl.maximum(-sh, 0).to(tl.int32)
        byte = byte | tl.where(ok, ((v << up) >> down) & 255, 0)
    tl.store(p_ptr + t, byte.to(tl.uint8), mask=mask)


def pack_bits_ref(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v (ints in [0, 2**bits)) → the packed little-endian bit stream, uint8 [ceil(c·bits/8)]."""
    c = v.numel()
    nbytes = packed_nbytes(c, bits)
    stream = torch.zeros(nbytes * 8, dtype=torch.uint8, device=v.device)
    if nbytes:
        shifts = torch.arange(bits, device=v.device)
        stream[: c * bits] = ((v.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1).to(torch.uint8)
    weights = (1 << torch.arange(8, device=v.device)).to(torch.uint8)
    return (stream.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    if not use_triton(v):
        return pack_bits_ref(v, bits)
    c = v.numel()
    nbytes = packed_nbytes(c, bits)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
    if nbytes:
        launch(
            _pack_kernel,
            (triton.cdiv(nbytes, _BLOCK),),
            v,
            packed,
            c,
            nbytes,
            BITS=bits,
            SPAN=-(-8 // bits) + 1,
            BLOCK=_BLOCK,
            num_warps=4,
            device=v.device,
        )
    return packed


_pack_bits_op = register_op("pack_bits", _pack_bits, mutates_args=())


@_pack_bits_op.register_fake
def _(v: torch.Tensor, bits: int) -> torch.Tensor:
    return v.new_empty(packed_nbytes(v.numel(), bits), dtype=torch.uint8)


@no_grad
def pack_bits(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack v (1-D ints, each in [0, 2**bits): not checked on the device) into ceil(c·bits/8) bytes. One launch."""
    check_tensor("pack_bits", "v", v, dtypes=_INT_DTYPES, ndim=1)
    _check_bits("pack_bits", bits)
    return call(_pack_bits_op, _pack_bits, v, bits)


# ----------------------------------------------------------------------------- unpack


@triton.jit
def _unpack_kernel(p_ptr, out_ptr, count, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # entries
    mask = j < count
    bit = j * BITS
    at = bit // 8
    b0 = tl.load(p_ptr + at, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(p_ptr + at + 1, mask=mask & (at + 1 < nbytes), other=0).to(tl.int32)
    b2 = tl.load(p_ptr + at + 2, mask=mask & (at + 2 < nbytes), other=0).to(tl.int32)
    word = b0 | (b1 << 8) | (b2 << 16)
    v = (word >> (bit % 8).to(tl.int32)) & ((1 << BITS) - 1)
    tl.store(out_ptr + j, v.to(out_ptr.dtype.element_ty), mask=mask)


def unpack_bits_ref(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out[j] ← bits j·b .. j·b+b−1 of the packed little-endian stream."""
    c = out.numel()
    if bits == 0:
        out.zero_()
        return
    shifts = torch.arange(8, device=packed.device)
    stream = ((packed.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)[: c * bits]
    weights = 1 << torch.arange(bits, device=packed.device)
    out.copy_((stream.view(c, bits) * weights).sum(dim=1))


def _unpack_bits(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    if not use_triton(packed, out):
        return unpack_bits_ref(packed, bits, out)
    c = out.numel()
    if bits == 0:
        out.zero_()
    elif c:
        launch(
            _unpack_kernel,
            (triton.cdiv(c, _BLOCK),),
            packed,
            out,
            c,
            packed.numel(),
            BITS=bits,
            BLOCK=_BLOCK,
            num_warps=4,
            device=out.device,
        )


_unpack_bits_op = register_op("unpack_bits", _unpack_bits, mutates_args=("out",))


@no_grad
def unpack_bits(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out (1-D ints, c entries) ← the c entries of `bits` bits packed in `packed` (uint8 [ceil(c·bits/8)])."""
    check_tensor("unpack_bits", "out", out, dtypes=_INT_DTYPES, ndim=1)
    _check_bits("unpack_bits", bits)
    want = packed_nbytes(out.numel(), bits)
    check_tensor("unpack_bits", "packed", packed, dtypes=(torch.uint8,), shape=(want,), device=out.device)
    call(_unpack_bits_op, _unpack_bits, packed, bits, out)


__all__ = ["MAX_BITS", "index_bits", "packed_nbytes", "pack_bits", "pack_bits_ref", "unpack_bits", "unpack_bits_ref"]
