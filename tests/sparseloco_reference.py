"""An independent reference of the compressed param sync with decayed error feedback (docs/design.md §8.4–8.5),
written from the design text, not from hsdp.sync or kernels/: M replicas of a list of flat units, one process.

Per sync of fragment f (units u with u mod P = f), per unit, replica m (fp32 throughout):

    Δ_m = θ_g − θ_m
    e_m ← β·e_m + Δ_m                     (e_m = 0 before the unit's first sync; without EF: e_m = Δ_m, kept 0)
    top-k per chunk of C from the unit's start: the k_c = min(k, len_c) largest |e_m| (ties: lowest index),
          positions ascending; k = ⌈ρ·C⌉
    values: fp32, or int2 over blocks of B consecutive selected values:
          lo = min|v|, hi = max|v|, d = (hi − lo)·½, t = lo + d; |v| ≥ t → level1 = lo + d·1.5, else
          level0 = lo + d·½; the sign is v's (v < 0 negative)
    D(C(e_m)) = the decoded values at their positions, 0 elsewhere;  e_m ← e_m − D(C(e_m))  (EF only)
    Δ   = Σ_{m=0..M−1} D(C(e_m)) (in that order) ÷ M  (topk_mean all), or ÷ n_i per coordinate, n_i = the
          replicas that selected i, 0 where none did (topk_mean chosen)
    b   = Δ on the unit's first outer step, else μ·b + Δ;  θ_g ← θ_g − η·(Δ + μ·b) (Nesterov);  θ_m ← θ_g

Bytes one replica sends for a unit of n elements (c selected): ⌈c·⌈log₂ C⌉/8⌉ + 4c (fp32) or
⌈c/4⌉ + 8·⌈c/B⌉ (int2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseSpec:
    density: float  # ρ
    chunk: int  # C
    quantize: str  # none | int2
    block: int  # B
    decay: float  # β (error feedback on when not None)
    error_feedback: bool
    mean: str  # all | chosen
    lr: float  # η
    momentum: float  # μ

    @property
    def k(self) -> int:
        return math.ceil(self.density * self.chunk)


def select(x: torch.Tensor, chunk: int, k: int) -> list[int]:
    """Positions of the per-chunk top-k of |x|, ties to the lowest index, ascending: one sort per chunk."""
    vals = x.tolist()
    out: list[int] = []
    for start in range(0, len(vals), chunk):
        idx = range(start, min(start + chunk, len(vals)))
        ranked = sorted(idx, key=lambda i: (-abs(vals[i]), i))  # abs(-0.0) == 0.0: a tie
        out.extend(sorted(ranked[:k]))
    return out


def int2_roundtrip(v: torch.Tensor, block: int) -> torch.Tensor:
    """The int2 codec's decoded values of v (fp32), block by block."""
    out = torch.empty_like(v)
    half, three_halves = torch.tensor(0.5), torch.tensor(1.5)
    for s in range(0, v.numel(), block):
        x = v[s : s + block]
        a = x.abs()
        lo, hi = a.min(), a.max()
        d = (hi - lo) * half
        t = lo + d
        level = torch.where(a >= t, lo + d * three_halves, lo + d * half)
        out[s : s + block] = torch.where(x < 0, -level, level)
    return out


def payload_bytes(n: int, spec: SparseSpec) -> int:
    """What one replica all-gathers for a unit of n elements."""
    full = math.ceil(n / spec.chunk) - 1
    c = full * spec.k + min(spec.k, n - full * spec.chunk)
    bits = math.ceil(math.log2(spec.chunk))
    values = 4 * c if spec.quantize == "none" else math.ceil(c / 4) + 8 * math.ceil(c / spec.block)
    return math.ceil(c * bits / 8) + values


class SparseReference:
    """θ_g, b and each replica's residuals of M replicas over `sizes` units; `sync(units, thetas)` updates
    thetas[m][u] in place."""

    def __init__(self, spec: SparseSpec, init: list[torch.Tensor], M: int) -> None:
        self.spec, self.M = spec, M
        self.theta_g = [t.clone() for t in init]
        self.b: list[torch.Tensor | None] = [None] * len(init)
        self.err = [[torch.zeros_like(t) for t in init] for _ in range(M)]

    def sync_unit(self, u: int, thetas: list[list[torch.Tensor]]) -> None:
        sp, M = self.spec, self.M
        n = self.theta_g[u].numel()
        total = torch.zeros(n)
        senders = torch.zeros(n)
        for m in range(M):
            delta = self.theta_g[u] - thetas[m][u]
            e = self.err[m][u] * torch.tensor(sp.decay) + delta if sp.error_feedback else delta
            pos = torch.tensor(select(e, sp.chunk, sp.k), dtype=torch.int64)
            sent = e[pos]
            if sp.quantize == "int2":
                sent = int2_roundtrip(sent, sp.block)
            dec = torch.zeros(n)
            dec[pos] = sent
            if sp.error_feedback:
                self.err[m][u] = e - dec
            total = total + dec
            senders[pos] += 1
        mean = total / M if sp.mean == "all" else total / senders.clamp(min=1)
        mu, eta = torch.tensor(sp.momentum), torch.tensor(sp.lr)
        self.b[u] = mean.clone() if self.b[u] is None else mu * self.b[u] + mean
        self.theta_g[u] = self.theta_g[u] - eta * (mean + mu * self.b[u])
        for m in range(M):
            thetas[m][u].copy_(self.theta_g[u])
