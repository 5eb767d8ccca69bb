"""compile.scope=blocks: the eager HSDP engine with each transformer block compiled in place.

This is torch's regional compilation, the way FSDP2 compiled runs (and torchtitan) compile: every block's
forward and backward are inductor graphs, while the gathers, releases, prefetch and reduce-scatters stay the
eager engine's own (hsdp/engines/hsdp.py), around the compiled blocks. The blocks are alike, so dynamo
traces one and the others reuse its graphs (their params are graph inputs, not constants): the compile
costs one block's, at any depth.

What it gives up against compile.scope=step (hsdp/engines/compiled.py): the collectives are not in a graph,
so our passes do not place them (the eager engine's one-unit prefetch overlaps them instead) and the
embedding, head and loss run eagerly. What it keeps: release. The compiled block's saved tensors pass
through the eager engine's saved-tensor hooks at run time (AOTAutograd saves them with save_for_backward
like any autograd.Function), so saved full params become markers, their storage is freed after the
forward, and backward re-gathers them (tests/engine_workers.py's release check, which also finds no saved
copy of a weight). That rests on two behaviours of torch: the hooks are called at run time, not traced
into the graph, and the compiled function saves through save_for_backward (hsdp/torch_compat.py lists
both). Eval forwards run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hsdp.engines.base import Batch
from hsdp.engines.clock import CompileClock, compile_blocks_in_place, graphs_captured
from hsdp.engines.hsdp import HSDPEngine, ShardedUnit


class BlockCompiledHSDPEngine(HSDPEngine):
    """HSDPEngine whose blocks (the units between the embedding and the head) run as compiled graphs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        compile_blocks_in_place([u.module for u in self.units])  # the modules the engine swaps params into
        self.clock = CompileClock()

    def _run_unit(self, unit: ShardedUnit, x: torch.Tensor) -> torch.Tensor:
        """Training forwards run the compiled block; eval forwards (no grad) run it eagerly, as the step scope's
        do: compiled, they would compile a second graph (dynamo guards on grad mode) outside the timed step."""
        if torch.is_grad_enabled():
            return super()._run_unit(unit, x)
        with torch.compiler.set_stance("force_eager"):
            return super()._run_unit(unit, x)

    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """The eager engine's step; its first call compiles the blocks (timed as FSDP2 compiled's is)."""
        with self.clock.call():
            return super().forward_backward(batches)

    def stats(self) -> dict[str, Any]:
        """Compile time (the first step less the second), recompiles during training steps, and every graph
        dynamo captured in the run (`dynamo_graphs_all`: the first step's alone while eval stays eager)."""
        return {**super().stats(), **self.clock.stats(), "dynamo_graphs_all": graphs_captured()}
