"""An elastic run's re-run never loses a replica's checkpoints, and its launcher never waits on a stopped worker.

Real runs of train.py (each replica its own world, torchft's lighthouse in the launcher). The state a
launcher killed while a replica was down leaves behind (the replicas' newest checkpoints differ, with no
step in common) is built by deleting checkpoint folders of a finished run rather than by timing kills.
Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.run.checkpoint import complete_checkpoints, step_of
from hsdp.run.pool import Exit
from hsdp.run.replicas import ElasticRun, check_lighthouse_reachable
from tests.helpers import REPO, SMALL, RunResult, run_train
from tests.test_elastic import _finish, _last_step, _replicas, _start
from tests.test_never_lose import files_under, flip_bytes, last_line

BASE = SMALL + ["mesh.sync=2", "mesh.shard=1", "elastic.enabled=true", "elastic.timeout_s=2"]
BASE += ["sync.warmup_steps=0", "sync.every=4", "sync.method=diloco", "run.checkpoint_every=4"]


def steps_of(run_dir: Path, replica: int) -> list[int]:
    return [step_of(p) for p in complete_checkpoints(run_dir / f"replica{replica}")]


def records(run_dir: Path, replica: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics.replica{replica}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("elastic-resume")


@pytest.fixture(scope="module")
def done(out: Path) -> RunResult:
    """16 steps, both replicas' checkpoints kept: step_3, step_7, step_11, step_15 each."""
    res = run_train(out, "done", BASE + ["run.steps=16", "run.keep_checkpoints=10"], timeout=300)
    assert steps_of(res.run_dir, 0) == steps_of(res.run_dir, 1) == [3, 7, 11, 15]
    return res


def left_as(done: RunResult, name: str, keep: dict[int, list[int]]) -> Path:
    """A copy of the finished run with only the checkpoints `keep` names per replica (a replica that was down)."""
    run = done.run_dir.parent / name
    shutil.copytree(done.run_dir, run)
    (run / "summary.json").unlink()
    for m, steps in keep.items():
        for p in complete_checkpoints(run / f"replica{m}"):
            if step_of(p) not in steps:
                shutil.rmtree(p)
    return run


