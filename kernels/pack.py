"""Shard packing around the all-gather of one unit (docs/design.md §11.1, §3).

copy-in  (`pack_shards`): this rank's fp32 held shards -> its slice of the
                          all-gather buffer, cast to param_dtype.
copy-out (`unpack_full`): the gathered [S, N] buffer (rank-major) -> the flat
                          param-major full buffer, param i as [S, sn_i].
"""

from __future__ import annotations

import torch

from kernels._triton_helpers import from_fp32
from kernels._util import (
    FLOAT_DTYPES,
    call,
    check_shard_sizes,
    check_tensor,
    no_grad,
    register_graph_op,
    register_op,
    unit_items,
)
from kernels.backend import launch, tl, triton, use_triton

_BLOCK = 4096  # elements per program for the flat cast-copy
_ITEM_BLOCK = 2048  # elements per work item (one param chunk on one rank) for unpack


# ----------------------------------------------------------------------------- pack_shards


@triton.jit
def _pack_shards_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, from_fp32(x, dst_ptr.dtype.element_ty), mask=mask)  # bf16: RNE, as torch


def pack_shards_ref(held: torch.Tensor, out: torch.Tensor) -> None:
    """out = held cast to out.dtype."""
    out.copy_(held)


def _pack_shards(held: torch.Tensor, out: torch.Tensor) -> None:
    if not use_triton(held, out):
        return pack_shards_ref(held, out)
    n = held.numel()
    if n:
        launch(
            _pack_shards_kernel, (triton.cdiv(n, _BLOCK),), held, out, n, BLOCK=_BLOCK, num_warps=8, device=out.device
        )


_pack_shards_op = register_op("pack_shards", _pack_shards, mutates_args=("out",))


@no_grad
def pack_shards(held: torch.Tensor, out: torch.Tensor) -> None:
    """Copy-in: out[:] = held (fp32 [N]) cast to out's param_dtype ([N]). One launch."""
    check_tensor("pack_shards", "held", held, dtypes=(torch.float32,), ndim=1)
    check_tensor("pack_shards", "out", out, dtypes=FLOAT_DTYPES, shape=held.shape, device=held.device)
    call(_pack_shards_op, _pack_shards, held, out)


# ----------------------------------------------------------------------------- unpack_full


@triton.jit
def _unpack_full_kernel(src_ptr, dst_ptr, items_ptr, N, S, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # program (item, rank r): copy r's chunk of one param's shard; it is contiguous
    # on both sides: src[r, off + j] -> dst[S*off + r*sn + j].
    item = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    off = tl.multiple_of(tl.load(items_ptr + item * 4 + 1), ALIGN)
    sn = tl.multiple_of(tl.load(items_ptr + item * 4 + 2), ALIGN)
    start = tl.multiple_of(tl.load(items_ptr + item * 4 + 3), BLOCK)
    j = start + tl.arange(0, BLOCK)
    mask = j < sn
    x = tl.load(src_ptr + (r * N + off) + j, mask=mask)
    tl.store(dst_ptr + (S * off + r * sn) + j, x, mask=mask)


def unpack_full_ref(gathered: torch.Tensor, shard_sizes: list[int], out: torch.Tensor) -> None:
    """Split gathered [S, N] by columns; param i's columns go to out[S*off_i : S*(off_i+sn_i)] viewed [S, sn_i]."""
    S = gathered.shape[0]
    views = []
    off = 0
    for sn in shard_sizes:
        views.append(out[S * off : S * (off + sn)].view(S, sn))
        off += sn
    torch.split_with_sizes_copy(gathered, shard_sizes, dim=1, out=views)


def _unpack_full(gathered: torch.Tensor, shard_sizes: list[int], out: torch.Tensor) -> None:
    if not use_triton(gathered, out):
        return unpack_full_ref(gathered, shard_sizes, out)
    S, N = gathered.shape
    table, n_items, align = unit_items(tuple(shard_sizes), out.device, _ITEM_BLOCK)
    if n_items and S:
        launch(
            _unpack_full_kernel,
            (n_items, S),
            gathered,
            out,
            table,
            N,
            S,
            BLOCK=_ITEM_BLOCK,
            ALIGN=align,
            num_warps=4,
            device=out.device,
        )


_unpack_full_op = register_op("unpack_full", _unpack_full, mutates_args=("out",))


@no_grad
def unpack_full(gathered: torch.Tensor, shard_sizes: list[int], out: torch.Tensor) -> None:
    """Copy-out: gathered [S, N] (rank-major) -> out [S*N] (param-major, param i as [S, sn_i]).

    Pure copy, one launch for the whole unit.
    """
    check_tensor("unpack_full", "gathered", gathered, dtypes=FLOAT_DTYPES, ndim=2)
    S, N = gathered.shape
    sizes = check_shard_sizes("unpack_full", shard_sizes, N)
    check_tensor("unpack_full", "out", out, dtypes=(gathered.dtype,), shape=(S * N,), device=gathered.device)
    call(_unpack_full_op, _unpack_full, gathered, sizes, out)


# ----------------------------------------------------------------------------- in the compiled graph


def _cast_shard(held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(held.shape, dtype=dtype, device=held.device)
    _pack_shards(held.contiguous(), out)
    return out


_cast_shard_op = register_graph_op(
    "cast_shard", _cast_shard, lambda held, dtype: torch.empty(held.shape, dtype=dtype, device=held.device)
)


def cast_shard(held: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The all-gather input of the compiled graph: the fp32 held shard cast to param_dtype (pack_shards'
    kernel, out of place). The held shard itself when no cast is needed."""
    return held if held.dtype == dtype else _cast_shard_op(held, dtype)


__all__ = ["pack_shards", "pack_shards_ref", "unpack_full", "unpack_full_ref", "cast_shard"]
