"""scripts/chaos_breakdown.py: a tiny chaos run against its calm run, every number worked out by hand.

Two replicas, a param round every 4 steps (synced steps 3, 7, ..., 23), 1 s a step. The calm run logs step s at
t = s. In the chaos run replica 1 is stopped for 2 s in step 5 (both replicas reach the round at step 7 2 s late)
and replica 0 is killed after step 12; its replacement (life 1, whose elapsed_s carries on from the dead life's,
so its clock is 3 s behind) heals to step 15, skipping steps 13 and 14.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import chaos_breakdown as cb  # noqa: E402

STEPS = 24
STOP = {"fault": "1@t4.4:stop=2", "kind": "stop", "replica": 1, "at_s": 4.4, "seconds": 2.0}
KILL = {"fault": "0@t14.1:kill", "kind": "kill", "replica": 0, "at_s": 14.1, "seconds": 0.0}


def _record(step: int, t: float, offset: float, step_s: float = 1.0, life: int = 0) -> dict:
    return {"step": step, "elapsed_s": t - offset, "step_time_s": step_s, "synced": step % 4 == 3, "life": life}


def _write(folder: Path, replicas: dict[int, list[dict]]) -> None:
    folder.mkdir(parents=True)
    for m, records in replicas.items():
        (folder / f"metrics.replica{m}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _soak(tmp_path: Path) -> Path:
    """runs/<soak>/slowlink.json and, beside it, the calm and chaos run folders (their `dir`s are elsewhere)."""
    calm = {m: [_record(s, s, -1.0) for s in range(STEPS)] for m in (0, 1)}
    late = [_record(s, s, -1.0) for s in range(5)] + [_record(5, 7, -1.0, step_s=3.0)]
    late += [_record(s, s + 2, -1.0) for s in range(6, STEPS)]
    waits = [_record(s, s, -1.0) for s in range(7)] + [_record(7, 9, -1.0, step_s=3.0)]
    waits += [_record(s, s + 2, -1.0) for s in range(8, 13)]
    waits += [_record(s, s + 2, 2.0, life=1) for s in range(15, STEPS)]  # the replacement: 3 s behind
    _write(tmp_path / "soak-calm", calm)
    _write(tmp_path / "soak-chaos", {0: waits, 1: late})
    faults = [
        {**STOP, "applied_s": 4.5, "over_s": 6.5, "step": 4},
        {**KILL, "applied_s": 14.2, "over_s": 17.0, "step": 12},
    ]
    doc = {
        "target_run": "calm",
        "runs": [
            {"run": "calm", "rate": "20mbit", "dir": "/nowhere/soak-calm"},
            {"run": "chaos", "rate": "20mbit", "dir": "/nowhere/soak-chaos", "faults": {"faults": faults}},
        ],
    }
    (tmp_path / "soak").mkdir()
    (tmp_path / "soak" / "slowlink.json").write_text(json.dumps(doc))
    return tmp_path / "soak"


def test_each_life_gets_its_own_offset_from_the_rounds_and_the_faults(tmp_path: Path) -> None:
    _soak(tmp_path)
    doc = json.loads((tmp_path / "soak" / "slowlink.json").read_text())
    chaos = cb.read_run(tmp_path / "soak-chaos")
    offsets, violations = cb.align(chaos, cb.faults_of(doc["runs"][1]))
    assert offsets == pytest.approx({(0, 0): -1.0, (1, 0): -1.0, (0, 1): 2.0})
    assert violations == []


def test_the_stop_and_the_kill_are_charged_what_they_cost(tmp_path: Path) -> None:
    soak = _soak(tmp_path)
    doc = json.loads((soak / "slowlink.json").read_text())
    chaos_run, calm_run = cb.pick_runs(doc, None)
    chaos, calm = cb.read_run(cb.run_dir_of(soak, chaos_run)), cb.read_run(cb.run_dir_of(soak, calm_run))
    b = cb.breakdown(chaos, calm, cb.faults_of(chaos_run))
    assert b.pace_s == pytest.approx(1.0)  # the calm frontier: 23 steps in 23 s
    assert b.tail_s == pytest.approx(4.0)  # one calm round
    stop, kill = b.costs
    # The round 3 → 7 took 6 s instead of 4, on both replicas: 2 s of the run's time, 2 idle seconds each.
    assert (stop.gap, stop.idle_s, stop.delay_s, stop.steps(b.pace_s)) == pytest.approx((0, 4.0, 2.0, 4.0))
    # Replica 0's steps 13 and 14 are in no record; the survivor's rounds were not slower.
    assert (kill.gap, kill.idle_s, kill.delay_s) == pytest.approx((2, 0.0, 0.0))
    assert b.steps_lost == 2 and b.unattributed_gap == 0
    assert b.end_s == pytest.approx(2.0) and b.start_s == pytest.approx(0.0)
    assert b.unattributed_delay_s + b.speedup_s == pytest.approx(0.0)


def test_the_script_prints_the_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cb.main([str(_soak(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "| 0 | `1@t4.4:stop=2` | stop | 1 | 4.5 | 6.5 | 0 | 4.0 | 4 | 2.0 |" in out
    assert "| 1 | `0@t14.1:kill` | kill | 0 | 14.2 | 17.0 | 2 | 0.0 | 2 | 0.0 |" in out
    assert "| stop | 1 | 4 | 2.0 | 4 | 2.0 |" in out
    assert "| **total** | 6 | 2.0 |" in out
    assert "gap steps charged 2 of 2 steps" in out
