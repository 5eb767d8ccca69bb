"""Chunked top-k selection fused with the error-feedback update, for a sparse sync codec (docs/design.md §8.5).

The flat vector is cut into chunks of `chunk` consecutive elements (the last may
be shorter, len_last = n - (n_chunks-1)·chunk). Chunk c selects
k_c = min(k, len_c) elements:

topk_select:         the k_c elements of largest |acc|, ties broken by the lowest
                     index. |acc| is compared as its fp32 bit pattern with the sign
                     cleared (bits & 0x7FFFFFFF), which orders finite values as
                     |acc| does and makes -0.0 and 0.0 a tie; acc must be finite (inf and
                     NaN order by their bits too, NaN above inf, alike in kernel and reference).
topk_error_feedback: acc = delta + err (fp32, one rounding), select as above, then
                     err <- acc with the selected positions zeroed, so that
                     scatter(vals) + err_new == delta + err_old exactly.
scatter_add_chunks:  out[c·chunk + idx[j]] += vals[j] · scale, c = the chunk of entry j.

Layout, no padding: chunk c's entries are idx[c·k : c·k + k_c] (positions within the
chunk, ascending) and vals (fp32, acc at those positions); only the last chunk can
have k_c < k, so the flat outputs hold (n_chunks-1)·k + k_last entries (`topk_numel`).
idx has the narrowest dtype that holds chunk-1 (`topk_index_dtype`): uint8 for
chunk <= 256, int16 for chunk <= 32768 (int16 rather than uint16, whose torch
support is limited), int32 above; chunk is capped at MAX_CHUNK.

The kernel runs one chunk (or a few short ones, one a row of its register tile)
per warp-sized program: a search over the 31 magnitude bits finds the k_c-th
largest |acc| with a few counting passes (galloping down from the max, then
bisecting; it stops once exactly k_c elements lie at or above the lower bound:
the k_c-th largest is then their minimum), the first (k_c - #larger) elements
equal to it are taken in index order, and one prefix sum (ties and larger
elements counted in one int32) places the selection at ascending positions.
The reference does the same selection with torch.topk on unique int64 keys
(|acc| bits, then the inverted index), so the two agree exactly.
"""

from __future__ import annotations

import torch

from kernels._util import call, check_tensor, fail, next_pow2, no_grad, register_op
from kernels.backend import launch, tl, triton, use_triton

MAX_CHUNK = 8192  # one chunk is one register tile of one program
_SCATTER_BLOCK = 2048
# The selection's tile: ROWS = _TOPK_TILE // next_pow2(chunk) chunks (at least one), a warp per
# _TOPK_WARP_VALUES of them (1 to 8). A chunk of <= 1024 within one warp counts with shuffles alone (no barrier).
_TOPK_TILE = 1024
_TOPK_WARP_VALUES = 1024
_TOPK_ARITY = 2  # pivots a counting pass + 1 (a power of two): 2 (bisection) beat 4 and 8 on an H200


def topk_index_dtype(chunk: int) -> torch.dtype:
    """Narrowest dtype holding chunk-1: uint8 (chunk <= 256), int16 (<= 32768; torch's uint16 is limited), int32."""
    if chunk <= 256:
        return torch.uint8
    if chunk <= 32768:
        return torch.int16
    return torch.int32


