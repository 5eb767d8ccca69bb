"""An independent single-process reference for periodic param sync (DESIGN §2).

M replicas are simulated in one process, each a full model with its own
optimizer: no torch.distributed, no hsdp engine (hsdp.shard / hsdp.sync are
not imported). Replica m's batch at each micro-step is rows [m·S·B, (m+1)·S·B)
of the global batch of one process with batch size B·M·S (the data module's
contract), i.e. the concatenation of its S shard ranks' batches.

Per step s:
  1. each replica computes grads on its rows (loss = mean over its rows);
  2. if s < warmup_steps (null: always) the grads are averaged over replicas;
  3. per-replica global-norm clipping, optimizer step;
  4. param sync of the fragments due after step s (DESIGN §2):
     average:  θ_m ← mean_m θ_m
     outer step (diloco, or anything quantized, or non-default η/μ):
       Δ = θ_g − mean_m θ_m   (int8: mean_m dequant(quant(θ_g − θ_m)) per shard)
       b = Δ (first sync) else μ·b + Δ
       θ_g −= η·(Δ + μ·b) (nesterov) or η·b
       θ_m ← θ_g
     θ_g is snapshotted after step warmup−1 (at init when warmup = 0).

int8 follows the engine's layout: each rank quantizes the flat held shard of
each unit separately; the held shard of a unit on shard rank k is the
concatenation, over the unit's params in named_parameters order, of rows
[k·rows, (k+1)·rows) of the param (rows = ceil(d0/S)), flattened and
zero-padded to rows·prod(rest) elements. Blocks of `quant_block` elements
start at the beginning of each such flat shard.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from hsdp.config import Config, load_config
from hsdp.data import Data
from hsdp.model import build_model, loss_fn
from hsdp.optim import build_optimizer, lr_at, set_lr


@dataclass
class SyncReferenceResult:
    losses: list[float]  # per step: mean over replicas of each replica's loss
    synced: list[bool]  # per step: some fragment synced params after this step
    params: list[dict[str, torch.Tensor]]  # per replica: final full params, model.named_parameters() names
    fragment_synced: list[list[int]]  # per step: the fragments that synced after it
    # int8 only, per synced step: name → (quant_step, tie_margin), per element of the param:
    #   quant_step = Σ_m scale_m / M: the most one rounding flip per replica can move mean Δ
    #   tie_margin = min_m | |Δ_m/scale_m| − floor(|Δ_m/scale_m|) − ½ |: how near a rounding tie it was
    int8_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- schedule (DESIGN §2)
def grad_sync_due(step: int, warmup: Optional[int]) -> bool:
    return warmup is None or step < warmup


def fragment_due(step: int, f: int, warmup: Optional[int], every: int, fragments: int) -> bool:
    """Fragment f syncs its params after step `step`."""
    if warmup is None or step < warmup:
        return False
    return (step + 1 - warmup - (f + 1) * every // fragments) % every == 0


def outer_hparams(method: str, outer_lr: Optional[float], outer_momentum: Optional[float]) -> tuple[float, float]:
    """η, μ with the defaults of DESIGN §2 (average: 1, 0; diloco: 0.7, 0.9)."""
    lr0, mom0 = (1.0, 0.0) if method == "average" else (0.7, 0.9)
    return (lr0 if outer_lr is None else outer_lr, mom0 if outer_momentum is None else outer_momentum)


# ---------------------------------------------------------------- int8 (block quantization)
def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    t = torch.trunc(v)
    frac = v - t  # exact in fp32 for |v| < 2^23
    return t + torch.sign(v) * (frac.abs() >= 0.5).to(v.dtype)


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 → (int8 values, one fp32 scale per block of `block` elements)."""
    x = x.reshape(-1).float()
    n = x.numel()
    nb = math.ceil(n / block)
    q = torch.zeros(n, dtype=torch.int8)
    scales = torch.zeros(nb, dtype=torch.float32)
    for i in range(nb):
        xb = x[i * block: (i + 1) * block]
        amax = xb.abs().max()
        scale = amax / 127
        scales[i] = scale
        if float(amax) == 0.0:
            continue  # all-zero block: scale 0, q 0
        q[i * block: (i + 1) * block] = _round_half_away(xb / scale).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(q.numel(), dtype=torch.float32)
    for i in range(scales.numel()):
        out[i * block: (i + 1) * block] = q[i * block: (i + 1) * block].float() * scales[i]
    return out


