"""The heal of an elastic replica at a param sync (docs/design.md §9.2 "Heal in the same period"), in one real run.

Three replicas of the small model, one rank each, DiLoCo with int8 Δ and error feedback, two fragments (a
round every 2 steps). tests/elastic_heal_train.py orders, by events, a kill on each side of a heal: replica
1 dies, its restart heals and dies at its first step after the heal; its next restart heals from a replica
that dies at the step after it published the state (before the fetch), so it heals again from the third.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.sync.schedule import fragment_units, fragments_due
from tests.helpers import QUIET_ENV, REPO, SMALL

STEPS, KILL_STEP = 24, 2
OVERRIDES = SMALL + [
    "mesh.sync=3",
    "mesh.shard=1",
    "elastic.enabled=true",
    "elastic.timeout_s=2",
    "elastic.restart_delay_s=0.5",
    "sync.warmup_steps=0",
    "sync.every=4",
    "sync.fragments=2",
    "sync.method=diloco",
    "sync.quantize=int8",
    "sync.error_feedback=true",
    "run.save_model=false",
    f"run.steps={STEPS}",
]


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(run folder, markers folder with the saved states, replicas.json) of the one run all tests read."""
    out = tmp_path_factory.mktemp("elastic-heal")
    markers = out / "markers"
    markers.mkdir()
    cmd = [sys.executable, str(REPO / "tests/elastic_heal_train.py"), str(KILL_STEP), str(markers)]
    cmd += ["--config", str(REPO / "configs/tiny.yaml")]
    for o in [*OVERRIDES, f"run.out_dir={out}", "run.name=heal"]:
        cmd += ["--set", o]
    try:  # the hang guard: the whole run takes well under a minute on an idle 2-core box
        env = {**os.environ, **QUIET_ENV}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the elastic run hung:\n{(e.stderr or b'')[-3000:]}") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / "heal"
    return run_dir, markers, json.loads((run_dir / "replicas.json").read_text())


def _records(run_dir: Path, m: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]


def _summary(run_dir: Path, m: int) -> dict:
    return json.loads((run_dir / f"summary.replica{m}.json").read_text())


def _server(replicas: dict) -> int:
    """The replica that served replica 1's third start and died (restarted once; the third never was)."""
    restarts = {m: replicas[str(m)]["restarts"] for m in (0, 2)}
    assert sorted(restarts.values()) == [0, 1], restarts
    return next(m for m, n in restarts.items() if n == 1)


def test_kills_on_both_sides_of_a_heal_end_with_every_replica_trained_to_the_end(healed) -> None:
    """Exit 0; replica 1 restarted twice (killed before, then right after, a heal), the server once; every
    replica's metrics have each step once, up to the last."""
    run_dir, _, replicas = healed
    assert replicas["1"]["restarts"] == 2
    _server(replicas)
    for m in range(3):
        steps = [r["step"] for r in _records(run_dir, m)]
        assert len(steps) == len(set(steps)) and steps == sorted(steps) and steps[-1] == STEPS - 1, (m, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 3 and summary["finished_replicas"] == [0, 1, 2], summary


def test_a_healed_replica_counts_from_the_round_after_its_heal(healed) -> None:
    """The same period: replica 1's last start spectated the round it healed in and, its server dead before
    the fetch, the round it healed in again (heal_retries 1), fetched once, and counted in the next round,
    where all three replicas counted; the server's restart spectated one round only."""
    run_dir, _, replicas = healed
    restarted = {1: (2, 1), _server(replicas): (1, 0)}  # replica: (rounds spectated, heals begun again)
    for m, (spectated, retries) in restarted.items():
        s = _summary(run_dir, m)
        assert (s["spectated_rounds"], s["heal_retries"], s["heal_fetches"]) == (spectated, retries, 1), (m, s)
        first = s["heal_contributes_from"]
        assert fragments_due(first, load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES).sync), first
        at_first = next(r for r in _records(run_dir, m) if r["step"] >= first)
        assert at_first["step"] == first and at_first["replicas"] == 3, (m, at_first)
        assert 0 <= s["heal_skipped_steps"] < 2, s  # a round every 2 steps: at least one step trained


