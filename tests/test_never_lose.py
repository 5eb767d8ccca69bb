"""Nothing lost, nothing hung: each way a run could lose work or hang, tried with real processes.

One test per case of the never-lose contract (docs/design.md §12.2): checks that refuse a run
come before the run folder changes; checksums catch a corrupt checkpoint; a diverged run stops
and never checkpoints or exports a NaN; a stopped rank ends the job within mesh.timeout_s; a
second launch of a running run is refused; a world/mesh mismatch under torchrun writes nothing;
a full disk names itself and leaves no partial save; a sweep dies with its runs and resumes.
Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsdp.export import main as export_main
from tests.helpers import QUIET_ENV, REPO, SMALL, RunResult, run_train
from tests.test_checkpoint import (
    alive,
    free_port,
    last_logged_step,
    left_behind,
    signal_held_rank,
    start_served,
    train_cmd,
)

ENV = {**os.environ, **QUIET_ENV}
MESH = ["mesh.sync=2", "mesh.shard=2"]
BASE = SMALL + MESH + ["run.steps=8", "run.checkpoint_every=2", "run.keep_checkpoints=2", "run.save_model=false"]


def files_under(folder: Path) -> dict[str, int]:
    """Every file below `folder` → its size (what is on disk, to compare before/after a refused run)."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def strict_json_lines(path: Path) -> list[dict]:
    """metrics.jsonl parsed the way a strict JSON reader would (NaN / Infinity are not JSON)."""

    def refuse(token: str) -> None:
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("never-lose")


@pytest.fixture(scope="module")
def finished(out: Path) -> RunResult:
    """8 steps on 2x2 with a checkpoint every 2 (the newest two kept: step_5, step_7)."""
    return run_train(out, "finished", BASE)


# ---------------------------------------------------------------- 1. overwrite + resume
def test_overwrite_with_a_bad_resume_deletes_nothing(out: Path, finished: RunResult) -> None:
    """run.overwrite=true with a resume path that is missing, or inside the run it would delete: exit 2, one line,
    and every file of the run still there."""
    run = out / "overwrite-victim"
    shutil.copytree(finished.run_dir, run)
    before = files_under(run)
    for resume, says in [
        (run / "checkpoints" / "step_3", "no such folder"),
        (run / "checkpoints" / "step_5", "inside"),
    ]:
        res = run_train(out, run.name, BASE + [f"run.resume={resume}", "run.overwrite=true"], check=False)
        assert res.returncode == 2, res.stderr
        assert last_line(res.stderr).startswith("config error: run.resume:") and says in last_line(res.stderr)
        assert files_under(run) == before


def test_a_refused_resume_leaves_no_run_folder(out: Path) -> None:
    res = run_train(out, "never-made", BASE + [f"run.resume={out / 'nowhere'}"], check=False)
    assert res.returncode == 2 and "run.resume" in last_line(res.stderr)
    assert not (out / "never-made").exists()


