"""`python -m hsdp.plan`: impossible inputs refused with one line before any work, words that fit one replica
and a latency-bound link, and `--calibrate` from the run's own per-step times (not its few logged records).

All in-process on the projection path (`--gpu`: FLOPs, no run, no timing) or a run folder written here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hsdp.plan.__main__ as plan_cli
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.plan.__main__ import main
from hsdp.plan.calibrate import check_same_shape, read_fake_run

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
PROJECT = [TINY, "--params", "1e9", "--gpu", "H100", "--mfu", "0.4", "--tokens", "1B"]


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Nothing here may calibrate, time collectives or build a workload before the input is checked."""

    def refuse(*args, **kwargs):
        raise AssertionError("the planner started work")

    monkeypatch.setattr(plan_cli, "measure_fake_run", refuse)
    monkeypatch.setattr(plan_cli, "measure_shard_collectives", refuse)


def one_line_error(capsys, argv: list[str], monkeypatch) -> str:
    """The command's stderr when it refuses `argv`: exit 2 (main's, or argparse's) and one line, before any work."""
    monkeypatch.setattr(plan_cli, "build_workload", lambda *a, **k: pytest.fail("worked before refusing"))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--replicas", "0", "--shard", "8", "--inter", "1gbit"], "--replicas"),
        (["--replicas", "2", "--shard", "0", "--inter", "1gbit"], "--shard"),
        (["--replicas", "-3", "--inter", "1gbit"], "--replicas"),
        (["--shard", "-1", "--inter", "1gbit"], "--shard"),
        (["--inter", "-10gbit"], "--inter"),
        (["--inter=-10gbit"], "--inter"),
        (["--inter", "1gbit,-1mbit"], "--inter"),
        (["--inter", "0gbit"], "--inter"),
        (["--inter", "infgbit"], "--inter"),
        (["--inter", "nanmbit"], "--inter"),
        (["--inter", "1gbit", "--intra", "-5gbit"], "--intra"),
        (["--inter", "1gbit", "--latency", "-5"], "--latency"),
        (["--inter", "1gbit", "--latency", "-inf"], "--latency"),
        (["--inter", "1gbit", "--latency", "inf"], "--latency"),
        (["--inter", "1gbit", "--overhead", "inf"], "--overhead"),
        (["--inter", "1gbit", "--replicas", "x"], "--replicas"),
        (["--inter", "1gbit", "--params", "0.1"], "--params"),
        (["--inter", "1gbit", "--params", "inf"], "--params"),
        (["--inter", "1gbit", "--tokens", "-1B"], "--tokens"),
        (["--inter", "1gbit", "--set", "mesh.replicate=0"], "mesh.replicate"),
    ],
)
def test_impossible_values_are_refused_with_one_line(capsys, monkeypatch, extra, flag):
    line = one_line_error(capsys, [*PROJECT, *extra], monkeypatch)  # a later flag wins over PROJECT's
    assert flag in line and line.startswith("plan: "), line
    assert "expected one argument" not in line


