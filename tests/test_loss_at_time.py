"""scripts/loss_at_time.py: val loss at equal training time, read off each run's eval curve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from loss_at_time import loss_at, val_curve  # noqa: E402


def _run(folder: Path, step_s: float, evals: dict[int, float], steps: int = 8) -> Path:
    folder.mkdir()
    lines = []
    for s in range(steps):
        record = {"step": s, "tokens": 10 * (s + 1), "step_time_s": step_s, "sync_bytes": 0}
        if s in evals:
            record["val_loss"] = evals[s]
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_the_loss_at_a_time_is_linear_between_the_evals_around_it(tmp_path: Path) -> None:
    fast = _run(tmp_path / "fast", 0.5, {3: 4.0, 7: 2.0})  # evals at 2.0 s and 4.0 s of training
    curve = val_curve(fast)
    assert curve == [(2.0, 4.0), (4.0, 2.0)]
    assert loss_at(curve, 1.0) is None  # before the first eval
    assert loss_at(curve, 3.0) == pytest.approx(3.0)
    assert loss_at(curve, 9.0) == 2.0  # past the last eval: its loss


def test_the_table_compares_every_run_at_the_shortest_runs_time(tmp_path: Path) -> None:
    fast = _run(tmp_path / "fast", 0.5, {3: 4.0, 7: 2.0})  # 4 s of training
    slow = _run(tmp_path / "slow", 1.0, {3: 3.0, 7: 1.0})  # 8 s: at 4 s its first eval, loss 3.0
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "loss_at_time.py"), str(fast), str(slow)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "val loss at 4.0 s" in out
    assert "| fast | 8 | 4.0 s | 2.0000 | 2.0000 |" in out
    assert "| slow | 8 | 8.0 s | 1.0000 | 3.0000 |" in out


def test_a_run_with_unlogged_steps_is_refused_with_one_line(tmp_path: Path) -> None:
    run = _run(tmp_path / "gaps", 0.5, {3: 4.0})
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[::2]) + "\n")
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "loss_at_time.py"), str(run)], capture_output=True, text=True
    )
    assert done.returncode == 2 and "needs run.log_every=1" in done.stderr
