"""An independent single-process reference for periodic param sync (docs/design.md §8).

M replicas are simulated in one process, each a full model with its own
optimizer: no torch.distributed, no hsdp engine (hsdp.engines / hsdp.sync are
not imported). Replica m's batch at each micro-step is rows [m·S·B, (m+1)·S·B)
of the global batch of one process with batch size B·M·S (the data module's
contract), i.e. the concatenation of its S shard ranks' batches. On a
three-level mesh (sites × R in-site replicas × shards, docs/design.md §4.1) a
replica here is a site: the in-site replicas average grads every step, so a
site computes what one replica with their R·S ranks' rows [m·R·S·B, (m+1)·R·S·B)
computes, while the sync (and the int8 layout) stays per shard rank of S.

Per step s:
  1. each replica computes grads on its rows (loss = mean over its rows);
  2. if s < warmup_steps (null: always) the grads are averaged over replicas;
  3. per-replica global-norm clipping, optimizer step;
  4. param sync of the fragments due after step s (docs/design.md §8):
     average:  θ_m ← mean_m θ_m
     outer step (diloco, or anything quantized, or non-default η/μ):
       Δ = θ_g − mean_m θ_m   (int8: mean_m dequant(quant(θ_g − θ_m)) per shard)
       b = Δ (first sync) else μ·b + Δ
       θ_g −= η·(Δ + μ·b) (nesterov) or η·b
       θ_m ← θ_g
     θ_g is snapshotted after step warmup−1 (at init when warmup = 0).
  5. delay τ > 0 (overlapped sync, docs/design.md §8.6): step 4 is split in two.
     After step s (fragment due) only the mean Δ = θ_g − mean_m θ_m (int8: as
     above) is taken, for every method (average: η = 1, μ = 0). After step s+τ,
     before any sync that starts there, the outer step above runs with that Δ and
     θ_m ← α·θ_m + (1 − α)·θ_g (θ_m has trained τ more steps). A sync whose s+τ is
     past the last step lands right after the last step.
  6. sync.schedule torchft (docs/design.md §8.9): fragment f's sync starts after step s
     iff f is due (step 4's rule) after s + τ, and lands after s + τ; it always takes
     step 5's path, so with τ = 0 it starts and lands after s and α mixes there too.
  7. sync.eager (§8.10): when a sync starts, replica m's Δ_m = θ_g − θ_m (fp32, before any
     codec) gives θ̂_m = θ_g − η·ŝ_m, the outer step of step 4 with Δ_m for Δ and b left
     as it is (ŝ_m = Δ_m + μ·(μ·b + Δ_m) with Nesterov, b ← Δ_m on a unit's first); then
     θ_m ← θ̂_m. When it lands: the outer step with the mean Δ, then θ_m ← θ_m + (θ_g − θ̂_m).
  8. η and μ per round (§8.11): a unit's r-th outer step (r = 0 first) uses
     μ_r = μ·min(r, W_μ)/W_μ (W_μ = outer_momentum_warmup, 0: μ), and η_r = η·(r+1)/W_η for
     r < W_η (outer_lr_warmup), then η (constant), or with p = min(1, (r − W_η)/(R − 1 − W_η))
     (R = outer_lr_rounds) η_min + (η − η_min)·(1 + cos πp)/2 (cosine) or η + (η_min − η)·p
     (linear), η_min = outer_min_lr.

int8 follows the engine's layout: each rank quantizes the flat held shard of
each unit separately; the held shard of a unit on shard rank k is the
concatenation, over the unit's params in named_parameters order, of rows
[k·rows, (k+1)·rows) of the param (rows = ceil(d0/S)), flattened and
zero-padded to rows·prod(rest) elements. Blocks of `quant_block` elements
start at the beginning of each such flat shard.

The other lossy codecs (docs/design.md §8.5) use the same flat held shards, written
here from the spec, not from kernels/ or hsdp.sync:
  int4     as int8 with 7 for 127 (scale = absmax/7, q = clamp(round_half_away(x/scale), ±7));
           the nibble packing changes only the bytes, so it is not simulated.
  top-k ρ  chunks of C = topk_chunk elements from the shard's start; chunk c keeps its
           k_c = min(⌈ρ·C⌉, len_c) elements of largest |x| (ties: lowest index; |−0| = |0|),
           positions ascending; the selected values, in that order (chunk by chunk), are sent
           as fp32 or quantized (int8 / int4 blocks over the selected values).
  decode   replica m's decoded values at their positions in a zero vector; the mean sums
           m = 0..M−1 in order, then ÷ M.
  error feedback (`error_feedback`): replica m keeps e_m per unit and shard rank (fp32, zero
           at the unit's first sync), sends C(Δ_m + e_m) and sets e_m ← (Δ_m + e_m) − D(C(Δ_m + e_m)).
The int8 case without top-k and error feedback keeps its own path (`quantized_mean_delta`, which
also writes `int8_trace`); every other lossy codec writes `codec_trace` (see there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import Config
from hsdp.data.tokens import Data
from hsdp.models.gpt import build_model, loss_fn
from tests.reference import set_torch_lr, torch_optimizers


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
    # other lossy codecs (int4, top-k, error feedback), per synced (started) step: name → (flip_bound,
    # margin), per element of the param:
    #   margin     = min over replicas of the relative perturbation of Δ_m (+ e_m) that could change
    #                what the codec sends for this element: a rounding tie, a top-k selection
    #                boundary, or (top-k + quantized values) a selection boundary of any chunk whose
    #                values share a quant block with it (it may move that block's absmax)
    #   flip_bound = mean over replicas of how far such a change can move this element's decoded
    #                value (a quant step; top-k: |x| + 2 quant steps of its chunk's blocks)
    codec_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)
    global_params: Optional[dict[str, torch.Tensor]] = None  # θ_g after the run (None: no θ_g)


# ---------------------------------------------------------------- schedule (docs/design.md §8)
def grad_sync_due(step: int, warmup: Optional[int]) -> bool:
    return warmup is None or step < warmup


def fragment_due(step: int, f: int, warmup: Optional[int], every: int, fragments: int) -> bool:
    """Fragment f syncs its params after step `step`."""
    if warmup is None or step < warmup:
        return False
    return (step + 1 - warmup - (f + 1) * every // fragments) % every == 0


def outer_hparams(method: str, outer_lr: Optional[float], outer_momentum: Optional[float]) -> tuple[float, float]:
    """η, μ with the defaults of docs/design.md §8 (average: 1, 0; diloco: 0.7, 0.9)."""
    lr0, mom0 = (1.0, 0.0) if method == "average" else (0.7, 0.9)
    return (lr0 if outer_lr is None else outer_lr, mom0 if outer_momentum is None else outer_momentum)


def outer_at(r: int, sc, eta: float, mu: float) -> tuple[float, float]:
    """η_r, μ_r of a unit's r-th outer step (item 8 of the module docstring)."""
    wm = sc.outer_momentum_warmup
    mu_r = mu * min(r, wm) / wm if wm > 0 else mu
    w = sc.outer_lr_warmup
    if r < w:
        return eta * (r + 1) / w, mu_r
    if sc.outer_lr_schedule == "constant":
        return eta, mu_r
    p = min(1.0, (r - w) / max(1, sc.outer_lr_rounds - 1 - w))
    lo = sc.outer_min_lr
    if sc.outer_lr_schedule == "cosine":
        return lo + (eta - lo) * (1 + math.cos(math.pi * p)) / 2, mu_r
    return eta + (lo - eta) * p, mu_r


