"""Sync policies (docs/design.md §8) on a 2×2 mesh against the independent reference in sync_reference.py.

Every multi-process run goes through `run_train` (with a timeout) and is made once per module
(`Runs` caches them). Cases:

  average   warmup 3, every 4                      16 steps (last step not a sync)
  diloco    warmup 3, every 4, η 0.7, μ 0.9         15 steps (last step 14 is a sync)
  frag      diloco, fragments 2, every 4           16 steps
  int8      diloco, int8, quant_block 64           16 steps
  int8first average + int8, quant_block 64          7 steps (ends at the first sync)
  sgd_w0    average, every 1, sgd, warmup 0        (linear: equals exact HSDP)
  sgd_hsdp  warmup null (exact HSDP)
  sgd_wall  warmup_steps = steps                   (equals sgd_hsdp bit for bit)
  delay_frag  frag with τ 3, α 0                   16 steps (two fragments in flight at once; one lands at the end)
  delay_avg   average with τ 1, α 0.5              16 steps (lands after 7, 11, 15)
  delay_int8  int8 with τ 3, α 0.5                 16 steps (the sync after step 14 lands at the end)
  torchft_frag  frag with schedule torchft, τ 1, α 0.5   (starts after 3, 5, 7, …; lands at the slots 4, 6, 8, …)
  torchft_tau0  frag with schedule torchft, τ 0, α 0.3   (α mixes at every blocking sync)
  eager       frag with τ 2 and eager updates       16 steps (fragment 1's last sync lands at the end)
  eager_int8  int8 + schedule torchft + eager, P 2, τ 1
  outer_sched diloco, μ warmup 2 rounds, η warmup 1 round then cosine to 0.1 at round 3

The policy alone (no model) runs on 2 gloo ranks in `python tests/test_sync.py policy OUT`:
a delayed sync landed at once equals the blocking one bit for bit, and state_dict → load into a
fresh policy → continue equals not stopping, bit for bit.

Byte formula checked (per rank, sync group of M, shard group of S; N_u = Σ over the unit's
params of ceil(d0/S)·prod(rest), the unit's held shard):
  warmup grad sync per step   Σ_u 2·(M−1)·4·N_u // M                    (fp32 all_reduce)
  fp32 param sync of unit u   2·(M−1)·4·N_u // M                        (all_reduce of Δ or θ)
  int8 param sync of unit u   (M−1)·(N_u + 4·ceil(N_u/block))           (all_gather q and scales)
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import SyncConfig
from hsdp.models.gpt import build_model
from tests.helpers import REPO, SMALL, hold_rendezvous, join_rendezvous, max_param_rel_err, rel_err, run_train
from tests.sync_reference import SyncReferenceResult, dequantize_int8, fragment_due, quantize_int8, sync_reference_run

M, S = 2, 2
MESH = [f"mesh.sync={M}", f"mesh.shard={S}"]
TOL = 1e-5
PERIODIC = ["sync.warmup_steps=3", "sync.every=4"]
FRAG2 = [*PERIODIC, "run.steps=16", "sync.method=diloco", "sync.fragments=2"]
SGD = ["optim.name=sgd", "optim.momentum=0", "optim.lr=0.05", "optim.min_lr=0.005", "optim.grad_clip=0", "run.steps=16"]

CASES: dict[str, list[str]] = {
    "average": [*PERIODIC, "run.steps=16"],
    "diloco": [*PERIODIC, "run.steps=15", "sync.method=diloco", "sync.outer_lr=0.7", "sync.outer_momentum=0.9"],
    "frag": [*PERIODIC, "run.steps=16", "sync.method=diloco", "sync.fragments=2"],
    "int8": [*PERIODIC, "run.steps=16", "sync.method=diloco", "sync.quantize=int8", "sync.quant_block=64"],
    "int8first": [*PERIODIC, "run.steps=7", "sync.quantize=int8", "sync.quant_block=64"],
    "sgd_w0": [*SGD, "sync.warmup_steps=0", "sync.every=1"],
    "sgd_hsdp": [*SGD, "sync.warmup_steps=null"],
    "sgd_wall": [*SGD, "sync.warmup_steps=16", "sync.every=4"],
    "delay_frag": [*PERIODIC, "run.steps=16", "sync.method=diloco", "sync.fragments=2", "sync.delay=3", "sync.alpha=0"],
    "delay_avg": [*PERIODIC, "run.steps=16", "sync.delay=1", "sync.alpha=0.5"],
    "delay_int8": [
        *PERIODIC,
        "run.steps=16",
        "sync.method=diloco",
        "sync.quantize=int8",
        "sync.quant_block=64",
        "sync.delay=3",
        "sync.alpha=0.5",
    ],
    "torchft_frag": [*FRAG2, "sync.schedule=torchft", "sync.delay=1", "sync.alpha=0.5"],
    "torchft_tau0": [*FRAG2, "sync.schedule=torchft", "sync.alpha=0.3"],
    "eager": [*FRAG2, "sync.delay=2", "sync.eager=true"],
    "eager_int8": [*FRAG2, "sync.quantize=int8", "sync.quant_block=64", "sync.schedule=torchft", "sync.delay=1"]
    + ["sync.eager=true"],
    "outer_sched": [*PERIODIC, "run.steps=16", "sync.method=diloco", "sync.outer_momentum_warmup=2"]
    + ["sync.outer_lr_warmup=1", "sync.outer_lr_schedule=cosine", "sync.outer_lr_rounds=3", "sync.outer_min_lr=0.1"],
}


def overrides(case: str) -> list[str]:
    return [*SMALL, *CASES[case]]


class Runs:
    """Each case's distributed run and reference, made on first use."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._runs, self._refs = {}, {}

    def run(self, case: str):
        if case not in self._runs:
            self._runs[case] = run_train(self.out, case, [*overrides(case), *MESH])
        return self._runs[case]

    def ref(self, case: str) -> SyncReferenceResult:
        if case not in self._refs:
            self._refs[case] = sync_reference_run(overrides(case), M, S)
        return self._refs[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("sync"))