@pytest.mark.parametrize(
    "case,keep,checkpoints,steps",
    [
        # The case: the launcher killed while replica 1 was down (no step in common), keep 2.
        ("r1-down-keep2", {0: [11, 15], 1: [3, 7]}, 2, 20),
        # Replica 0 was down instead, keep 1; run.steps short of the next save: nothing may be deleted at all.
        ("r0-down-keep1", {0: [7], 1: [15]}, 1, 18),
        # Replica 1 was down before its first checkpoint: it has none.
        ("r1-none", {0: [11, 15], 1: []}, 2, 20),
    ],
)
def test_replicas_that_disagree_resume_each_from_its_own_newest(
    done: RunResult, case: str, keep: dict[int, list[int]], checkpoints: int, steps: int
) -> None:
    """Every replica resumes from its own newest checkpoint, the one behind heals from the one ahead when they
    meet, and the run finishes; no checkpoint is deleted except by `run.keep_checkpoints` after a newer save."""
    run = left_as(done, case, keep)
    before = {m: steps_of(run, m) for m in (0, 1)}
    res = run_train(
        run.parent, case, BASE + [f"run.steps={steps}", f"run.keep_checkpoints={checkpoints}"], check=False, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "note: the replicas' newest checkpoints differ" in res.stderr
    ahead = max((0, 1), key=lambda m: max(before[m], default=-1))
    behind = 1 - ahead
    saved = list(range(before[ahead][-1] + 4, steps, 4))  # the steps the re-run saved
    for m in (0, 1):
        summary = json.loads((run / f"summary.replica{m}.json").read_text())
        mine = f"replica{m}/checkpoints/step_{before[m][-1]}" if before[m] else None
        assert (summary["resumed_from"] or "").endswith(mine or "") and bool(summary["resumed_from"]) == bool(mine)
        assert summary["heals"] == (1 if m == behind else 0), (m, summary)
        # nothing deleted but by the keep rule: the `checkpoints` newest of what was there and what was saved
        assert steps_of(run, m) == sorted(set(before[m]) | set(saved))[-checkpoints:] if saved else before[m], m
        got = [r["step"] for r in records(run, m)]
        assert len(got) == len(set(got)) and got == sorted(got) and got[-1] == steps - 1, m
    assert [r["step"] for r in records(run, ahead)] == list(range(steps))  # its work kept, none repeated
    assert json.loads((run / "summary.json").read_text())["heals"] == 1
    # Each replica's ledger is over its lives (the first launch's, kept up to where it resumed or healed, and
    # this one's): one replica's tokens per step its metrics file holds, counted without the ledger code; the
    # run's tokens are their sum (the one behind counts from its checkpoint: its own counter falls short)
    cfg = load_config(str(run / "config.yaml"))
    assert cfg.run.log_every == 1
    share = cfg.mesh.replicate * cfg.mesh.shard * cfg.data.batch_size * cfg.model.seq_len * cfg.optim.grad_accum
    summary = json.loads((run / "summary.json").read_text())
    for m in (0, 1):
        entry = summary["replica_ledger"][str(m)]
        assert entry["trained_tokens"] == share * len(records(run, m)), (m, entry)
        assert [x["ended"] for x in entry["lives"]] == ["restarted", "finished"], (m, entry)
    assert summary["tokens"] == sum(e["trained_tokens"] for e in summary["replica_ledger"].values())
    if steps % 4 == 0:  # the run ends on a sync: the replicas agree
        a, b = (torch.load(run / f"model.replica{m}.pt") for m in (0, 1))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_corrupt_newest_checkpoint_of_one_replica_refuses_and_deletes_nothing(done: RunResult) -> None:
    """Replica 1's newest checkpoint is corrupt (replica 0 is ahead): exit 2 naming the file, nothing changed."""
    run = left_as(done, "r1-corrupt", {0: [11, 15], 1: [3, 7]})
    victim = run / "replica1" / "checkpoints" / "step_7" / "__0_0.distcp"
    flip_bytes(victim, victim.stat().st_size // 2)
    before = files_under(run)
    res = run_train(run.parent, run.name, BASE + ["run.steps=20", "run.keep_checkpoints=2"], check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    line = last_line(res.stderr)
    assert line.startswith("config error: run.resume:") and "replica1/checkpoints/step_7/__0_0.distcp" in line, line
    assert files_under(run) == before


def test_a_stopped_elastic_worker_is_failed_and_the_run_ends(tmp_path: Path) -> None:
    """SIGSTOP of replica 1's only worker: the launcher kills it after mesh.timeout_s and fails the replica; the
    run then finishes healed: mid-run, or at the close, where replica 0 waits for it (it was not given up) and
    its restart heals whole to the run's final state. Or, had that failed, the run ends with one line naming
    the stopped pid. Nothing is left running and replicas.json lists no live pid."""
    run_dir = tmp_path / "stopped"
    overrides = BASE + ["run.steps=40", "run.checkpoint_every=0", "elastic.restart_delay_s=1", "mesh.timeout_s=10"]
    proc = _start(run_dir, overrides)
    pid = None
    try:
        deadline = time.monotonic() + 240
        while _last_step(run_dir / "metrics.replica1.jsonl") < 4:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "replica 1 never reached step 4"
            time.sleep(0.05)
        (pid,) = _replicas(run_dir)["1"]["pids"]
        os.kill(pid, signal.SIGSTOP)
        code, err = _finish(proc, timeout=10 + 120)  # the hang guard: mesh.timeout_s plus a generous bound
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the stopped worker {pid} was left running")
            except ProcessLookupError:
                pass
    state = _replicas(run_dir)
    assert all(r["pids"] == [] and r["ended"] for r in state.values()), state
    assert (run_dir / "summary.json").is_file()
    if code == 0:  # restarted and healed while replica 0 was still training, or closing the run
        assert state["1"]["restarts"] == 1
        restart = json.loads((run_dir / "summary.replica1.json").read_text())
        assert records(run_dir, 1)[-1]["step"] == 39 or restart["closing_heals"] == 1, restart
        a, b = torch.load(run_dir / "model.replica0.pt"), torch.load(run_dir / "model.replica1.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:
        assert code == 1, err[-3000:]
        line = last_line(err)
        assert "replica 1 failed 1 times" in line and f"(pid {pid}) has been stopped" in line, line
        assert "replica 0 finished" in line, line
    assert records(run_dir, 0)[-1]["step"] == 39


# ---------------------------------------------------------------- the launcher's smaller cases
def test_a_malformed_or_unreachable_lighthouse_is_one_line(tmp_path: Path) -> None:
    """A malformed elastic.lighthouse is a config error (before anything is written); an unreachable one is one
    line at once, not a restart of every replica until max_restarts."""
    base = ["elastic.enabled=true", "mesh.sync=2", "sync.warmup_steps=0", "sync.every=8"]
    for url in ("foo", "http://host", "ftp://host:1"):
        with pytest.raises(ConfigError, match="elastic.lighthouse: expected http://HOST:PORT"):
            load_config(str(REPO / "configs/tiny.yaml"), [*base, f"elastic.lighthouse={url}"])
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [*base, "elastic.lighthouse=http://127.0.0.1:9"])
    with pytest.raises(ConfigError, match="elastic.lighthouse: cannot reach http://127.0.0.1:9"):
        check_lighthouse_reachable(cfg)


def test_a_later_life_waits_for_a_lighthouse_being_restarted(tmp_path: Path) -> None:
    """No node is special: a replica's later life (its records in the run folder) that starts while the lighthouse is
    down waits for it up to elastic.partition_timeout_s, as a running replica would, and goes on once it answers; a
    first start with the same address refuses at once, and a later life refuses once the bound is spent."""
    import socket
    import threading

    from hsdp.run.replicas import later_life

    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = ["elastic.enabled=true", "mesh.sync=2", "sync.warmup_steps=0", "sync.every=8", "elastic.replica=1"]
    base += [f"elastic.lighthouse=http://127.0.0.1:{port}", f"run.out_dir={tmp_path}", "run.name=later"]
    cfg = load_config(str(REPO / "configs/tiny.yaml"), [*base, "elastic.partition_timeout_s=30"])
    assert not later_life(cfg)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"cannot reach http://127.0.0.1:{port} \\("):
        check_lighthouse_reachable(cfg)  # a first start: at once
    assert time.monotonic() - t0 < 10

    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.replica1.jsonl").write_text('{"step": 0}\n')
    assert later_life(cfg)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def come_back() -> None:  # the lighthouse's restart, 1.5 s later
        time.sleep(1.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    back = threading.Thread(target=come_back)
    back.start()
    try:
        t0 = time.monotonic()
        check_lighthouse_reachable(cfg)  # waits, then answers
        assert time.monotonic() - t0 >= 1.0
    finally:
        back.join()
        server.close()
    short = load_config(str(REPO / "configs/tiny.yaml"), [*base, "elastic.partition_timeout_s=1"])
    with pytest.raises(ConfigError, match="within 1 s \\(elastic.partition_timeout_s\\)"):
        check_lighthouse_reachable(short)  # down for good: refused once the bound is spent


class _Pool:
    """The pool as ElasticRun uses it (no processes): each start is one worker, numbered from 0."""

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}
        self.killed: list[int] = []

    def start(self, targets: list) -> list[int]:
        i = len(self.pids)
        self.pids[i] = 1000 + i
        return [i]

    def signal(self, sig: int, indices: list[int]) -> None:
        self.killed += list(indices)


def test_every_replica_down_ends_the_run_instead_of_restarting(tmp_path: Path) -> None:
    """kill -9 of both replicas: with no live replica to heal from, neither is restarted (each restart would fail
    the same way until max_restarts); the outcome is one line naming both."""
    cfg = load_config(str(REPO / "configs/tiny.yaml"), ["elastic.enabled=true", "mesh.sync=2", "mesh.shard=1"])
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "both"
    (tmp_path / "both").mkdir()
    run = ElasticRun(cfg, _Pool(), print, lighthouse="")
    run.start_replica(0)
    run.start_replica(1)
    run.worker_ended(Exit(0, -9))  # replica 0 killed: replica 1 is live, so replica 0 waits for its restart
    assert run.replicas[0].restart_at is not None and not run.replicas[0].given_up
    run.worker_ended(Exit(1, -9))  # replica 1 killed too: nobody left to heal from
    assert all(r.given_up and r.restart_at is None for r in run.replicas) and not run.running
    line = run.outcome()
    assert line.startswith("replicas 0, 1 given up; replica 0 failed 1 times (no live replica left to heal from)")
    assert json.loads((tmp_path / "both" / "replicas.json").read_text())["1"]["given_up"] is True


def test_an_elastic_divergence_ends_the_run_with_its_line_not_restarts(out: Path) -> None:
    """A NaN loss is not a lost process: a restarted replica would heal and diverge again. Each diverged
    replica is given up at once (no restart), and the run ends with exit 1 and one line that says NaN."""
    res = run_train(out, "nan", [*BASE, "optim.lr=1e30", "optim.lr_warmup=0", "run.steps=8"], check=False)
    assert res.returncode == 1, res.stderr[-2000:]
    line = last_line(res.stderr)
    assert "not restarted: a restart would fail the same way" in line and " is nan on rank " in line, line
    assert "Traceback" not in res.stderr and "flight recorder" not in res.stderr
    assert all(r["restarts"] == 0 and r["given_up"] for r in _replicas(res.run_dir).values())


def test_an_unreachable_lighthouse_is_refused_before_the_run_folder_is_written(out: Path) -> None:
    """elastic.lighthouse that accepts no connection: exit 2 with one line and no run folder, so the same
    command works once the lighthouse is up (before: config.yaml was written first, and the re-run exited 2)."""
    res = run_train(out, "nolighthouse", [*BASE, "elastic.lighthouse=http://127.0.0.1:9", "run.steps=4"], check=False)
    assert res.returncode == 2 and "elastic.lighthouse: cannot reach" in last_line(res.stderr), res.stderr[-2000:]
    assert not res.run_dir.exists()
