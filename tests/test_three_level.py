"""The three-level mesh (docs/design.md §4.1): sites × in-site replicas × shards.

The distributed runs are held to the independent single-process reference of
tests/sync_reference.py, where a site is one replica whose batch is its R·S
ranks' rows; the equivalences of the issue are checked run against run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsdp.config.schema import ConfigError
from hsdp.plan.model import Compute, Link, Timeline
from hsdp.plan.workload import build_workload
from hsdp.run.preflight import check_world_size, load_checked_config
from tests.helpers import REPO, SMALL, STEP_SCOPE, max_param_rel_err, run_train
from tests.reference import reference_run
from tests.sync_reference import sync_reference_run

TOL = 1e-5
PERIODIC = ["sync.warmup_steps=3", "sync.every=4", "run.steps=12"]
SITES = ["mesh.sync=2", "mesh.replicate=2", "mesh.shard=1"]  # 2 sites × 2 in-site replicas
CASES: dict[str, list[str]] = {
    "diloco": [*PERIODIC, "sync.method=diloco", "sync.outer_lr=0.7", "sync.outer_momentum=0.9"],
    "average": [*PERIODIC],
    "frag_delay": [*PERIODIC, "sync.method=diloco", "sync.fragments=2", "sync.delay=1", "sync.alpha=0.5"],
    "int8": [*PERIODIC, "sync.method=diloco", "sync.quantize=int8", "sync.quant_block=64"],
}


class Runs:
    """Each (case, mesh) run and each case's reference, made on first use."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self._runs: dict[str, object] = {}
        self._refs: dict[str, object] = {}

    def run(self, name: str, overrides: list[str]):
        if name not in self._runs:
            self._runs[name] = run_train(self.out, name, [*SMALL, *overrides])
        return self._runs[name]

    def sites(self, case: str):
        return self.run(f"sites-{case}", [*CASES[case], *SITES])

    def ref(self, case: str):
        if case not in self._refs:
            self._refs[case] = sync_reference_run([*SMALL, *CASES[case]], 2, 1, replicate=2)
        return self._refs[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("three_level"))


def max_loss_rel_err(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["diloco", "average", "frag_delay"])
def test_sites_match_the_reference(runs: Runs, case: str):
    """Warmup (grads split around the slow link) then periodic sync of each site's held shards (sliced)."""
    run, ref = runs.sites(case), runs.ref(case)
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    assert [m["synced"] for m in run.metrics] == ref.synced
    for m in range(2):
        err = max_param_rel_err(run.params(m), ref.params[m])
        assert err <= TOL, f"{case}: site {m} params differ from the reference by {err:.3g}"


def test_int8_sites_match_the_reference_up_to_rounding_ties(runs: Runs):
    """int8 payloads travel through the sliced all-gather: losses to 1e-5, params well inside int8's effect
    (rounding-tie flips carry ~1e-4 on, as in tests/test_sync.py's long int8 run)."""
    run, ref = runs.sites("int8"), runs.ref("int8")
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    fp32 = sync_reference_run(
        [*SMALL, *[o for o in CASES["int8"] if not o.startswith("sync.quant")]], 2, 1, replicate=2
    )
    effect = max_param_rel_err(ref.params[0], fp32.params[0])
    for m in range(2):
        err = max_param_rel_err(run.params(m), ref.params[m])
        assert err <= 1e-3 and err <= 0.3 * effect, (m, err, effect)


def test_the_slow_link_carries_a_site_payload_once(runs: Runs):
    """Per round, a site's R ranks together send what one two-level replica sends (up to slice padding);
    the in-site all-gather of the slices rides the replicate group."""
    three = runs.sites("diloco")
    two = runs.run("two-level-diloco", [*CASES["diloco"], "mesh.sync=2", "mesh.shard=1"])
    site_bytes = 2 * three.summary["sync_bytes"]  # rank 0's; its in-site peer sends a slice of the same length
    assert two.summary["sync_bytes"] <= site_bytes <= 1.01 * two.summary["sync_bytes"]
    assert three.summary["replicate_bytes"] > 0 and two.summary["replicate_bytes"] == 0
    assert three.summary["world"] == 4 and two.summary["world"] == 2


