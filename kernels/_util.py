"""Input checks and the per-unit work-item table shared by the kernel files."""

from __future__ import annotations

import functools
from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Check one argument: a contiguous tensor with the given dtype/shape/device."""
    check(isinstance(t, torch.Tensor), f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        check(t.dtype in dtypes, f"{op}: {name} has dtype {t.dtype}, expected {allowed}")
    if ndim is not None:
        check(t.dim() == ndim, f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        check(tuple(t.shape) == shape, f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if device is not None:
        check(t.device == device, f"{op}: {name} is on {t.device}, expected {device}")
    # The kernels index flat memory, so every tensor they touch must be dense.
    check(t.is_contiguous(), f"{op}: {name} must be contiguous")


def check_shard_sizes(op: str, shard_sizes: Sequence[int], total: int) -> tuple[int, ...]:
    """Validate per-param shard numels against the unit's shard length N; return them as a tuple."""
    sizes = tuple(int(s) for s in shard_sizes)
    check(all(s >= 0 for s in sizes), f"{op}: shard_sizes must be >= 0, got {list(sizes)[:8]}...")
    check(sum(sizes) == total, f"{op}: shard_sizes sum to {sum(sizes)}, but the shard length N is {total}")
    return sizes


def _pow2_divisor(x: int, cap: int) -> int:
    """Largest power of two <= cap that divides x (x == 0 counts as divisible)."""
    d = 1
    while d < cap and x % (2 * d) == 0:
        d *= 2
    return d


@functools.lru_cache(maxsize=128)
def unit_items(shard_sizes: tuple[int, ...], device: torch.device, block: int) -> tuple[torch.Tensor, int, int]:
    """Work items for one launch over a whole unit.

    One item per `block`-long chunk of each param's shard, so no program straddles
    two params and none has to search for its param. Returns (table, n_items,
    align): table is int64 [n_items, 4] = (param index, shard offset, shard size,
    chunk start); align is the largest power of two (<= 16) dividing every offset,
    size and N, used as a divisibility hint so the GPU can vectorise loads.
    Cached: the engine calls with the same shard_sizes every step, so the host
    work and the host-to-device copy happen once per unit.
    """
    rows = []
    off = 0
    align = 16
    for i, sn in enumerate(shard_sizes):
        for start in range(0, sn, block):
            rows.append((i, off, sn, start))
        align = min(align, _pow2_divisor(off, 16), _pow2_divisor(sn, 16))
        off += sn
    align = min(align, _pow2_divisor(off, 16))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)
    return table, len(rows), align
