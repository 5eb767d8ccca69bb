"""A finished run stays finished, and every run ends with one closing line on stdout.

A run that trained all its `run.steps` writes a completion record (finished.json) last, after summary.json;
the same command again prints "finished at step N, nothing to do (<summary.json>)", exits 0 and changes no
file, whatever checkpoints the run kept (before the record, a run whose last step was not a checkpoint step
re-trained its tail from the newest checkpoint and rewrote summary.json). A longer run.steps continues from
the newest checkpoint; a shorter one is refused. Real runs of train.py, each with a timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.run.rundir import finished_line, read_finished, write_finished
from tests.helpers import QUIET_ENV, REPO, SMALL, run_train

ONE = SMALL + ["mesh.sync=1", "mesh.shard=2", "run.save_model=false"]
# 7 steps, a checkpoint every 3 (after steps 2 and 5): the last step (6) is not a checkpoint step
FIN = ONE + ["run.steps=7", "run.checkpoint_every=3", "run.keep_checkpoints=3"]
DONE = re.compile(r"^done: step (\d+), loss (\S+), val (\S+), ([\d,]+) tok/s \(median step\), (\S+)$")


def state_of(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file below `folder` → (SHA-256, mtime in ns): what a run that changes nothing leaves as it was."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def train_subprocess(out: Path, name: str, overrides: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py` in a fresh process, stdout and stderr apart (the warm server merges them)."""
    cmd = [sys.executable, str(REPO / "train.py")]
    for o in [*overrides, f"run.out_dir={out}", f"run.name={name}", "mesh.timeout_s=60"]:
        cmd += ["--set", o]
    env = {**os.environ, **QUIET_ENV, "HSDP_NO_BAR": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("finished")


@pytest.fixture(scope="module")
def fin(out: Path) -> subprocess.CompletedProcess:
    """The issue's run, small: its last step is not a checkpoint step. A fresh process, to read its stdout."""
    res = train_subprocess(out, "fin", FIN)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_a_run_ends_with_one_closing_line_on_stdout(out: Path, fin: subprocess.CompletedProcess) -> None:
    """HSDP_NO_BAR=1, wandb disabled: stdout's last line is the closing line, its figures the summary's."""
    closing = [line for line in lines(fin.stdout) if line.startswith("done:")]
    assert len(closing) == 1 and lines(fin.stdout)[-1] == closing[0], fin.stdout
    m = DONE.match(closing[0])
    assert m, closing[0]
    summary_path = out / "fin" / "summary.json"
    summary = json.loads(summary_path.read_text())
    assert int(m.group(1)) == 6 and m.group(5) == str(summary_path)
    assert float(m.group(2)) == pytest.approx(summary["final_loss"], rel=1e-3)
    assert float(m.group(3)) == pytest.approx(summary["final_val_loss"], rel=1e-3)
    tokens_per_step = 2 * 2 * 17  # mesh 1x2, data.batch_size=2, model.seq_len=17
    rate = float(m.group(4).replace(",", ""))
    assert rate == pytest.approx(tokens_per_step / summary["median_step_time_s"], abs=1)
    assert "done:" not in fin.stderr


def test_the_completion_record_comes_after_the_summary(out: Path, fin: subprocess.CompletedProcess) -> None:
    run = out / "fin"
    record = read_finished(run)
    assert record is not None and record["steps"] == 7 and record["last_step"] == 6, record
    assert record["summary"] == "summary.json"
    assert (run / "finished.json").stat().st_mtime_ns >= (run / "summary.json").stat().st_mtime_ns


@pytest.mark.parametrize("how", ["same", "another-period", "no-checkpoints"])
def test_rerunning_a_finished_run_changes_nothing(out: Path, fin: subprocess.CompletedProcess, how: str) -> None:
    """The same command again (or with another checkpoint period, or none): one line, exit 0, no file touched."""
    run = out / f"again-{how}"
    shutil.copytree(out / "fin", run)
    overrides = {
        "same": FIN,
        "another-period": FIN + ["run.checkpoint_every=2"],
        "no-checkpoints": FIN + ["run.checkpoint_every=0"],
    }[how]
    if how == "no-checkpoints":
        shutil.rmtree(run / "checkpoints")
    before = state_of(run)
    again = run_train(out, run.name, overrides, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert lines(again.stderr) == [f"finished at step 6, nothing to do ({run / 'summary.json'})"], again.stderr
    assert state_of(run) == before


def test_another_config_is_another_command(out: Path, fin: subprocess.CompletedProcess) -> None:
    """The record answers for the config it trained: how the run is kept (checkpoint period, how many kept, the
    timeout, wandb) may change; another seed or learning rate is not this run, and the run folder's usual rules
    apply (resume from the newest checkpoint, or refuse a folder without one)."""

    def line(*extra: str) -> str | None:
        return finished_line(load_config(None, [*FIN, f"run.out_dir={out}", "run.name=fin", *extra]))

    same = f"finished at step 6, nothing to do ({out / 'fin' / 'summary.json'})"
    assert line() == same
    assert line("run.checkpoint_every=0", "run.keep_checkpoints=1", "mesh.timeout_s=5", "wandb.mode=offline") == same
    assert line("run.seed=7") is None and line("optim.lr=0.01") is None


def test_a_longer_run_continues_from_the_newest_checkpoint(out: Path, fin: subprocess.CompletedProcess) -> None:
    """run.steps 7 -> 10: resumed from step_5 (the newest checkpoint; steps after it are trained again under the
    stretched LR schedule, each logged once), a new record; the same command again has nothing to do."""
    run = out / "longer"
    shutil.copytree(out / "fin", run)
    longer = FIN[:-3] + ["run.steps=10", "run.checkpoint_every=3", "run.keep_checkpoints=3"]
    res = run_train(out, run.name, longer)
    assert res.summary["resumed_from"] == str(run / "checkpoints" / "step_5")
    assert [m["step"] for m in res.metrics] == list(range(10))
    assert "note: run.steps 7 -> 10 on resume" in res.stderr
    assert read_finished(run)["steps"] == 10
    assert lines(res.stderr)[-1].startswith("done: step 9, ")
    before = state_of(run)
    again = run_train(out, run.name, longer)
    assert lines(again.stderr) == [f"finished at step 9, nothing to do ({run / 'summary.json'})"]
    assert state_of(run) == before


def test_a_shorter_run_steps_than_finished_is_refused(out: Path, fin: subprocess.CompletedProcess) -> None:
    run = out / "shorter"
    shutil.copytree(out / "fin", run)
    before = state_of(run)
    res = run_train(out, run.name, FIN + ["run.steps=4"], check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    assert lines(res.stderr) == [
        f"config error: run.steps: 4 is below the 7 steps {run} has finished; set run.steps=7 (nothing to do) or "
        "more (continues from its newest checkpoint), or run.overwrite=true to start over"
    ], res.stderr
    assert state_of(run) == before


def test_overwrite_starts_a_finished_run_over(out: Path, fin: subprocess.CompletedProcess) -> None:
    run = out / "over"
    shutil.copytree(out / "fin", run)
    res = run_train(out, run.name, FIN + ["run.overwrite=true"])
    assert res.summary["resumed_from"] is None and read_finished(run)["steps"] == 7


def test_a_finished_elastic_run_stays_finished(tmp_path: Path) -> None:
    """An elastic run's launcher writes the record after merging the replicas' summaries, and prints the closing
    line; the same command again changes nothing."""
    overrides = SMALL + ["mesh.sync=2", "mesh.shard=1", "elastic.enabled=true", "elastic.timeout_s=2"]
    overrides += ["sync.warmup_steps=0", "sync.every=4", "sync.method=diloco", "run.steps=8"]
    overrides += ["run.checkpoint_every=3", "run.save_model=false"]
    res = run_train(tmp_path, "el", overrides, timeout=300)
    run = res.run_dir
    assert read_finished(run) == {**read_finished(run), "steps": 8, "summary": "summary.json"}
    done = [line for line in lines(res.stderr) if line.startswith("done:")]
    assert len(done) == 1 and DONE.match(done[0]) and done[0].endswith(str(run / "summary.json")), res.stderr
    before = state_of(run)
    again = run_train(tmp_path, "el", overrides, timeout=300)
    assert lines(again.stderr) == [f"finished at step 7, nothing to do ({run / 'summary.json'})"], again.stderr
    assert state_of(run) == before


def test_elastic_replicas_under_torchrun_finish_by_their_own_records(tmp_path: Path) -> None:
    """Under torchrun each elastic replica is its own job and no launcher merges them: each writes its own record,
    and the run is finished once every replica's says so."""
    cfg = load_config(None, SMALL + ["mesh.sync=2", "mesh.shard=1", "elastic.enabled=true", "sync.warmup_steps=0"])
    cfg.run.out_dir, cfg.run.name, cfg.run.steps = str(tmp_path), "tr", 8
    cfg.run_dir.mkdir()
    cfg.elastic.replica = 0
    write_finished(cfg, "summary.replica0.json", replica=0)
    assert finished_line(cfg) is None  # replica 1 has not finished
    cfg.elastic.replica = 1
    write_finished(cfg, "summary.replica1.json", replica=1)
    assert finished_line(cfg) == f"finished at step 7, nothing to do ({cfg.run_dir / 'summary.replica0.json'})"
    cfg.run.steps = 12
    assert finished_line(cfg) is None  # longer: continues
    cfg.run.steps = 6
    with pytest.raises(ConfigError, match="run.steps: 6 is below the 8 steps"):
        finished_line(cfg)
    cfg.run.steps, cfg.run.resume = 8, "never"
    assert finished_line(cfg) is None  # never: prepare_run_dir decides (refuses without run.overwrite)


def test_a_record_that_is_not_one_counts_as_none(tmp_path: Path) -> None:
    (tmp_path / "finished.json").write_text("{not json")
    assert read_finished(tmp_path) is None
    (tmp_path / "finished.json").write_text(json.dumps({"steps": "7"}))
    assert read_finished(tmp_path) is None


def test_closing_line_falls_back_to_the_mean_rate(tmp_path: Path) -> None:
    import train

    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"final_loss": 2.91234, "final_val_loss": None, "wall_tokens_per_s": 41200.4}))
    assert train.closing_line(49, summary) == f"done: step 49, loss 2.912, val n/a, 41,200 tok/s (mean), {summary}"
    # the steady rate is the summary's own tokens_per_s (trained tokens), never nominal tokens per step / median
    s = {"final_loss": 2.9, "final_val_loss": 2.95, "median_step_time_s": 0.1, "tokens_per_s": 11329.0}
    summary.write_text(json.dumps({**s, "tokens_per_step": 4096}))
    assert (
        train.closing_line(49, summary) == f"done: step 49, loss 2.9, val 2.95, 11,329 tok/s (median step), {summary}"
    )
    assert train.closing_line(49, tmp_path / "none.json") is None