# ---------------------------------------------------------------- int8 (block quantization)
def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    t = torch.trunc(v)
    frac = v - t  # exact in fp32 for |v| < 2^23
    return t + torch.sign(v) * (frac.abs() >= 0.5).to(v.dtype)


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 → (int8 values, one fp32 scale per block of `block` elements)."""
    return quantize_blocks(x, block, 127)


def quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 → (values in −7..7 as int8, one fp32 scale = absmax/7 per block); unpacked."""
    return quantize_blocks(x, block, 7)


def quantize_blocks(x: torch.Tensor, block: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: scale = absmax/qmax, q = clamp(round_half_away(x/scale), ±qmax) (q = 0 where scale = 0)."""
    x = x.reshape(-1).float()
    n = x.numel()
    nb = math.ceil(n / block)
    xb = torch.zeros(nb * block, dtype=torch.float32)  # a short last block, zero-padded: same absmax and q
    xb[:n] = x
    xb = xb.view(nb, block)
    scales = xb.abs().amax(dim=1) / qmax
    nonzero = scales > 0
    q = _round_half_away(xb / torch.where(nonzero, scales, torch.ones_like(scales))[:, None]).clamp(-qmax, qmax)
    q[~nonzero] = 0  # all-zero block: scale 0, q 0
    return q.reshape(-1)[:n].to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """q · the scale of its block (any integer q: int8 or int4 values)."""
    return q.float() * scales.repeat_interleave(block)[: q.numel()]


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


# ---------------------------------------------------------------- int4, top-k, error feedback
@dataclass(frozen=True)
class CodecSpec:
    """A lossy codec as the config names it (docs/design.md §8.5)."""

    quantize: str  # none | int8 | int4: the dense values, or top-k's selected values
    block: int  # quant_block
    k: int  # top-k entries per chunk, ⌈ρ·C⌉ (0: dense, no top-k)
    chunk: int  # topk_chunk
    error_feedback: bool

    @staticmethod
    def of(sc) -> Optional[CodecSpec]:
        """The lossy codec of a SyncConfig, None for fp32."""
        k = math.ceil(sc.topk * sc.topk_chunk) if sc.topk > 0 else 0
        if sc.quantize == "none" and k == 0:
            return None
        return CodecSpec(sc.quantize, sc.quant_block, k, sc.topk_chunk, sc.error_feedback)

    @property
    def qmax(self) -> int:
        return {"int8": 127, "int4": 7}[self.quantize]

    @property
    def legacy_int8(self) -> bool:
        """Plain int8 (no top-k, no error feedback): the original path of this reference."""
        return self.quantize == "int8" and self.k == 0 and not self.error_feedback


def topk_positions(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Flat positions kept by top-k: per chunk the min(k, len) largest |x|, ties to the lowest index,
    ascending within the chunk, chunks in order."""
    n = x.numel()
    nc = math.ceil(n / chunk)
    mag = torch.full((nc * chunk,), -1.0)  # padding of the last chunk: below every |x|
    mag[:n] = x.abs()  # |−0.0| = 0.0: a tie, as the spec's sign-cleared bit pattern
    # a stable descending sort keeps equal magnitudes in index order: the lowest index comes first
    order = torch.sort(mag.view(nc, chunk), dim=1, descending=True, stable=True).indices[:, :k]
    pos = (order.sort(dim=1).values + torch.arange(nc)[:, None] * chunk).reshape(-1)
    return pos[pos < n]  # a short last chunk: its padding sorted last and is dropped


def _rounding_margin(x: torch.Tensor, scales: torch.Tensor, block: int, qmax: int) -> torch.Tensor:
    """Per element: the relative change of x that moves x/scale onto a rounding tie (inf for 0)."""
    s = scales.repeat_interleave(block)[: x.numel()]
    y = x.abs() / torch.where(s > 0, s, torch.ones_like(s))
    frac = (y - y.floor() - 0.5).abs()
    margin = frac / y
    margin[y == 0] = math.inf
    return torch.where(y >= qmax, torch.full_like(margin, 0.5 / qmax), margin)  # the absmax: scale moves with it


def encode_decode(x: torch.Tensor, spec: CodecSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(D(C(x)), margin, flip_bound) of one replica's flat held shard (see SyncReferenceResult.codec_trace)."""
    n = x.numel()
    if spec.k == 0:
        q, scales = quantize_blocks(x, spec.block, spec.qmax)
        bound = scales.repeat_interleave(spec.block)[:n]  # one rounding flip: one step
        return dequantize_int8(q, scales, spec.block), _rounding_margin(x, scales, spec.block, spec.qmax), bound
    chunk, k = spec.chunk, spec.k
    pos = topk_positions(x, chunk, k)
    vals = x[pos]
    # selection margins: how close each element is to its chunk's k-th / (k+1)-th largest |x|
    nc = math.ceil(n / chunk)
    mag = torch.full((nc * chunk,), -1.0)
    mag[:n] = x.abs()
    ranked = torch.sort(mag.view(nc, chunk), dim=1, descending=True).values
    kth = ranked[:, k - 1]
    nxt = ranked[:, k] if k < chunk else torch.full((nc,), -1.0)  # -1: the chunk sends all its elements
    c_of = torch.arange(n) // chunk
    selected = torch.zeros(n, dtype=torch.bool)
    selected[pos] = True
    a = x.abs()
    gap = torch.where(selected, a - nxt[c_of], kth[c_of] - a)
    ref = torch.where(selected, a, kth[c_of])
    margin = torch.where(ref > 0, gap / torch.where(ref > 0, ref, torch.ones_like(ref)), torch.full_like(a, math.inf))
    margin[(nxt[c_of] < 0)] = math.inf  # nothing left out of this chunk: no selection to flip
    dec = torch.zeros(n)
    bound = a.clone()  # a selection flip: the element is sent or not
    if spec.quantize == "none":
        dec[pos] = vals
        return dec, margin, bound
    q, scales = quantize_blocks(vals, spec.block, spec.qmax)
    dec[pos] = dequantize_int8(q, scales, spec.block)
    nv = vals.numel()
    slot_block = torch.arange(nv) // spec.block
    slot_chunk = c_of[pos]
    # a chunk's selection flip can move any value of the blocks its slots share (their absmax)
    chunk_gap = (kth - nxt) / torch.where(kth > 0, kth, torch.ones_like(kth))
    chunk_gap[(nxt < 0) | (kth == 0)] = math.inf
    block_gap = torch.full((scales.numel(),), math.inf).scatter_reduce(0, slot_block, chunk_gap[slot_chunk], "amin")
    round_m = _rounding_margin(vals, scales, spec.block, spec.qmax)
    margin[pos] = torch.minimum(torch.minimum(margin[pos], round_m), block_gap[slot_block])
    chunk_scale = torch.zeros(nc).scatter_reduce(0, slot_chunk, scales[slot_block], "amax")
    bound += 2 * chunk_scale[c_of]  # re-rounding, also with another scale
    return dec, margin, bound


def compressed_mean_delta(
    deltas: list[list[torch.Tensor]], shard: int, spec: CodecSpec, errors: list[list[torch.Tensor]]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """mean_m D(C(Δ_m + e_m)) of one unit, per shard rank's flat held shard; deltas[m] per param.

    errors[m][k] is replica m's residual on shard rank k (updated in place with error feedback).
    Returns the mean per param, and per param the flip_bound and margin of `codec_trace`.
    """
    M = len(deltas)
    out = [torch.zeros_like(t) for t in deltas[0]]
    bounds = [torch.zeros_like(t) for t in deltas[0]]
    margins = [torch.zeros_like(t) for t in deltas[0]]
    for k in range(shard):
        acc = bnd = marg = None
        for m in range(M):
            x = flat_shard(deltas[m], k, shard)
            if spec.error_feedback:
                x = x + errors[m][k]
            dec, mg, bd = encode_decode(x, spec)
            if spec.error_feedback:
                errors[m][k] = x - dec
            acc = dec if acc is None else acc + dec
            bnd = bd / M if bnd is None else bnd + bd / M
            marg = mg if marg is None else torch.minimum(marg, mg)
        unflat_shard(acc / M, out, k, shard)
        unflat_shard(bnd, bounds, k, shard)
        unflat_shard(marg, margins, k, shard)
    return out, bounds, margins


# ---------------------------------------------------------------- the simulation
def reference_config(overrides: list[str], sync: int, shard: int, replicate: int = 1) -> Config:
    """One process holding the global batch (B·M·R·S rows)."""
    cfg = load_config(None, overrides)
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * sync * replicate * shard),
        mesh=dataclasses.replace(cfg.mesh, sync=1, replicate=1, shard=1),
    )


def sync_reference_run(overrides: list[str], sync: int, shard: int, replicate: int = 1) -> SyncReferenceResult:
    """Simulate `sync` replicas (each a shard group of `shard` ranks; with `replicate` > 1 each a site of
    that many such groups averaging grads every step) with periodic param sync."""
    torch.set_num_threads(1)
    cfg = reference_config(overrides, sync, shard, replicate)
    M, S = sync, shard
    RS = replicate * shard  # one replica's (site's) ranks: the rows of its batch
    B = cfg.data.batch_size // (M * RS)
    sc = cfg.sync
    warmup, every, P = sc.warmup_steps, sc.every, sc.fragments
    eta, mu = outer_hparams(sc.method, sc.outer_lr, sc.outer_momentum)
    codec = CodecSpec.of(sc)  # None: fp32
    delay, alpha = sc.delay, sc.alpha
    torchft, eager = sc.schedule == "torchft", sc.eager
    shift = delay if torchft else 0  # torchft: a sync starts τ steps before its slot and lands at it
    overlapped = delay > 0 or torchft  # item 5's path (torchft: also with τ = 0, where α mixes)
    # A delayed sync always takes the outer-step path: Δ is snapshotted against θ_g.
    plain_average = sc.method == "average" and codec is None and eta == 1.0 and mu == 0.0 and not overlapped

    models = [build_model(cfg.model, cfg.run.seed) for _ in range(M)]
    opts = [torch_optimizers(mdl, cfg) for mdl in models]  # optim.name=muon: torch.optim.Muon + AdamW
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
    rounds = [0] * len(unit_names)  # each unit's outer steps so far

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: params[0][n].detach().clone() for n in names}

    if warmup == 0:
        theta_g = snapshot()

    losses, synced_flags, frag_log, land_log = [], [], [], []
    # (land step, fragment, mean Δ per unit, eager: θ̂ per unit per replica)
    in_flight: list[tuple[int, int, dict[int, dict[str, torch.Tensor]], dict[int, list[dict[str, torch.Tensor]]]]] = []
    int8_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    codec_trace: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    # error feedback: unit → [replica m][shard rank k] residual, flat fp32 (allocated at the unit's first sync)
    errors: dict[int, list[list[torch.Tensor]]] = {}

    def unit_errors(u: int) -> Optional[list[list[torch.Tensor]]]:
        if codec is None or not codec.error_feedback:
            return None
        if u not in errors:
            n = sum(held_numel(params[0][name].shape, S) for name in unit_names[u])
            errors[u] = [[torch.zeros(n) for _ in range(S)] for _ in range(M)]
        return errors[u]

    def record(step: int, trace: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if trace:
            (int8_trace if codec.legacy_int8 else codec_trace).setdefault(step, {}).update(trace)

    def land(entry, landed: list[int]) -> None:
        """A delayed sync's outer step and merge, with the mean Δ taken when it started."""
        _, f, mean_deltas, estimates = entry
        for u in frag_units[f]:
            eta_r, mu_r = outer_at(rounds[u], sc, eta, mu)
            merge = alpha if u not in estimates else None
            _outer_update(
                unit_names[u], params, theta_g, buf, mean_deltas[u], eta_r, mu_r, sc.nesterov, merge, estimates.get(u)
            )
            rounds[u] += 1
        in_flight.remove(entry)
        landed.append(f)

    def eager_estimates(u: int) -> list[dict[str, torch.Tensor]]:
        """θ̂_m per replica (item 7), from θ_m as it is now; b and θ_g are not changed."""
        eta_r, mu_r = outer_at(rounds[u], sc, eta, mu)
        out = []
        for m in range(M):
            est = {}
            for n in unit_names[u]:
                d = theta_g[n] - params[m][n].detach()
                b = d.clone() if buf[n] is None else mu_r * buf[n] + d
                est[n] = theta_g[n] - eta_r * (d + mu_r * b if sc.nesterov else b)
            out.append(est)
        return out

    for step in range(cfg.run.steps):
        replica_losses = []
        for m in range(M):
            set_torch_lr(opts[m], cfg, step)
            total = 0.0
            for micro in range(accum):
                x, y = data.train_batch(step, micro)
                rows = slice(m * RS * B, (m + 1) * RS * B)
                loss = loss_fn(models[m](x[rows]), y[rows]) / accum
                loss.backward()
                total += loss.item()
            replica_losses.append(total)
        losses.append(sum(replica_losses) / M)

        if grad_sync_due(step, warmup):
            average_grads(params, names)

        for m in range(M):
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(models[m].parameters(), cfg.optim.grad_clip)
            for opt in opts[m]:
                opt.step()
                opt.zero_grad(set_to_none=True)

        if warmup is not None and step == warmup - 1:
            theta_g = snapshot()  # every replica holds the same params here

        due = [f for f in range(P) if fragment_due(step + shift, f, warmup, every, P)]
        landed: list[int] = []
        with torch.no_grad():
            for entry in [e for e in in_flight if e[0] == step]:  # delayed syncs landing now, oldest first
                land(entry, landed)
            for f in due:
                if overlapped:  # only the mean Δ now; the outer step after step + delay
                    mean_deltas, estimates = {}, {}
                    for u in frag_units[f]:
                        if eager:
                            estimates[u] = eager_estimates(u)
                        mean_deltas[u], trace = _mean_delta(unit_names[u], params, theta_g, codec, S, unit_errors(u))
                        record(step, trace)
                        for m, est in enumerate(estimates.get(u, [])):  # the replica trains on from θ̂_m
                            for n in unit_names[u]:
                                params[m][n].copy_(est[n])
                    entry = (step + delay, f, mean_deltas, estimates)
                    in_flight.append(entry)
                    if delay == 0:  # torchft with τ = 0: it lands where it starts (α mixes)
                        land(entry, landed)
                    continue
                eta_r, mu_r = outer_at(rounds[frag_units[f][0]], sc, eta, mu)
                for u in frag_units[f]:
                    rounds[u] += 1
                    trace = _sync_unit(
                        unit_names[u],
                        params,
                        theta_g,
                        buf,
                        plain_average,
                        codec,
                        eta_r,
                        mu_r,
                        sc.nesterov,
                        S,
                        unit_errors(u),
                    )
                    record(step, trace)
                landed.append(f)
            if step == cfg.run.steps - 1:  # the run ends: what is still in flight lands now
                for entry in list(in_flight):
                    land(entry, landed)
        synced_flags.append(bool(due))
        frag_log.append(due)
        land_log.append(landed)

    final = [{n: p.detach().clone() for n, p in mdl.named_parameters()} for mdl in models]
    final_g = None if theta_g is None else {n: t.clone() for n, t in theta_g.items()}
    return SyncReferenceResult(losses, synced_flags, final, frag_log, land_log, int8_trace, codec_trace, final_g)


@torch.no_grad()
def average_grads(params: list[dict[str, torch.Tensor]], names: list[str]) -> None:
    """Exact HSDP's grad sync: every replica's grad ← the mean over replicas, summed m = 0..M−1 in order."""
    for n in names:
        acc = params[0][n].grad.clone()
        for m in range(1, len(params)):
            acc += params[m][n].grad
        acc /= len(params)
        for p in params:
            p[n].grad.copy_(acc)


def _sync_unit(
    unit: list[str],
    params: list[dict[str, torch.Tensor]],
    theta_g,
    buf,
    plain_average: bool,
    codec: Optional[CodecSpec],
    eta: float,
    mu: float,
    nesterov: bool,
    shard: int,
    errors: Optional[list[list[torch.Tensor]]],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Sync one unit's params across replicas now; a lossy codec returns its trace (see _mean_delta)."""
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
    mean_delta, trace = _mean_delta(unit, params, theta_g, codec, shard, errors)
    _outer_update(unit, params, theta_g, buf, mean_delta, eta, mu, nesterov, None)
    return trace


def _mean_delta(
    unit: list[str],
    params: list[dict[str, torch.Tensor]],
    theta_g,
    codec: Optional[CodecSpec],
    shard: int,
    errors: Optional[list[list[torch.Tensor]]],
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The mean over replicas of Δ_m = θ_g − θ_m per param of the unit (lossy: coded per shard), and the trace.

    The trace is int8_trace's (quant_step, tie_margin) for plain int8, codec_trace's (flip_bound, margin)
    for the other lossy codecs; `errors` (error feedback) is updated in place.
    """
    M = len(params)
    if codec is not None:
        deltas = [[theta_g[n] - params[m][n].detach() for n in unit] for m in range(M)]
        if codec.legacy_int8:
            means, qsteps, margins = quantized_mean_delta(deltas, shard, codec.block)
        else:
            means, qsteps, margins = compressed_mean_delta(deltas, shard, codec, errors)
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
    estimates: Optional[list[dict[str, torch.Tensor]]] = None,
) -> None:
    """Outer SGD step on θ_g with Δ; then θ_m ← θ_g (alpha None: blocking) or α·θ_m + (1 − α)·θ_g, or with
    eager `estimates` θ_m ← θ_m + (θ_g − θ̂_m)."""
    for n in unit:
        d = mean_delta[n]
        buf[n] = d.clone() if buf[n] is None else mu * buf[n] + d
        step = d + mu * buf[n] if nesterov else buf[n]
        theta_g[n] -= eta * step
        for m in range(len(params)):
            if estimates is not None:
                new = params[m][n].detach() + (theta_g[n] - estimates[m][n])
            elif alpha is None:
                new = theta_g[n]
            else:
                new = alpha * params[m][n].detach() + (1 - alpha) * theta_g[n]
            params[m][n].copy_(new)