def test_one_site_of_two_replicas_is_exact_hsdp(runs: Runs):
    """sites = 1: the in-site replicas average grads every step — what a two-level run with grad sync
    always (sync.warmup_steps=null) computes, and the single-process run on the global batch."""
    one_site = runs.run("one-site", ["run.steps=8", "mesh.sync=1", "mesh.replicate=2", "mesh.shard=2"])
    flat = runs.run("flat", ["run.steps=8", "mesh.sync=2", "mesh.shard=2", "sync.warmup_steps=null"])
    assert max_loss_rel_err(one_site.losses, flat.losses) <= 1e-6
    assert max_param_rel_err(one_site.params(0), flat.params(0)) <= 1e-6
    losses, params = reference_run([*SMALL, "run.steps=8"], 4)
    assert max_loss_rel_err(one_site.losses, losses) <= TOL
    assert max_param_rel_err(one_site.params(0), params) <= TOL


def test_compiled_sites_match_the_reference(runs: Runs):
    """The compiled engine's graph splits the warmup grads around the slow link as the eager engine does."""
    run = runs.run("sites-compiled", [*CASES["diloco"], *SITES, *STEP_SCOPE])
    ref = runs.ref("diloco")
    assert max_loss_rel_err(run.losses, ref.losses) <= TOL
    for m in range(2):
        assert max_param_rel_err(run.params(m), ref.params[m]) <= TOL


def test_a_site_of_replicas_computes_what_a_replica_of_their_shards_does(runs: Runs):
    """2 sites × 2 replicas × 1 shard and 2 replicas × 2 shards put the same rows on each site / replica
    (world ranks [m·R·S, (m+1)·R·S)), so with an fp32 sync they run the same training."""
    sites, two_level = (
        runs.sites("diloco"),
        runs.run("two-by-two-diloco", [*CASES["diloco"], "mesh.sync=2", "mesh.shard=2"]),
    )
    assert max_loss_rel_err(sites.losses, two_level.losses) <= TOL
    for m in range(2):
        assert max_param_rel_err(sites.params(m), two_level.params(m)) <= TOL