def test_one_replica_has_no_survivors(capsys):
    assert main([*PROJECT, "--replicas", "1", "--shard", "8", "--inter", "1gbit"]) == 0
    out = capsys.readouterr().out
    assert "mesh 1×8" in out
    assert "survivors lose" not in out and "no survivors" in out
    assert main([*PROJECT, "--replicas", "2", "--shard", "8", "--inter", "1gbit"]) == 0
    assert "the other replica loses ~" in capsys.readouterr().out
    assert main([*PROJECT, "--replicas", "1", "--shard", "8", "--inter", "1gbit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failure_survivor_lost_s"] is None


def test_the_projected_mesh_is_the_one_asked_for(capsys):
    assert main([*PROJECT, "--replicas", "4", "--shard", "2", "--inter", "1gbit", "--json"]) == 0
    tokens = json.loads(capsys.readouterr().out)["tokens"]
    assert tokens == 10**9
    assert main([*PROJECT, "--replicas", "4", "--shard", "2", "--inter", "1gbit"]) == 0
    assert "mesh 4×2" in capsys.readouterr().out


def test_latency_bound_utilisation_is_said(capsys):
    """Exact HSDP with 100 ms of latency: at a fast link the latency, not the bandwidth, bounds the utilisation;
    with no latency nothing is said."""
    argv = [*PROJECT, "--replicas", "8", "--shard", "8", "--inter", "400gbit"]
    assert main([*argv, "--latency", "100"]) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("latency, not bandwidth, bounds")]
    assert len(note) == 1 and "400 Gbit/s" in note[0], out
    assert main([*argv, "--latency", "100", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["latency_bound"] is True
    assert p["compute_utilization"] <= p["utilization_unlimited_bandwidth"] < p["utilization_no_latency"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_bound"] is False
    assert main([*PROJECT, "--replicas", "8", "--shard", "8", "--inter", "10mbit", "--latency", "1"]) == 0
    assert "latency, not bandwidth" not in capsys.readouterr().out  # bandwidth-bound there


# ------------------------------------------------------------------ --calibrate


def run_folder(tmp_path: Path, steps: int, logged: dict[int, float], median: float | None) -> Path:
    summary = {"backend": "fake", "steps": steps}
    if median is not None:
        summary["median_step_time_s"] = median
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    lines = [json.dumps({"step": s, "step_time_s": t, "synced": False}) for s, t in logged.items()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_calibration_uses_the_runs_median_step_not_its_few_records(tmp_path: Path, capsys):
    """The trial's run: log_every=10, two records past the skipped steps averaging 1.6 s, a median step of 0.61 s."""
    run = run_folder(tmp_path, 16, {0: 3.0, 10: 1.5, 15: 1.7}, median=0.61)
    assert read_fake_run(str(run)).step_s == pytest.approx(0.61)
    assert main([TINY, "--inter", "1gbit", "--calibrate", str(run), "--intra", "free", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["compute_s"] == pytest.approx(0.61)
    assert "warning" not in err  # 16 steps timed


def test_calibration_from_every_steps_time_and_a_warning_when_few(tmp_path: Path, capsys):
    run = run_folder(tmp_path, 8, {s: 0.5 + 0.01 * s for s in range(8)}, median=9.9)  # every step logged: used
    compute = read_fake_run(str(run))
    assert compute.step_s == pytest.approx(0.55)  # the median of steps 3..7
    assert "only 5 step times" in compute.warning
    assert main([TINY, "--inter", "1gbit", "--calibrate", str(run), "--intra", "free"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("plan: warning: --calibrate: only 5 step times"), err


def test_calibration_on_few_steps_of_the_summary_warns(tmp_path: Path):
    run = run_folder(tmp_path, 6, {0: 3.0, 5: 1.0}, median=0.7)
    compute = read_fake_run(str(run))
    assert compute.step_s == pytest.approx(0.7) and "only 6 step times" in compute.warning


def test_calibration_without_per_step_times_is_refused(tmp_path: Path, capsys, monkeypatch):
    run = run_folder(tmp_path, 40, {0: 3.0, 10: 1.5, 20: 1.7}, median=None)  # an old summary, records only
    line = one_line_error(capsys, [TINY, "--inter", "1gbit", "--calibrate", str(run)], monkeypatch)
    assert "--calibrate" in line and "run.log_every=1" in line


def test_calibration_shape_ignores_compile_options_when_neither_run_compiles():
    """A run folder whose config.yaml names another compile.scope (an older default) still calibrates an
    eager plan; a compiled run against an eager plan is refused in one line."""
    eager = load_config(TINY, [])
    check_same_shape(load_config(TINY, ["compile.scope=step"]), eager, "old-run")
    with pytest.raises(ConfigError, match="another compile than the config to plan"):
        check_same_shape(load_config(TINY, ["compile.enabled=true"]), eager, "compiled-run")
