"""Sync policies across the sync group (DESIGN §2): warmup grad sync, periodic param sync.

    step s < warmup_steps        grads averaged across replicas (exact HSDP)
    after the update of step s   fragment f syncs iff s >= warmup and
                                 (s + 1 − warmup − (f+1)·every/P) % every == 0

Param sync of a fragment, per unit's held shard θ_m (fp32):
    average:  θ_m ← mean_m θ_m                           (one all-reduce)
    diloco:   Δ = θ_g − mean_m θ_m;  b = μ·b + Δ (b = Δ on the first sync)
              θ_g ← θ_g − η·(Δ + μ·b) (nesterov) or θ_g − η·b;  θ_m ← θ_g
    int8:     Δ_m = θ_g − θ_m travels as int8 + one fp32 scale per block
              (all-gather), dequantized and averaged in fp32; then the outer
              step (average + int8 is the outer step with η = 1, μ = 0).
θ_g and b are fp32 buffers the size of the held shard (4 bytes/element each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hsdp.comm import Comm
from hsdp.config import SyncConfig, outer_hyperparams
from kernels.outer import compute_delta, outer_step
from kernels.quant import dequantize_mean, quantize_int8


def grad_sync_due(step: int, cfg: SyncConfig) -> bool:
    """Grads are averaged across the sync group on step s iff s < warmup_steps (None: always)."""
    return cfg.warmup_steps is None or step < cfg.warmup_steps


def fragments_due(step: int, cfg: SyncConfig) -> list[int]:
    """The fragments whose params sync after the local update of `step`."""
    if cfg.warmup_steps is None or step < cfg.warmup_steps:
        return []
    P, H = cfg.fragments, cfg.every
    return [f for f in range(P) if (step + 1 - cfg.warmup_steps - (f + 1) * H // P) % H == 0]


def steps_after_last_sync(steps: int, cfg: SyncConfig) -> int:
    """How many final steps of a `steps`-step run come after some fragment's last param sync.

    0 means the run ends on a full sync, so the final model (and val loss) is θ_g;
    otherwise it is each replica's local model. With warmup_steps None it is 0 (exact HSDP).
    """
    if cfg.warmup_steps is None or steps <= cfg.warmup_steps:
        return 0
    last = [max((s for s in range(cfg.warmup_steps, steps) if f in fragments_due(s, cfg)), default=-1)
            for f in range(cfg.fragments)]
    return steps - 1 - min(last)


@dataclass
class _OuterState:
    """θ_g and outer momentum b for one unit's held shard."""

    global_params: torch.Tensor
    momentum: Optional[torch.Tensor] = None  # allocated on the first sync


class SyncPolicy:
    """Decides, each step, whether grads or params cross the sync group, and does the param sync."""

    def __init__(self, cfg: SyncConfig, held: list[torch.Tensor], comm: Comm) -> None:
        self.cfg = cfg
        self.held = held  # each unit's flat fp32 held shard (updated in place)
        self.comm = comm
        self.M = comm.size("sync")
        self.lr, self.mu = outer_hyperparams(cfg)
        self.uses_global = cfg.method == "diloco" or cfg.quantize == "int8"
        self.outer: list[Optional[_OuterState]] = [None] * len(held)
        # Units are dealt round-robin into fragments.
        self.fragments = [list(range(f, len(held), cfg.fragments)) for f in range(cfg.fragments)]
        if cfg.warmup_steps == 0:
            self._start_global_copy()

    def grad_sync(self, step: int) -> bool:
        return grad_sync_due(step, self.cfg)

    def after_step(self, step: int) -> bool:
        """Called after the local update of `step`; returns True if any params were synced."""
        if self.cfg.warmup_steps is not None and step == self.cfg.warmup_steps - 1:
            self._start_global_copy()  # end of warmup: replicas are identical here
        due = fragments_due(step, self.cfg)
        for f in due:
            for u in self.fragments[f]:
                self.sync_params(u)
        return bool(due)

    def _start_global_copy(self) -> None:
        if self.uses_global:
            self.outer = [_OuterState(global_params=h.clone()) for h in self.held]

    # ------------------------------------------------------------ the param sync of one unit
    @torch.no_grad()
    def sync_params(self, u: int) -> None:
        held = self.held[u]
        if not self.uses_global:
            self.comm.all_reduce(held, "sync")
            held.div_(self.M)
            return
        state = self.outer[u]
        delta = torch.empty_like(held)
        compute_delta(state.global_params, held, delta)
        self.average_delta(delta)
        first = state.momentum is None
        if first:
            state.momentum = torch.empty_like(held)
        outer_step(held, state.global_params, state.momentum, delta, self.lr, self.mu, self.cfg.nesterov, first)

    def average_delta(self, delta: torch.Tensor) -> None:
        """delta ← mean over replicas of delta, in fp32 or via int8 + per-block scales."""
        if self.cfg.quantize == "none":
            self.comm.all_reduce(delta, "sync")
            delta.div_(self.M)
            return
        block = self.cfg.quant_block
        q, scales = quantize_int8(delta, block)
        q_all = torch.empty(self.M * q.numel(), dtype=torch.int8, device=q.device)
        s_all = torch.empty(self.M * scales.numel(), dtype=torch.float32, device=q.device)
        self.comm.all_gather(q_all, q, "sync")
        self.comm.all_gather(s_all, scales, "sync")
        dequantize_mean(q_all.view(self.M, -1), s_all.view(self.M, -1), block, delta)
