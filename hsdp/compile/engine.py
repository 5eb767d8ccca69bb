"""The compiled HSDP engine: the step's forward+backward as torch.compile (inductor) graphs.

Same units, held shards, optimizer params and sync policy as the eager engine
(it is one, with `forward_backward` replaced); eval forwards stay eager. One
compiled function per reduce variant (`ReducePlan`: grad-sync steps all-reduce
across replicas, local steps do not), each compiled once with fullgraph=True:
a run compiles at most two graphs pairs (forward + backward each) and should
never recompile; `stats()` reports both counts and the compile time.

Grad accumulation: each micro-step's backward reduce-scatters its grads (as
SimpleFSDP/torchtitan do), so with optim.grad_accum > 1 the compiled path
sends grad_accum × the eager engine's reduce-scatter bytes; results agree.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Sequence

import torch
import torch._dynamo

from hsdp.collectives import ReducePlan
from hsdp.compile.graph import Groups, sharded_loss
from hsdp.compile.passes import CollectiveCensus, recompute_gathers
from hsdp.config import CompileConfig, Config
from hsdp.engine import Batch
from hsdp.mesh import Mesh
from hsdp.shard import HSDPEngine


class CompiledHSDPEngine(HSDPEngine):
    """HSDPEngine whose training forward+backward runs as compiled graphs with the collectives inside."""

    def __init__(self, *args: Any, compile_cfg: CompileConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.compile_cfg = compile_cfg or CompileConfig(enabled=True)
        groups = self.mesh.comm.groups
        self.groups = Groups(groups["shard"].group_name, self.mesh.shard_size, groups["sync"].group_name,
                             self.mesh.sync_size)
        # Leaves that share storage with the held shards; their .grad is the grad shard, so the compiled
        # backward's output accumulates straight into it (AccumulateGrad adds in place into a set .grad).
        self.leaves = [u.held_flat.detach().requires_grad_(True) for u in self.units]
        for leaf, u in zip(self.leaves, self.units):
            leaf.grad = u.grad_flat
        self.census = CollectiveCensus(labels=dict(self.mesh.comm.labels))
        self._compiled: dict[ReducePlan, Any] = {}
        self._frames: dict[ReducePlan, int] = {}
        self.compile_time_s = 0.0
        self.recompiles = 0

    @classmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> "CompiledHSDPEngine":
        engine = super().from_config(cfg, mesh)
        engine.compile_cfg = cfg.compile
        return engine

    # ------------------------------------------------------------ compile
    def _step_fn(self, plan: ReducePlan):
        """The compiled loss function of this reduce variant (compiled on first use)."""
        if plan not in self._compiled:
            units = [(u.module, u.layout) for u in self.units]
            fn = partial(sharded_loss, units, param_dtype=self.param_dtype, groups=self.groups, plan=plan)
            self._compiled[plan] = torch.compile(fn, fullgraph=True, options=self._inductor_options())
        return self._compiled[plan]

    def _inductor_options(self) -> dict[str, Any]:
        return {
            "joint_custom_pre_pass": recompute_gathers,  # release: backward re-gathers full params
            # A plain-callable pass also keeps inductor's FX cache out, so the census sees every compile.
            "post_grad_custom_post_pass": self.census,
        }

    # ------------------------------------------------------------ the step
    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Each micro-batch through the compiled forward and backward; bytes counted from the graphs."""
        plan = self.plan
        fn = self._step_fn(plan)
        total = torch.zeros((), device=self.mesh.device)
        for x, y in batches:
            first = plan not in self._frames
            frames_before = _frames_compiled()
            t0 = time.perf_counter()
            self.census.current = plan
            loss = fn(self.leaves, x, y) / len(batches)
            loss.backward()
            self.census.current = None
            compiled_now = _frames_compiled() - frames_before
            if first:
                self._frames[plan] = compiled_now
                self.compile_time_s += time.perf_counter() - t0
            elif compiled_now:
                self.recompiles += compiled_now
            self._count_bytes(plan)
            total += loss.detach()
        return total

    def _count_bytes(self, plan: ReducePlan) -> None:
        """Add what the compiled forward+backward of `plan` sent (read off its graphs at compile time)."""
        for label, op, nbytes in self.census.per_call(plan):
            self.mesh.comm.count(label, op, nbytes)

    def set_reduce_grads(self, reduce: bool) -> None:
        """Every micro-step reduces in the compiled path (see the module doc)."""

    def stats(self) -> dict[str, Any]:
        return {"compile_graphs": sum(len(self.census.graphs.get(p, [])) for p in self._compiled),
                "compiled_variants": len(self._compiled), "recompiles": self.recompiles,
                "compile_time_s": round(self.compile_time_s, 2)}


def _frames_compiled() -> int:
    """Frames dynamo has compiled so far in this process (a new one after the first = a recompile)."""
    return torch._dynamo.utils.counters["frames"]["ok"]