def max_loss_rel_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def replica_gap(run) -> float:
    """How far replica 1's params are from replica 0's (max relative over params)."""
    return max_param_rel_err(run.params(1), run.params(0))


# ---------------------------------------------------------------- the schedule and the reference itself
def test_schedule_formula():
    """docs/design.md §8.2's formula, spelled out for the cases used here (a check of the reference's schedule)."""
    due = lambda f, P, w=3, H=4, steps=16: [s for s in range(steps) if fragment_due(s, f, w, H, P)]  # noqa: E731
    assert due(0, 1) == [6, 10, 14]
    assert due(0, 2) == [4, 8, 12] and due(1, 2) == [6, 10, 14]
    assert due(0, 1, w=0, H=1, steps=4) == [0, 1, 2, 3]
    assert due(0, 1, w=None) == [] and due(0, 1, w=16) == []


def test_steps_after_last_sync():
    """The tail a run trains after its last param sync (train.py warns when it is not 0), worked by hand."""
    from hsdp.sync.schedule import steps_after_last_sync

    assert steps_after_last_sync(600, SyncConfig(warmup_steps=0, every=32)) == 24  # last sync after step 575
    assert steps_after_last_sync(640, SyncConfig(warmup_steps=0, every=32)) == 0
    assert steps_after_last_sync(600, SyncConfig(warmup_steps=40, every=32)) == 16  # 40 + 17·32 = 584
    assert steps_after_last_sync(600, SyncConfig(warmup_steps=None)) == 0  # exact HSDP has no tail
    assert steps_after_last_sync(20, SyncConfig(warmup_steps=30, every=4)) == 0  # all warmup
    # Fragments 2, H=4, warmup 0: fragment 0 syncs after steps 1, 5, 9, fragment 1 after 3, 7, 11.
    assert steps_after_last_sync(12, SyncConfig(warmup_steps=0, every=4, fragments=2)) == 2
    assert steps_after_last_sync(33, SyncConfig(warmup_steps=0, every=32)) == 1


