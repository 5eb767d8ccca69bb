"""Elastic replicas on torchft (elastic.enabled): a replica that dies never stops the others, and rejoins healed.

Real runs of train.py (each replica its own world of gloo ranks, torchft's lighthouse in the launcher);
a replica is killed with SIGKILL from outside, by the pids the launcher lists in replicas.json.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from hsdp.comm.groups import Comm
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.core import timeline
from hsdp.run.checkpoint import complete_checkpoints, step_of
from hsdp.sync.elastic.transport import Done, FTTransport
from tests.helpers import QUIET_ENV, REPO, SMALL, SMALLER, STEP_SCOPE, ServedRun, run_train, serve_train

# The tiny CPU job's elastic settings (2x2, DiLoCo every 8, no warmup); `_start` runs them on SMALLER.
ELASTIC = [
    "elastic.enabled=true",
    "elastic.timeout_s=2",
    "elastic.restart_delay_s=4",  # long enough that the survivors sync alone before the restart is back
    "sync.warmup_steps=0",
    "sync.every=8",
    "sync.method=diloco",
    "run.eval_every=0",
    "run.eval_batches=1",  # the final eval only (what these tests check is no loss value): 1 batch, not 8
    "run.log_every=1",
    "run.save_model=true",
    "wandb.mode=disabled",
]


# The kill cases, placed by elastic.faults (docs/design.md §9.4, fault points; nothing here is timed). A
# replica's rounds after its join: one per sync (param syncs every 4 steps: round 1 after step 3, 2 after step
# 7, ...; in the warmup one per step: round 1 is step 0's grads); its join's rounds are round 0. Replica 1 dies
# before its round KILL_ROUND's quorum; its restart starts only once replica 0 has reached the commit of that round (the
# survivors' round without it); the survivors hold their next round's quorum until the restart's first
# request is at the lighthouse (`asked_quorum`), so it heals in exactly that round (out of band at a param
# sync: it spectates it) and counts from the one after.
KILL_RUN_STEPS = 24
KILL = ["sync.every=4", "elastic.restart_delay_s=0.5"]


def kill_faults(replicas: int, kill_round: int, also: tuple[str, ...] = ()) -> list[str]:
    """elastic.faults for the kill cases: replica 1 dies at `kill_round`, heals in the round after it (`also`:
    more faults)."""
    held = [f"{m}@{kill_round + 1}:before_quorum:wait=1.1@0:asked_quorum" for m in range(replicas) if m != 1]
    faults = [f"1@{kill_round}:before_quorum:die", f"1.1@0:start:wait=0@{kill_round}:before_commit", *held, *also]
    return ["elastic.faults=" + ",".join(faults)]


def _start(run_dir: Path, overrides: list[str], script: Optional[list[str]] = None) -> subprocess.Popen | ServedRun:
    """An elastic run that goes on while the test watches it: `python train.py` served by the warm launcher
    (tests/train_server.py: its stdout and stderr in one), or `script` in a fresh interpreter (stderr only)."""
    args = ["--config", str(REPO / "configs/tiny.yaml")]
    for o in [*SMALLER, *overrides, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]:
        args += ["--set", o]
    env = {**os.environ, **QUIET_ENV}
    if script is None:
        return serve_train(str(REPO / "train.py"), args, env)
    out, err = subprocess.DEVNULL, subprocess.PIPE
    return subprocess.Popen([sys.executable, *script, *args], cwd=REPO, env=env, stdout=out, stderr=err, text=True)


def _last_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (OSError, ValueError, KeyError):
        return -1  # not there yet, or a line being written


def _replicas(run_dir: Path) -> dict:
    return json.loads((run_dir / "replicas.json").read_text())


def _finish(proc: subprocess.Popen | ServedRun, timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the elastic run hung:\n{err[-3000:]}") from None
    return proc.returncode, err


def _records(run_dir: Path, replica: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics.replica{replica}.jsonl").read_text().splitlines()]


def _params(run_dir: Path, replica: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / f"model.replica{replica}.pt")


@pytest.mark.parametrize(
    "case,mesh,extra,kill_round,also",
    [
        # dies before the round after step 7; its restart heals θ_g and the outer state only (elastic.heal=global)
        ("2x2", ["mesh.sync=2", "mesh.shard=2"], ["elastic.heal=global"], 2, ()),
        # int8 Δ and an overlapped sync (τ = 1) on 3 replicas: the two others keep syncing with each other
        ("3x1-int8-delay1", ["mesh.sync=3", "mesh.shard=1"], ["sync.quantize=int8", "sync.delay=1"], 2, ()),
        # grad-sync steps throughout (exact HSDP): a quorum per step; the restarted replica heals inside one
        ("2x1-grad-sync", ["mesh.sync=2", "mesh.shard=1"], [f"sync.warmup_steps={KILL_RUN_STEPS}"], 6, ()),
        # two sites of two in-site replicas (docs/design.md §4.1): a site is the unit of membership; both of
        # site 1's ranks die, the site restarts and each rank heals from its counterpart in site 0. Only its
        # rank 1 stalls before the fetch (many steps of the peers' pace): the site's ranks must still agree
        # on the steps they skip, or their in-site collectives stop pairing up
        ("2x2x1-sites", ["mesh.sync=2", "mesh.replicate=2", "mesh.shard=1"], [], 2, ("1.1/1@0:before_fetch:stall=2",)),
    ],
)
def test_a_killed_replica_heals_and_the_run_finishes(
    tmp_path: Path, case: str, mesh: list[str], extra: list[str], kill_round: int, also: tuple[str, ...]
):
    """Replica 1 SIGKILLed (every process) at a fault point: the others train on without restarting, replica
    1 is restarted, heals from a live replica and trains to the end; every step once in each metrics file;
    the quorum size goes down and back up; after the final sync every replica's params are bitwise equal;
    the survivors dropped no round, and the failure touched exactly two of their rounds (the one without
    replica 1, and the one its restart healed in)."""
    run_dir = tmp_path / case
    n = int(mesh[0].split("=")[1])
    faults = kill_faults(n, kill_round, also)
    proc = _start(run_dir, ELASTIC + KILL + mesh + extra + faults + [f"run.steps={KILL_RUN_STEPS}"])
    code, err = _finish(proc)
    assert code == 0, err[-3000:]
    replicas = _replicas(run_dir)
    assert replicas["1"]["restarts"] == 1
    assert all(replicas[str(m)]["restarts"] == 0 for m in range(n) if m != 1)
    assert "elastic: fault 1@" in err and ":before_quorum:die" in err
    # the launcher's own story: one line per event, the death (with its restart) and the restart
    assert "elastic: replica 1 died (" in err and "; restart 1 of " in err, err[-3000:]
    assert "elastic: replica 1 restarted (start 2)" in err, err[-3000:]
    for m in range(n):
        steps = [r["step"] for r in _records(run_dir, m)]
        assert len(steps) == len(set(steps)) and steps == sorted(steps) and steps[-1] == KILL_RUN_STEPS - 1, m
    # a restarted replica's counters continue its previous life's: none goes backwards in its metrics
    for key in ("elapsed_s", "train_time_s", "tokens", "trained_tokens", "merged_tokens", "sync_bytes"):
        values = [r[key] for r in _records(run_dir, 1)]
        assert all(a <= b for a, b in zip(values, values[1:])), (key, values)
    # its ledger covers every life: what its last record says it trained and merged, no less
    merged = json.loads((run_dir / "summary.json").read_text())["replica_ledger"]["1"]
    last = _records(run_dir, 1)[-1]
    assert (merged["trained_tokens"], merged["merged_tokens"]) == (last["trained_tokens"], last["merged_tokens"])
    _assert_lives_are_the_records(run_dir, [*SMALLER, *ELASTIC, *KILL, *mesh, *extra, f"run.steps={KILL_RUN_STEPS}"])
    survivor = [r["replicas"] for r in _records(run_dir, 0)]
    first_short = survivor.index(n - 1)  # a sync without replica 1 ...
    assert n in survivor[first_short:]  # ... and later with it again
    # After the heal, replica 1's LR is the schedule's at each of its steps (torchtitan's stale-LR report),
    # and the batches it trains on are its own stream's at that step (torchft #58): train.py reads them by
    # (rank, step) with no iterator state, which _assert_data_is_indexed_by_step checks for these ranks.
    lr0 = {r["step"]: r["lr"] for r in _records(run_dir, 0)}
    assert all(r["lr"] == lr0[r["step"]] for r in _records(run_dir, 1))
    _assert_data_is_indexed_by_step(SMALLER + ELASTIC + mesh + extra, replica=1)
    reference = _params(run_dir, 0)
    for m in range(1, n):
        got = _params(run_dir, m)
        assert all(torch.equal(got[k], reference[k]) for k in reference), m
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 1 and summary["heals"] >= 1
    restarted = json.loads((run_dir / "summary.replica1.json").read_text())
    phases = [p.split(":")[0] for p in restarted["elastic_phases"]]
    if "warmup" in " ".join(extra):  # healed inside a grad-sync round
        assert restarted["spectated_rounds"] == 0 and restarted["heal_fetches"] == 0, restarted
        assert phases == ["starting", "joining", "training"], phases
    else:  # healed at a param sync: out of band, spectating one round, counted from the next
        assert restarted["spectated_rounds"] == 1 and restarted["heal_fetches"] == 1, restarted
        assert phases == ["starting", "joining", "healing", "training"], phases
        first = restarted["heal_contributes_from"]
        healed_at = 4 * (kill_round + 1) - 1 + int("sync.delay=1" in extra)  # the heal round's step (+τ: it lands then)
        resumed = next(r for r in _records(run_dir, 1) if r["step"] > healed_at)["step"]
        assert resumed == healed_at + 1 + restarted["heal_skipped_steps"] and resumed <= first, restarted
        assert next(r for r in _records(run_dir, 1) if r["step"] >= first)["replicas"] == n, restarted
        if also:  # the stalled fetch took many of the peers' steps: the site skipped some, all its ranks alike
            assert restarted["heal_skipped_steps"] >= 1, restarted
        # what crossed: a full state holds the peer's params, AdamW's two moments and θ_g (4× a rank's held bytes;
        # 5× with the outer momentum, where a unit's params are not θ_g); elastic.heal=global's, θ_g and the
        # outer momentum only (2×)
        shard = next(int(o.split("=")[1]) for o in mesh if o.startswith("mesh.shard="))
        held = sum(t.numel() for t in reference.values()) * 4 / shard
        ratio = restarted["heal_fetch_bytes"] / held
        assert (1.9 < ratio < 2.3) if "elastic.heal=global" in extra else ratio > 3.9, (ratio, restarted)
    # what the survivors lost, counted: no dropped round, and exactly the two rounds the schedule touches
    assert all(summary["dropped_syncs"][str(m)] == 0 for m in range(n) if m != 1), summary["dropped_syncs"]
    quorums = {
        m: json.loads((run_dir / f"summary.replica{m}.json").read_text())["elastic_round_quorums"] for m in range(n)
    }
    assert summary["survivor_touched_rounds"] == 2, (summary["survivor_touched_rounds"], quorums, err[-3000:])
    _assert_restart_timeline(run_dir, restarted, _summary(run_dir, 0))


def _summary(run_dir: Path, m: int) -> dict:
    return json.loads((run_dir / f"summary.replica{m}.json").read_text())


def _assert_restart_timeline(run_dir: Path, restarted: dict, first_life: dict) -> None:
    """The restarted life's phases (hsdp/core/timeline.py): every mark, in order although three processes took
    them (the dying replica, the launcher, the new worker), the kill's the dying process's own record, and the
    phases sum to its kill → first trained step. A first life has the worker's marks only."""
    names = [name for name, _ in restarted["start_marks"]]
    assert names == list(timeline.ORDER), names
    times = [t for _, t in restarted["start_marks"]]
    assert all(a <= b for a, b in zip(times, times[1:])), restarted["start_marks"]
    killed = min(float(p.read_text()) for p in (run_dir / "faults").glob("died.1.0.rank*"))
    assert times[0] == pytest.approx(killed, abs=1e-3)
    phases = restarted["start_phases_s"]
    assert list(phases) == names[1:] and all(v >= 0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(times[-1] - killed, abs=2e-3)
    assert restarted["start_s"] == pytest.approx(times[-1] - killed, abs=2e-3)
    assert [name for name, _ in first_life["start_marks"]] == list(timeline.ORDER[3:]), first_life["start_marks"]


def _assert_lives_are_the_records(run_dir: Path, overrides: list[str], given_up: Optional[int] = None) -> None:
    """summary.json's per-life ledger against a count of the metrics files made without it: with run.log_every=1
    a life logs every step it finishes and dies in a step it does not log, so a replica's lives are its file's
    runs of consecutive steps. Each life trained one replica's tokens per step it logged, and merged those of
    its steps up to the last param sync that landed within it (every step, on grad-sync steps throughout; a
    sync in flight at the last step lands then). Σ over lives is the replica's total, in summary.json and in its
    own summary (`given_up`: a replica that wrote none, its last life given up); Σ over replicas is the run's
    tokens. (The step a life died in was trained but is in no record: counted nowhere, here as in the ledger.)"""
    cfg = load_config(str(REPO / "configs/tiny.yaml"), overrides)
    assert cfg.run.log_every == 1
    share = cfg.mesh.replicate * cfg.mesh.shard * cfg.data.batch_size * cfg.model.seq_len * cfg.optim.grad_accum
    summary = json.loads((run_dir / "summary.json").read_text())
    for m in range(cfg.mesh.sync):
        records, restarts = _records(run_dir, m), _replicas(run_dir)[str(m)]["restarts"]
        runs: list[list[dict]] = [[records[0]]]
        for r in records[1:]:
            if r["step"] == runs[-1][-1]["step"] + 1:
                runs[-1].append(r)
            else:  # a gap: the step its life died in, and those its restart skipped to heal
                runs.append([r])
        expected = []
        for i, life in enumerate(runs):
            steps = [r["step"] for r in life]
            if cfg.sync.warmup_steps is not None and cfg.sync.warmup_steps >= cfg.run.steps:
                merged = len(steps)  # a grad-sync step's grads reach every replica in its own round
            else:
                # a sync started after step s lands after step s + sync.delay, or at the run's last step
                end = steps[-1] + (cfg.sync.delay if steps[-1] == cfg.run.steps - 1 else 0)
                landed = [r["step"] for r in life if r["synced"] and r["step"] + cfg.sync.delay <= end]
                merged = sum(s <= max(landed) for s in steps) if landed else 0
            ended = "restarted" if i < len(runs) - 1 else "given_up" if m == given_up else "finished"
            if m == given_up and i == len(runs) - 1 and len(runs) - 1 < restarts:
                ended = "restarted"  # its last start died before it logged a step: no entry, in `restarts` only
            expected.append((i, steps[0], steps[-1], len(steps) * share, merged * share, ended))
        entry = summary["replica_ledger"][str(m)]
        got = [tuple(x[k] for k in ("life", "first_step", "last_step", "trained_tokens", "merged_tokens", "ended"))
               for x in entry["lives"]]  # fmt: skip
        assert got == expected, (m, got, expected)
        assert entry["restarts"] == restarts, entry
        assert len(runs) - 1 == restarts if m != given_up else len(runs) - 1 <= restarts, (runs, restarts)
        assert entry["trained_tokens"] == sum(e[3] for e in expected), entry
        assert entry["merged_tokens"] == sum(e[4] for e in expected), entry
        assert entry["trained_tokens"] == records[-1]["trained_tokens"]  # the counter it carried over its lives
        if m != given_up:
            own = json.loads((run_dir / f"summary.replica{m}.json").read_text())
            assert own["trained_tokens"] == entry["trained_tokens"]
    ledger = summary["replica_ledger"].values()
    assert summary["tokens"] == sum(e["trained_tokens"] for e in ledger)
    assert summary["goodput"] == round(sum(e["merged_tokens"] for e in ledger) / summary["tokens"], 4)


def _assert_data_is_indexed_by_step(overrides: list[str], replica: int) -> None:
    """A replica's batch at step s depends on (its ranks, s) only: a fresh Data (a restarted replica's)
    gives, at a late step, exactly what one that has served every earlier step gives."""
    from hsdp.data.tokens import Data

    cfg = load_config(str(REPO / "configs/tiny.yaml"), overrides)
    world = cfg.mesh.sync * cfg.mesh.shard
    for rank in range(replica * cfg.mesh.shard, (replica + 1) * cfg.mesh.shard):
        served, fresh = Data(cfg, rank, world), Data(cfg, rank, world)
        for step in range(50):
            served.train_batch(step, 0)
        for step in (50, 51, 77):
            assert all(torch.equal(a, b) for a, b in zip(served.train_batch(step, 0), fresh.train_batch(step, 0)))
        other = Data(cfg, (rank + cfg.mesh.shard) % world, world)  # another replica's stream differs
        assert not torch.equal(other.train_batch(50, 0)[0], fresh.train_batch(50, 0)[0])


def test_a_replica_that_keeps_dying_is_given_up_and_the_others_finish(tmp_path: Path):
    """elastic.max_restarts=1: replica 1 dies at round 2, its restart (started once replica 0's round 2 is at
    its commit) heals in round 3 (replica 0 holds that round's quorum for it) and dies before its own first
    round after the heal; it is not restarted again; replica 0 still finishes; exit 1 and one line naming the
    replica and the limit."""
    run_dir = tmp_path / "dying"
    faults = ",".join(kill_faults(2, 2)[0].split("=", 1)[1].split(",") + ["1.1@1:before_quorum:die"])
    overrides = ELASTIC + ["mesh.sync=2", "mesh.shard=1", "elastic.max_restarts=1", "elastic.restart_delay_s=0.5"]
    proc = _start(run_dir, overrides + ["run.steps=48", f"elastic.faults={faults}"])
    code, err = _finish(proc)
    assert code == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "replica 1 failed 2 times (elastic.max_restarts=1)" in last and "replica 0 finished" in last, last
    assert _replicas(run_dir)["1"]["given_up"] is True
    assert _records(run_dir, 0)[-1]["step"] == 47
    assert "elastic: fault 1.1@1:before_quorum:die" in err
    # it wrote no summary, yet summary.json's ledger has it, from its metrics file: its first life, restarted,
    # and its restart's, given up (unless the restart died before it logged a step: then in `restarts` only)
    assert not (run_dir / "summary.replica1.json").exists()
    gone = json.loads((run_dir / "summary.json").read_text())["replica_ledger"]["1"]
    assert gone["restarts"] == 1 and gone["lives"][0]["ended"] == "restarted", gone
    _assert_lives_are_the_records(run_dir, [*SMALLER, *overrides, "run.steps=48"], given_up=1)


def test_elastic_without_failures_computes_the_plain_run(tmp_path: Path):
    """No failure: losses within 1e-6 and final params of every replica equal to the non-elastic run's,
    through 8 grad-sync (warmup) steps, each its own torchft round, then DiLoCo every 4 steps."""
    base = SMALL + ["mesh.sync=2", "mesh.shard=2", "run.steps=24", "sync.warmup_steps=8", "sync.every=4"]
    base += ["sync.method=diloco"]
    plain = run_train(tmp_path, "plain", base)
    elastic = run_train(tmp_path, "elastic", base + ["elastic.enabled=true"], timeout=300)
    losses = [(a["loss"] + b["loss"]) / 2 for a, b in zip(_records(elastic.run_dir, 0), _records(elastic.run_dir, 1))]
    assert len(losses) == len(plain.losses)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, plain.losses)) < 1e-6
    for m in (0, 1):
        got, want = elastic.params(m), plain.params(m)
        assert max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want) < 1e-6
    assert elastic.summary["sync_bytes"] == plain.summary["sync_bytes"]
    assert elastic.summary["heals"] == 0 and elastic.summary["replica_failures"] == 0
    assert elastic.summary["sync_rounds"] >= 8 + 4  # a round per grad-sync step, and per param sync
    assert all(r["replicas"] == 2 for r in _records(elastic.run_dir, 0))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.engine=fsdp2"], "elastic.enabled: elastic replicas need mesh.engine hsdp, got 'fsdp2'"),
        (["mesh.sync=1"], "needs at least 2 replicas"),
        (["sync.fragments=2", "sync.delay=4"], "sync.delay: an elastic run has one sync in flight"),
        (["elastic.min_replicas=3"], "elastic.min_replicas: expected at most mesh.sync=2"),
        (["elastic.timeout_s=0"], "elastic.timeout_s: expected a value > 0"),
        (["run.resume=/tmp"], "run.resume: an elastic run's replicas resume together"),
    ],
)
def test_elastic_config_refusals(overrides: list[str], message: str) -> None:
    from hsdp.engines.registry import check_engine_config  # the engine's part: the preflight asks it

    base = ["elastic.enabled=true", "mesh.sync=2", "sync.warmup_steps=0", "sync.every=8"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_engine_config(load_config(str(REPO / "configs/tiny.yaml"), base + overrides))


def test_two_torchrun_agents_as_two_machines(tmp_path: Path) -> None:
    """Across machines: a lighthouse started on its own (`torchft_lighthouse`), the run folder prepared
    (`train.py --prepare`) and one torchrun agent per replica (here two on this machine, started at once: neither
    prepares anything): both finish, each with its own metrics file, and the replicas' final params are bitwise
    equal. (tests/test_multihost.py runs the documented multi-host launch, one network namespace per host.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lighthouse_bin = Path(sys.executable).with_name("torchft_lighthouse")
    lighthouse = subprocess.Popen(
        [str(lighthouse_bin), "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", "10000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    run_dir = tmp_path / "torchrun"
    # The small test model: what crosses machines here is the launch and the rounds, not the tiny job's compute.
    overrides = SMALL + ELASTIC + ["mesh.sync=2", "mesh.shard=2", "run.steps=32"]
    overrides += [f"elastic.lighthouse=http://localhost:{port}"]
    agents = []
    common = ["--config", str(REPO / "configs/tiny.yaml")]
    for o in [*overrides, f"run.out_dir={tmp_path}", "run.name=torchrun"]:
        common += ["--set", o]
    try:
        prepared = subprocess.run([sys.executable, str(REPO / "train.py"), *common, "--prepare"], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)  # fmt: skip
        assert prepared.returncode == 0 and (run_dir / "config.yaml").is_file(), prepared.stderr[-2000:]
        for m in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            cmd += [str(REPO / "train.py"), "--config", str(REPO / "configs/tiny.yaml")]
            for o in [*overrides, f"elastic.replica={m}", f"run.out_dir={tmp_path}", "run.name=torchrun"]:
                cmd += ["--set", o]
            log = open(tmp_path / f"agent{m}.log", "w")
            agents.append((subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ), log))
        codes = [p.wait(timeout=300) for p, _ in agents]
    finally:
        for p, log in agents:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        lighthouse.kill()
        lighthouse.wait()
    assert codes == [0, 0], [(tmp_path / f"agent{m}.log").read_text()[-3000:] for m in (0, 1)]
    for m in (0, 1):
        assert [r["step"] for r in _records(run_dir, m)] == list(range(32))
        assert json.loads((run_dir / f"summary.replica{m}.json").read_text())["sync_rounds"] >= 4
    a, b = _params(run_dir, 0), _params(run_dir, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_replica_dying_inside_a_round_drops_the_round_whole(tmp_path: Path) -> None:
    """Replica 1 dies inside its round 3 (the param sync after step 23): the quorum formed with it and the
    round's contributors were agreed, but it sends no part. The survivor's collective then fails after
    elastic.timeout_s and that round is dropped (counted, not applied), the run goes on, replica 1's restart
    heals (replica 0 holds its round 4 for it), and the replicas end bitwise equal."""
    run_dir = tmp_path / "inside"
    faults = "1@3:after_quorum:die,0@4:before_quorum:wait=1.1@0:asked_quorum"
    overrides = ELASTIC + ["mesh.sync=2", "mesh.shard=1", "run.steps=64", "elastic.restart_delay_s=1"]
    proc = _start(run_dir, overrides + [f"elastic.faults={faults}"])
    code, err = _finish(proc)
    assert code == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped_syncs"]["0"] >= 1 and summary["replica_failures"] == 1 and summary["heals"] >= 1
    assert "elastic: fault 1@3:after_quorum:die" in err and "dropped" in err, err[-3000:]
    a, b = _params(run_dir, 0), _params(run_dir, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_elastic_compiled_engine_computes_the_eager_one(tmp_path: Path) -> None:
    """compile.enabled with elastic, both scopes: the step scope's graphs run the replica's shard collectives
    (the local variant on grad-sync steps, whose replica mean is then the torchft round), the blocks scope
    (the default) compiles the blocks around the eager engine's collectives; the losses and final params of
    both replicas equal the eager elastic run's within 1e-5.

    Both runs use SGD with momentum, not AdamW: AdamW normalizes each element's update to about lr, so a
    tiny, cancellation-dominated grad (a rarely hit embedding row) turns fp32 reordering noise between the
    compiled and eager kernels into lr-sized param differences, which depend on the CPU's vector width
    (2.01e-5 of the tensor max after 12 steps on some x86 CPUs). SGD's update is linear in the grad, so the
    params differ by lr·Σδg: fp32 reordering only, well inside 1e-5."""
    base = SMALL + ["mesh.sync=2", "mesh.shard=1", "run.steps=12", "sync.warmup_steps=4", "sync.every=4"]
    base += ["sync.method=diloco", "elastic.enabled=true", "optim.name=sgd", "optim.momentum=0.9"]
    eager = run_train(tmp_path, "eager", base, timeout=300)
    step = run_train(tmp_path, "step", base + STEP_SCOPE, timeout=600)
    blocks = run_train(tmp_path, "blocks", base + ["compile.enabled=true"], timeout=600)
    for compiled in (step, blocks):
        scope = compiled.run_dir.name
        for m in (0, 1):
            want = [r["loss"] for r in _records(eager.run_dir, m)]
            got = [r["loss"] for r in _records(compiled.run_dir, m)]
            assert len(got) == len(want) == 12
            assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-5, (scope, m)
            g, w = compiled.params(m), eager.params(m)
            assert max(float((g[k] - w[k]).abs().max() / w[k].abs().max()) for k in w) < 1e-5, (scope, m)
    assert step.summary["compile_graphs"] >= 2 and step.summary["sync_rounds"] >= 4 + 2
    assert blocks.summary["dynamo_graphs"] == 1 and blocks.summary["recompiles"] == 0, blocks.summary


def test_elastic_checkpoints_resume_auto_from_the_newest_step_every_replica_saved(tmp_path: Path) -> None:
    """Each replica saves its own checkpoints (replica<m>/checkpoints/step_N, in its own world); resume=auto
    restarts every replica from its own newest checkpoint (here both step 7) and, when they agree, the run
    continues bit for bit as the uninterrupted one (replicas that disagree: tests/test_elastic_resume.py)."""
    base = SMALL + ["mesh.sync=2", "mesh.shard=1", "run.steps=16", "sync.warmup_steps=4", "sync.every=4"]
    base += ["sync.method=diloco", "elastic.enabled=true", "run.checkpoint_every=4", "run.keep_checkpoints=10"]
    ref = run_train(tmp_path, "ref", base, timeout=300)
    for m in (0, 1):
        assert [step_of(p) for p in complete_checkpoints(ref.run_dir / f"replica{m}")] == [3, 7, 11, 15]
    run_dir = tmp_path / "resumed"
    shutil.copytree(ref.run_dir, run_dir)
    for record in run_dir.glob("finished*.json"):  # a run preempted after step 7 wrote no completion record
        record.unlink()
    for m in (0, 1):
        shutil.rmtree(run_dir / f"replica{m}" / "checkpoints" / "step_15")
        shutil.rmtree(run_dir / f"replica{m}" / "checkpoints" / "step_11")
    resumed = run_train(tmp_path, "resumed", base, timeout=300)  # run.resume=auto is the default
    for m in (0, 1):
        summary = json.loads((run_dir / f"summary.replica{m}.json").read_text())
        assert summary["resumed_from"].endswith(f"resumed/replica{m}/checkpoints/step_7"), summary["resumed_from"]
        got, want = _records(resumed.run_dir, m), _records(ref.run_dir, m)
        assert [r["step"] for r in got] == list(range(16))
        assert [r["loss"] for r in got] == [r["loss"] for r in want]
        g, w = resumed.params(m), ref.params(m)
        assert all(torch.equal(g[k], w[k]) for k in w)


class _Clock:
    """A clock only the scripted manager moves: the test's times are its script's, whatever the machine does."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _ScriptedManager:
    """torchft's Manager as FTTransport sees it: each start_quorum takes the next scripted (wait, size), each
    round after its quorum takes `round_s` (a dropped one too), on `clock`."""

    def __init__(self, rounds: list[tuple[float, int]], dropped: set[int], clock: _Clock, round_s: float) -> None:
        self.rounds, self.dropped, self.i, self.n = rounds, dropped, -1, 0
        self.clock, self.round_s = clock, round_s

    def start_quorum(self) -> None:
        self.i += 1
        wait, self.n = self.rounds[self.i]
        self.clock.now += wait

    def num_participants(self) -> int:
        return self.n

    def errored(self) -> None:
        return None

    def current_step(self) -> int:
        return self.i

    def should_commit(self) -> bool:
        self.clock.now += self.round_s
        return self.i not in self.dropped


class _EveryoneContributes:
    """The process group's allgather of the contributor flags: every replica contributes."""

    def allgather(self, outs, inps, opts):
        for chunk in outs[0]:
            chunk.fill_(1.0)
        return Done()


def test_survivor_lost_time_counts_only_the_rounds_a_failure_touched() -> None:
    """lost_s sums the quorum waits beyond the median in rounds where the quorum changed size or that follow
    a dropped round, plus the dropped rounds' time; other rounds' excess waits (the peers' jitter) are not
    counted: over a grad-sync run's round per step they added up to more than the failure cost. On a fake
    clock the scripted manager moves (no sleeping: nothing here depends on the machine's speed)."""
    jitter, detect, rejoin, round_s = 0.03, 0.3, 0.2, 0.01
    # usual, jitter, the kill (2 → 1), alone, jitter, the rejoin (1 → 2), usual, jitter, a kill inside a
    # round (its quorum still 2: dropped), the round after it (alone)
    rounds = [(0, 2), (jitter, 2), (detect, 1), (0, 1), (jitter, 1), (rejoin, 2), (0, 2), (jitter, 2), (0, 2), (0, 1)]
    clock = _Clock()
    manager = _ScriptedManager(rounds, dropped={8}, clock=clock, round_s=round_s)
    transport = FTTransport(manager, _EveryoneContributes(), Comm({}), clock=clock)
    transport.joined_at = 0  # every round here is after the join
    committed = []
    for _ in rounds:
        transport.begin_round()
        committed.append(transport.commit_round())
    assert committed == [True] * 8 + [False, True]
    assert transport.touched == [False, False, True, False, False, True, False, False, False, True]
    assert transport.touched_rounds() == 3
    waits = transport.quorum_waits
    assert waits == pytest.approx([w for w, _ in rounds])
    assert transport.dropped_s == pytest.approx(round_s)  # the dropped round's time after its quorum
    usual = statistics.median(waits)
    expected = sum(max(0.0, waits[i] - usual) for i in (2, 5, 9)) + transport.dropped_s
    assert transport.lost_s() == pytest.approx(expected)
    assert expected < detect + rejoin + transport.dropped_s + jitter  # the jittered rounds are not in it


def test_a_fresh_runs_meeting_rounds_are_not_touched_by_a_failure() -> None:
    """A fresh run's join: replica 0 forms quorums alone until replica 1 has started (a slow start on a
    loaded box), then both meet. Those size changes are the start, not a failure: touched counts from the
    join on (it had counted the meeting, and a kill test's survivor showed 3 touched rounds for 2)."""
    rounds = [(0, 1), (0, 1), (0, 2), (0, 2), (0.3, 1), (0, 1), (0.2, 2)]
    clock = _Clock()
    transport = FTTransport(
        _ScriptedManager(rounds, dropped=set(), clock=clock, round_s=0.01),
        _EveryoneContributes(),
        Comm({}),
        clock=clock,
    )
    for i in range(len(rounds)):
        if i == 3:
            transport.joined_at = transport.rounds  # the join (3 rounds) is over
        transport.begin_round()
        transport.commit_round()
    assert transport.touched == [False, False, False, False, True, False, True]
    assert transport.touched_rounds() == 2
    assert [transport.fault_round(r) for r in (4, 5, 6, 7)] == [1, 2, 3, 4]  # fault rounds count from the join


def test_timeline_marks_each_boundary_once_and_begins_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A boundary passed again (every step, a second heal) keeps its first mark; `begin` drops an earlier run's
    marks and puts the launcher's first; phases are the marks' differences, named by the mark that ends each."""
    clock = iter([10.0, 10.5, 11.0, 20.0])
    monkeypatch.setattr(timeline, "_clock", lambda: next(clock))
    monkeypatch.setattr(timeline, "_marks", [])  # this process's own, left as they were
    timeline.begin("forked", (("killed", 9.0), ("detected", 9.5)))
    timeline.mark("world")
    timeline.mark("trained")
    timeline.mark("trained")  # the next step: kept as it was
    taken = (("killed", 9.0), ("detected", 9.5), ("forked", 10.0), ("world", 10.5), ("trained", 11.0))
    assert timeline.marks() == taken
    assert timeline.phases(timeline.marks()) == {"detected": 0.5, "forked": 0.5, "world": 0.5, "trained": 0.5}
    assert timeline.summary()["start_s"] == 2.0
    timeline.begin("forked")  # a later run in the same process
    assert timeline.marks() == (("forked", 20.0),)
