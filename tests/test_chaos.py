"""Seeded chaos (the generator hsdp/faults/chaos.py, applied by hsdp/bench/chaos.py): the schedule is a function of
the seed, a Poisson process of the stated mean gap, and only hits what each kind may hit; a bad `chaos:` is one
ConfigError before any run."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest

from hsdp.bench.faults import chaos_of
from hsdp.bench.plan import LinkOptions, make_plan
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.faults.chaos import KINDS, SLOW_FACTOR, SPELL_S, Chaos, draw_schedule, kind
from hsdp.faults.spec import parse_fault
from tests.helpers import REPO

ELASTIC = ["elastic.enabled=true", "sync.warmup_steps=0", "mesh.sync=3", "mesh.shard=1"]


def test_the_same_seed_draws_the_same_schedule_and_another_seed_another() -> None:
    a = draw_schedule(Chaos(7, 30.0), replicas=3, horizon_s=3600, restart_delay_s=2)
    assert a == draw_schedule(Chaos(7, 30.0), replicas=3, horizon_s=3600, restart_delay_s=2)
    assert a != draw_schedule(Chaos(8, 30.0), replicas=3, horizon_s=3600, restart_delay_s=2)


def test_faults_arrive_as_a_poisson_process_of_the_mean_gap() -> None:
    """Exponential gaps: over many draws the mean gap is MTBF_S and their spread (std ≈ mean) is the
    exponential's, not a fixed period's; every kind appears about equally often."""
    faults = draw_schedule(Chaos(1, 30.0), replicas=3, horizon_s=300_000, restart_delay_s=2)
    times = [0.0] + [f.at.at_s or 0.0 for f in faults]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(gaps) > 9000
    assert statistics.mean(gaps) == pytest.approx(30.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(30.0, rel=0.08)
    counts = {k: sum(kind(f) == k for f in faults) for k in KINDS}
    assert all(c == pytest.approx(len(faults) / len(KINDS), rel=0.1) for c in counts.values()), counts


def test_each_kind_hits_what_it_may_for_a_spell_in_its_range() -> None:
    """Kills, partitions, stops and slow spells hit any replica, 0 included (no replica holds the lighthouse or the
    run folder); a lighthouse fault has no replica and is its kill; spells lie in their ranges, a kill's is the restart
    delay; a slow spell runs at a third; each is a Fault at a time the grammar reads back."""
    faults = draw_schedule(Chaos(3, 5.0), replicas=3, horizon_s=20_000, restart_delay_s=2.5)
    for f in faults:
        if kind(f) == "lighthouse":
            assert f.replica is None and f.action == "kill"
        else:
            assert f.replica in (0, 1, 2)
        lo, hi = SPELL_S.get(kind(f), (2.5, 2.5))
        assert lo <= f.seconds <= hi
        assert f.factor == (SLOW_FACTOR if f.action == "slow" else 1.0)
        assert f.at.when == "time" and parse_fault(str(f)) == f
    for k in ("kill", "partition", "stop", "slow"):
        assert {f.replica for f in faults if kind(f) == k} == {0, 1, 2}, k


def test_a_bad_chaos_value_is_one_config_error_naming_the_key(tmp_path) -> None:
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ELASTIC)
    assert chaos_of("7:30", cfg, "--chaos") == Chaos(7, 30.0)
    for text, why in [("7", "SEED:MTBF_S"), ("x:3", "SEED:MTBF_S"), ("7:0", "SEED:MTBF_S"), ("7:-1", "SEED:MTBF_S")]:
        with pytest.raises(ConfigError, match=why):
            chaos_of(text, cfg, "--chaos")
    plain = load_config(str(REPO / "configs" / "tiny.yaml"), [])
    with pytest.raises(ConfigError, match="runs.x.chaos: chaos needs an elastic run"):
        chaos_of("7:30", plain, "runs.x.chaos")

    shutil.copy(REPO / "configs" / "tiny.yaml", tmp_path / "tiny.yaml")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"base: tiny.yaml\nrates: [20mbit]\nset: [{', '.join(ELASTIC)}]\nruns:\n  calm: []\n"
        "  wild: {set: [], chaos: '7:30'}\n"
    )
    plan = make_plan(LinkOptions(spec=str(spec), shared=[f"run.out_dir={tmp_path}"]))
    assert plan.chaoses == {"wild": Chaos(7, 30.0)}
    with pytest.raises(ConfigError, match="--chaos: no run is elastic"):
        make_plan(LinkOptions(rate="20mbit", runs=["plain="], chaos="1:3", shared=[f"run.out_dir={tmp_path}"]))
    spec.write_text(
        f"base: tiny.yaml\nrates: [20mbit]\nset: [{', '.join(ELASTIC)}]\nruns:\n"
        "  wild: {set: [], chaos: '7:30', kill: '1@3'}\n"
    )
    with pytest.raises(ConfigError, match="runs.wild: chaos draws its own kills"):
        make_plan(LinkOptions(spec=str(spec), shared=[f"run.out_dir={tmp_path}"]))


def _at_20mbit(name: str, tmp_path: Path, measured: Any, record: Any) -> Any:
    """A finished slow-link run of the chaos table's tests, at 20 Mbit/s."""
    from hsdp.bench.records import LinkRun

    return LinkRun(name, "20mbit", 20_000_000, 0, tmp_path, measured, record)