def shard_rows(shape: torch.Size, shard: int) -> int:
    return math.ceil(shape[0] / shard)


def held_numel(shape: torch.Size, shard: int) -> int:
    """Elements of one rank's (padded) shard of a param of this shape."""
    return shard_rows(shape, shard) * math.prod(shape[1:])


def flat_shard(tensors: list[torch.Tensor], k: int, shard: int) -> torch.Tensor:
    """Shard rank k's flat held shard of a unit (its params in order, dim-0 rows, zero-padded)."""
    parts = []
    for t in tensors:
        rows = shard_rows(t.shape, shard)
        piece = t[k * rows: (k + 1) * rows].reshape(-1)
        padded = torch.zeros(held_numel(t.shape, shard), dtype=torch.float32)
        padded[: piece.numel()] = piece
        parts.append(padded)
    return torch.cat(parts)


def unflat_shard(flat: torch.Tensor, outs: list[torch.Tensor], k: int, shard: int) -> None:
    """Write shard rank k's flat held shard back into full tensors `outs` (padding dropped)."""
    off = 0
    for t in outs:
        rows = shard_rows(t.shape, shard)
        n = held_numel(t.shape, shard)
        view = t[k * rows: (k + 1) * rows]
        view.copy_(flat[off: off + view.numel()].view_as(view))
        off += n


def quantized_mean_delta(deltas: list[list[torch.Tensor]], shard: int, block: int
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """mean_m dequant(quant(Δ_m)) for one unit; deltas[m] = replica m's Δ per param of the unit.

    Quantization is per shard rank's flat held shard; the mean sums m = 0..M−1 in order, then
    divides by M. Also returns, per param, each element's quant_step and tie_margin (see
    SyncReferenceResult.int8_trace).
    """
    M = len(deltas)
    out = [torch.zeros_like(t) for t in deltas[0]]
    qstep = [torch.zeros_like(t) for t in deltas[0]]
    margin = [torch.zeros_like(t) for t in deltas[0]]
    for k in range(shard):
        acc = step = marg = None
        for m in range(M):
            flat = flat_shard(deltas[m], k, shard)
            q, scales = quantize_int8(flat, block)
            deq = dequantize_int8(q, scales, block)
            acc = deq if acc is None else acc + deq
            per_elem = scales.repeat_interleave(block)[: flat.numel()]
            y = (flat / torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))).abs()
            mg = (y - y.floor() - 0.5).abs()
            step = per_elem / M if step is None else step + per_elem / M
            marg = mg if marg is None else torch.minimum(marg, mg)
        unflat_shard(acc / M, out, k, shard)
        unflat_shard(step, qstep, k, shard)
        unflat_shard(marg, margin, k, shard)
    return out, qstep, margin


# ---------------------------------------------------------------- the simulation
def reference_config(overrides: list[str], sync: int, shard: int) -> Config:
    """One process holding the global batch (B·M·S rows)."""
    cfg = load_config(None, overrides)
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * sync * shard),
        mesh=dataclasses.replace(cfg.mesh, sync=1, shard=1))


