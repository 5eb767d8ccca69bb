"""On gloo, the compiled graph's all-gathers and reduce-scatters run through the eager engine's c10d calls.

Why: torch 2.13's functional collectives (`torch.ops._c10d_functional`, what a compiled graph
calls) take gloo's *coalesced* paths: an all-gather becomes `allgather_into_tensor_coalesced`
(gloo's `AsyncAllgatherCoalescedWork`) and a reduce-scatter `reduce_scatter_tensor_coalesced`
(a clone, an all-reduce and a `LambdaWork`). With those in flight on the shard group while the
sync group all-reduces, a gloo worker thread corrupts the heap in about one run in ten
(`malloc(): unaligned tcache chunk detected`; `scripts/repro_gloo_abort.py` shows it without
torch.compile; docs/results/compile.md). The eager engine's calls (`all_gather_single`,
`reduce_scatter_single`, i.e. gloo's `_allgather_base` / `_reduce_scatter_base`) never did.

So, for CPU tensors only, `route_functional_collectives_to_c10d` registers a CPU kernel for the two
functional ops that issues those c10d calls asynchronously and hands the work to the functional
work registry (`_register_work`), where the graph's `wait_tensor` finds it. The registration (a
process-global patch) and the private c10d names are hsdp/torch_compat.py's. The graph, inductor's
lowering, our passes and the byte census see the same ops as before; only the kernel behind them
on CPU changes. CUDA tensors (NCCL) keep torch's kernel. The all-reduce already took gloo's plain
all-reduce, as eager does; it is routed too (the same c10d call) so that every collective a graph
issues tells hsdp/compile/turns.py that the graph is running — a graph whose first collective is an
all-reduce (a shard group of 1 with replicas that sync grads) would otherwise hold the ranks waiting
for its compile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Optional

import torch
import torch.distributed as dist

from hsdp.comm.groups import _all_gather_single, _reduce_scatter_single
from hsdp.torch_compat import register_cpu_collectives, register_work, resolve_process_group

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


_routed = False
_on_issue: Optional[Callable[[], None]] = None  # called as the next collective is issued (hsdp/compile/turns.py)


def route_functional_collectives_to_c10d() -> None:
    """Register the CPU kernels (once per process; later calls do nothing)."""
    global _routed
    register_cpu_collectives(all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_reduce_inplace)
    _routed = True


def routed() -> bool:
    """Whether this process's CPU graphs issue their collectives through the kernels below."""
    return _routed


@contextlib.contextmanager
def on_next_collective(callback: Callable[[], None]) -> Iterator[None]:
    """Inside the block, `callback()` once, as the first collective a graph issues starts (its code is running)."""
    global _on_issue
    _on_issue = callback
    try:
        yield
    finally:
        _on_issue = None


def _issuing() -> None:
    global _on_issue
    if _on_issue is not None:
        callback, _on_issue = _on_issue, None
        callback()


def all_gather_into_tensor(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """`_c10d_functional.all_gather_into_tensor` on CPU: gloo's `_allgather_base`, async, work registered."""
    _issuing()
    out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]))
    work = _all_gather_single(out, inp.contiguous(), group=resolve_process_group(group_name), async_op=True)
    register_work(out, work)
    return out


def reduce_scatter_tensor(inp: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """`_c10d_functional.reduce_scatter_tensor` on CPU: gloo's `_reduce_scatter_base`, async, work registered."""
    _issuing()
    out = inp.new_empty((inp.shape[0] // group_size, *inp.shape[1:]))
    op = _REDUCE_OPS[reduce_op.lower()]
    work = _reduce_scatter_single(out, inp.contiguous(), op=op, group=resolve_process_group(group_name), async_op=True)
    register_work(out, work)
    return out


def all_reduce_inplace(inp: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """`_c10d_functional.all_reduce_` on CPU: gloo's all-reduce in place, async, work registered."""
    _issuing()
    op = _REDUCE_OPS[reduce_op.lower()]
    work = dist.all_reduce(inp, op=op, group=resolve_process_group(group_name), async_op=True)
    register_work(inp, work)
    return inp


def all_reduce(inp: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """`_c10d_functional.all_reduce` on CPU: the same on a copy (the functional op does not mutate its input)."""
    return all_reduce_inplace(inp.clone(memory_format=torch.contiguous_format), reduce_op, group_name)
