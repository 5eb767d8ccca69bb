"""hsdp/run/lighthouse.py: the lighthouse as a supervised process of its own, started again at its address when it dies,
and a local elastic run whose lighthouse is killed mid-run (the launcher starts it again; the run finishes level)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.run.lighthouse import LighthouseProcess, free_port
from hsdp.sync.elastic import lighthouse_unreachable

REPO = Path(__file__).resolve().parents[1]


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.timeout(90)
def test_a_killed_lighthouse_is_started_again_at_its_address_and_a_held_one_is_not() -> None:
    """SIGKILL the lighthouse: the supervisor starts a new process at the same address (it answers there again);
    `stop` (a fault holding it down) is not undone by the supervisor; `close` leaves no process."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["elastic.enabled=true", "sync.warmup_steps=0"])
    port = free_port()
    lighthouse = LighthouseProcess(cfg, port, f"http://localhost:{port}").start().supervise(every_s=0.05)
    try:
        first = lighthouse.proc
        assert first is not None and lighthouse_unreachable(lighthouse.address, 2.0) is None
        os.kill(first.pid, signal.SIGKILL)
        assert _wait(lambda: lighthouse.restarts == 1 and lighthouse.alive, 30), "not started again"
        assert lighthouse.proc is not first
        assert _wait(lambda: lighthouse_unreachable(lighthouse.address, 1.0) is None, 30), "no answer at its address"
        lighthouse.stop()
        time.sleep(0.5)  # ten looks of the supervisor
        assert not lighthouse.alive and lighthouse.restarts == 1
        lighthouse.start()
        assert lighthouse.alive and lighthouse_unreachable(lighthouse.address, 2.0) is None
        last = lighthouse.proc
    finally:
        lighthouse.close()
    assert last is not None and last.poll() is not None


@pytest.mark.timeout(300)
def test_a_local_elastic_run_outlives_its_lighthouse(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The local launcher's own lighthouse is a child process: killed with SIGKILL once both replicas logged step 8,
    it is started again at the same address, and the run finishes with both replicas bitwise equal."""
    import train  # the repo root is on sys.path (tests/test_robustness.py imports it too)

    run_dir = tmp_path / "lh"
    overrides = ["elastic.enabled=true", "sync.warmup_steps=0", "sync.method=diloco", "sync.every=8"]
    overrides += ["mesh.sync=2", "mesh.shard=1", "run.steps=48", "run.save_model=true", "run.log_every=1"]
    overrides += ["run.eval_every=0", "wandb.mode=disabled", "elastic.timeout_s=3", "mesh.timeout_s=60"]
    overrides += ["model.n_layer=2", "model.d_model=64", "model.n_head=4", "data.source=synthetic"]
    overrides += [f"run.out_dir={tmp_path}", "run.name=lh"]
    killed: list[int] = []

    def killer() -> None:  # the launcher's lighthouse is this process's only torchft_lighthouse child
        def logged(m: int) -> int:
            path = run_dir / f"metrics.replica{m}.jsonl"
            return len(path.read_text().splitlines()) if path.is_file() else 0

        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and min(logged(0), logged(1)) < 8:
            time.sleep(0.05)
        for pid in _lighthouse_children():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    argv = ["--config", str(REPO / "configs" / "tiny.yaml")] + [a for o in overrides for a in ("--set", o)]
    code = train.main(argv)
    thread.join(5)
    err = capfd.readouterr().err
    assert code == 0, err[-3000:]
    assert len(killed) == 1 and "the lighthouse exited (-9); started again at" in err, err[-3000:]
    for m in (0, 1):  # every step trained and logged once by each replica
        steps = [json.loads(line)["step"] for line in (run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]
        assert steps == list(range(48)), (m, steps)
    a, b = torch.load(run_dir / "model.replica0.pt"), torch.load(run_dir / "model.replica1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not _lighthouse_children()  # the launcher stopped it at the end


def _lighthouse_children() -> list[int]:
    """The pids of torchft_lighthouse processes whose parent is this process."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == os.getpid() and b"torchft_lighthouse" in cmd and state != "Z":
            out.append(int(entry.name))
    return out
