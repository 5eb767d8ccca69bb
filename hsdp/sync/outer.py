"""The outer optimizer of a param sync: what θ_g does with the replicas' mean Δ (docs/design.md §2.4).

average:  η = 1, μ = 0 by default (θ_g ← θ_g − mean Δ = mean θ_m)
diloco:   η = 0.7, μ = 0.9 by default, Nesterov unless sync.nesterov=false
          b ← μ·b + Δ (b = Δ on the first sync);  θ_g ← θ_g − η·(Δ + μ·b) or θ_g − η·b
"""

from __future__ import annotations

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
    """η, μ and Nesterov of one run's outer step (the Triton/torch kernel does the arithmetic)."""

    lr: float
    momentum: float
    nesterov: bool

    @classmethod
    def from_config(cls, s: SyncConfig) -> OuterOptimizer:
        lr, mu = outer_hyperparams(s)
        return cls(lr, mu, s.nesterov)

    def step(
        self,
        out: torch.Tensor,
        global_params: torch.Tensor,
        momentum: torch.Tensor,
        mean_delta: torch.Tensor,
        first: bool,
    ) -> None:
        """θ_g and b updated in place with mean Δ; `out` ← the new θ_g (`out` may be the held shard)."""
        outer_step(out, global_params, momentum, mean_delta, self.lr, self.momentum, self.nesterov, first)
