"""An independent single-process reference for periodic param sync (docs/design.md §2).

M replicas are simulated in one process, each a full model with its own
optimizer: no torch.distributed, no hsdp engine (hsdp.engines / hsdp.sync are
not imported). Replica m's batch at each micro-step is rows [m·S·B, (m+1)·S·B)
of the global batch of one process with batch size B·M·S (the data module's
contract), i.e. the concatenation of its S shard ranks' batches.

Per step s:
  1. each replica computes grads on its rows (loss = mean over its rows);
  2. if s < warmup_steps (null: always) the grads are averaged over replicas;
  3. per-replica global-norm clipping, optimizer step;
  4. param sync of the fragments due after step s (docs/design.md §2):
     average:  θ_m ← mean_m θ_m
     outer step (diloco, or anything quantized, or non-default η/μ):
       Δ = θ_g − mean_m θ_m   (int8: mean_m dequant(quant(θ_g − θ_m)) per shard)
       b = Δ (first sync) else μ·b + Δ
       θ_g −= η·(Δ + μ·b) (nesterov) or η·b
       θ_m ← θ_g
     θ_g is snapshotted after step warmup−1 (at init when warmup = 0).
  5. delay τ > 0 (overlapped sync, docs/design.md §2.6): step 4 is split in two.
     After step s (fragment due) only the mean Δ = θ_g − mean_m θ_m (int8: as
     above) is taken, for every method (average: η = 1, μ = 0). After step s+τ,
     before any sync that starts there, the outer step above runs with that Δ and
     θ_m ← α·θ_m + (1 − α)·θ_g (θ_m has trained τ more steps). A sync whose s+τ is
     past the last step lands right after the last step.

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

from hsdp.config.loader import load_config
from hsdp.config.schema import Config
from hsdp.data import Data
from hsdp.model import build_model, loss_fn
from hsdp.optim import build_optimizer, lr_at, set_lr


@dataclass
class SyncReferenceResult:
    losses: list[float]  # per step: mean over replicas of each replica's loss
    synced: list[bool]  # per step: some fragment synced params after this step
    params: list[dict[str, torch.Tensor]]  # per replica: final full params, model.named_parameters() names
    fragment_synced: list[list[int]]  # per step: the fragments whose sync started after it
    landed: list[list[int]]  # per step: the fragments whose sync landed after it (τ = 0: = fragment_synced)
    # int8 only, per synced step: name → (quant_step, tie_margin), per element of the param:
    #   quant_step = Σ_m scale_m / M: the most one rounding flip per replica can move mean Δ
    #   tie_margin = min_m | |Δ_m/scale_m| − floor(|Δ_m/scale_m|) − ½ |: how near a rounding tie it was
    int8_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- schedule (docs/design.md §2)
def grad_sync_due(step: int, warmup: Optional[int]) -> bool:
    return warmup is None or step < warmup


def fragment_due(step: int, f: int, warmup: Optional[int], every: int, fragments: int) -> bool:
    """Fragment f syncs its params after step `step`."""
    if warmup is None or step < warmup:
        return False
    return (step + 1 - warmup - (f + 1) * every // fragments) % every == 0


def outer_hparams(method: str, outer_lr: Optional[float], outer_momentum: Optional[float]) -> tuple[float, float]:
    """η, μ with the defaults of docs/design.md §2 (average: 1, 0; diloco: 0.7, 0.9)."""
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
        xb = x[i * block : (i + 1) * block]
        amax = xb.abs().max()
        scale = amax / 127
        scales[i] = scale
        if float(amax) == 0.0:
            continue  # all-zero block: scale 0, q 0
        q[i * block : (i + 1) * block] = _round_half_away(xb / scale).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(q.numel(), dtype=torch.float32)
    for i in range(scales.numel()):
        out[i * block : (i + 1) * block] = q[i * block : (i + 1) * block].float() * scales[i]
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
        piece = t[k * rows : (k + 1) * rows].reshape(-1)
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
        view = t[k * rows : (k + 1) * rows]
        view.copy_(flat[off : off + view.numel()].view_as(view))
        off += n


def quantized_mean_delta(
    deltas: list[list[torch.Tensor]], shard: int, block: int
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
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * sync * shard),
        mesh=dataclasses.replace(cfg.mesh, sync=1, shard=1),
    )


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
    delay, alpha = sc.delay, sc.alpha
    # A delayed sync always takes the outer-step path: Δ is snapshotted against θ_g.
    plain_average = sc.method == "average" and not int8 and eta == 1.0 and mu == 0.0 and delay == 0

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

    losses, synced_flags, frag_log, land_log = [], [], [], []
    in_flight: list[tuple[int, int, dict[int, dict[str, torch.Tensor]]]] = []  # (land step, fragment, Δ per unit)
    int8_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def land(entry: tuple[int, int, dict[int, dict[str, torch.Tensor]]], landed: list[int]) -> None:
        """A delayed sync's outer step and merge, with the mean Δ taken when it started."""
        _, f, mean_deltas = entry
        for u in frag_units[f]:
            _outer_update(unit_names[u], params, theta_g, buf, mean_deltas[u], eta, mu, sc.nesterov, alpha)
        in_flight.remove(entry)
        landed.append(f)

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
        landed: list[int] = []
        with torch.no_grad():
            for entry in [e for e in in_flight if e[0] == step]:  # delayed syncs landing now, oldest first
                land(entry, landed)
            for f in due:
                if delay > 0:  # only the mean Δ now; the outer step after step + delay
                    mean_deltas = {}
                    for u in frag_units[f]:
                        mean_deltas[u], trace = _mean_delta(unit_names[u], params, theta_g, int8, S, sc.quant_block)
                        if trace:
                            int8_trace.setdefault(step, {}).update(trace)
                    in_flight.append((step + delay, f, mean_deltas))
                    continue
                for u in frag_units[f]:
                    trace = _sync_unit(
                        unit_names[u],
                        params,
                        theta_g,
                        buf,
                        plain_average,
                        int8,
                        eta,
                        mu,
                        sc.nesterov,
                        S,
                        sc.quant_block,
                    )
                    if trace:
                        int8_trace.setdefault(step, {}).update(trace)
                landed.append(f)
            if step == cfg.run.steps - 1:  # the run ends: what is still in flight lands now
                for entry in list(in_flight):
                    land(entry, landed)
        synced_flags.append(bool(due))
        frag_log.append(due)
        land_log.append(landed)

    final = [{n: p.detach().clone() for n, p in mdl.named_parameters()} for mdl in models]
    return SyncReferenceResult(losses, synced_flags, final, frag_log, land_log, int8_trace)