def test_train_warns_when_run_ends_between_syncs(capsys):
    import train

    train.warn_unsynced_end(load_config(str(REPO / "configs/tiny.yaml"), ["sync.warmup_steps=0", "sync.every=32"]))
    assert "the last 24 steps come after the last param sync" in capsys.readouterr().err
    for ends_on_sync in (["sync.warmup_steps=0", "sync.every=32", "run.steps=640"], []):
        train.warn_unsynced_end(load_config(str(REPO / "configs/tiny.yaml"), ends_on_sync))
        assert capsys.readouterr().err == ""


def test_reference_quantizer_rounds_half_away_from_zero():
    # absmax 127 → scale exactly 1, so x/scale = x and the rounding is visible directly
    x = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 0.49, 126.5, -1.5, 0.0, 0.0, 0.0, 0.0])
    q, s = quantize_int8(x, 8)
    assert s.tolist() == [1.0, 0.0]  # second block is all zero: scale 0, q 0
    assert q.tolist() == [127, 3, -3, 1, -1, 0, 127, -2, 0, 0, 0, 0]
    y = torch.tensor([-254.0, 1.0, 127.0, 3.0])  # scale 2: -127, round(0.5)=1, round(63.5)=64, round(1.5)=2
    q, s = quantize_int8(y, 4)
    assert s.tolist() == [2.0] and q.tolist() == [-127, 1, 64, 2]
    assert torch.equal(dequantize_int8(q, s, 4), torch.tensor([-254.0, 2.0, 128.0, 4.0]))


# ---------------------------------------------------------------- distributed run == reference
@pytest.mark.parametrize(
    "case",
    ["average", "diloco", "frag", "delay_frag", "delay_avg", "torchft_frag", "torchft_tau0", "eager"] + ["outer_sched"],
)
def test_matches_reference(runs: Runs, case: str):
    run, ref = runs.run(case), runs.ref(case)
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    for m in range(M):
        err = max_param_rel_err(run.params(m), ref.params[m])
        assert err <= TOL, f"{case}: replica {m} params differ from the reference by {err:.3g}"


def test_int8_first_sync_matches_reference_up_to_rounding_ties(runs: Runs):
    """average + int8, ending right after the first sync: exact up to int8 rounding-tie flips.

    int8 rounding is discontinuous: a Δ_m that the engine and the reference hold ~1e-7 apart
    (fp32 reduction order of the sharded grads, as in every other case) rounds to different
    int8 values when x/scale sits within that noise of a .5 tie. Each such flip moves its element
    by one int8 step of one replica (scale_m / M), ~5e-5 abs here, which alone is 3e-5–8e-5 of a
    whole param's norm (measured: 8 flips in 50400 elements, each at a tie margin < 1e-3). So the
    check is element-wise: every element agrees to 1e-5 (relative, per param) except a few, and
    each of those is at most one step off and was at a tie in the reference.
    """
    run, ref = runs.run("int8first"), runs.ref("int8first")
    assert ref.synced == [False] * 6 + [True]
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    check_equal_up_to_int8_ties([run.params(m) for m in range(M)], ref, 6)