def test_the_chaos_table_sets_a_run_against_the_calm_one(tmp_path) -> None:
    """slowlink.md's chaos table: the faults by kind, the restarts, both goodputs against the target run, the
    steps lost and what was checked after the run (2 of 3 replicas finished, equal; checkpoints valid)."""
    from hsdp.bench.analysis import Assessed
    from hsdp.bench.plan import LinkPlan
    from hsdp.bench.records import Measured, RunRecord
    from hsdp.bench.report import chaos_table

    plan = LinkPlan(
        "x", "b", [], [("20mbit", 20_000_000)], ["20mbit"], 0, "calm", 60, 2, {}, tmp_path, tmp_path, (3, 1)
    )
    calm = _at_20mbit("calm", tmp_path, Measured(), RunRecord(tmp_path, {}, wall_time_s=90.0, final_val_loss=2.0))
    faults = {
        "chaos": {"seed": 7, "mtbf_s": 30.0},
        "faults": [{"kind": "kill"}, {"kind": "stop"}, {"kind": "stop"}],
        "crashes": [{"replica": 1}],
        "after": {
            "steps_lost": {"0": 0, "1": 40},
            "replicas_equal": True,
            "models": 2,
            "checkpoints": 6,
            "invalid_checkpoints": [],
            "processes_left": 0,
        },
    }
    summary = {"goodput": 0.9}
    chaos = _at_20mbit(
        "wild", tmp_path, Measured(faults=faults), RunRecord(tmp_path, summary, wall_time_s=120.0, final_val_loss=2.02)
    )
    assessed = {("wild", "20mbit"): Assessed(2.0, time_to_target_vs_target_run=1.25)}
    (line,) = [x for x in chaos_table(plan, [calm, chaos], assessed) if x.startswith("| wild")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:5] == ["7:30", "1 kill, 2 stop", "1"]
    assert cells[6:11] == ["2.0200", "+1.0%", "0.80", "0.75", "0.900"]
    assert cells[11:] == ["40", "6/6", "yes (2 of 3 finished)", "0"]


def test_fault_flags_reach_the_runs_that_name_them_and_never_the_calm_target(tmp_path) -> None:
    """`--chaos 3:8` on the chaos spec (calm, chaos: '7:30') makes the chaos run denser and leaves `calm`, the
    target goodput is taken against, without faults (it used to reach every elastic run, and a run's own value
    won: the chaos run stayed at 7:30 while calm got 3:8). A flag that no run names reaches every run it fits
    but the target (a kill no chaos run: it draws its own), or the target when it is the one run it fits."""
    shutil.copy(REPO / "configs" / "tiny.yaml", tmp_path / "tiny.yaml")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"base: tiny.yaml\nrates: [20mbit]\nset: [{', '.join(ELASTIC)}]\ntarget: calm\nruns:\n  calm: []\n"
        "  chaos: {set: [], chaos: '7:30'}\n  other: []\n"
    )
    shared = [f"run.out_dir={tmp_path}", "run.steps=100"]
    plan = make_plan(LinkOptions(spec=str(spec), shared=shared, chaos="3:8"))
    assert plan.chaoses == {"chaos": Chaos(3, 8.0)}
    assert "calm" not in {**plan.kills, **plan.partitions, **plan.slows, **plan.chaoses}
    plan = make_plan(LinkOptions(spec=str(spec), shared=shared, kill="1@0.5", slow="2:3"))
    assert plan.kills == {"other": parse_fault("1@50:kill")} and plan.chaoses == {"chaos": Chaos(7, 30.0)}
    assert plan.slows == {"chaos": parse_fault("2@0:slow=3"), "other": parse_fault("2@0:slow=3")}
    alone = LinkOptions(rate="20mbit", runs=["el="], kill="1@3", shared=[*shared, *ELASTIC])
    assert make_plan(alone).kills == {"el": parse_fault("1@3:kill")}  # the one run: the target, none measured against