def topk_numel(n: int, chunk: int, k: int) -> int:
    """Entries in the flat idx/vals of n elements: k per chunk, min(k, len_last) for the last one."""
    if n == 0:
        return 0
    n_chunks = -(-n // chunk)
    return (n_chunks - 1) * k + min(k, n - (n_chunks - 1) * chunk)


def _check_chunk_k(op: str, chunk: object, k: object) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK:
        fail(f"{op}: chunk must be an int in [1, {MAX_CHUNK}], got {chunk!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= chunk:
        fail(f"{op}: k must be an int in [1, chunk = {chunk}], got {k!r}")


# ----------------------------------------------------------------------------- selection


@triton.jit
def _topk_kernel(
    delta_ptr, err_ptr, idx_ptr, val_ptr, n, chunk, k,
    HAS_ERR: tl.constexpr, ROWS: tl.constexpr, CP: tl.constexpr, ARITY: tl.constexpr,
):  # fmt: skip
    # a [ROWS, CP] tile: ROWS chunks, one a row (CP = next_pow2(chunk)); rows past the last chunk are empty
    c = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, CP)
    start = c * chunk
    length = tl.maximum(tl.minimum(n - start, chunk), 0).to(tl.int32)
    mask = i[None, :] < length[:, None]
    offs = start[:, None] + i[None, :]
    acc = tl.load(delta_ptr + offs, mask=mask, other=0.0)
    if HAS_ERR:
        acc = acc + tl.load(err_ptr + offs, mask=mask, other=0.0)
    bits = acc.to(tl.int32, bitcast=True)  # |acc| is bits & 0x7FFFFFFF, taken where needed (one array live)
    kc = tl.minimum(length, k)
    # thr* = the kc-th largest mag = the largest t with #{mag >= t} >= kc, searched in [lo, hi] with
    # cnt = #{mag >= lo} >= kc: hi starts at max(mag), lo at 0. Each pass counts at ARITY - 1 pivots (independent
    # sums: more work per pass, fewer dependent passes). The first passes gallop down from hi in factors of two
    # of |acc| (hi - step << q: a top-k's k-th largest usually lies within a binade or two of the max), then the
    # pivots cut [lo, hi] in ARITY parts. A row is done when lo == hi (thr* = lo) or cnt == kc (thr* = the least
    # mag >= lo); all rows of the tile go on until each is done (ARITY 2: ~6 passes for 10 of 1024 random values).
    # Padding counts as 0 (never above a pivot > lo).
    hi = tl.max(bits & 0x7FFFFFFF, axis=1)
    lo = tl.zeros([ROWS], dtype=tl.int32)
    cnt = length
    step = tl.full([ROWS], 1 << 23, tl.int32)  # the galloping step; 0 once a pivot held: divide
    todo = tl.max(((cnt != kc) & (lo < hi)).to(tl.int32), axis=0)
    while todo > 0:
        gap = hi - lo
        new_lo, new_cnt, new_hi = lo, cnt, hi
        for q in tl.static_range(1, ARITY):  # pivots ascending, so the held ones (count >= kc) come first
            gallop = tl.maximum(hi - (step << (ARITY - 1 - q)), lo + 1)
            divide = lo + (gap // ARITY) * q + ((gap % ARITY) * q + ARITY - 1) // ARITY  # ceil(q·gap / ARITY)
            pivot = tl.where(gap > 0, tl.where(step > 0, gallop, divide), lo)  # a done row keeps its bounds
            got = tl.sum(((bits & 0x7FFFFFFF) >= pivot[:, None]).to(tl.int32), axis=1)
            held = got >= kc
            new_lo = tl.where(held, pivot, new_lo)
            new_cnt = tl.where(held, got, new_cnt)
            new_hi = tl.where(held, new_hi, tl.minimum(new_hi, pivot - 1))
        step = tl.where(new_lo > lo, 0, tl.minimum(step, 1 << (33 - 2 * ARITY)) << (ARITY - 1))
        lo, cnt, hi = new_lo, new_cnt, new_hi
        todo = tl.max(((cnt != kc) & (lo < hi)).to(tl.int32), axis=0)
    mag = bits & 0x7FFFFFFF
    thr = tl.min(tl.where(mask & (mag >= lo[:, None]), mag, 0x7FFFFFFF), axis=1)
    above = (mask & (mag > thr[:, None])).to(tl.int32)
    tie = (mask & (mag == thr[:, None])).to(tl.int32)
    need = kc - tl.sum(above, axis=1)
    # one scan for both prefix counts (each < 2**16): ties before j (low half), elements above before j (high)
    pre = tl.cumsum(tie | (above << 16), axis=1)
    tie_pre = pre & 0xFFFF
    sel = (above != 0) | ((tie != 0) & (tie_pre <= need[:, None]))  # ties: lowest indices first
    slot = (pre >> 16) + tl.minimum(tie_pre, need[:, None]) - 1  # = #selected at or before j, minus one
    out = c[:, None] * k + slot
    tl.store(idx_ptr + out, i[None, :].to(idx_ptr.dtype.element_ty), mask=sel)
    tl.store(val_ptr + out, acc, mask=sel)
    if HAS_ERR:
        tl.store(err_ptr + offs, tl.where(sel, 0.0, acc), mask=mask)


def _select_ref(acc: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Flat positions (int64, in acc) of the selection, chunk by chunk, ascending within each chunk."""
    n = acc.numel()
    nc = -(-n // chunk)
    # key = (|acc| bits << 32) + (chunk - 1 - i): unique per chunk, larger |acc| first, then lower i
    key = torch.full((nc * chunk,), -1, dtype=torch.int64, device=acc.device)  # padding: below every key
    inv = torch.arange(chunk - 1, -1, -1, dtype=torch.int64, device=acc.device).repeat(nc)[:n]
    key[:n] = ((acc.view(torch.int32) & 0x7FFFFFFF).to(torch.int64) << 32) + inv
    pos = key.view(nc, chunk).topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    pos += torch.arange(0, nc * chunk, chunk, device=acc.device)[:, None]
    return pos.view(-1)[: topk_numel(n, chunk, k)]  # a short last chunk's padding sorts to its end


def _finish_ref(acc: torch.Tensor, pos: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx within the chunk, narrowest dtype; vals = acc[pos])."""
    idx = (pos % chunk).to(topk_index_dtype(chunk))
    return idx, acc[pos]


def topk_select_ref(acc: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk: the min(k, len) largest |acc| (ties: lowest index), positions ascending; (idx, vals)."""
    return _finish_ref(acc, _select_ref(acc, chunk, k), chunk)


def topk_error_feedback_ref(
    delta: torch.Tensor, err: torch.Tensor, chunk: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """acc = delta + err; select as topk_select_ref; err <- acc with the selected positions zeroed."""
    acc = err.add_(delta)  # err + delta == delta + err in fp32
    pos = _select_ref(acc, chunk, k)
    idx, vals = _finish_ref(acc, pos, chunk)
    err[pos] = 0.0
    return idx, vals


def _topk(delta: torch.Tensor, err: torch.Tensor | None, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = delta.numel()
    total = topk_numel(n, chunk, k)
    idx = torch.empty(total, dtype=topk_index_dtype(chunk), device=delta.device)
    vals = torch.empty(total, dtype=torch.float32, device=delta.device)
    if n:
        cp = next_pow2(chunk)
        rows = max(1, _TOPK_TILE // cp)
        warps = min(8, max(1, rows * cp // _TOPK_WARP_VALUES))
        launch(
            _topk_kernel,
            (triton.cdiv(triton.cdiv(n, chunk), rows),),
            delta,
            delta if err is None else err,
            idx,
            vals,
            n,
            chunk,
            k,
            HAS_ERR=err is not None,
            ROWS=rows,
            CP=cp,
            ARITY=_TOPK_ARITY,
            num_warps=warps,
            enable_fp_fusion=False,
            device=delta.device,
        )
    return idx, vals


def _topk_select(acc: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(acc):
        return topk_select_ref(acc, chunk, k)
    return _topk(acc, None, chunk, k)


def _topk_error_feedback(
    delta: torch.Tensor, err: torch.Tensor, chunk: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(delta, err):
        return topk_error_feedback_ref(delta, err, chunk, k)
    return _topk(delta, err, chunk, k)


def _fake_outputs(x: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    total = topk_numel(x.numel(), chunk, k)
    return x.new_empty(total, dtype=topk_index_dtype(chunk)), x.new_empty(total, dtype=torch.float32)


_topk_select_op = register_op("topk_select", _topk_select, mutates_args=())
_topk_select_op.register_fake(_fake_outputs)
_topk_error_feedback_op = register_op("topk_error_feedback", _topk_error_feedback, mutates_args=("err",))


@_topk_error_feedback_op.register_fake
def _(delta: torch.Tensor, err: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_outputs(delta, chunk, k)


@no_grad
def topk_select(acc: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk of fp32 acc [n]: (idx [topk_numel], narrowest int dtype; vals fp32) of the top-k |acc|. One launch."""
    check_tensor("topk_select", "acc", acc, dtypes=(torch.float32,), ndim=1)
    _check_chunk_k("topk_select", chunk, k)
    return call(_topk_select_op, _topk_select, acc, chunk, k)


@no_grad
def topk_error_feedback(
    delta: torch.Tensor, err: torch.Tensor, chunk: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_select of delta + err (fp32 [n]); err (in place) <- delta + err with the selection zeroed. One launch."""
    check_tensor("topk_error_feedback", "delta", delta, dtypes=(torch.float32,), ndim=1)
    check_tensor(
        "topk_error_feedback", "err", err, dtypes=(torch.float32,), shape=tuple(delta.shape), device=delta.device
    )
    _check_chunk_k("topk_error_feedback", chunk, k)
    return call(_topk_error_feedback_op, _topk_error_feedback, delta, err, chunk, k)


# ----------------------------------------------------------------------------- scatter_add_chunks


@triton.jit
def _scatter_add_kernel(idx_ptr, val_ptr, out_ptr, total, n, chunk, k, scale, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < total
    pos = (j // k) * chunk + tl.load(idx_ptr + j, mask=mask, other=0).to(tl.int64)
    v = tl.load(val_ptr + j, mask=mask, other=0.0) * scale
    mask = mask & (pos < n)  # idx past a short last chunk is invalid input; never write out of bounds
    o = tl.load(out_ptr + pos, mask=mask, other=0.0)
    tl.store(out_ptr + pos, o + v, mask=mask)  # one chunk never repeats a position: no write races


def scatter_add_chunks_ref(
    idx: torch.Tensor, vals: torch.Tensor, chunk: int, k: int, out: torch.Tensor, scale: float = 1.0
) -> None:
    """out[c·chunk + idx[j]] += vals[j] * scale, entry j in chunk c = j // k."""
    j = torch.arange(idx.numel(), device=idx.device)
    pos = j.div_(k, rounding_mode="floor").mul_(chunk).add_(idx)
    out.index_add_(0, pos, vals if scale == 1.0 else vals * scale)  # fp32 product first: no fused multiply-add


def _scatter_add_chunks(
    idx: torch.Tensor, vals: torch.Tensor, chunk: int, k: int, out: torch.Tensor, scale: float
) -> None:
    if not use_triton(idx, vals, out):
        return scatter_add_chunks_ref(idx, vals, chunk, k, out, scale)
    total = idx.numel()
    if total:
        launch(
            _scatter_add_kernel,
            (triton.cdiv(total, _SCATTER_BLOCK),),
            idx,
            vals,
            out,
            total,
            out.numel(),
            chunk,
            k,
            float(scale),
            BLOCK=_SCATTER_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
            device=out.device,
        )


_scatter_add_chunks_op = register_op("scatter_add_chunks", _scatter_add_chunks, mutates_args=("out",))


@no_grad
def scatter_add_chunks(
    idx: torch.Tensor, vals: torch.Tensor, chunk: int, k: int, out: torch.Tensor, scale: float = 1.0
) -> None:
    """out (fp32 [n]) += one replica's topk payload (idx, vals) · scale, as laid out by topk_select. One launch.

    For the mean of M replicas call it for m = 0..M-1 in order, then divide out by M.
    idx must be valid (each < its chunk's length, no repeats within a chunk): not checked on the device.
    """
    _check_chunk_k("scatter_add_chunks", chunk, k)
    check_tensor("scatter_add_chunks", "out", out, dtypes=(torch.float32,), ndim=1)
    total = topk_numel(out.numel(), chunk, k)
    dt = topk_index_dtype(chunk)
    check_tensor("scatter_add_chunks", "idx", idx, dtypes=(dt,), shape=(total,), device=out.device)
    check_tensor("scatter_add_chunks", "vals", vals, dtypes=(torch.float32,), shape=(total,), device=out.device)
    call(_scatter_add_chunks_op, _scatter_add_chunks, idx, vals, chunk, k, out, float(scale))


__all__ = [
    "MAX_CHUNK",
    "topk_index_dtype",
    "topk_numel",
    "topk_select",
    "topk_select_ref",
    "topk_error_feedback",
    "topk_error_feedback_ref",
    "scatter_add_chunks",
    "scatter_add_chunks_ref",
]