def check_equal_up_to_int8_ties(params: list[dict[str, torch.Tensor]], ref: SyncReferenceResult, step: int) -> None:
    """Right after an int8 sync with η = 1, μ = 0 (where one flip moves θ by scale_m / M <= quant_step)."""
    trace = ref.int8_trace[step]
    total = flipped = 0
    for m, eng in enumerate(params):
        assert eng.keys() == ref.params[m].keys() == trace.keys()
        for name, (qstep, margin) in trace.items():
            r = ref.params[m][name]
            d = (eng[name] - r).abs()
            flip = d > 0.1 * qstep + 1e-6 * float(r.abs().max())
            assert bool((d[flip] <= 1.1 * qstep[flip]).all()), f"{name}: off by more than one int8 step"
            assert bool((margin[flip] <= 0.05).all()), (
                f"{name}: int8 values differ where the reference is not near a rounding tie"
            )
            patched = torch.where(flip, r, eng[name])
            assert rel_err(patched, r) <= TOL, f"{name}: {rel_err(patched, r):.3g} outside flipped elements"
            total += d.numel()
            flipped += int(flip.sum())
    assert flipped <= 1e-3 * total, f"{flipped} of {total} elements differ by an int8 step"


@pytest.mark.parametrize("case", ["int8", "delay_int8", "eager_int8"])
def test_int8_long_run_matches_reference(runs: Runs, case: str):
    """Losses to 1e-5; params within 1e-3, well below the effect of quantizing at all.

    After a rounding-tie flip (see the test above) the two runs' params differ by ~1e-4 relative
    and Adam carries that on (measured 1.7e-4 and 3.3e-4 at 16 steps, in runs with different
    kernel revisions), so 1e-5 cannot hold for params here.
    The bound is kept meaningful by asserting it is < 0.3× the distance between the int8 and the
    fp32 reference (3.2e-3); quantizing with the wrong shard layout moves params as far (3.4e-3).
    delay_int8 (τ 3, α 0.5, ending with a sync landed at the end) and eager_int8 (schedule torchft, eager)
    are held to the same bounds.
    """
    run, ref = runs.run(case), runs.ref(case)
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    fp32 = sync_reference_run([o for o in overrides(case) if not o.startswith("sync.quant")], M, S)
    effect = max_param_rel_err(ref.params[0], fp32.params[0])
    for m in range(M):
        err = max_param_rel_err(run.params(m), ref.params[m])
        assert err <= 1e-3 and err <= 0.3 * effect, (m, err, effect)


# ---------------------------------------------------------------- linearity and warmup = whole run
def test_average_every_step_with_sgd_equals_exact_hsdp(runs: Runs):
    """SGD (momentum 0, no clipping) is linear: averaging params every step = averaging grads."""
    w0, hsdp = runs.run("sgd_w0"), runs.run("sgd_hsdp")
    assert all(m["synced"] for m in w0.metrics)
    assert max_loss_rel_err(w0.losses, hsdp.losses) <= TOL
    for m in range(M):
        assert max_param_rel_err(w0.params(m), hsdp.params(m)) <= TOL
    assert max_param_rel_err(hsdp.params(0), runs.ref("sgd_hsdp").params[0]) <= TOL


def test_warmup_covering_the_run_is_exact_hsdp_bit_for_bit(runs: Runs):
    wall, hsdp = runs.run("sgd_wall"), runs.run("sgd_hsdp")
    assert wall.losses == hsdp.losses
    assert [m["sync_bytes"] for m in wall.metrics] == [m["sync_bytes"] for m in hsdp.metrics]
    assert not any(m["synced"] for m in wall.metrics)
    for m in range(M):
        a, b = wall.params(m), hsdp.params(m)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- synced flags and sync bytes
def unit_sizes(case: str) -> list[int]:
    """N_u: elements of one rank's held shard of each unit."""
    model = build_model(load_config(None, overrides(case)).model, 0)
    return [sum(math.ceil(p.shape[0] / S) * math.prod(p.shape[1:]) for p in unit.parameters()) for unit in model.units]


def fp32_all_reduce_bytes(n: int) -> int:
    return 2 * (M - 1) * 4 * n // M


def int8_sync_bytes(n: int, block: int) -> int:
    return (M - 1) * (n + 4 * math.ceil(n / block))