def test_replicas_end_equal_after_the_last_sync_with_fragments_and_error_feedback(healed) -> None:
    """θ_g and the outer momentum of every unit bitwise equal in the three replicas; the params of the
    fragment that synced after the last step equal too (and equal θ_g); the other fragment's are each
    replica's own after its last local steps. A healed replica started from zero residuals and has its
    own since (it contributed with error feedback)."""
    run_dir, markers, replicas = healed
    states = [torch.load(markers / f"state.r{m}.pt") for m in range(3)]
    cfg = load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES)
    units = fragment_units(len(states[0]["held"]), cfg.sync.fragments)
    last = [u for f in fragments_due(STEPS - 1, cfg.sync) for u in units[f]]
    assert last and len(last) < len(states[0]["held"])  # one fragment synced last, not both
    for m in (1, 2):
        for u in range(len(states[0]["held"])):
            assert torch.equal(states[m]["global"][u], states[0]["global"][u]), (m, u)
            assert torch.equal(states[m]["momentum"][u], states[0]["momentum"][u]), (m, u)
        for u in last:
            assert torch.equal(states[m]["held"][u], states[0]["held"][u]), (m, u)
    assert all(torch.equal(states[0]["held"][u], states[0]["global"][u]) for u in last)
    for name in ("healed.r1.s1.pt", "healed.r1.s2.pt", f"healed.r{_server(replicas)}.s1.pt"):
        residuals = torch.load(markers / name)
        assert all(e is None or not e.any() for e in residuals), name
    assert any(e is not None and e.any() for e in states[1]["error"])


def test_steps_behind_is_the_fetch_over_the_peers_pace_leaving_one_step() -> None:
    """k = min(round(ℓ / p), n − a − 1), 0 without a pace (docs/design.md §9.2, Heal in the same period)."""
    from hsdp.sync.elastic.replica import steps_behind

    assert steps_behind(5.5, 0.4, 32) == 14  # the slow-link benchmark's fetch at its step time
    assert steps_behind(0.01, 0.2, 2) == 0  # a local fetch: under half a step
    assert steps_behind(60.0, 0.4, 32) == 31  # a fetch past the period: one step left to train
    assert steps_behind(5.5, None, 32) == 0  # the peer had no pace yet


def test_a_replica_healed_again_mid_training_finishes_the_heal_in_place() -> None:
    """A quorum that heals a training replica again (cut off and back, or a round behind its peers) is
    finished in place (hsdp/sync/elastic/replica.py): after the round it began as its own sync (spectated),
    anything in flight lands, catch_up continues from the offer without spectating that round again, and
    the training loop's next step is the one catch_up returns."""
    from types import SimpleNamespace

    from hsdp.sync.elastic.heal import HealState
    from hsdp.sync.elastic.phase import Phase
    from hsdp.sync.elastic.replica import ElasticReplica
    from hsdp.sync.seam import ReplicaSeat, ReplicaState

    cfg = load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES)
    replica = ElasticReplica(cfg, ReplicaSeat(1, 0, "http://x:1"))
    calls: list = []
    policy = SimpleNamespace(finish=lambda: calls.append("finish"))
    replica._heal = HealState(replica)
    replica._heal.state = ReplicaState([], torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), policy)
    replica._transport = SimpleNamespace(
        open=False, rounds=3, touched=[], quorum_waits=[4.5], failure_in_rounds_since=lambda first: False
    )
    replica.enter(Phase.JOINING, "test")
    replica.enter(Phase.TRAINING, "test")

    def catch_up(spectated=False):
        calls.append(("catch_up", spectated))
        replica.heal.offer = None
        return 30

    replica._catch_up = catch_up
    steps = replica.steps(0, 40)
    assert [next(steps) for _ in range(12)] == list(range(12))
    replica.heal.load_state_dict({"snapshot": "http://peer/checkpoint/", "step": 9, "step_s": 0.2})
    assert replica.phase is Phase.HEALING and replica.heal.spectating
    replica.after_sync(11)
    assert calls == ["finish", ("catch_up", True)] and replica.rejoins == 1
    assert next(steps) == 30 and next(steps) == 31
