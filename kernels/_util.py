"""Shared plumbing for the kernel files: input checks, op registration, the unit work-item table."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F = TypeVar("F", bound=Callable[..., Any])


def fail(msg: str) -> NoReturn:
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
    """Check one argument: a contiguous tensor with the given dtype/shape/device.

    Messages are only formatted on failure: these checks run on every call.
    """
    if not isinstance(t, torch.Tensor):
        fail(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(f"{op}: {name} has dtype {t.dtype}, expected {allowed}")
    if ndim is not None and t.dim() != ndim:
        fail(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and t.shape != shape:
        fail(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if device is not None and t.device != device:
        fail(f"{op}: {name} is on {t.device}, expected {device}")
    # The kernels index flat memory, so every tensor they touch must be dense.
    if not t.is_contiguous():
        fail(f"{op}: {name} must be contiguous")


def check_shard_sizes(op: str, shard_sizes: Sequence[int], total: int) -> list[int]:
    """Validate per-param shard numels against the unit's shard length N; return them as a list."""
    sizes = [int(s) for s in shard_sizes]
    if min(sizes, default=0) < 0:
        fail(f"{op}: shard_sizes must be >= 0, got {sizes[:8]}{'...' if len(sizes) > 8 else ''}")
    if sum(sizes) != total:
        fail(f"{op}: shard_sizes sum to {sum(sizes)}, but the shard length N is {total}")
    return sizes


def no_grad(fn: F) -> F:
    """Run fn without autograd recording (the kernels write into params in place).

    Cheaper than @torch.no_grad() when grad mode is already off, the usual case.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def register_op(name: str, impl: Callable[..., Any], mutates_args: tuple[str, ...]) -> Any:
    """Register impl as the custom op hsdp_kernels::<name>, so torch.compile sees one opaque op."""
    return torch.library.custom_op(f"hsdp_kernels::{name}", impl, mutates_args=mutates_args)


def register_graph_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Register a functional (out-of-place) op hsdp_kernels::<name> for compiled graphs.

    Inductor keeps it as one call in the generated code (the op appears in the graph); the impl
    picks the Triton kernel or the torch reference at run time, by `kernels.backend`.
    """
    op = torch.library.custom_op(f"hsdp_kernels::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


def call(op: Any, impl: Callable[..., Any], *args: Any) -> Any:
    """Run the custom op while torch.compile traces, else impl itself.

    Same code either way; the eager shortcut skips ~40 us of Python dispatcher
    overhead per call that a custom op costs.
    """
    return (op if torch.compiler.is_compiling() else impl)(*args)


def pow2_divisor(x: int, cap: int = 16) -> int:
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
    size and N, a divisibility hint that lets the GPU vectorise loads and stores.
    Cached: the engine calls with the same shard_sizes every step, so the host
    work and the host-to-device copy happen once per unit.
    """
    rows = []
    off = 0
    align = 16
    for i, sn in enumerate(shard_sizes):
        for start in range(0, sn, block):
            rows.append((i, off, sn, start))
        align = min(align, pow2_divisor(off), pow2_divisor(sn))
        off += sn
    align = min(align, pow2_divisor(off))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)
    return table, len(rows), align