def sync_reference_run(overrides: list[str], sync: int, shard: int) -> SyncReferenceResult:
    """Simulate `sync` replicas (each a shard group of `shard` ranks) with periodic param sync."""
    torch.set_num_threads(1)
    cfg = reference_config(overrides, sync, shard)
    M, S = sync, shard
    B = cfg.data.batch_size // (M * S)
    sc = cfg.sync
    warmup, every, P = sc.warmup_steps, sc.every, sc.fragments
    eta, mu = outer_hparams(sc.method, sc.outer_lr, sc.outer_momentum)
    int8 = sc.quantize == "int8"
    plain_average = sc.method == "average" and not int8 and eta == 1.0 and mu == 0.0

    models = [build_model(cfg.model, cfg.run.seed) for _ in range(M)]
    opts = [build_optimizer(list(mdl.named_parameters()), cfg.optim) for mdl in models]
    params = [dict(mdl.named_parameters()) for mdl in models]
    names = list(params[0])
    # units → fragments (round-robin); each unit's param names in named_parameters order
    unit_names = [[f"units.{i}.{n}" for n, _ in unit.named_parameters()] for i, unit in enumerate(models[0].units)]
    assert sum(len(u) for u in unit_names) == len(names)
    frag_units = [[i for i in range(len(unit_names)) if i % P == f] for f in range(P)]

    data = Data(cfg, 0, 1)
    accum = cfg.optim.grad_accum
    theta_g: Optional[dict[str, torch.Tensor]] = None
    buf: dict[str, Optional[torch.Tensor]] = {n: None for n in names}

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: params[0][n].detach().clone() for n in names}

    if warmup == 0:
        theta_g = snapshot()

    losses, synced_flags, frag_log = [], [], []
    int8_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for step in range(cfg.run.steps):
        lr = lr_at(step, cfg.optim, cfg.run.steps)
        replica_losses = []
        for m in range(M):
            set_lr(opts[m], lr)
            total = 0.0
            for micro in range(accum):
                x, y = data.train_batch(step, micro)
                rows = slice(m * S * B, (m + 1) * S * B)
                loss = loss_fn(models[m](x[rows]), y[rows]) / accum
                loss.backward()
                total += loss.item()
            replica_losses.append(total)
        losses.append(sum(replica_losses) / M)

        if grad_sync_due(step, warmup):
            with torch.no_grad():
                for n in names:
                    acc = params[0][n].grad.clone()
                    for m in range(1, M):
                        acc += params[m][n].grad
                    acc /= M
                    for m in range(M):
                        params[m][n].grad.copy_(acc)

        for m in range(M):
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(models[m].parameters(), cfg.optim.grad_clip)
            opts[m].step()
            opts[m].zero_grad(set_to_none=True)

        if warmup is not None and step == warmup - 1:
            theta_g = snapshot()  # every replica holds the same params here

        due = [f for f in range(P) if fragment_due(step, f, warmup, every, P)]
        with torch.no_grad():
            for f in due:
                for u in frag_units[f]:
                    trace = _sync_unit(unit_names[u], params, theta_g, buf, plain_average, int8, eta, mu,
                                       sc.nesterov, S, sc.quant_block)
                    if trace:
                        int8_trace.setdefault(step, {}).update(trace)
        synced_flags.append(bool(due))
        frag_log.append(due)

    final = [{n: p.detach().clone() for n, p in mdl.named_parameters()} for mdl in models]
    return SyncReferenceResult(losses, synced_flags, final, frag_log, int8_trace)


def _sync_unit(unit: list[str], params: list[dict[str, torch.Tensor]], theta_g, buf, plain_average: bool,
               int8: bool, eta: float, mu: float, nesterov: bool, shard: int, block: int
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sync one unit's params across replicas; int8 returns its trace (name → (quant_step, tie_margin))."""
    M = len(params)
    trace = {}
    if plain_average:
        for n in unit:
            acc = params[0][n].detach().clone()
            for m in range(1, M):
                acc += params[m][n]
            acc /= M
            for m in range(M):
                params[m][n].copy_(acc)
        return trace
    if int8:
        deltas = [[theta_g[n] - params[m][n].detach() for n in unit] for m in range(M)]
        means, qsteps, margins = quantized_mean_delta(deltas, shard, block)
        mean_delta = dict(zip(unit, means))
        trace = {n: (qs, mg) for n, qs, mg in zip(unit, qsteps, margins)}
    else:
        mean_delta = {}
        for n in unit:
            acc = params[0][n].detach().clone()
            for m in range(1, M):
                acc += params[m][n]
            mean_delta[n] = theta_g[n] - acc / M
    for n in unit:
        d = mean_delta[n]
        buf[n] = d.clone() if buf[n] is None else mu * buf[n] + d
        step = d + mu * buf[n] if nesterov else buf[n]
        theta_g[n] -= eta * step
        for m in range(M):
            params[m][n].copy_(theta_g[n])
    return trace
