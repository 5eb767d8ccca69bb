"""Grad packing around the reduce-scatter of one unit (docs/design.md §11.1, §3).

`pack_grads`: chunk-cat the unit's full grads into the [S, N] reduce-scatter
input, cast to reduce_dtype with the pre-divide fused (optionally accumulating).
`accumulate_grad_shards`: post-divide the reduce-scatter output and add it to
the fp32 grad shard.

All arithmetic is fp32, one rounding per operation (the kernels are launched
with FMA contraction off), so kernel and reference agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hsdp.torch_compat import chunk_cat
from kernels._triton_helpers import from_fp32, to_fp32
from kernels._util import (
    FLOAT_DTYPES,
    call,
    check_shard_sizes,
    check_tensor,
    fail,
    no_grad,
    pow2_divisor,
    register_graph_op,
    register_op,
    unit_items,
)
from kernels.backend import launch, tl, triton, use_triton

_BLOCK = 4096
_ITEM_BLOCK = 2048
_GRAD_DTYPES = FLOAT_DTYPES + (torch.float64,)


# ----------------------------------------------------------------------------- pack_grads


@triton.jit
def _pack_grads_kernel(
    grads_ptr,
    out_ptr,
    items_ptr,
    g0_ptr,
    n_params,
    N,
    scale,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
    NUMEL_ALIGN: tl.constexpr,
    PTR_ALIGN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    # program (item, rank): out[r, off + j] = grad_i.flat[r*sn + j] * scale, 0 past numel_i.
    item = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    i = tl.load(items_ptr + item * 4)
    off = tl.multiple_of(tl.load(items_ptr + item * 4 + 1), ALIGN)
    sn = tl.multiple_of(tl.load(items_ptr + item * 4 + 2), ALIGN)
    start = tl.multiple_of(tl.load(items_ptr + item * 4 + 3), BLOCK)
    # grads_ptr is an int64 table [2, n_params]: data pointers, then numels. All
    # grads share g0's dtype, so the pointer type is known at compile time.
    # The alignment hints (checked on the host) let the GPU use vector loads.
    g_ptr = tl.multiple_of(tl.load(grads_ptr + i).to(g0_ptr.dtype), PTR_ALIGN)
    numel = tl.multiple_of(tl.load(grads_ptr + n_params + i), NUMEL_ALIGN)
    j = start + tl.arange(0, BLOCK)
    in_shard = j < sn
    src = r * sn + j
    g = tl.load(g_ptr + src, mask=in_shard & (src < numel), other=0.0)
    x = to_fp32(g) * scale
    dst = out_ptr + (r * N + off) + j
    if ACCUMULATE:
        x = x + to_fp32(tl.load(dst, mask=in_shard))
    tl.store(dst, from_fp32(x, out_ptr.dtype.element_ty), mask=in_shard)


def _grads_dtype(grads: list[torch.Tensor | None], default: torch.dtype) -> torch.dtype:
    """The one dtype the grads are read in: their common dtype (mixed ones are promoted)."""
    dtype = None
    for g in grads:
        if g is not None:
            dtype = g.dtype if dtype is None else torch.promote_types(dtype, g.dtype)
    return default if dtype is None else dtype


def pack_grads_ref(
    grads: list[torch.Tensor | None], shard_sizes: list[int], out: torch.Tensor, scale: float, accumulate: bool = False
) -> None:
    """out[r, off_i + j] (+)= grads[i].flatten()[r*sn_i + j] * scale (0 past the end), via torch's _chunk_cat.

    _chunk_cat pads dim 0 of each grad to a multiple of S and lays rank r's rows
    at out[r, off_i : off_i + sn_i], which is exactly the dim-0 shard layout.
    """
    S = out.shape[0]
    if out.numel() == 0:
        return
    gdtype = _grads_dtype(grads, out.dtype)
    parts = []
    for g, sn in zip(grads, shard_sizes):
        if sn == 0:  # _chunk_cat rejects empty tensors; they own no columns anyway
            continue
        if g is None:
            parts.append(torch.zeros(S * sn, dtype=gdtype, device=out.device))
        else:
            parts.append(g.reshape(g.shape[0] if g.dim() else 1, -1).to(gdtype))
    # Cast + scale in one rounding: straight into `out` when out is fp32 or the grads'
    # own dtype (torch computes low-precision mul in fp32), else through an fp32 buffer.
    direct = not accumulate and out.dtype in (torch.float32, gdtype)
    buf = out if direct else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    chunk_cat(parts, dim=0, num_chunks=S, out=buf)
    if scale != 1.0:
        buf.mul_(scale)
    if accumulate:
        buf.add_(out)
    if buf is not out:
        out.copy_(buf)


def _pack_grads(
    grads: list[torch.Tensor | None], shard_sizes: list[int], out: torch.Tensor, scale: float, accumulate: bool
) -> None:
    if not use_triton(out, *[g for g in grads if g is not None]):
        return pack_grads_ref(grads, shard_sizes, out, scale, accumulate)
    S, N = out.shape
    table, n_items, align = unit_items(tuple(shard_sizes), out.device, _ITEM_BLOCK)
    if not (n_items and S):
        return
    gdtype = _grads_dtype(grads, out.dtype)
    # Mixed grad dtypes (rare) are promoted first so one pointer type serves all.
    present = [g.to(gdtype).contiguous() for g in grads if g is not None]
    g0 = present[0] if present else out.new_empty(0, dtype=gdtype)
    it = iter(present)
    ptrs, numels = [], []
    for g in grads:
        t = g0 if g is None else next(it)
        ptrs.append(t.data_ptr())  # a None grad reads nothing (numel 0) through a valid pointer
        numels.append(0 if g is None else t.numel())
    grads_table = torch.tensor(ptrs + numels, dtype=torch.int64, device=out.device)
    numel_align = min([pow2_divisor(k) for k in numels] + [16])
    ptr_align = 16 if all(p % 16 == 0 for p in ptrs) else 1
    launch(
        _pack_grads_kernel,
        (n_items, S),
        grads_table,
        out,
        table,
        g0,
        len(grads),
        N,
        scale,
        BLOCK=_ITEM_BLOCK,
        ALIGN=align,
        NUMEL_ALIGN=numel_align,
        PTR_ALIGN=ptr_align,
        ACCUMULATE=accumulate,
        num_warps=4,
        enable_fp_fusion=False,
        device=out.device,
    )
    # The grads (and converted copies in `present`) may be freed once this returns:
    # the caching allocator only reuses their memory for work queued after the kernel.


_pack_grads_op = register_op("pack_grads", _pack_grads, mutates_args=("out",))


@no_grad
def pack_grads(
    grads: Sequence[torch.Tensor | None],
    shard_sizes: list[int],
    out: torch.Tensor,
    scale: float,
    accumulate: bool = False,
) -> None:
    """Chunk-cat a unit's full grads into the reduce-scatter input out [S, N] (reduce_dtype).

    out[r, off_i + j] = grads[i].flatten()[r*sn_i + j] * scale, or 0 past the grad's
    end (None grads are zero); accumulate=True adds into out. Computed in fp32,
    stored in out's dtype. One launch for all grads of the unit.
    """
    check_tensor("pack_grads", "out", out, dtypes=FLOAT_DTYPES, ndim=2)
    S, N = out.shape
    sizes = check_shard_sizes("pack_grads", shard_sizes, N)
    if len(grads) != len(sizes):
        fail(f"pack_grads: {len(grads)} grads but {len(sizes)} shard_sizes")
    if not math.isfinite(scale):
        fail(f"pack_grads: scale must be finite, got {scale}")
    for i, (g, sn) in enumerate(zip(grads, sizes)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor) or g.dtype not in _GRAD_DTYPES or g.device != out.device:
            fail(
                f"pack_grads: grads[{i}] must be None or a float tensor on {out.device}, got "
                f"{g.dtype if isinstance(g, torch.Tensor) else type(g).__name__}"
                f"{' on ' + str(g.device) if isinstance(g, torch.Tensor) else ''}"
            )
        d0 = g.shape[0] if g.dim() else 1
        expect = -(-d0 // S) * (g.numel() // d0) if d0 else 0
        if sn != expect:
            fail(
                f"pack_grads: grads[{i}] of shape {tuple(g.shape)} has dim-0 shards of {expect} elements "
                f"over S={S}, but shard_sizes[{i}] = {sn}"
            )
    call(_pack_grads_op, _pack_grads, list(grads), sizes, out, float(scale), bool(accumulate))


# ----------------------------------------------------------------------------- accumulate_grad_shards


@triton.jit
def _accumulate_kernel(reduced_ptr, shard_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = to_fp32(tl.load(reduced_ptr + offs, mask=mask))
    acc = tl.load(shard_ptr + offs, mask=mask)
    tl.store(shard_ptr + offs, acc + x * scale, mask=mask)


def accumulate_grad_shards_ref(reduced: torch.Tensor, grad_shard: torch.Tensor, scale: float) -> None:
    """grad_shard += reduced.float() * scale (mul then add, two roundings)."""
    tmp = reduced.to(torch.float32, copy=True)
    if scale != 1.0:
        tmp.mul_(scale)
    grad_shard.add_(tmp)


def _accumulate_grad_shards(reduced: torch.Tensor, grad_shard: torch.Tensor, scale: float) -> None:
    if not use_triton(reduced, grad_shard):
        return accumulate_grad_shards_ref(reduced, grad_shard, scale)
    n = reduced.numel()
    if n:
        launch(
            _accumulate_kernel,
            (triton.cdiv(n, _BLOCK),),
            reduced,
            grad_shard,
            n,
            scale,
            BLOCK=_BLOCK,
            num_warps=8,
            enable_fp_fusion=False,
            device=grad_shard.device,
        )


_accumulate_grad_shards_op = register_op(
    "accumulate_grad_shards", _accumulate_grad_shards, mutates_args=("grad_shard",)
)


@no_grad
def accumulate_grad_shards(reduced: torch.Tensor, grad_shard: torch.Tensor, scale: float) -> None:
    """grad_shard (fp32 [N]) += reduced ([N], reduce_dtype) * scale. One launch."""
    check_tensor("accumulate_grad_shards", "reduced", reduced, dtypes=FLOAT_DTYPES, ndim=1)
    check_tensor(
        "accumulate_grad_shards",
        "grad_shard",
        grad_shard,
        dtypes=(torch.float32,),
        shape=reduced.shape,
        device=reduced.device,
    )
    if not math.isfinite(scale):
        fail(f"accumulate_grad_shards: scale must be finite, got {scale}")
    call(_accumulate_grad_shards_op, _accumulate_grad_shards, reduced, grad_shard, float(scale))


# ----------------------------------------------------------------------------- in the compiled graph


def _scale_grad(grad: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    flat = grad.contiguous().view(-1)
    out = torch.empty(1, flat.numel(), dtype=dtype, device=grad.device)
    if flat.numel():
        _pack_grads([flat], [flat.numel()], out, scale, False)  # one grad, one row: cast and scale
    return out.view(grad.shape)


def _scaled_grad_shard(reduced: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.zeros(reduced.shape, dtype=torch.float32, device=reduced.device)
    _accumulate_grad_shards(reduced.contiguous().view(-1), out.view(-1), scale)
    return out


_scale_grad_op = register_graph_op(
    "scale_grad", _scale_grad, lambda grad, dtype, scale: torch.empty(grad.shape, dtype=dtype, device=grad.device)
)
_scaled_grad_shard_op = register_graph_op(
    "scaled_grad_shard",
    _scaled_grad_shard,
    lambda reduced, scale: torch.empty(reduced.shape, dtype=torch.float32, device=reduced.device),
)


def scale_grad(grad: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The reduce-scatter input of the compiled graph: the full grad · scale in reduce_dtype, one rounding
    (pack_grads' kernel). The grad itself when there is nothing to do."""
    if grad.dtype == dtype and scale == 1.0:
        return grad
    return _scale_grad_op(grad, dtype, scale)


def scaled_grad_shard(reduced: torch.Tensor, scale: float) -> torch.Tensor:
    """The compiled graph's grad shard: reduced.float() · scale (accumulate_grad_shards' kernel into
    zeros; autograd then adds it into the held grad in place). `reduced` itself when fp32 and scale 1."""
    if reduced.dtype == torch.float32 and scale == 1.0:
        return reduced
    return _scaled_grad_shard_op(reduced, scale)


__all__ = [
    "pack_grads",
    "pack_grads_ref",
    "accumulate_grad_shards",
    "accumulate_grad_shards_ref",
    "scale_grad",
    "scaled_grad_shard",
]
