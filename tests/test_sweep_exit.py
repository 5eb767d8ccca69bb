"""`python -m hsdp.sweep`: its exit code and failure lines, and its ratio column's words.

The trial: `--only hsdp,diloco-h32-int8` (and again with `--no-run`) exited 1 with no message after both runs
succeeded, because the runs not asked for (no folder yet) counted as failures. train.py is replaced here by a
stand-in that writes (or not) the run's summary.json, so nothing trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hsdp.bench.sweep as bench_sweep
from hsdp import sweep
from hsdp.bench.records import RunRecord
from hsdp.bench.report import sweep_table

REPO = Path(__file__).resolve().parents[1]


def write_spec(tmp_path: Path, runs: str = "  hsdp: []\n  h32: [sync.warmup_steps=0, sync.every=32]\n") -> Path:
    out = tmp_path / "runs"
    path = tmp_path / "s.yaml"
    path.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\nset: [wandb.mode=disabled, run.out_dir={out}]\n"
        f"columns: [final_val_loss, sync_bytes]\nratio: sync_bytes\nruns:\n{runs}"
    )
    return path


def run_dir(overrides: list[str]) -> Path:
    """The run folder train.py would write: the last run.out_dir / run.name of the overrides."""
    values = dict(o.split("=", 1) for o in overrides)
    return Path(values["run.out_dir"]) / values["run.name"]


def summary(run: Path, sync_bytes: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "summary.json").write_text(json.dumps({"final_val_loss": 2.0, "sync_bytes": sync_bytes, "steps": 8}))


@pytest.fixture
def train(monkeypatch):
    """A stand-in for train.py: run name → its exit code (default 0); a run that exits 0 writes its summary
    unless named in `silent`. Records the runs started."""
    state = {"codes": {}, "silent": set(), "started": []}

    def run_one(base: str, overrides: list[str], stop) -> int:
        folder = run_dir(overrides)
        name = folder.name.split("-", 1)[1]
        state["started"].append(name)
        code = state["codes"].get(name, 0)
        if code == 0 and name not in state["silent"]:
            summary(folder, 1000 if name == "hsdp" else 10)
        return code

    monkeypatch.setattr(bench_sweep, "run_one", run_one)
    return state


def stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_only_the_runs_asked_for_decide_the_exit_code(tmp_path: Path, train, capsys):
    spec = write_spec(tmp_path, "  hsdp: []\n  h8: [sync.warmup_steps=0, sync.every=8]\n  h32: [sync.warmup_steps=0]\n")
    assert sweep.main([str(spec), "--only", "hsdp,h32"]) == 0
    assert train["started"] == ["hsdp", "h32"]
    err = stderr_lines(capsys)
    assert not [line for line in err if line.startswith("sweep:")], err
    assert any("no results yet for h8" in line for line in err), err  # said, but not a failure
    assert sweep.main([str(spec), "--only", "hsdp,h32", "--no-run"]) == 0  # the trial's second command
    assert train["started"] == ["hsdp", "h32"]


def test_every_run_succeeded_exits_0(tmp_path: Path, train, capsys):
    assert sweep.main([str(write_spec(tmp_path))]) == 0
    assert sweep.main([str(write_spec(tmp_path)), "--no-run"]) == 0


def test_a_failed_run_exits_1_with_one_line_naming_it(tmp_path: Path, train, capsys):
    train["codes"]["h32"] = 3
    assert sweep.main([str(write_spec(tmp_path))]) == 1
    err = [line for line in stderr_lines(capsys) if line.startswith("sweep:")]
    assert err == ["sweep: run s-h32 failed: train.py exited with code 3 (its output is above)"], err


def test_a_run_that_exits_0_without_a_summary_fails(tmp_path: Path, train, capsys):
    train["silent"].add("hsdp")
    train["codes"]["h32"] = -9
    assert sweep.main([str(write_spec(tmp_path))]) == 1
    err = [line for line in stderr_lines(capsys) if line.startswith("sweep:")]
    assert len(err) == 2, err
    assert err[0].startswith("sweep: run s-hsdp failed: train.py exited 0 but left no summary.json in ")
    assert err[1] == "sweep: run s-h32 failed: train.py was killed by signal 9"


def test_no_run_names_an_asked_run_without_results(tmp_path: Path, train, capsys):
    spec = write_spec(tmp_path)
    summary(tmp_path / "runs" / "s-hsdp", 1000)
    (tmp_path / "runs" / "s-h32").mkdir(parents=True)
    (tmp_path / "runs" / "s-h32" / "summary.json").write_text("{not json")
    assert sweep.main([str(spec), "--no-run", "--only", "hsdp"]) == 0
    capsys.readouterr()
    assert sweep.main([str(spec), "--no-run"]) == 1
    err = [line for line in stderr_lines(capsys) if line.startswith("sweep:")]
    assert len(err) == 1 and err[0].startswith("sweep: run s-h32 has no results: unreadable "), err
    assert train["started"] == []


def test_ratio_column_reads_right():
    spec = {"columns": ["sync_bytes"], "runs": {}, "ratio": "sync_bytes"}
    values = {"hsdp": 1000, "h8": 125, "more": 4000, "same": 1000, "none": 0, "failed": None}
    records = {
        run: RunRecord.from_summary(Path(run), {"sync_bytes": b}) if b is not None else None
        for run, b in values.items()
    }
    rows = [line.split("|") for line in sweep_table(spec, records).splitlines()]
    cells = {row[1].strip(): row[-2].strip() for row in rows}
    assert cells["hsdp"] == "1× (reference)"  # not "1.0× fewer"
    assert cells["h8"] == "8× fewer"
    assert cells["more"] == "4× more"
    assert cells["same"] == "same"
    assert cells["none"] == cells["failed"] == "–"
    from hsdp.bench.report import ratio_cell

    assert ratio_cell(33.4, 1068.4, False) == "32× fewer"
    assert ratio_cell(8.5, 1068.4, False) == "126× fewer"
    assert ratio_cell(None, None, True) == "–"  # the reference run has no result: nothing to compare to
