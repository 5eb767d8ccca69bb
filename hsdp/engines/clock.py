"""Compile time and recompiles of a compiled training step, and the per-block compile (hsdp compiled and fsdp2
compiled alike)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator, Sequence

import torch
import torch.nn as nn

from hsdp.compile.cache import cpu_options
from hsdp.torch_compat import compiled_graph_count, start_compile_pool_lazily


def graphs_captured() -> int:
    """Graphs dynamo has captured so far in this process (one more after the first = a recompile)."""
    return compiled_graph_count()


def compile_blocks_in_place(units: Sequence[nn.Module]) -> None:
    """Each block (the units between the embedding and the head) compiled in place, as torchtitan does:
    the module object stays (parameter names, an engine's param swaps), its calls run the compiled graphs."""
    options = cpu_options()  # warm compiles load from inductor's caches (hsdp.compile.cache)
    start_compile_pool_lazily()
    for block in units[1:-1]:
        block.compile(fullgraph=True, options=options)


def device_synchronize() -> None:
    """Wait for the work queued on this process's GPU (nothing to wait for on CPU or before CUDA is used)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class CompileClock:
    """Times the compile of each compiled variant and counts later recompiles.

    A variant is whatever selects a compiled function (hsdp: the ReducePlan and micro-step mode; fsdp2:
    one, the whole forward_backward). Its first call compiles and runs the step; its second call only runs
    it. The compile time of a variant is first call − second call (the step's own work is not compile
    time); a run whose variant is called once counts its whole first call. Both timed calls are wall
    clock from an idle device to an idle device (the GPU is synchronized before and after them), so on a
    GPU they hold the step's device work as on a CPU, and the difference is the compile alone, whichever
    engine, device or caching allocator state: without the synchronize the second call would time only
    the kernel launches while the first waits for the compile (and autotuning) to finish. Later calls are
    not synchronized (they only count recompiles). Any graph dynamo captures during a later call is a
    recompile (0 expected: shapes and guards do not change).
    """

    def __init__(self) -> None:
        self.first_call_s: dict[Hashable, float] = {}
        self.second_call_s: dict[Hashable, float] = {}
        self.recompiles = 0
        self.first_call_graphs = 0  # graphs dynamo captured during first calls (the compile's own)

    @property
    def compile_time_s(self) -> float:
        return sum(t - self.second_call_s.get(v, 0.0) for v, t in self.first_call_s.items())

    @contextlib.contextmanager
    def call(self, variant: Hashable = None) -> Iterator[bool]:
        """Around one call of the compiled step; yields whether it is the variant's first (compiling) call."""
        first = variant not in self.first_call_s
        timed = first or variant not in self.second_call_s
        if timed:
            device_synchronize()
        before, t0 = graphs_captured(), time.perf_counter()
        yield first
        if timed:
            device_synchronize()
        elapsed = time.perf_counter() - t0
        if first:
            self.first_call_s[variant] = elapsed
            self.first_call_graphs += graphs_captured() - before
            return
        self.recompiles += graphs_captured() - before
        self.second_call_s.setdefault(variant, elapsed)

    def stats(self) -> dict[str, float]:
        return {
            "recompiles": self.recompiles,
            "dynamo_graphs": self.first_call_graphs,
            "compile_time_s": round(self.compile_time_s, 2),
            "compile_first_call_s": round(sum(self.first_call_s.values()), 2),
        }
