"""One replica's SparseLoCo payload added into the mean's sum in one launch (docs/design.md §8.5).

decode_topk_int2_add: for entry j of a top-k payload whose values are int2 and whose indices are bit-packed
                      (b bits each), with c = j // k its chunk:
                          i      = bits j·b .. j·b+b−1 of the index stream        (kernels/bitpack.py)
                          v      = ±table[j // block, bit 0 of code j]             (kernels/quant2.py)
                          out[c·chunk + i] += v;   senders[c·chunk + i] += 1 (if given)
                      Unpack + dequantize + scatter-add fused: the three separate launches' result, bit for
                      bit (each element gets one fp32 add). Call it for m = 0..M−1 in order, then divide.

One chunk never repeats a position, so entries of one payload never write the same element: no races.
"""

from __future__ import annotations

from typing import Optional

import torch

from kernels._util import call, check_tensor, fail, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton
from kernels.bitpack import MAX_BITS, packed_nbytes, unpack_bits_ref
from kernels.quant2 import _decode_ref
from kernels.topk import MAX_CHUNK, scatter_add_chunks_ref, topk_numel

_BLOCK = 1024  # entries per program


@triton.jit
def _decode_add_kernel(
    pi_ptr, pv_ptr, table_ptr, out_ptr, senders_ptr, total, n, nbytes_idx, chunk, k, block,
    BITS: tl.constexpr, HAS_SENDERS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < total
    # the index: up to three bytes of the little-endian bit stream
    bit = j * BITS
    at = bit // 8
    b0 = tl.load(pi_ptr + at, mask=mask & (at < nbytes_idx), other=0).to(tl.int32)
    b1 = tl.load(pi_ptr + at + 1, mask=mask & (at + 1 < nbytes_idx), other=0).to(tl.int32)
    b2 = tl.load(pi_ptr + at + 2, mask=mask & (at + 2 < nbytes_idx), other=0).to(tl.int32)
    idx = ((b0 | (b1 << 8) | (b2 << 16)) >> (bit % 8).to(tl.int32)) & ((1 << BITS) - 1)
    # the value: a 2-bit code and its block's level
    code = (tl.load(pv_ptr + j // 4, mask=mask, other=0).to(tl.int32) >> ((j % 4) * 2).to(tl.int32)) & 3
    level = tl.load(table_ptr + 2 * (j // block) + (code & 1), mask=mask, other=0.0)
    v = tl.where((code & 2) != 0, -level, level)
    pos = (j // k) * chunk + idx.to(tl.int64)
    mask = mask & (pos < n)  # an index past a short last chunk is invalid input: never write out of bounds
    o = tl.load(out_ptr + pos, mask=mask, other=0.0)
    tl.store(out_ptr + pos, o + v, mask=mask)
    if HAS_SENDERS:
        s = tl.load(senders_ptr + pos, mask=mask, other=0.0)
        tl.store(senders_ptr + pos, s + 1.0, mask=mask)


def decode_topk_int2_add_ref(
    packed_idx: torch.Tensor,
    packed_vals: torch.Tensor,
    table: torch.Tensor,
    bits: int,
    chunk: int,
    k: int,
    block: int,
    out: torch.Tensor,
    senders: Optional[torch.Tensor],
) -> None:
    """The three steps by their references: unpack the indices, decode the values, scatter-add them."""
    total = topk_numel(out.numel(), chunk, k)
    idx = torch.empty(total, dtype=torch.int64, device=out.device)
    unpack_bits_ref(packed_idx, bits, idx)
    vals = _decode_ref(packed_vals, table, block, total)
    scatter_add_chunks_ref(idx, vals, chunk, k, out)
    if senders is not None:
        scatter_add_chunks_ref(idx, torch.ones_like(vals), chunk, k, senders)


def _decode_topk_int2_add(
    packed_idx: torch.Tensor,
    packed_vals: torch.Tensor,
    table: torch.Tensor,
    bits: int,
    chunk: int,
    k: int,
    block: int,
    out: torch.Tensor,
    senders: Optional[torch.Tensor],
) -> None:
    if not use_triton(packed_idx, packed_vals, table, out):
        return decode_topk_int2_add_ref(packed_idx, packed_vals, table, bits, chunk, k, block, out, senders)
    total = topk_numel(out.numel(), chunk, k)
    if total:
        launch(
            _decode_add_kernel,
            (triton.cdiv(total, _BLOCK),),
            packed_idx,
            packed_vals,
            table,
            out,
            out if senders is None else senders,
            total,
            out.numel(),
            packed_idx.numel(),
            chunk,
            k,
            block,
            BITS=bits,
            HAS_SENDERS=senders is not None,
            BLOCK=_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
            device=out.device,
        )


_decode_op = register_op("decode_topk_int2_add", _decode_topk_int2_add, mutates_args=("out", "senders"))


@no_grad
def decode_topk_int2_add(
    packed_idx: torch.Tensor,
    packed_vals: torch.Tensor,
    table: torch.Tensor,
    bits: int,
    chunk: int,
    k: int,
    block: int,
    out: torch.Tensor,
    senders: Optional[torch.Tensor] = None,
) -> None:
    """out (fp32 [n]) += one replica's top-k payload (bit-packed indices, int2 values + level table); senders
    (fp32 [n], optional) += 1 where it sent. One launch. Indices must be valid (not checked on the device)."""
    if not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK or not isinstance(k, int) or not 1 <= k <= chunk:
        fail(f"decode_topk_int2_add: chunk must be in [1, {MAX_CHUNK}] and k in [1, chunk], got {chunk}, {k}")
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS or (1 << bits) < chunk:
        fail(f"decode_topk_int2_add: bits must hold an index of a chunk of {chunk} (<= {MAX_BITS}), got {bits!r}")
    if not isinstance(block, int) or block < 4 or block % 4:
        fail(f"decode_topk_int2_add: block must be a multiple of 4, got {block!r}")
    check_tensor("decode_topk_int2_add", "out", out, dtypes=(torch.float32,), ndim=1)
    total = topk_numel(out.numel(), chunk, k)
    dev = out.device
    u8 = (torch.uint8,)
    check_tensor("decode_topk_int2_add", "packed_idx", packed_idx, dtypes=u8, shape=(packed_nbytes(total, bits),))
    check_tensor("decode_topk_int2_add", "packed_vals", packed_vals, dtypes=u8, shape=((total + 3) // 4,), device=dev)
    nb = -(-total // block)
    check_tensor("decode_topk_int2_add", "table", table, dtypes=(torch.float32,), shape=(2 * nb,), device=dev)
    if senders is not None:
        check_tensor("decode_topk_int2_add", "senders", senders, dtypes=(torch.float32,), shape=tuple(out.shape))
    call(_decode_op, _decode_topk_int2_add, packed_idx, packed_vals, table, bits, chunk, k, block, out, senders)


__all__ = ["decode_topk_int2_add", "decode_topk_int2_add_ref"]
