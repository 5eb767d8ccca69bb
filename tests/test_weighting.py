"""Token-weighted outer means (sync.weighting=tokens, docs/design.md §8.12), codec by codec.

M replicas' SyncPolicy objects run in threads of one process over tests/loopback.py's transport, whose
collectives complete once every replica issued them (so blocking rounds work). Replica m trained w_m steps
since the last sync; one DiLoCo round with η = 1, μ = 0 moves every θ_m to θ_g − mean Δ, so the landed
params give the mean Δ the codec computed. Two oracles:

- the spec, written independently in tests/sync_reference.py: mean Δ = Σ_m w_m D(C(Δ_m)) / Σ_m w_m with
  D(C(·)) that reference's encode/decode (fp32, int8, int4, top-k with fp32 or int8 values);
- for every codec (int2 and SparseLoCo included): the unweighted round of Σ w_m replicas in which replica
  m's Δ appears w_m times — what a weight means. Top-k with `topk_mean: chosen` divides by the weight of
  the replicas that sent each coordinate, which the duplicated round does too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hsdp.config.schema import SyncConfig
from hsdp.sync.policy import SyncPolicy
from tests.loopback import ThreadedLoopback, run_in_threads
from tests.sync_reference import CodecSpec, encode_decode

SIZES = [300, 1111, 64]  # held elements per unit
WEIGHTS = [4, 1, 3]  # steps each replica trained since the last sync
BASE: dict[str, Any] = dict(warmup_steps=0, every=1, method="diloco", outer_lr=1.0, outer_momentum=0.0)
CODECS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": dict(quantize="int8", quant_block=32),
    "int4": dict(quantize="int4", quant_block=32),
    "int2": dict(quantize="int2", quant_block=32),
    "topk-fp32": dict(topk=0.1, topk_chunk=100),
    "topk-int8-chosen": dict(topk=0.2, topk_chunk=50, quantize="int8", quant_block=16, topk_mean="chosen"),
    "sparseloco": dict(
        topk=0.1, topk_chunk=64, quantize="int2", quant_block=16, error_feedback=True, topk_mean="chosen"
    ),
}
SPEC_CODECS = ["fp32", "int8", "int4", "topk-fp32"]  # what the reference's encode/decode writes out


def _deltas(M: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """θ_0 per unit, and replica m's local change per unit (θ_m = θ_0 + change: Δ_m = −change)."""
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in SIZES]
    changes = [[torch.randn(n, generator=g) * 0.1 for n in SIZES] for _ in range(M)]
    return init, changes


def _round(cfg: SyncConfig, init: list[torch.Tensor], changes: list[list[torch.Tensor]], steps: list[int]):
    """One weighted round of len(changes) replicas; (mean Δ per unit as replica 0 landed it, the policies)."""
    M = len(changes)
    loop = ThreadedLoopback(M)
    policies = [SyncPolicy(cfg, [t.clone() for t in init], loop.transport(m)) for m in range(M)]

    def replica(m: int) -> None:
        p = policies[m]
        for h, c in zip(p.held, changes[m]):
            h.add_(c)
        for _ in range(steps[m]):
            p.note_trained(0, applied=True)
        assert p.after_step(0)  # the round: weights, payloads, land

    run_in_threads([lambda m=m: replica(m) for m in range(M)])
    assert all(torch.equal(a, b) for p in policies[1:] for a, b in zip(p.held, policies[0].held))
    return [t0 - h for t0, h in zip(init, policies[0].held)], policies


@pytest.mark.parametrize("name", list(CODECS))
def test_a_weight_counts_a_replica_as_often_as_its_steps(name: str) -> None:
    cfg = SyncConfig(**BASE, **CODECS[name], weighting="tokens")
    init, changes = _deltas(len(WEIGHTS))
    weighted, policies = _round(cfg, init, changes, WEIGHTS)
    repeated = [c for c, w in zip(changes, WEIGHTS) for _ in range(w)]
    plain, _ = _round(SyncConfig(**BASE, **CODECS[name], weighting="equal"), init, repeated, [1] * len(repeated))
    for a, b in zip(weighted, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the ledger: every replica's steps reached θ_g, and the round saw everyone's weight
    assert [p.merged_steps for p in policies] == WEIGHTS and [p.trained_steps for p in policies] == WEIGHTS
    assert policies[0].round_weights == [[float(w) for w in WEIGHTS]]
    # and the weights matter: the equal mean of the three differs
    equal, _ = _round(SyncConfig(**BASE, **CODECS[name], weighting="equal"), init, changes, WEIGHTS)
    assert max((a - b).abs().max().item() for a, b in zip(weighted, equal)) > 1e-3


@pytest.mark.parametrize("name", SPEC_CODECS)
def test_the_weighted_mean_is_the_specs(name: str) -> None:
    cfg = SyncConfig(**BASE, **CODECS[name], weighting="tokens")
    init, changes = _deltas(len(WEIGHTS))
    got, _ = _round(cfg, init, changes, WEIGHTS)
    spec = CodecSpec.of(cfg)
    for u, mean in enumerate(got):
        decoded = [(-c[u]) if spec is None else encode_decode(-c[u], spec)[0] for c in changes]
        want = sum(w * d for w, d in zip(WEIGHTS, decoded)) / sum(WEIGHTS)
        torch.testing.assert_close(mean, want, rtol=1e-5, atol=1e-6)


def test_equal_weights_are_the_plain_mean_bit_for_bit() -> None:
    """Factors of exactly 1.0: a paced run whose replicas train alike computes the step-counted run's bits."""
    for name in ("fp32", "int8", "sparseloco"):
        init, changes = _deltas(3)
        weighted, _ = _round(SyncConfig(**BASE, **CODECS[name], weighting="tokens"), init, changes, [5, 5, 5])
        plain, _ = _round(SyncConfig(**BASE, **CODECS[name], weighting="equal"), init, changes, [5, 5, 5])
        assert all(torch.equal(a, b) for a, b in zip(weighted, plain)), name


def test_a_replica_that_trained_nothing_adds_nothing() -> None:
    init, changes = _deltas(3)
    got, _ = _round(SyncConfig(**BASE, weighting="tokens"), init, changes, [2, 0, 2])
    for u, mean in enumerate(got):
        torch.testing.assert_close(
            mean, -(changes[0][u] + changes[2][u]) / 2, rtol=1e-5, atol=1e-6
        )  # θ_0 − θ: ulps of θ


def test_each_fragment_weighs_the_steps_since_its_own_sync() -> None:
    """Streaming (P = 2, H = 2): fragment 0 syncs after steps 0, 2, …, fragment 1 after 1, 3, …; a fragment's
    weight is the steps trained since its own last sync began (a skipped step, not noted, is not counted)."""
    cfg = SyncConfig(**{**BASE, "every": 2}, fragments=2, weighting="tokens")
    init, _ = _deltas(1)
    p = SyncPolicy(cfg, [t.clone() for t in init], ThreadedLoopback(1).transport(0))
    for step in range(6):
        if step != 3:  # step 3 skipped (a paced replica's cut)
            p.note_trained(step, applied=True)
        p.after_step(step)
    # step 0: f0 (step 0); 1: f1 (0, 1); 2: f0 (1, 2); 3: f1 (2; 3 skipped); 4: f0 (4: 3 skipped); 5: f1 (4, 5)
    assert p.round_weights == [[1.0], [2.0], [2.0], [1.0], [1.0], [2.0]]
    assert p.trained_steps == 5 and p.merged_steps == pytest.approx((1 + 2 + 2 + 1 + 1 + 2) / 2)