def expected_sync_bytes(case: str) -> list[int]:
    """Bytes this rank sends on the sync group at each step (docs/design.md §8.2 schedule, formula above)."""
    cfg = load_config(None, overrides(case))
    sc = cfg.sync
    sizes = unit_sizes(case)
    out = []
    for s in range(cfg.run.steps):
        b = sum(fp32_all_reduce_bytes(n) for n in sizes) if sc.warmup_steps is None or s < sc.warmup_steps else 0
        shift = sc.delay if sc.schedule == "torchft" else 0  # torchft: a sync starts τ before its slot
        for f in range(sc.fragments):
            if fragment_due(s + shift, f, sc.warmup_steps, sc.every, sc.fragments):
                for u in range(f, len(sizes), sc.fragments):
                    b += (
                        int8_sync_bytes(sizes[u], sc.quant_block)
                        if sc.quantize == "int8"
                        else fp32_all_reduce_bytes(sizes[u])
                    )
        out.append(b)
    return out


@pytest.mark.parametrize(
    "case",
    ["average", "diloco", "frag", "int8", "sgd_w0", "sgd_hsdp", "delay_frag", "delay_avg", "delay_int8"]
    + ["torchft_frag", "torchft_tau0", "eager_int8"],
)
def test_synced_flags_and_sync_bytes(runs: Runs, case: str):
    """`synced` marks the steps a sync starts after (τ = 0: also lands); its bytes count on that step."""
    run, ref = runs.run(case), runs.ref(case)
    metrics = run.metrics
    assert [m["step"] for m in metrics] == list(range(len(ref.synced)))
    assert [m["synced"] for m in metrics] == ref.synced
    cum = [m["sync_bytes"] for m in metrics]
    per_step = [b - a for a, b in zip([0, *cum], cum)]
    assert per_step == expected_sync_bytes(case)
    assert run.summary["sync_bytes"] == cum[-1]


def test_synced_steps_follow_the_formula(runs: Runs):
    steps = lambda case: [m["step"] for m in runs.run(case).metrics if m["synced"]]  # noqa: E731
    assert steps("average") == [6, 10, 14]
    assert steps("diloco") == [6, 10, 14]
    assert steps("frag") == [4, 6, 8, 10, 12, 14]  # fragment 0 after 4, 8, 12; fragment 1 after 6, 10, 14
    assert steps("delay_frag") == steps("frag")  # τ moves where a sync lands, not where it starts
    assert steps("torchft_tau0") == steps("frag")
    # schedule torchft: τ before the slot (§8.9); the one after step 15 (slot 16) lands at the end
    assert steps("torchft_frag") == [3, 5, 7, 9, 11, 13, 15]


def test_reference_lands_delayed_syncs_tau_steps_later(runs: Runs):
    """The reference's landing schedule, by hand: τ after the start, and whatever is in flight at the end."""
    landed = lambda case: {s: f for s, f in enumerate(runs.ref(case).landed) if f}  # noqa: E731
    assert landed("frag") == {4: [0], 6: [1], 8: [0], 10: [1], 12: [0], 14: [1]}  # τ = 0: lands where it starts
    assert landed("delay_frag") == {7: [0], 9: [1], 11: [0], 13: [1], 15: [0, 1]}  # 14 + 3 is past step 15
    assert landed("delay_avg") == {7: [0], 11: [0], 15: [0]}
    assert landed("delay_int8") == {9: [0], 13: [0], 15: [0]}
    assert landed("torchft_frag") == {**landed("frag"), 15: [0]} and landed("torchft_tau0") == landed("frag")
    assert landed("eager") == {6: [0], 8: [1], 10: [0], 12: [1], 14: [0], 15: [1]}
    # the delay changes the result (so matching the reference checks the delayed path)
    assert max_param_rel_err(runs.ref("delay_frag").params[0], runs.ref("frag").params[0]) > 1e-3


