"""Stopping a run: SIGINT/SIGTERM to the launcher end every worker within seconds (exit 130/143),
a background launcher (SIGINT ignored) still stops on SIGTERM, and `kill -9` of the launcher leaves
no orphan. Real runs of train.py; processes are found by a unique marker in their environment."""

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

from tests.helpers import QUIET_ENV, REPO, SMALL

MARK_ENV = "HSDP_TEST_RUN_MARK"
START_TIMEOUT_S = 150  # until the first metrics line (4 workers importing torch on a busy 2-core box)
STOP_TIMEOUT_S = 15  # the launcher gives workers 3 s after SIGTERM, then kills them


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


def wait_until_gone(mark: str, timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := marked_pids(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
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
        preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
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

    def wait_training(self) -> set[int]:
        """Block until rank 0 logged a step; return the launcher's descendants (workers and helpers)."""
        metrics = self.run_dir / "metrics.jsonl"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            if self.proc.poll() is not None:
                pytest.fail(f"train.py exited early ({self.proc.returncode}): {self.proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no metrics after {START_TIMEOUT_S}s")
            time.sleep(0.2)
        workers = marked_pids(self.mark) - {self.proc.pid}
        assert len(workers) >= self.world, workers
        return workers

    def stop(self, sig: int) -> tuple[int, str, float]:
        """Send `sig` to the launcher only; (exit code, stderr, seconds until it exited)."""
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=STOP_TIMEOUT_S)
        return self.proc.returncode, err, time.monotonic() - t0

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
    """Signal the launcher: it exits `code` within seconds with one line, and no worker remains."""
    rc, err, took = run.stop(sig)
    assert rc == code, f"rc={rc}\n{err[-3000:]}"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith(f"interrupted by {signal.Signals(sig).name}; stopped 4 workers"), err
    assert "Traceback" not in err, err
    assert took < 10, f"the launcher took {took:.1f}s to stop"
    left = wait_until_gone(run.mark, 5)
    assert not left, f"processes left behind: {left}"
    assert_metrics_intact(run.run_dir)


def test_sigint_stops_every_worker(tmp_path, runs):
    runs.append(run := Run(tmp_path, 2, 2))
    run.wait_training()
    assert_stopped(run, signal.SIGINT, 130)


def test_sigterm_stops_every_worker_of_a_background_launcher(tmp_path, runs):
    """Started like `python train.py &` from a script: SIGINT stays ignored, SIGTERM stops the run."""
    runs.append(run := Run(tmp_path, 2, 2, ignore_sigint=True))
    workers = run.wait_training()
    run.proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    assert run.proc.poll() is None and workers <= marked_pids(run.mark), "an ignored SIGINT stopped the run"
    assert_stopped(run, signal.SIGTERM, 143)


def test_kill_9_of_the_launcher_leaves_no_orphans(tmp_path, runs):
    runs.append(run := Run(tmp_path, 1, 2))
    run.wait_training()
    rc, _, _ = run.stop(signal.SIGKILL)
    assert rc == -signal.SIGKILL
    left = wait_until_gone(run.mark, 5)  # the kernel kills the workers (PR_SET_PDEATHSIG)
    assert not left, f"orphans: {left}"