def test_elastic_sites_without_failures_compute_the_plain_run(runs: Runs):
    """Elastic sites (torchft between sites, each site's slices through it): the warmup's grad rounds and the
    DiLoCo rounds give the c10d run's losses and params (1e-6) and the same sync bytes. The kill of a whole
    site and its heal is tests/test_elastic.py's `2x2x1-sites` case."""
    plain = runs.sites("diloco")
    elastic = runs.run("sites-elastic", [*CASES["diloco"], *SITES, "elastic.enabled=true", "elastic.timeout_s=5"])
    records = [
        [json.loads(line) for line in (elastic.run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]
        for m in range(2)
    ]
    losses = [(a["loss"] + b["loss"]) / 2 for a, b in zip(*records)]
    assert max_loss_rel_err(losses, plain.losses) <= 1e-6
    for m in range(2):
        assert max_param_rel_err(elastic.params(m), plain.params(m)) <= 1e-6
    assert elastic.summary["sync_bytes"] == plain.summary["sync_bytes"]
    assert elastic.summary["heals"] == 0 and elastic.summary["replica_failures"] == 0


# ---------------------------------------------------------------- checkpoints
def test_resume_keeps_a_site_bitwise_and_reshards_to_another_replicate(runs: Runs):
    """A checkpoint between syncs (the sites differ) resumes bit for bit on the same mesh, and on 2×1×2
    (one replica of two shards per site: DCP reshards, nothing in it depends on R) it continues the reference."""
    ckpt = [*CASES["diloco"], "run.checkpoint_every=6"]
    ref = runs.run("sites-ckpt", [*ckpt, *SITES])
    step_5 = ref.run_dir / "checkpoints" / "step_5"
    meta = json.loads((step_5 / "meta.json").read_text())
    assert meta["mesh"]["replicate"] == 2 and not meta["replicas_identical"]
    same = runs.run("sites-resumed", [*ckpt, *SITES, f"run.resume={step_5}"])
    assert [m["step"] for m in same.metrics] == list(range(6, 12))
    assert [m["loss"] for m in same.metrics] == [m["loss"] for m in ref.metrics][6:]
    for m in range(2):
        assert all(torch.equal(a, b) for a, b in zip(same.params(m).values(), ref.params(m).values()))
    other = runs.run("resharded", [*ckpt, "mesh.sync=2", "mesh.shard=2", f"run.resume={step_5}"])
    reference = runs.ref("diloco")
    assert max_loss_rel_err([m["loss"] for m in other.metrics], reference.losses[6:]) <= TOL
    for m in range(2):
        assert max_param_rel_err(other.params(m), reference.params[m]) <= TOL


# ---------------------------------------------------------------- the planner
def test_the_planner_counts_the_bytes_the_engine_sends(runs: Runs):
    """The planner's workload of the three-level run: its warmup grad-sync bytes per step and its bytes per
    param-sync round are what the engine's counters recorded on rank 0 (the same slices, hsdp/comm/site.py)."""
    run = runs.sites("diloco")
    w = build_workload(load_checked_config(None, [*SMALL, *CASES["diloco"], *SITES]))
    cum = [m["sync_bytes"] for m in run.metrics]
    per_step = [b - a for a, b in zip([0, *cum], cum)]
    assert per_step[:3] == [w.grad_sync_bytes()] * 3  # sync.warmup_steps=3
    rounds = [b for b, m in zip(per_step[3:], run.metrics[3:]) if m["synced"]]
    assert rounds and all(b == w.period_sync_bytes() for b in rounds), (rounds, w.period_sync_bytes())
    assert w.tokens_per_step == run.summary["tokens_per_step"]


def test_the_planner_puts_a_site_payload_on_the_slow_link_once():
    """A site of R replicas moves what one replica moves: the same time per round on the slow link as
    the two-level mesh with the same site payload, and R× the tokens per step."""
    common = [*SMALL, "sync.warmup_steps=0", "sync.method=diloco", "sync.every=4", "sync.quantize=int8"]
    w3 = build_workload(load_checked_config(None, [*common, *SITES]))
    w2 = build_workload(load_checked_config(None, [*common, "mesh.sync=2", "mesh.shard=1"]))
    link = Link(inter_bps=20e6)
    units = list(range(len(w3.units)))
    t3 = sum(Timeline(w3, link, Compute(0.0)).inter_time(m) for m in w3.round_sync_messages(units))
    t2 = sum(Timeline(w2, link, Compute(0.0)).inter_time(m) for m in w2.round_sync_messages(units))
    assert t2 <= t3 <= 1.001 * t2
    assert w3.tokens_per_step == 2 * w2.tokens_per_step
    assert w3.site_round_messages(units) and not w2.site_round_messages(units)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "overrides, says",
    [
        (["mesh.replicate=0"], "mesh.replicate: expected an integer >= 1, got 0"),
        (["mesh.replicate=2", "mesh.engine=fsdp2"], "mesh.replicate: the fsdp2 baseline has one level"),
        (["mesh.replicate=2", "mesh.engine=ddp"], "mesh.replicate: the ddp baseline has one level"),
    ],
)
def test_bad_replicate_is_one_line(overrides: list[str], says: str):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        load_checked_config(None, [*SMALL, *overrides])


def test_a_torchrun_world_that_does_not_factor_is_refused():
    cfg = load_checked_config(None, [*SMALL, "mesh.sync=2", "mesh.replicate=2", "mesh.shard=2"])
    with pytest.raises(ConfigError, match=r"sync×replicate×shard = 2×2×2 = 8 does not match the launched world size 6"):
        check_world_size(cfg, 6)


def test_train_refuses_replicate_zero_with_exit_2(tmp_path: Path):
    cmd = [sys.executable, "train.py", "--set", "mesh.replicate=0", "--set", f"run.out_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("mesh.replicate: expected an integer >= 1, got 0")
    assert not any(tmp_path.iterdir())
