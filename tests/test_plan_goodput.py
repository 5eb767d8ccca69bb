"""The planner's goodput model (hsdp/plan/goodput.py): each fault's cost by hand, the shape of goodput over
replicas, the validation against a slow-link report's chaos runs, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hsdp.plan.goodput import MODES, Cluster, fault_cost, goodput, main, predict_run, validate

C = Cluster(replicas=4, period_s=20.0, heal_s=30.0, detect_s=5.0, checkpoint_every_s=600.0, save_s=6.0)


@pytest.mark.parametrize(
    "kind,spell,mode,cost",
    [
        ("kill", 0.0, "lockstep", 4 * (30 + 300)),  # all restart, half an interval redone
        ("kill", 0.0, "elastic", 30 + 10 + 3 * 5),  # heal, half a period, the survivors' detection
        ("stop", 3.0, "elastic", 4 * 3),  # within the heartbeat timeout: everyone waits it out at the round
        ("stop", 8.0, "elastic", 4 * 5 + (8 - 5 + 30)),  # beyond: counted out after 5 s, healed when back
        ("stop", 8.0, "paced", 8 + 30),  # the others never wait
        ("partition", 12.0, "elastic", 12 + 10 + 30 + 3 * 5),
        ("slow", 9.0, "elastic", 4 * 9 * (2 / 3)),
        ("slow", 9.0, "paced", 9 * (2 / 3)),
        ("lighthouse", 4.0, "elastic", 4 * (0.2 + 4 * 4 / 20)),  # the heartbeats reach it, the outage's share
        ("lighthouse", 4.0, "lockstep", 0.0),
    ],
)
def test_each_fault_costs_what_the_table_says(kind: str, spell: float, mode: str, cost: float) -> None:
    assert fault_cost(kind, spell, mode, C) == pytest.approx(cost)


def test_goodput_over_replicas_and_pacing() -> None:
    """Lockstep falls with the replicas (every fault restarts all of them); elastic keeps most of a replica's
    time until stalls in step-counted rounds (each makes all N wait) grow with N; paced rounds are never
    worse than elastic ones; an asynchronous save (a short wait) beats a synchronous one."""
    ns = [2, 8, 64, 1024]
    for mode in MODES:
        values = [goodput(Cluster(n, 20.0, 30.0, 5.0, 600.0, 6.0), 6 * 3600, mode) for n in ns]
        assert all(0 < v <= 1 for v in values) and values == sorted(values, reverse=True), (mode, values)
    for n in ns:
        c = Cluster(n, 20.0, 30.0, 5.0, 600.0, 6.0)
        assert goodput(c, 3600, "paced") >= goodput(c, 3600, "elastic") > goodput(c, 3600, "lockstep")
    sync, asynchronous = Cluster(3, 20.0, 30.0, 5.0, 600.0, 6.0), Cluster(3, 20.0, 30.0, 5.0, 600.0, 0.5)
    assert goodput(asynchronous, 3600, "elastic") > goodput(sync, 3600, "elastic")
    assert goodput(Cluster(3, 20.0, 30.0, 5.0), math.inf, "elastic") == 1.0  # no faults, no saves: all useful


def test_a_run_is_predicted_from_the_faults_it_had_and_checked_against_its_report(tmp_path: Path, capsys) -> None:
    faults = [
        {"kind": "kill", "replica": 1, "at_s": 10, "seconds": 2, "applied_s": 10, "over_s": 40},
        {"kind": "stop", "replica": 0, "at_s": 50, "seconds": 4, "applied_s": 50, "over_s": 54},
        {"kind": "slow", "replica": 2, "at_s": 90, "seconds": 30, "applied_s": None, "over_s": None},  # never applied
    ]
    c = Cluster(3, 0.25 * 32, 30.0, 5.0)
    cost = (30 + 4 + 2 * 5) + 3 * 4
    assert predict_run(faults, 200.0, c) == pytest.approx(1 - cost / 600)
    report = {
        "target_run": "calm",
        "mesh": [3, 1],
        "set": ["sync.every=8", "sync.every=32"],
        "runs": [
            {"run": "calm", "rate": "20mbit", "wall_time_s": 150.0, "mean_step_s": 0.25, "tokens": 1000},
            {
                "run": "chaos",
                "rate": "20mbit",
                "wall_time_s": 200.0,
                "tokens": 900,
                "faults": {"chaos": {"seed": 7}, "faults": faults},
            },
        ],
    }
    path = tmp_path / "slowlink.json"
    path.write_text(json.dumps(report))
    (row,) = validate(path, detect_s=5.0)
    assert row["faults"] == 2 and row["heal_s"] == 30.0 and row["period_s"] == 8.0 and row["measured_by"] == "wall"
    assert row["measured"] == 0.75 and row["predicted"] == pytest.approx(1 - cost / 600, abs=1e-3)
    # the floor, on the calm run's 150 s: the kill's unmerged half period (4 s) and the stop's 4 s, nothing else
    assert predict_run(faults, 150.0, c, "floor") == pytest.approx(1 - (8 / 2 + 4) / 450)
    assert row["floor"] == pytest.approx(1 - 8 / 450, abs=1e-3)
    assert main(["--validate", str(path), "--detect-s", "5"]) == 0
    assert "| chaos | 20mbit | 3 | elastic | 2 |" in capsys.readouterr().out
    # rounds paced by wall time (sync.every_s in the report's overrides): the model's paced column
    report["set"].append("sync.every_s=5.8")
    path.write_text(json.dumps(report))
    (row,) = validate(path, detect_s=5.0)
    assert row["mode"] == "paced" and row["predicted"] == pytest.approx(
        predict_run(faults, 200.0, c, "paced"), abs=1e-3
    )
    assert row["predicted"] > predict_run(faults, 200.0, c, "elastic")  # nobody waits at the round for the stop
    assert row["measured_by"] == "tokens" and row["measured"] == 0.9  # 900 of the calm run's 1,000 tokens


@pytest.mark.parametrize(
    "kind,spell,cost", [("kill", 0.0, 4.0), ("stop", 7.0, 7.0), ("slow", 30.0, 20.0), ("partition", 12.0, 0.0)]
)
def test_the_floor_charges_only_what_the_fault_itself_takes(kind: str, spell: float, cost: float) -> None:
    """No detection, restart, heal or wait: a period of 8 s, a heal of 30 s and a detection of 5 s change nothing."""
    from hsdp.plan.goodput import spell_cost

    assert spell_cost(kind, spell, Cluster(3, 8.0, 30.0, 5.0)) == pytest.approx(cost)
    assert spell_cost(kind, spell, Cluster(3, 8.0, 30.0, 5.0)) <= fault_cost(
        kind, spell, "elastic", Cluster(3, 8.0, 30.0, 5.0)
    )


def exit_code(argv: list[str]) -> object:
    """main's exit code, whether it returns it or argparse raises it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize(
    "report,args,needle",
    [
        (None, ["--validate", "{report}"], "does not exist"),  # a missing file
        ("not json", ["--validate", "{report}"], "is not JSON"),
        ('{"target_run": "calm"}', ["--validate", "{report}"], "no `runs` list"),
        ('{"runs": [{"rate": "20mbit"}]}', ["--validate", "{report}"], "not a slow-link report"),  # another shape
        ('{"runs": []}', ["--validate", "{report}"], "no chaos run"),
        (None, ["--validate", "{dir}"], "cannot read"),  # a folder
        (None, ["--replicas", "x"], "--replicas: expected comma-separated numbers"),
        (None, ["--replicas", "2.5"], "--replicas: expected whole numbers"),
        (None, ["--mtbf-h", "0"], "--mtbf-h: expected positive numbers"),
        (None, ["--step-s", "-1"], "--step-s: expected a positive number"),
        (None, ["--round-s", "-5"], "--round-s: expected seconds >= 0"),
        (None, ["--save-s", "nan"], "--save-s: expected seconds >= 0"),
        (None, ["--checkpoint-every-s", "0"], "--checkpoint-every-s"),
        (None, ["--plot", "{dir}/missing/out.png"], "is not a folder"),
        (None, ["--plot", "/proc/out.png"], "cannot write into /proc"),
        (None, ["--every", "x"], "invalid int value"),
        (None, ["--nosuchflag"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, report: str | None, args, needle: str) -> None:
    path = tmp_path / "slowlink.json"
    if report is not None:
        path.write_text(report)
    assert exit_code([a.format(report=path, dir=tmp_path) for a in args]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("plan.goodput: ") and needle in err[0], err
    assert captured.out == ""
