"""The zygote in both of its starts: a fork of the launcher (CPU torch, one Python thread) and a fresh interpreter.

Either way it forks the workers and reports how they ended, and it holds nothing of the launcher's but
stderr: no file the launcher had open (a run folder's lock would outlive the launcher), no signal handler.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from hsdp.run.pool import Pool
from hsdp.run.zygote import Zygote, can_fork_launcher


def report(path: str) -> None:
    """A worker: write what it sees (its process, its parent, whether the preloaded module is there)."""
    Path(path).write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "preloaded": "wave" in sys.modules}))


def fail() -> None:
    raise ValueError("a worker's error")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
def test_zygote_forks_workers_and_holds_nothing_of_the_launcher(tmp_path: Path, fork: bool) -> None:
    held = open(tmp_path / "held.lock", "w")  # noqa: SIM115 (open while the zygote starts)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a launcher's handler; not the zygote's
    try:
        zygote = Zygote(["wave"], fork=fork)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        out = tmp_path / "worker.json"
        with Pool(zygote) as pool:
            pool.start([(report, (str(out),)), (fail, ())])
            ended = {}
            while len(ended) < 2:
                ended |= {e.index: e for e in pool.poll(60)}
        assert ended[0].code == 0 and ended[1].code == 1 and "ValueError: a worker's error" in ended[1].traceback
        seen = json.loads(out.read_text())
        assert seen["ppid"] == zygote.proc.pid and seen["preloaded"]
        fds = os.listdir(f"/proc/{zygote.proc.pid}/fd")
        targets = {os.readlink(f"/proc/{zygote.proc.pid}/fd/{fd}") for fd in fds if fd.isdigit()}
        assert str(tmp_path / "held.lock") not in targets
        os.kill(zygote.proc.pid, signal.SIGTERM)
        assert zygote.proc.wait(30) == -signal.SIGTERM  # the default action: the launcher's handler is gone
    finally:
        zygote.close()
        held.close()


def test_a_launcher_with_a_python_thread_starts_a_fresh_zygote() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork_launcher()
    finally:
        stop.set()
        thread.join()


def test_a_launcher_with_torchft_loaded_starts_a_fresh_zygote() -> None:
    """A local elastic launcher runs torchft's lighthouse: its Rust runtime must not be forked into the workers."""
    import torchft._torchft  # noqa: F401

    assert not can_fork_launcher()