# ---------------------------------------------------------------- 2. corrupt checkpoints
def flip_bytes(path: Path, offset: int, n: int = 4096) -> None:
    """Same size, different bytes (what a bad disk block or a torn copy leaves)."""
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "pickle-header"])
def test_a_corrupt_checkpoint_is_refused_by_resume_and_export(out: Path, finished: RunResult, where: str) -> None:
    run = out / f"corrupt-{where}"
    shutil.copytree(finished.run_dir, run)
    step = run / "checkpoints" / "step_7"
    victim = step / "__1_0.distcp"
    size = victim.stat().st_size
    flip_bytes(victim, size // 2 if where == "data" else 0, 4096 if where == "data" else 64)
    assert victim.stat().st_size == size
    before = files_under(run)
    # named by path: refused (run.resume=auto falls back to an older one instead: tests/test_corrupt_checkpoints.py)
    res = run_train(out, run.name, BASE + ["run.steps=10", f"run.resume={step}"], check=False)
    assert res.returncode == 2, res.stderr
    line = last_line(res.stderr)
    assert line.startswith("config error: run.resume:") and "__1_0.distcp" in line and "corrupt" in line
    assert (step / ".complete").is_file() and files_under(run) == before  # nothing was deleted, moved or pruned
    assert export_main([str(step), str(out / f"corrupt-{where}.pt")]) == 2
    assert not (out / f"corrupt-{where}.pt").exists()


def test_a_checkpoint_that_lost_its_checksums_is_refused(out: Path, finished: RunResult) -> None:
    """checksums.json deleted and a tensor's bytes changed: the marker says the checksums were written, so resume
    and export refuse (one line naming the file); nothing in the run folder changes."""
    run = out / "no-checksums"
    shutil.copytree(finished.run_dir, run)
    step = run / "checkpoints" / "step_7"
    assert json.loads((step / ".complete").read_text()) == {"step": 7, "checksums": "checksums.json"}
    (step / "checksums.json").unlink()
    victim = step / "__1_0.distcp"
    flip_bytes(victim, victim.stat().st_size // 2)
    before = files_under(run)
    res = run_train(out, run.name, BASE + ["run.steps=10", f"run.resume={step}"], check=False)
    assert res.returncode == 2, res.stderr
    line = last_line(res.stderr)
    assert line.startswith("config error: run.resume:") and "missing its checksums.json" in line, line
    assert str(step) in line
    assert files_under(run) == before
    assert export_main([str(step), str(out / "no-checksums.pt")]) == 2
    assert not (out / "no-checksums.pt").exists()


def test_a_checkpoint_from_before_checksums_still_loads(out: Path, finished: RunResult) -> None:
    """A marker without the checksums record (written before checksums existed) and no checksums.json: the
    checkpoint loads unverified, as it always did, and the run continues from it."""
    run = out / "old-format"
    shutil.copytree(finished.run_dir, run)
    step = run / "checkpoints" / "step_7"
    (step / "checksums.json").unlink()
    (step / ".complete").write_text(json.dumps({"step": 7}) + "\n")
    res = run_train(out, run.name, BASE + ["run.steps=10"])
    assert res.summary["resumed_from"] == str(step)
    assert [m["step"] for m in res.metrics] == list(range(10))


def test_checksums_cover_every_file(finished: RunResult) -> None:
    step = finished.run_dir / "checkpoints" / "step_7"
    listed = set(json.loads((step / "checksums.json").read_text()))
    assert listed == {p.name for p in step.iterdir() if p.name not in ("checksums.json", ".complete")}
    assert {".metadata", "meta.json", "config.yaml", "__0_0.distcp", "__3_0.distcp"} <= listed


# ---------------------------------------------------------------- 3. divergence
def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(out: Path, finished: RunResult) -> None:
    """Resume the finished run's step_5 with optim.lr=1e6: the run stops with one line naming the step and the
    last good checkpoint; nothing non-finite is saved, the good checkpoints survive, metrics stay valid JSON."""
    run = out / "diverge"
    shutil.copytree(finished.run_dir, run)
    shutil.rmtree(run / "checkpoints" / "step_7")  # resume=auto then takes step_5
    res = run_train(out, run.name, BASE + ["optim.lr=1e6", "optim.lr_warmup=0", "run.steps=40"], check=False)
    assert res.returncode == 1, res.stderr
    line = last_line(res.stderr)
    assert line.startswith("error: rank ") and any(w in line for w in ("non-finite", " is nan", " is inf")), line
    diverged_at = int(line.split("step ", 1)[1].split(":", 1)[0])
    kept = sorted((p for p in (run / "checkpoints").iterdir()), key=lambda p: int(p.name.split("_")[1]))
    assert [p.name for p in kept][0] == "step_5"  # the good checkpoint the bad run started from is still there
    assert all(p.name.startswith("step_") and int(p.name[5:]) < diverged_at for p in kept)
    assert f"the last good checkpoint is {kept[-1]} " in line, line
    for p in kept:  # every checkpoint left is finite: export refuses anything else
        assert export_main([str(p), str(out / "diverge.pt")]) == 0
    records = strict_json_lines(run / "metrics.jsonl")
    assert records[-1]["step"] == diverged_at - 1


def test_nan_from_the_first_step_exits_non_zero(out: Path) -> None:
    res = run_train(out, "nan-at-once", SMALL + ["run.steps=5", "optim.lr=1e30", "optim.lr_warmup=0"], check=False)
    assert res.returncode == 1
    assert "step " in last_line(res.stderr) and "no checkpoint was saved" in last_line(res.stderr)
    strict_json_lines(out / "nan-at-once" / "metrics.jsonl")
    assert not (out / "nan-at-once" / "summary.json").exists()


# ---------------------------------------------------------------- 4. a stalled rank
def test_a_stopped_rank_ends_the_job_within_the_timeout(out: Path) -> None:
    """SIGSTOP of one worker with mesh.timeout_s=10: every rank ends within the timeout plus a few seconds,
    and the launcher's last line names the rank that stopped answering.

    The ranks are held before step 2 (tests/checkpoint_train.py) until rank 2 is stopped; released, the others
    go on into step 2's collectives, which rank 2 never joins."""
    pid_dir = out / "stall-pids"
    pid_dir.mkdir()
    hold = pid_dir / "hold"
    hold.write_text("2")
    name, timeout_s = "stall", 10
    cmd = train_cmd(["tests/checkpoint_train.py", "pids", str(pid_dir)], out, name, SMALL + MESH + ["run.steps=4"])
    cmd += ["--set", f"mesh.timeout_s={timeout_s}"]  # the last override wins over train_cmd's 60
    run = start_served(cmd)  # a worker is stopped, not the launcher: the warm server's launch will do

    def reached() -> bool:  # every rank has written its pid by step 1
        return last_logged_step(out / name / "metrics.jsonl") >= 1

    returncode, stderr, ended_s, pids = signal_held_rank(run, pid_dir, 2, signal.SIGSTOP, reached, timeout_s + 60)
    assert returncode == 1, stderr[-3000:]
    line = last_line(stderr)
    assert "rank 2" in line and "stopped answering" in line, line
    assert ended_s < timeout_s + 60, ended_s  # a hang guard: the line above says the stall detector ended it
    assert not left_behind(pids), "workers left behind"


# ---------------------------------------------------------------- 5. the run lock
def test_a_second_launch_of_a_running_run_is_refused(out: Path) -> None:
    """While a run trains (held before step 2, after step 1's checkpoint), launching it again exits 2 naming the
    first launcher; the first never notices, and once it is stopped the run resumes and finishes."""
    pid_dir = out / "lock-pids"
    pid_dir.mkdir()
    (pid_dir / "hold").write_text("2")
    name = "locked"
    overrides = SMALL + ["mesh.sync=1", "mesh.shard=2", "run.steps=4", "run.checkpoint_every=2", "run.save_model=false"]
    first = subprocess.Popen(  # a fresh process: the test signals this launcher
        train_cmd(["tests/checkpoint_train.py", "pids", str(pid_dir)], out, name, overrides),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while not list((out / name / "checkpoints").glob("step_*/.complete")):
            assert first.poll() is None and time.monotonic() < deadline, "no checkpoint yet"
            time.sleep(0.05)
        second = run_train(out, name, overrides, check=False)
        assert second.returncode == 2, second.stderr
        line = last_line(second.stderr)
        assert f"in use by another launch (pid {first.pid})" in line, line
        assert first.poll() is None  # the first run never noticed
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    again = run_train(out, name, overrides)  # the lock went with the first launcher: it resumes and finishes
    assert again.summary["resumed_from"] is not None


# ---------------------------------------------------------------- 6. torchrun world vs mesh
def test_torchrun_world_mismatch_writes_nothing(out: Path) -> None:
    """A 2-process torchrun for a 2x2 mesh refuses before the run folder exists; the corrected run of that name
    then runs (launched locally: what it checks is that the refusal left nothing in its way)."""
    name = "tr-mismatch"

    def torchrun(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"localhost:{free_port()}",
            *train_cmd(["train.py"], out, name, overrides)[1:],
        ]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=ENV)

    refused = torchrun(2, SMALL + MESH + ["run.steps=2"])
    assert refused.returncode != 0
    assert "config error: mesh" in refused.stderr and "world" in refused.stderr, refused.stderr[-3000:]
    assert not (out / name).exists()
    ok = run_train(out, name, SMALL + ["mesh.sync=1", "mesh.shard=2", "run.steps=2"])
    assert ok.summary["steps"] == 2


# ---------------------------------------------------------------- 7. disk full during a save
def test_disk_full_during_a_save_names_itself_and_leaves_no_partial_save(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs (CI and the dev box run as root)")
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        res = run_train(disk, "full", SMALL + MESH + ["run.steps=6", "run.checkpoint_every=3"], check=False)
        assert res.returncode == 1, res.stderr[-3000:]
        assert "the disk is full (" in last_line(res.stderr), res.stderr[-3000:]
        left = (
            [p.name for p in (disk / "full" / "checkpoints").iterdir()]
            if (disk / "full" / "checkpoints").is_dir()
            else []
        )
        assert not [n for n in left if n.startswith(".tmp_step_")], left
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---------------------------------------------------------------- 8. sweeps
SWEEP_SET = [*SMALL, "mesh.sync=1", "mesh.shard=2", "run.save_model=false"]


def write_sweep(path: Path, out: Path, steps: int) -> Path:
    """Runs a, then b (which checkpoints every 2 steps: the first after step 1)."""
    spec = {
        "base": str(REPO / "configs" / "tiny.yaml"),
        "set": [*SWEEP_SET, f"run.out_dir={out}", f"run.steps={steps}", "mesh.timeout_s=60"],
        "columns": ["final_loss"],
        "runs": {"a": [], "b": ["optim.lr=0.002", "run.checkpoint_every=2"]},
    }
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def sweep_cmd(spec: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hsdp.sweep", str(spec), *extra]


def process_tree(pid: int) -> set[int]:
    """Every descendant of `pid` alive now (children of each of its threads, recursively)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:  # gone meanwhile
                continue
            todo += children - found
            found |= children
    return found


def test_kill9_of_a_sweep_leaves_no_run_alive(tmp_path: Path) -> None:
    """kill -9 of a sweep while its run trains: the run's launcher, its zygote and every worker die with it."""
    spec = write_sweep(tmp_path / "s.yaml", tmp_path / "runs", steps=400)
    metrics = tmp_path / "runs" / "s-a" / "metrics.jsonl"
    proc = subprocess.Popen(sweep_cmd(spec), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + 240  # a hang guard: at load 15 the sweep's run took > 120 s to log step 2
        while last_logged_step(metrics) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert children, "the sweep has no run process"
        launcher = int(children[0])
        run = process_tree(launcher) | {launcher}  # training: the launcher, its zygote, both workers
        assert len(run) >= 4, run
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while [p for p in run if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(launcher), "the run's launcher outlived the sweep"
        assert not [p for p in run if alive(p)], "a process of the run outlived the sweep"  # none trains on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_interrupted_sweep_resumes(tmp_path: Path) -> None:
    """SIGTERM during run b (after its first checkpoint); --resume keeps a and continues b from its checkpoint."""
    spec = write_sweep(tmp_path / "s.yaml", tmp_path / "runs", steps=16)  # b: 14 steps and 7 saves after the first
    proc = subprocess.Popen(sweep_cmd(spec), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV)
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "runs" / "s-b" / "checkpoints").glob("step_*/.complete")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, proc.stdout.read().decode()[-3000:]
    a_summary = (tmp_path / "runs" / "s-a" / "summary.json").read_bytes()
    resumed = subprocess.run(
        sweep_cmd(spec, "--resume"), cwd=tmp_path, capture_output=True, text=True, timeout=240, env=ENV
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (tmp_path / "runs" / "s-a" / "summary.json").read_bytes() == a_summary  # kept, not re-run
    b = json.loads((tmp_path / "runs" / "s-b" / "summary.json").read_text())
    assert b["resumed_from"] is not None and b["steps"] == 16


# ---------------------------------------------------------------- 9. the smaller cases
def test_export_to_a_directory_or_below_a_file_exits_2_and_makes_missing_folders(
    out: Path, finished: RunResult, capsys
) -> None:
    step = str(finished.run_dir / "checkpoints" / "step_7")
    (out / "a-file").write_text("")
    for target, says in [(out, "is a folder"), (out / "a-file" / "m.pt", "is not a folder")]:
        assert export_main([step, str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: out:") and says in err[0], err
    assert export_main([step, str(out / "no" / "such" / "m.pt")]) == 0  # the README's out/tiny-hf on a fresh clone
    assert (out / "no" / "such" / "m.pt").is_file()


def test_a_too_long_run_name_exits_2(out: Path) -> None:
    res = run_train(out, "x" * 300, SMALL + ["run.steps=1"], check=False)
    assert res.returncode == 2 and last_line(res.stderr).startswith("config error: run.name:"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_run_steps_below_the_checkpoint_exits_2(out: Path, finished: RunResult) -> None:
    res = run_train(out, "steps-below", BASE + ["run.steps=4", f"run.resume={finished.run_dir}"], check=False)
    assert res.returncode == 2 and last_line(res.stderr).startswith("config error: run.steps:"), res.stderr[-2000:]
    assert not (out / "steps-below").exists()


def test_rerunning_a_finished_run_keeps_its_summary(out: Path, finished: RunResult) -> None:
    before = files_under(finished.run_dir)
    summary = (finished.run_dir / "summary.json").read_bytes()
    again = run_train(out, "finished", BASE)
    assert again.stderr.strip() == f"finished at step 7, nothing to do ({finished.run_dir / 'summary.json'})"
    assert (finished.run_dir / "summary.json").read_bytes() == summary
    assert files_under(finished.run_dir) == before