@pytest.mark.parametrize(
    "case,without",
    [
        ("torchft_frag", "sync.schedule=torchft"),  # the same τ and α on schedule hsdp
        ("torchft_tau0", "sync.alpha=0.3"),
        ("eager", "sync.eager=true"),
        ("outer_sched", "sync.outer_lr_schedule=cosine"),
    ],
)
def test_each_option_changes_the_reference(runs: Runs, case: str, without: str):
    """So matching the reference checks the option's own path (items 6-8 of tests/sync_reference.py)."""
    drop = {without} | ({"sync.outer_lr_rounds=3", "sync.outer_min_lr=0.1"} if case == "outer_sched" else set())
    other = sync_reference_run([o for o in overrides(case) if o not in drop], M, S)
    assert max_param_rel_err(runs.ref(case).params[0], other.params[0]) > 1e-3, case


def test_int8_sync_sends_about_a_quarter_of_fp32(runs: Runs):
    def per_sync(case):
        m = runs.run(case).metrics
        return m[6]["sync_bytes"] - m[5]["sync_bytes"]  # the first sync (after step 6)

    ratio = per_sync("int8") / per_sync("diloco")
    assert 0.25 <= ratio <= 0.3, ratio  # (1 + 4/64)/4 = 0.266 with block 64 on M = 2


# ---------------------------------------------------------------- replicas agree right after a sync only
def test_replicas_identical_after_sync_and_different_between(runs: Runs):
    for case in ("diloco", "int8first"):  # last step is a sync
        run = runs.run(case)
        assert run.metrics[-1]["synced"]
        a, b = run.params(0), run.params(1)
        assert all(torch.equal(a[k], b[k]) for k in a), case
    for case in ("average", "frag", "int8"):  # last step is not a sync
        run = runs.run(case)
        assert not run.metrics[-1]["synced"]
        assert replica_gap(run) > 1e-4, case


def test_delayed_sync_landing_at_the_end_leaves_replicas_identical_only_with_alpha_0(runs: Runs):
    """delay_frag (α 0): both fragments land after the last step, so every replica holds θ_g.
    With α 0.5 each replica keeps half of its own τ local steps."""
    run = runs.run("delay_frag")
    assert not run.metrics[-1]["synced"]  # the landing is not a start
    a, b = run.params(0), run.params(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for case in ("delay_avg", "delay_int8"):
        assert replica_gap(runs.run(case)) > 1e-4, case


# ---------------------------------------------------------------- the policy alone, on 2 gloo ranks
POLICY_UNITS = [1000, 37, 515]  # held-shard sizes; 37 and 515 are not multiples of the quant block


def fake_update(held: list[torch.Tensor], step: int, rank: int, warmup: int) -> None:
    """Stands in for an optimizer step: replicas move alike during warmup (as with averaged grads), apart after."""
    for u, h in enumerate(held):
        g = torch.Generator().manual_seed(1000 * step + 10 * u + (rank if step >= warmup else 0))
        h.add_(torch.randn(h.numel(), generator=g), alpha=0.01)


def initial_held() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in POLICY_UNITS]


def policy_tensors(policy) -> list[torch.Tensor]:
    """θ_m, θ_g and b of every unit (what must agree bit for bit)."""
    out = list(policy.held)
    for s in policy.outer:
        out += [s.global_params, s.momentum] if s.momentum is not None else [s.global_params]
    return out


def bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check_delayed_landed_at_once_equals_blocking(rank: int, comm) -> dict[str, bool]:
    """τ = 0 is the blocking sync: a τ = 1 sync's start + land with nothing in between gives the same bits."""
    from hsdp.comm.transport import GroupTransport
    from hsdp.sync.policy import SyncPolicy

    results = {}
    for name, cfg in {
        "diloco": SyncConfig(warmup_steps=0, every=4, method="diloco"),
        "diloco_int8": SyncConfig(warmup_steps=0, every=4, method="diloco", quantize="int8", quant_block=64),
        "average_int8": SyncConfig(warmup_steps=0, every=4, quantize="int8", quant_block=64),
    }.items():
        blocking = SyncPolicy(cfg, initial_held(), GroupTransport(comm))
        delayed = SyncPolicy(dataclasses.replace(cfg, delay=1, alpha=0.0), initial_held(), GroupTransport(comm))
        async_started = True
        for step in range(2):  # the second sync's momentum is not the first's Δ
            fake_update(blocking.held, step, rank, 0)
            fake_update(delayed.held, step, rank, 0)
            blocking.land([blocking.start(0, step)])
            started = delayed.start(0, step)
            async_started &= all(w.work is not None for r in started.reductions for w in r.works)
            delayed.land([started])
        results[f"{name}: bitwise"] = bitwise_equal(policy_tensors(blocking), policy_tensors(delayed))
        results[f"{name}: reductions launched async"] = async_started
    return results