def test_no_goodput_is_taken_against_a_target_that_had_faults(tmp_path) -> None:
    """A target run with faults of its own is no calm baseline: the chaos table leaves both goodputs out and says
    why (the issue's calm run with --chaos read 1.13)."""
    from hsdp.bench.analysis import Assessed
    from hsdp.bench.plan import LinkPlan
    from hsdp.bench.records import LinkRun, Measured, RunRecord
    from hsdp.bench.report import chaos_table

    plan = LinkPlan("x", "b", [], [("20mbit", 20_000_000)], ["20mbit"], 0, "calm", 60, 2, {}, tmp_path, tmp_path)
    chaos = {"chaos": {"seed": 3, "mtbf_s": 8.0}, "faults": [{"kind": "stop"}], "after": {}}
    record = RunRecord(tmp_path, {}, wall_time_s=90.0, final_val_loss=2.0)
    calm = LinkRun("calm", "20mbit", 20_000_000, 0, tmp_path, Measured(faults=chaos), record)
    wild = LinkRun("wild", "20mbit", 20_000_000, 0, tmp_path, Measured(faults=chaos), record)
    assessed = {(r.run, "20mbit"): Assessed(2.0, time_to_target_vs_target_run=1.0) for r in (calm, wild)}
    lines = chaos_table(plan, [calm, wild], assessed)
    assert any("`calm` had faults injected at 20mbit: no goodput" in line for line in lines), lines
    cells = [c.strip() for c in next(x for x in lines if x.startswith("| wild")).strip("|").split("|")]
    assert cells[7:10] == ["–", "–", "–"], cells  # vs target, goodput (to target), goodput (wall)


def test_a_fault_drawn_for_a_held_replica_hits_the_next_one_up() -> None:
    """A replica holds one fault at a time: one drawn for a held replica lands on the next replica in order that no
    fault holds and that trains (not awaiting its replacement, not finished); it waits only while none is, and the
    lighthouse's fault waits for the lighthouse."""
    from types import SimpleNamespace

    from hsdp.bench.chaos import WAIT, ChaosJob

    class Node:
        def __init__(self, code=None) -> None:
            self.code = code

        def poll(self):
            return self.code

    def target(m, holding, pending=(), finished=()):
        job = SimpleNamespace(
            _holding=dict.fromkeys(holding),
            _pending=dict.fromkeys(pending),
            link=SimpleNamespace(replicas=3),
            procs=[Node(0 if r in finished else None) for r in range(3)],
        )
        return ChaosJob._target(job, m)

    assert target(1, holding=[]) == 1 and target(None, holding=[0, 1, 2]) is None
    assert target(1, holding=[1]) == 2 and target(2, holding=[2]) == 0  # the next in order, wrapping
    assert target(1, holding=[1, 2]) == 0
    assert target(1, holding=[1], pending=[2]) == 0  # 2 is killed, its replacement not yet started
    assert target(1, holding=[1], finished=[2]) == 0
    assert target(1, holding=[0, 1, 2]) == WAIT and target(1, holding=[1], pending=[2], finished=[0]) == WAIT
    assert target(None, holding=[None]) == WAIT


def test_a_target_met_where_the_records_hold_no_time_is_not_called_not_reached(tmp_path) -> None:
    """A chaos run whose replica 0 healed has steps missing from its metrics, so its time to the target is not in
    them: met at the run's last step, its goodput to the target is the wall times' ratio (both runs met it at
    their ends; the paced soak chaos-paced1 printed "not reached" at −0.4% val); met earlier, the step; never
    met, "not reached"."""
    from hsdp.bench.analysis import Assessed, Reached
    from hsdp.bench.plan import LinkPlan
    from hsdp.bench.records import Measured, RunRecord
    from hsdp.bench.report import chaos_table, to_target_cell

    plan = LinkPlan("x", "b", [], [("20mbit", 20_000_000)], ["20mbit"], 0, "calm", 60, 2, {}, tmp_path, tmp_path)
    calm = _at_20mbit("calm", tmp_path, Measured(), RunRecord(tmp_path, {}, wall_time_s=90.0, final_val_loss=2.0))
    record = RunRecord(tmp_path, {}, steps=100, wall_time_s=120.0, final_val_loss=1.99)
    wild = _at_20mbit(
        "wild", tmp_path, Measured(faults={"chaos": {"seed": 7, "mtbf_s": 30.0}, "faults": [], "after": {}}), record
    )
    cells = {}
    for step in (99, 50, None):
        assessed = {("wild", "20mbit"): Assessed(2.0, reached=Reached(step_to_target=step))}
        line = next(x for x in chaos_table(plan, [calm, wild], assessed) if x.startswith("| wild"))
        cells[step] = [c.strip() for c in line.strip("|").split("|")][8]
    assert cells == {99: "0.75 (at its end)", 50: "reached at step 50", None: "not reached"}
    assert to_target_cell(1.25, None, None, None, None) == "0.80"  # a time in the records wins
