"""Compile time and recompiles of a compiled training step (hsdp compiled and fsdp2 compiled alike)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator

import torch._dynamo.utils


def graphs_captured() -> int:
    """Graphs dynamo has captured so far in this process (one more after the first = a recompile)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class CompileClock:
    """Times the first call of each compiled variant (compile included) and counts later recompiles.

    A variant is whatever selects a compiled function (hsdp: the ReducePlan; fsdp2: one). Its
    first call's wall time is its compile time (the compile dominates it); any graph dynamo
    captures during a later call is a recompile (0 expected: shapes and guards do not change).
    """

    def __init__(self) -> None:
        self.compile_time_s = 0.0
        self.recompiles = 0
        self.seen: set[Hashable] = set()

    @contextlib.contextmanager
    def call(self, variant: Hashable = None) -> Iterator[bool]:
        """Around one call of the compiled step; yields whether it is the variant's first (compiling) call."""
        first = variant not in self.seen
        before, t0 = graphs_captured(), time.perf_counter()
        yield first
        if first:
            self.seen.add(variant)
            self.compile_time_s += time.perf_counter() - t0
        else:
            self.recompiles += graphs_captured() - before

    def stats(self) -> dict[str, float]:
        return {"recompiles": self.recompiles, "compile_time_s": round(self.compile_time_s, 2)}
