"""The compiled HSDP engine: the step's forward+backward as torch.compile (inductor) graphs.

Same units, held shards, optimizer params and sync policy as the eager engine
(it is one, with `forward_backward` replaced); eval forwards stay eager. One
compiled function per reduce variant (`ReducePlan`: grad-sync steps all-reduce
across replicas, local steps do not), each compiled once with fullgraph=True:
a run compiles at most two pairs of graphs (forward + backward each; with
grad accumulation up to three more, see below) and should
never recompile; `stats()` reports both counts and the compile time.

Grad accumulation (`set_reduce_grads(False)` on non-final micro-steps): those
micro-steps run a variant whose backward reduces nothing and sums the full
grads into a per-bucket accumulator; the final micro-step's variant adds that
sum before its one reduce-scatter. So the compiled path sends the eager
engine's bytes for any optim.grad_accum (up to 3 more graph pairs are compiled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from functools import partial
from typing import Any, Optional

import torch

from hsdp.compile.cache import cpu_options
from hsdp.compile.census import CollectiveCensus
from hsdp.compile.gloo import route_functional_collectives_to_c10d
from hsdp.compile.graph import Groups, plan_buckets, sharded_loss, unit_runs
from hsdp.compile.passes import CacheablePass, OurPasses, inductor_overlap_options, recompute_gathers, schedule_of_code
from hsdp.compile.turns import CompileTurns
from hsdp.config.schema import CompileConfig, Config
from hsdp.core.layout import ReducePlan
from hsdp.engines.base import Batch
from hsdp.engines.clock import CompileClock
from hsdp.engines.hsdp import HSDPEngine
from hsdp.torch_compat import (
    allow_autograd_functions_in_aot_cache,
    capture_output_code,
    compile_backward_with_forward,
    inductor_keeps_collective_order,
    keep_region_inputs_undonated,
    name_process_group,
    start_compile_pool_lazily,
)

# What the compiled graphs call the rank's shard, sync and replicate groups (registered under these names in
# each process).
GRAPH_GROUP_NAMES = {"shard": "hsdp.shard", "sync": "hsdp.sync", "replicate": "hsdp.replicate"}

Variant = tuple[ReducePlan, str]  # (how grads are reduced, reduce | accumulate | reduce_pending)


class CompiledHSDPEngine(HSDPEngine):
    """HSDPEngine whose training forward+backward runs as compiled graphs with the collectives inside."""

    def __init__(self, *args: Any, compile_cfg: CompileConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile_cfg = compile_cfg or CompileConfig(enabled=True)
        if self.mesh.device.type == "cpu":  # gloo: the graph's collectives on the eager engine's c10d calls
            route_functional_collectives_to_c10d()
        groups = self.mesh.comm.groups
        shard, sync, world = groups["shard"], groups["sync"], groups["world"]
        assert shard is not None and sync is not None and world is not None  # the mesh's own (build_mesh)
        # The graphs name the groups by role (GRAPH_GROUP_NAMES), not by c10d's name of each rank's group: the
        # ranks of every shard group then trace the same graphs, and one rank per machine compiles them.
        self.groups = Groups(
            name_process_group(GRAPH_GROUP_NAMES["shard"], shard),
            self.mesh.shard_size,
            name_process_group(GRAPH_GROUP_NAMES["sync"], sync),
            self.mesh.sync_size,
            *self._replicate_group(),
        )
        # Leaves that share storage with the held shards; their .grad is the grad shard, so the compiled
        # backward's output accumulates straight into it (AccumulateGrad adds in place into a set .grad).
        self.leaves = [u.held_flat.detach().requires_grad_(True) for u in self.units]
        for leaf, u in zip(self.leaves, self.units):
            leaf.grad = u.grad_flat
        self.census = CollectiveCensus(labels={name: role for role, name in GRAPH_GROUP_NAMES.items()})
        # Units per all-gather: neighbours share one up to compile.bucket_mb (0: one unit each).
        # Each unit's forward in the graph; compile.regional: identical blocks share one compiled region.
        self.runs = unit_runs([(u.module, u.layout) for u in self.units], self.compile_cfg.regional)
        self.buckets = plan_buckets([u.layout for u in self.units], self.param_dtype, self.compile_cfg.bucket_mb)
        self._compiled: dict[Variant, Any] = {}
        self.accs: Optional[list[torch.Tensor]] = None  # gradient-accumulation leaves (see _accumulators)
        self.generated_code: list[str] = []  # inductor's output code of every graph compiled, in order
        self.clock = CompileClock()
        # One compile per machine: the first rank here compiles, the others (of any shard group) load its graphs.
        self.turns = CompileTurns(world)

    def _replicate_group(self) -> tuple[str, int]:
        """(graph name, size) of the in-site replicate group; ("", 1) on a two-level mesh (no such group)."""
        group = self.mesh.comm.groups.get("replicate")
        if group is None:
            return "", 1
        return name_process_group(GRAPH_GROUP_NAMES["replicate"], group), self.mesh.replicate_size

    @classmethod
    def config_kwargs(cls, cfg: Config) -> dict[str, Any]:
        return {"compile_cfg": cfg.compile}

    # ------------------------------------------------------------ compile
    def _step_fn(self, variant: Variant):
        """The compiled loss function of this variant (compiled on first use)."""
        if variant not in self._compiled:
            units = [(u.module, u.layout) for u in self.units]
            plan, _ = variant
            fn = partial(
                sharded_loss,
                units,
                param_dtype=self.param_dtype,
                groups=self.groups,
                plan=plan,
                buckets=self.buckets,
                runs=self.runs,
            )
            # dynamic=False: the variants trace the same code, and dynamo would otherwise make the
            # divide factors that differ between them symbolic ("automatic dynamic") on a later compile.
            self._compiled[variant] = torch.compile(fn, fullgraph=True, dynamic=False, options=self._inductor_options())
        return self._compiled[variant]

    def _inductor_options(self) -> dict[str, Any]:
        """Our joint pass always (release); who schedules the collectives is compile.passes."""
        # Cacheable passes (stable uuids): a warm compile loads the graphs from inductor's FX graph and
        # AOTAutograd caches; the census then comes from its sidecar (hsdp.compile.census).
        allow_autograd_functions_in_aot_cache()  # _GatherShards (hsdp.compile.cache, point 2)
        compile_backward_with_forward()  # the entry is written before the ranks that wait load it (point 5)
        start_compile_pool_lazily()
        keep_region_inputs_undonated()  # compile.regional: torch 2.13 donates a region's input grad (wrong grads)
        options: dict[str, Any] = {"joint_custom_pre_pass": CacheablePass(recompute_gathers), **cpu_options()}
        if self.compile_cfg.passes == "ours":
            options["post_grad_custom_post_pass"] = OurPasses(self.census, self.compile_cfg.prefetch)
            options["reorder_for_peak_memory"] = False  # it would undo our prefetch in the generated code
        else:
            options["post_grad_custom_post_pass"] = self.census
        if self.compile_cfg.passes == "inductor":
            options.update(inductor_overlap_options(self.compile_cfg.bucket_mb))
        else:  # ours, or none (the traced order): inductor's own overlap pass (torch >= 2.15) moves nothing
            options.update(inductor_keeps_collective_order())
        return options

    # ------------------------------------------------------------ the step
    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Each micro-batch through the compiled forward and backward; grads reduced once, on the last."""
        total = torch.zeros((), device=self.mesh.device)
        for i, (x, y) in enumerate(batches):
            self.set_reduce_grads(i == len(batches) - 1)
            total += self.micro_step(x, y, len(batches))
        return total

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, n_micro: int) -> torch.Tensor:
        """One micro-batch: accumulate its full grads (set_reduce_grads(False)) or reduce them with what
        earlier micro-steps accumulated; bytes counted from the compiled graphs."""
        kwargs: dict[str, Any] = {}
        if not self.reduce_grads:
            mode = "accumulate"
            kwargs["accs"] = self._accumulators()
        elif self.accs is not None and self.accs[0].grad is not None:
            mode = "reduce_pending"
            kwargs["pendings"] = [acc.grad for acc in self.accs]
            for acc in self.accs:
                acc.grad = None  # the sum is handed over: freed once this backward used it
        else:
            mode = "reduce"
        variant: Variant = (self.plan, mode)
        fn = self._step_fn(variant)
        self.census.current = variant
        with self.clock.call(variant) as first, capture_output_code(self._on_code if first else None):
            with self.turns.first_call() if first else contextlib.nullcontext():
                loss = fn(self.leaves, x, y, **kwargs) / n_micro
            with self.turns.first_call() if first else contextlib.nullcontext():
                loss.backward()  # its graph may compile now (AOTAutograd compiles it lazily where shapes are dynamic)
        self.census.current = None
        self._count_bytes(variant)
        return loss.detach()

    def _on_code(self, code: str) -> None:
        """Inductor produced (or loaded from its cache) one graph's code: keep it and file its census."""
        self.generated_code.append(code)
        self.census.on_code(code)

    def _accumulators(self) -> list[torch.Tensor]:
        """One leaf per bucket, of its gathered size, whose .grad sums the micro-steps' full grads.

        Its value is never read: a single zero expanded to the size, so only the grad takes memory
        (the eager engine's packed reduce-scatter input, [S, N] in reduce_dtype).
        """
        if self.accs is None:
            sizes = [self.mesh.shard_size * sum(self.units[u].layout.N for u in b) for b in self.buckets]
            one = torch.zeros(1, dtype=self.reduce_dtype, device=self.mesh.device)
            self.accs = [one.expand(n).requires_grad_(True) for n in sizes]
        return self.accs

    def _count_bytes(self, variant: Variant) -> None:
        """Add what the compiled forward+backward of `variant` sent (read off its graphs at compile time)."""
        for label, op, nbytes in self.census.per_call(variant):
            self.mesh.comm.count(label, op, nbytes)

    def artifacts(self) -> dict[str, str]:
        """schedule.txt, and inductor's generated code of each graph (what the schedule was read from)."""
        code = {f"compiled/graph{i}.py": c for i, c in enumerate(self.generated_code)}
        return {"schedule.txt": schedule_text(self), **code}

    def stats(self) -> dict[str, Any]:
        """summary.json: graph and recompile counts, compile time, and what each graph does."""
        graphs = [g for p in self._compiled for g in self.census.graphs.get(p, [])]
        return {
            "compile_graphs": len(graphs),
            **self.clock.stats(),
            "compile_cache_hits": self.census.cache_hits,
            "buckets": self.buckets,
            "compiled": [
                {
                    "graph": g.kind,
                    "all_gathers": g.count("all_gather"),
                    "reduce_scatters": g.count("reduce_scatter"),
                    "all_reduces": g.count("all_reduce"),
                    "saved_full_params": g.saved_gathered,
                    "max_full_params_alive": g.max_alive,
                }
                for g in graphs
            ],
        }


def schedule_text(engine: CompiledHSDPEngine) -> str:
    """schedule.txt: per compiled graph, its collective starts/waits and compute, as generated."""
    out = []
    graphs = [g for p in engine._compiled for g in engine.census.graphs.get(p, [])]
    for i, code in enumerate(engine.generated_code):
        kind = graphs[i].kind if i < len(graphs) else "graph"
        out.append(f"# graph {i} ({kind}), passes={engine.compile_cfg.passes}, prefetch={engine.compile_cfg.prefetch}")
        out.extend(schedule_of_code(code))
        out.append("")
    return "\n".join(out)
