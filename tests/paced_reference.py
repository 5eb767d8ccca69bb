"""An independent single-process reference for paced rounds (sync.every_s, docs/design.md §8.12).

M replicas in one process, each a full model with its own optimizer, as in tests/sync_reference.py (whose
config, data-row and outer-step helpers it reuses; hsdp.engines / hsdp.sync are not imported). What a
paced run changes, given which steps each replica trained (the wall clock decides that in a real run;
here it is an input):

  periods   after warmup W the step-counted schedule stays: a round after every slot s with
            (s + 1 − W) % H == 0 (one fragment). Period p is the H nominal steps W + p·H … W + p·H + H − 1;
            replica m trains step k of period p iff k < counts[m][p]. Warmup steps (grads averaged) and
            the tail after the last round are always trained.
  data      a skipped step reads no batch: replica m's j-th trained step (j = 0, 1, … over every step it
            trained) reads rows [m·S·B, (m+1)·S·B) of the global batch of position j (not of the step).
  LR        the schedule's at the nominal step: lr_at(step).
  update    per replica, only on a step it trained: its own grads, global-norm clipping, optimizer step.
  round     w_m = steps replica m trained since the last round (weighting tokens; equal: w_m = 1).
              outer (diloco, or η/μ not 1/0):  mean Δ = θ_g − Σ_m w_m θ_m / Σ_m w_m (= Σ w_m Δ_m / Σ w_m,
                                               fp32), then sync_reference's outer step, θ_m ← θ_g
              plain average (η = 1, μ = 0):    θ_m ← Σ_m w_m θ_m / Σ_m w_m
            With equal weights this is sync_reference_run's computation operation for operation.

Only fp32, one fragment, τ = 0 (blocking) syncs are simulated; anything else is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hsdp.data.tokens import Data
from hsdp.models.gpt import build_model, loss_fn
from hsdp.models.optim import build_optimizer, lr_at, set_lr
from tests.sync_reference import (
    CodecSpec,
    _outer_update,
    average_grads,
    fragment_due,
    outer_at,
    outer_hparams,
    reference_config,
)


@dataclass
class PacedReferenceResult:
    params: list[dict[str, torch.Tensor]]  # per replica: final full params
    losses: list[list[Optional[float]]]  # per step, per replica: its loss (None: it skipped the step)
    trained: list[int]  # per replica: steps trained
    round_weights: list[list[float]]  # per round: w_m of every replica


def trains(step: int, counts: list[int], warmup: int, every: int) -> bool:
    """Whether a replica with per-period trained counts `counts` trains nominal `step`."""
    if step < warmup:
        return True
    p, k = divmod(step - warmup, every)
    return p >= len(counts) or k < counts[p]  # past the counted periods: the unsynced tail


def paced_reference_run(
    overrides: list[str], counts: list[list[int]], sync: int, shard: int, weighting: str = "tokens"
) -> PacedReferenceResult:
    """Simulate `sync` replicas (each `shard` ranks' rows) where replica m trains the steps `counts[m]` allows."""
    torch.set_num_threads(1)
    cfg = reference_config(overrides, sync, shard)
    M, S = sync, shard
    B = cfg.data.batch_size // (M * S)
    sc = cfg.sync
    W, H = sc.warmup_steps, sc.every
    assert W is not None and sc.fragments == 1 and sc.delay == 0 and sc.schedule == "hsdp" and not sc.eager
    assert CodecSpec.of(sc) is None, "fp32 only"
    assert weighting in ("tokens", "equal") and len(counts) == M
    rounds_due = [s for s in range(cfg.run.steps) if fragment_due(s, 0, W, H, 1)]
    assert all(len(c) == len(rounds_due) and all(1 <= n <= H for n in c) for c in counts), (counts, rounds_due)
    eta, mu = outer_hparams(sc.method, sc.outer_lr, sc.outer_momentum)
    plain_average = sc.method == "average" and eta == 1.0 and mu == 0.0

    models = [build_model(cfg.model, cfg.run.seed) for _ in range(M)]
    opts = [build_optimizer(list(mdl.named_parameters()), cfg.optim) for mdl in models]
    params = [dict(mdl.named_parameters()) for mdl in models]
    names = list(params[0])
    data = Data(cfg, 0, 1)
    accum = cfg.optim.grad_accum
    theta_g = {n: params[0][n].detach().clone() for n in names} if W == 0 else None
    buf: dict[str, Optional[torch.Tensor]] = {n: None for n in names}
    position = [0] * M  # steps trained so far: the data position
    since = [0] * M  # steps trained since the last round (after the warmup)
    losses: list[list[Optional[float]]] = []
    round_weights: list[list[float]] = []
    n_rounds = 0

    for step in range(cfg.run.steps):
        lr = lr_at(step, cfg.optim, cfg.run.steps)
        active = [m for m in range(M) if trains(step, counts[m], W, H)]
        row: list[Optional[float]] = [None] * M
        for m in active:
            set_lr(opts[m], lr)
            total = 0.0
            for micro in range(accum):
                x, y = data.train_batch(position[m], micro)
                rows = slice(m * S * B, (m + 1) * S * B)
                loss = loss_fn(models[m](x[rows]), y[rows]) / accum
                loss.backward()
                total += loss.item()
            row[m] = total
            position[m] += 1
            since[m] += step >= W
        losses.append(row)

        if step < W:  # warmup: every replica trained; grads averaged (sync_reference's order)
            average_grads(params, names)
        for m in active:
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(models[m].parameters(), cfg.optim.grad_clip)
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)

        if step == W - 1:
            theta_g = {n: params[0][n].detach().clone() for n in names}
        if step in rounds_due:
            w = [float(n) for n in since] if weighting == "tokens" else [1.0] * M
            round_weights.append(w)
            total_w = sum(w)
            with torch.no_grad():
                mean = {}
                for n in names:
                    acc = params[0][n].detach() * w[0]
                    for m in range(1, M):
                        acc = acc + params[m][n].detach() * w[m]
                    mean[n] = acc / total_w
                if plain_average:
                    for n in names:
                        for m in range(M):
                            params[m][n].copy_(mean[n])
                else:
                    eta_r, mu_r = outer_at(n_rounds, sc, eta, mu)
                    delta = {n: theta_g[n] - mean[n] for n in names}
                    _outer_update(names, params, theta_g, buf, delta, eta_r, mu_r, sc.nesterov, None)
            n_rounds += 1
            since = [0] * M

    final = [{n: p.detach().clone() for n, p in mdl.named_parameters()} for mdl in models]
    return PacedReferenceResult(final, losses, position, round_weights)