def _sync_unit(
    unit: list[str],
    params: list[dict[str, torch.Tensor]],
    theta_g,
    buf,
    plain_average: bool,
    int8: bool,
    eta: float,
    mu: float,
    nesterov: bool,
    shard: int,
    block: int,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sync one unit's params across replicas now; int8 returns its trace (name → (quant_step, tie_margin))."""
    M = len(params)
    if plain_average:
        for n in unit:
            acc = params[0][n].detach().clone()
            for m in range(1, M):
                acc += params[m][n]
            acc /= M
            for m in range(M):
                params[m][n].copy_(acc)
        return {}
    mean_delta, trace = _mean_delta(unit, params, theta_g, int8, shard, block)
    _outer_update(unit, params, theta_g, buf, mean_delta, eta, mu, nesterov, None)
    return trace


def _mean_delta(
    unit: list[str], params: list[dict[str, torch.Tensor]], theta_g, int8: bool, shard: int, block: int
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The mean over replicas of Δ_m = θ_g − θ_m per param of the unit (int8: quantized per shard), and the trace."""
    M = len(params)
    if int8:
        deltas = [[theta_g[n] - params[m][n].detach() for n in unit] for m in range(M)]
        means, qsteps, margins = quantized_mean_delta(deltas, shard, block)
        return dict(zip(unit, means)), {n: (qs, mg) for n, qs, mg in zip(unit, qsteps, margins)}
    mean_delta = {}
    for n in unit:
        acc = params[0][n].detach().clone()
        for m in range(1, M):
            acc += params[m][n]
        mean_delta[n] = theta_g[n] - acc / M
    return mean_delta, {}


def _outer_update(
    unit: list[str],
    params: list[dict[str, torch.Tensor]],
    theta_g,
    buf,
    mean_delta: dict[str, torch.Tensor],
    eta: float,
    mu: float,
    nesterov: bool,
    alpha: Optional[float],
) -> None:
    """Outer SGD step on θ_g with Δ; then θ_m ← θ_g (alpha None: blocking) or α·θ_m + (1 − α)·θ_g."""
    for n in unit:
        d = mean_delta[n]
        buf[n] = d.clone() if buf[n] is None else mu * buf[n] + d
        step = d + mu * buf[n] if nesterov else buf[n]
        theta_g[n] -= eta * step
        for m in range(len(params)):
            new = theta_g[n] if alpha is None else alpha * params[m][n].detach() + (1 - alpha) * theta_g[n]
            params[m][n].copy_(new)
