"""Stopping a run: SIGINT/SIGTERM to the launcher end every worker (exit 130/143), a background
launcher (SIGINT ignored) still stops on SIGTERM, and `kill -9` of the launcher leaves no orphan.
Real runs of train.py; processes are found by a unique marker in their environment. Every wait is a
hang guard (a minute or more), so a loaded machine makes a test slower, not red."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import QUIET_ENV, REPO, SMALL, as_ctrl_c_reaches_it

MARK_ENV = "HSDP_TEST_RUN_MARK"
START_TIMEOUT_S = 150  # until the first metrics line (a fresh launcher and its zygote importing torch, busy box)
STOP_TIMEOUT_S = 60  # hang guard: the launcher gives workers 3 s after SIGTERM, then kills them
GONE_TIMEOUT_S = 60  # hang guard: until no process of the run is left


def marked_pids(mark: str) -> set[int]:
    """Live (non-zombie) processes whose environment carries this test's marker."""
    needle = f"{MARK_ENV}={mark}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if state not in ("Z", "X"):
            pids.add(int(entry.name))
    return pids


def signal_set(pid: int, field: str) -> set[int]:
    """The signals in a mask of /proc/<pid>/status (e.g. SigIgn: those the process ignores)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def wait_until_gone(mark: str, timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := marked_pids(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class Run:
    """train.py on a sync×shard mesh with many steps, started so that the test can signal it."""

    def __init__(self, tmp_path: Path, sync: int, shard: int, ignore_sigint: bool = False) -> None:
        self.mark = uuid.uuid4().hex
        self.run_dir = tmp_path / "r"
        overrides = [
            *SMALL,
            "run.save_model=false",
            "run.steps=1000000",
            f"mesh.sync={sync}",
            f"mesh.shard={shard}",
            f"run.out_dir={tmp_path}",
            "run.name=r",
        ]
        cmd = [sys.executable, str(REPO / "train.py"), *[a for o in overrides for a in ("--set", o)]]
        env = {**os.environ, **QUIET_ENV, MARK_ENV: self.mark}
        # A script's background job (`cmd &`) starts with SIGINT ignored; reproduce that.
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else as_ctrl_c_reaches_it
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec,
            start_new_session=True,
        )
        self.world = sync * shard

    def logged_steps(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        return metrics.read_bytes().count(b"\n") if metrics.is_file() else 0

    def wait_steps(self, steps: int, timeout: float) -> None:
        """Block until rank 0 logged `steps` steps; fail if train.py exits first."""
        deadline = time.monotonic() + timeout
        while self.logged_steps() < steps:
            if self.proc.poll() is not None:
                pytest.fail(f"train.py exited early ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"fewer than {steps} steps logged after {timeout}s")
            time.sleep(0.05)

    def wait_training(self) -> set[int]:
        """Block until rank 0 logged a step; return the launcher's descendants (workers and helpers)."""
        self.wait_steps(1, START_TIMEOUT_S)
        workers = marked_pids(self.mark) - {self.proc.pid}
        assert len(workers) >= self.world, workers
        return workers

    def stop(self, sig: int) -> tuple[int, str]:
        """Send `sig` to the launcher only; (exit code, stderr) once it exited."""
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=STOP_TIMEOUT_S)
        return self.proc.returncode, err

    def cleanup(self) -> None:
        """Kill whatever this run left behind (only processes carrying this run's marker)."""
        for pid in marked_pids(self.mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stderr.close()


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:
        run.cleanup()


def assert_metrics_intact(run_dir: Path) -> None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["step"] == i for i, line in enumerate(lines))


def assert_stopped(run: Run, sig: int, code: int) -> None:
    """Signal the launcher: it exits `code` with one line, and no worker remains."""
    rc, err = run.stop(sig)
    assert rc == code, f"rc={rc}\n{err[-3000:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    stopped = f"interrupted by {signal.Signals(sig).name}; stopped {run.world} workers"
    assert lines and lines[-1].startswith(stopped), err
    assert "Traceback" not in err, err
    left = wait_until_gone(run.mark, GONE_TIMEOUT_S)
    assert not left, f"processes left behind: {left}"
    assert_metrics_intact(run.run_dir)


def test_sigint_stops_every_worker(tmp_path, runs):
    runs.append(run := Run(tmp_path, 1, 2))
    run.wait_training()
    assert_stopped(run, signal.SIGINT, 130)


def test_sigterm_stops_every_worker_of_a_background_launcher(tmp_path, runs):
    """Started like `python train.py &` from a script: SIGINT stays ignored, SIGTERM stops the run."""
    runs.append(run := Run(tmp_path, 1, 2, ignore_sigint=True))
    workers = run.wait_training()
    assert signal.SIGINT in signal_set(run.proc.pid, "SigIgn"), "the launcher does not ignore SIGINT"
    run.proc.send_signal(signal.SIGINT)  # discarded by the kernel when sent, as SIGINT is ignored
    # The event that shows it: steps logged after the signal, by the same launcher and workers.
    run.wait_steps(run.logged_steps() + 3, START_TIMEOUT_S)
    assert run.proc.poll() is None and workers <= marked_pids(run.mark), "an ignored SIGINT stopped the run"
    assert signal.SIGINT in signal_set(run.proc.pid, "SigIgn"), "the launcher stopped ignoring SIGINT"
    assert_stopped(run, signal.SIGTERM, 143)


def test_kill_9_of_the_launcher_leaves_no_orphans(tmp_path, runs):
    runs.append(run := Run(tmp_path, 1, 2))
    run.wait_training()
    rc, _ = run.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    left = wait_until_gone(run.mark, GONE_TIMEOUT_S)  # the zygote exits and kills them (and PR_SET_PDEATHSIG)
    assert not left, f"orphans: {left}"