def check_resume_from_state_dict(rank: int, comm) -> dict[str, bool]:
    """state_dict → torch.save/load → a fresh policy → continue == never stopping, bit for bit."""
    import io

    from hsdp.comm.transport import GroupTransport
    from hsdp.sync.policy import SyncPolicy

    steps, warmup = 14, 2
    # fragment 0 starts after 3, 7, 11 and lands 3 later; fragment 1 starts after 5, 9, 13
    results = {}
    for name, quantize in (("fp32", "none"), ("int8", "int8")):
        cfg = SyncConfig(
            warmup_steps=warmup,
            every=4,
            fragments=2,
            method="diloco",
            quantize=quantize,
            quant_block=64,
            delay=3,
            alpha=0.5,
        )

        def run(cfg: SyncConfig, stop_after: Optional[int]) -> tuple[list[torch.Tensor], int]:
            held = initial_held()
            policy = SyncPolicy(cfg, held, GroupTransport(comm))
            in_flight_at_stop = -1
            for step in range(steps):
                fake_update(held, step, rank, warmup)
                policy.after_step(step)
                if step == stop_after:
                    in_flight_at_stop = len(policy.in_flight)
                    buf = io.BytesIO()
                    torch.save(policy.state_dict(), buf)
                    buf.seek(0)
                    held = [h.clone() for h in held]  # the engine restores its held shards from its own state
                    policy = SyncPolicy(cfg, held, GroupTransport(comm))
                    policy.load_state_dict(torch.load(buf))  # weights_only: plain containers and tensors
            policy.finish()
            assert not policy.in_flight
            return policy_tensors(policy), in_flight_at_stop

        straight, _ = run(cfg, None)
        for stop_after, in_flight in ((0, 0), (7, 2), (8, 1)):  # in warmup (no θ_g yet); two / one in flight
            resumed, n = run(cfg, stop_after)
            results[f"{name}: stop after {stop_after}: {n} in flight"] = n == in_flight
            results[f"{name}: stop after {stop_after}: bitwise"] = bitwise_equal(straight, resumed)
    return results


def _policy_worker(rank: int, port: int, out: str) -> None:
    import json

    import torch.distributed as dist

    from hsdp.comm.groups import Comm
    from hsdp.run.rank import shutdown_process_group

    torch.set_num_threads(1)
    join_rendezvous(port, rank, world_size=2)
    try:
        comm = Comm({"sync": dist.group.WORLD})
        results = {
            **check_delayed_landed_at_once_equals_blocking(rank, comm),
            **check_resume_from_state_dict(rank, comm),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        shutdown_process_group()


def test_policy_delayed_equals_blocking_at_once_and_resumes_exactly(tmp_path: Path):
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/test_sync.py"), "policy", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 6 + 12 and all(results.values()), (rank, results)


# ---------------------------------------------------------------- entry point of the policy checks' subprocess
def main(argv: list[str]) -> int:
    """`policy OUT`: the 2-rank policy checks, each rank writing OUT/rank{r}.json."""
    import torch.multiprocessing as mp

    store = hold_rendezvous()  # listening until both ranks are done
    mp.start_processes(_policy_worker, args=(store.port, argv[1]), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
