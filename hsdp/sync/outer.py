"""The outer optimizer of a param sync: what θ_g does with the replicas' mean Δ (docs/design.md §8.4, §8.11).

average:  η = 1, μ = 0 by default (θ_g ← θ_g − mean Δ = mean θ_m)
diloco:   η = 0.7, μ = 0.9 by default, Nesterov unless sync.nesterov=false
          b ← μ·b + Δ (b = Δ on the first sync);  θ_g ← θ_g − η·(Δ + μ·b) or θ_g − η·b

η and μ may change per round r (the unit's outer steps before this one, 0 on its first):
    μ_r = μ·min(r, W_μ)/W_μ                       W_μ = sync.outer_momentum_warmup (0: μ_r = μ)
    η_r = η·(r + 1)/W_η                  r < W_η   W_η = sync.outer_lr_warmup
        = η                              constant
        = η_min + (η − η_min)·½(1 + cos πp)  cosine   p = min(1, (r − W_η)/(R − 1 − W_η)),
        = η − (η − η_min)·p              linear     R = sync.outer_lr_rounds, η_min = sync.outer_min_lr
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hsdp.config.schema import SyncConfig
from kernels.outer import outer_step


def outer_hyperparams(s: SyncConfig) -> tuple[float, float]:
    """(outer lr η, outer momentum μ) with the method's defaults."""
    if s.method == "average":
        return (1.0 if s.outer_lr is None else s.outer_lr, 0.0 if s.outer_momentum is None else s.outer_momentum)
    return (0.7 if s.outer_lr is None else s.outer_lr, 0.9 if s.outer_momentum is None else s.outer_momentum)


@dataclass(frozen=True)
class OuterOptimizer:
    """η, μ, Nesterov and their per-round schedules of one run's outer step (the Triton/torch kernel does the
    arithmetic)."""

    lr: float
    momentum: float
    nesterov: bool
    momentum_warmup: int = 0  # W_μ
    lr_warmup: int = 0  # W_η
    lr_schedule: str = "constant"
    lr_rounds: int = 0  # R
    min_lr: float = 0.0  # η_min

    @classmethod
    def from_config(cls, s: SyncConfig) -> OuterOptimizer:
        lr, mu = outer_hyperparams(s)
        return cls(
            lr,
            mu,
            s.nesterov,
            s.outer_momentum_warmup,
            s.outer_lr_warmup,
            s.outer_lr_schedule,
            s.outer_lr_rounds,
            s.outer_min_lr,
        )

    @property
    def per_round(self) -> bool:
        """Whether η or μ depend on the round (else every round uses `lr`, `momentum`)."""
        return bool(self.momentum_warmup or self.lr_warmup or self.lr_schedule != "constant")

    def at(self, r: int) -> tuple[float, float]:
        """(η_r, μ_r) of a unit's outer step r (0 = its first)."""
        mu = (
            self.momentum
            if not self.momentum_warmup
            else self.momentum * min(r, self.momentum_warmup) / self.momentum_warmup
        )
        w = self.lr_warmup
        if r < w:
            return self.lr * (r + 1) / w, mu
        if self.lr_schedule == "constant":
            return self.lr, mu
        p = min(1.0, (r - w) / max(1, self.lr_rounds - 1 - w))
        if self.lr_schedule == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p)), mu
        return self.lr - (self.lr - self.min_lr) * p, mu  # linear

    def step(
        self,
        out: torch.Tensor,
        global_params: torch.Tensor,
        momentum: torch.Tensor,
        mean_delta: torch.Tensor,
        first: bool,
        r: int = 0,
    ) -> None:
        """θ_g and b updated in place with mean Δ (round r's η, μ); `out` ← the new θ_g (`out` may be the held
        shard)."""
        lr, mu = self.at(r)
        outer_step(out, global_params, momentum, mean_delta, lr, mu, self.nesterov, first)

    def tentative(
        self,
        out: torch.Tensor,
        global_params: torch.Tensor,
        momentum: torch.Tensor | None,
        delta: torch.Tensor,
        r: int,
    ) -> None:
        """`out` ← the θ_g that round r's outer step would give with `delta` for the mean (eager updates,
        docs/design.md §8.10): the same kernel on copies, so θ_g and b are left as they are."""
        g = global_params.clone()
        b = torch.empty_like(delta) if momentum is None else momentum.clone()
        self.step(out, g, b, delta, momentum is None, r)
