"""Paced rounds (sync.every_s, hsdp/sync/pace.py) against the independent reference in paced_reference.py.

Runs (2 replicas × 2 shard ranks, warmup 0, H = 4, diloco, 16 steps: rounds after 3, 7, 11, 15):

  uneven   window 2 s; replica 1 slowed 150× from step 4, replica 0 at full speed (20-80 ms a step on 2
           loaded cores): the first period is at full speed (both train 4 in its window), then replica 1
           fits one step per window (a second would end 2·150·t ≥ 2 s past the meeting for any step time t ≥ 6.7 ms) and
           replica 0 all four (it would need steps ≥ 500 ms to lose one). grad_accum 2, so the data
           position covers every micro-batch. Every step is logged: a paced run logs the logging replica's
           own loss (a mean over its ranks only), so a logged step does not hold replica 0 until replica 1
           got there (a mean over all ranks did, and paced both replicas alike).
  fit      window 1000 s, no slowdown: every replica trains every step
  counted  the step-counted run (every_s 0) the fit run must equal bit for bit

The step counts the reference simulates are read from the run's summary (paced_period_steps), never
written here; the test asserts separately that they are uneven, so it cannot pass by both sides doing
the unpaced thing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import SMALL, max_param_rel_err, run_train
from tests.paced_reference import paced_reference_run
from tests.sync_reference import sync_reference_run

M, S, H, STEPS, ACCUM = 2, 2, 4, 16, 2
MESH = [f"mesh.sync={M}", f"mesh.shard={S}"]
BASE = [
    *SMALL,
    "sync.warmup_steps=0",
    f"sync.every={H}",
    "sync.method=diloco",
    f"run.steps={STEPS}",
    f"optim.grad_accum={ACCUM}",
    "run.checkpoint_every=0",
]
CASES: dict[str, list[str]] = {
    "uneven": [
        "sync.every_s=2",
        "run.slowdown=150",
        "run.slow_replica=1",
        "run.slow_from=4",
        "run.log_every=1",
        "run.checkpoint_every=8",  # a checkpoint after the round of step 7: the resume case starts there
        # replica 0 waits ~150x a step of replica 1 at each round: 7 s quiet, a minute on a loaded box (a resumed
        # life's first step is slowed from its own, colder time); the collectives' bound must outlast that
        "mesh.timeout_s=180",
    ],
    "fit": ["sync.every_s=1000"],
    "counted": ["sync.every_s=0"],
}
CASES["resumed"] = CASES["uneven"]  # from the uneven run's step-7 checkpoint
CASES["elastic"] = [  # torchft, no checkpoint
    *(o for o in CASES["uneven"] if not o.startswith("run.checkpoint_every")),
    "elastic.enabled=true",
    "elastic.timeout_s=5",
]
# Engine vs reference: fp32 reduction order differs (the shard group's reduce-scatter of grads; the weighted
# mean as Σ_j (M·w_j/Σw)·Δ_j / M in the engine, θ_g − Σ w_m θ_m / Σw here), ~1e-7 per op, which Adam
# (eps 1e-6) carries through 16 steps to ~1e-6 (measured 1.4e-6): the bound test_sync.py holds its runs to.
# What the check must see is far above it (measured on the uneven run's counts): the rounds weighted equally
# instead of 4:1, 0.2 (asserted below); the slow replica reading the batch of the nominal step instead of its
# position, 1.4e-2; its LR taken at the position instead of the nominal step, 1.6e-2.
TOL = 1e-5
TOKENS_PER_STEP = 2 * 17 * S * ACCUM  # one replica's: data.batch_size × model.seq_len × shard ranks × grad_accum


class Runs:
    def __init__(self, out: Path) -> None:
        self.out, self._runs = out, {}

    def run(self, case: str, extra: tuple[str, ...] = ()):
        if case not in self._runs:
            self._runs[case] = run_train(self.out, case, [*BASE, *CASES[case], *MESH, *extra], timeout=420)
        return self._runs[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("paced"))


def period_counts(run) -> list[list[int]]:
    ledger = run.summary["replica_ledger"]
    assert sorted(ledger) == [str(m) for m in range(M)], ledger
    return [list(ledger[str(m)]["paced_period_steps"]) for m in range(M)]


def test_uneven_speeds_match_the_weighted_reference(runs: Runs):
    run = runs.run("uneven")
    summary = run.summary
    counts = period_counts(run)
    trained = [sum(c) for c in counts]
    assert all(len(c) == STEPS // H for c in counts), counts
    assert counts[0][0] == counts[1][0] == H, (
        f"the first period (full speed: the slowdown starts at step 4) lost steps: {counts}"
    )
    assert trained[1] < trained[0], f"replica 1 (slowed) did not train fewer steps than replica 0: {counts}"

    ledger = summary["replica_ledger"]
    for m in range(M):
        entry = ledger[str(m)]
        assert entry["paced_cut_steps"] == STEPS - trained[m], (m, entry, counts)
        assert entry["trained_tokens"] == trained[m] * TOKENS_PER_STEP, (m, entry, counts)
        assert entry["merged_tokens"] == entry["trained_tokens"], (m, entry)  # the run ends on a sync
    assert summary["goodput"] == 1.0, summary["goodput"]
    assert summary["tokens"] == sum(trained) * TOKENS_PER_STEP  # the replicas' own steps, not rank 0's for all

    # The pacing keys only decide which steps train (the counts); the reference is given those instead.
    ref = paced_reference_run(BASE, counts, M, S)
    assert ref.trained == trained
    final = [run.params(m) for m in range(M)]
    assert max_param_rel_err(final[1], final[0]) <= TOL, "the replicas differ after the final sync"
    errs = [max_param_rel_err(final[m], ref.params[m]) for m in range(M)]
    assert max(errs) <= TOL, f"replica params differ from the weighted reference by {errs}"

    # The tolerance discriminates: the same steps with the plain (equal-weight) mean land far away.
    equal = paced_reference_run(BASE, counts, M, S, weighting="equal")
    wrong = max_param_rel_err(final[0], equal.params[0])
    assert wrong > 100 * TOL, f"equal weighting is only {wrong:.3g} from the run: the check would not see it"


def test_a_window_that_fits_every_step_is_the_step_counted_run(runs: Runs):
    """Equal speeds, a window of 1000 s: every period trains H steps, each round's weights are 4:4 (factor
    exactly 1.0), positions are the steps: the same computation as sync.every_s = 0, bit for bit."""
    fit, counted = runs.run("fit"), runs.run("counted")
    assert period_counts(fit) == [[H] * (STEPS // H)] * M
    assert all(fit.summary["replica_ledger"][str(m)]["paced_cut_steps"] == 0 for m in range(M))
    # a paced run logs its logging replica's loss (a mean over replica 0's ranks), the step-counted one all ranks'
    ref = paced_reference_run(BASE, [[H] * (STEPS // H)] * M, M, S)
    assert len(fit.losses) == STEPS
    assert max(abs(a - row[0]) / abs(row[0]) for a, row in zip(fit.losses, ref.losses)) <= TOL
    assert max(abs(a - b) for a, b in zip(fit.losses, counted.losses)) > 0  # so the two logs really differ
    for m in range(M):
        a, b = fit.params(m), counted.params(m)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"replica {m}'s params are not bitwise equal"


def test_a_resumed_paced_run_goes_on_from_each_replicas_own_position(runs: Runs):
    """Resumed at the round after step 7: each rank's checkpoint holds its replica's skipped steps (its data
    position), periods and round ledger, so the resumed run is the weighted reference's for its split of steps, and,
    where the wall clock gave the same split (a quiet box), trains what the uninterrupted one trained (the slow
    replica's first period after the resume is paced from its start)."""
    whole = runs.run("uneven")
    step_7 = whole.run_dir / "checkpoints" / "step_7"
    assert step_7.is_dir(), sorted(p.name for p in (whole.run_dir / "checkpoints").iterdir())
    resumed = runs.run("resumed", (f"run.resume={step_7}",))
    counts, before = period_counts(resumed), 8 // H  # the periods of steps 0-7 come from the checkpoint
    assert [c[:before] for c in counts] == [c[:before] for c in period_counts(whole)], (counts, period_counts(whole))
    # Each later period's split is the wall clock's: the same in both runs on a quiet box, but a load spike in one of
    # them (two busy loops beside the suite) cuts a period there and not in the other. Whatever the split, the resumed
    # run is the weighted reference's for its own counts (its data positions and rounds carried by the checkpoint).
    ref = paced_reference_run(BASE, counts, M, S)
    assert max(max_param_rel_err(resumed.params(m), ref.params[m]) for m in range(M)) <= TOL, counts
    for m in range(M):
        assert resumed.summary["replica_ledger"][str(m)]["trained_tokens"] == sum(counts[m]) * TOKENS_PER_STEP, m
    if counts == period_counts(whole):  # the same split: what the uninterrupted run trained, bit for bit
        for m in range(M):
            a, b = resumed.summary["replica_ledger"][str(m)], whole.summary["replica_ledger"][str(m)]
            assert (a["trained_tokens"], a["merged_tokens"], a["skipped_steps"]) == (
                b["trained_tokens"],
                b["merged_tokens"],
                b["skipped_steps"],
            ), (m, a, b)
            assert max_param_rel_err(resumed.params(m), whole.params(m)) <= TOL, m


def test_elastic_paced_rounds_match_the_weighted_reference(runs: Runs):
    """The same uneven replicas on torchft (each replica its own world, its quorum's waits in the ledger):
    the weights travel through torchft's all-gather and the params are the reference's for the counts."""
    run = runs.run("elastic")
    counts = period_counts(run)
    assert sum(counts[1]) < sum(counts[0]), counts
    assert run.summary["goodput"] == 1.0 and run.summary["replica_failures"] == 0
    ref = paced_reference_run(BASE, counts, M, S)
    for m in range(M):
        assert max_param_rel_err(run.params(m), ref.params[m]) <= TOL, m


@pytest.mark.parametrize("method", ["diloco", "average"])
def test_reference_with_full_periods_is_sync_reference(method: str):
    """The anchor: all H steps every period, equal weights → sync_reference_run's result (to 1e-6)."""
    overrides = [*BASE, f"sync.method={method}"]
    full = [[H] * (STEPS // H)] * M
    ref = paced_reference_run(overrides, full, M, S, weighting="equal")
    anchor = sync_reference_run(overrides, M, S)
    for m in range(M):
        assert max_param_rel_err(ref.params[m], anchor.params[m]) <= 1e-6
    assert ref.trained == [STEPS] * M and all(v is not None for row in ref.losses for v in row)
    losses = [sum(row) / M for row in ref.losses]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, anchor.losses)) <= 1e-6
    # tokens weighting with equal counts is the same mean (w = 4, 4)
    tokens = paced_reference_run(overrides, full, M, S, weighting="tokens")
    assert max_param_rel_err(tokens.params[0], anchor.params[0]) <= 1e-6
