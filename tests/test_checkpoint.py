"""Checkpoints (hsdp/run/checkpoint/): bitwise resume, resharding, crashes, validation, export, torchrun.

Real processes and real files; every subprocess has a timeout. A fresh launch costs ~10 s on
2 cores (mostly imports; run_train's warm server cuts that to a few seconds), so runs are kept
short and shared through module-scoped fixtures: a resumed run is compared with one
uninterrupted run of the same config.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.export import main as export_main
from hsdp.models.gpt import GPT
from hsdp.run.checkpoint import check_resume, latest_checkpoint, prune, read_meta
from tests.helpers import (
    QUIET_ENV,
    REPO,
    SMALL,
    RunResult,
    ServedRun,
    max_param_rel_err,
    rel_err,
    run_train,
    serve_train,
)

MESH = ["mesh.sync=2", "mesh.shard=2"]
EXACT = SMALL + MESH + ["run.steps=20"]  # exact HSDP (grads averaged every step)
# DiLoCo after 4 warmup steps, a param sync every 4 steps: after steps 7, 11, 15, 19.
DILOCO = SMALL + MESH + ["sync.warmup_steps=4", "sync.every=4", "sync.method=diloco", "run.steps=20"]
EVERY_5 = ["run.checkpoint_every=5", "run.keep_checkpoints=10"]  # saves after steps 4, 9, 14, ...


# ---------------------------------------------------------------- helpers
def assert_same_run(run: RunResult, ref: RunResult, from_step: int = 0) -> None:
    """Every step from `from_step` logged exactly once, losses and every replica's final params bit for bit."""
    steps = [m["step"] for m in run.metrics]
    assert steps == list(range(from_step, len(ref.metrics))), steps
    ref_loss = {m["step"]: m["loss"] for m in ref.metrics}
    assert [m["loss"] for m in run.metrics] == [ref_loss[s] for s in steps]
    for path in sorted(ref.run_dir.glob("model.replica*.pt")):
        mine, theirs = torch.load(run.run_dir / path.name), torch.load(path)
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), path.name


def assert_close_run(run: RunResult, ref: RunResult, from_step: int, tol: float = 1e-5) -> None:
    """Losses and final params within `tol` relative (a resharded continuation sums in another order)."""
    ref_loss = {m["step"]: m["loss"] for m in ref.metrics}
    assert [m["step"] for m in run.metrics] == list(range(from_step, len(ref.metrics)))
    assert max(abs(m["loss"] - ref_loss[m["step"]]) / ref_loss[m["step"]] for m in run.metrics) < tol
    for path in sorted(ref.run_dir.glob("model.replica*.pt")):
        assert max_param_rel_err(torch.load(run.run_dir / path.name), torch.load(path)) < tol, path.name


def train_cmd(script: list[str], out: Path, name: str, overrides: list[str]) -> list[str]:
    """The command line tests/helpers.run_train runs (for tests that need the process itself)."""
    cmd = [sys.executable, str(REPO / script[0]), *script[1:]]
    for o in [*overrides, f"run.out_dir={out}", f"run.name={name}", "mesh.timeout_s=60"]:
        cmd += ["--set", o]
    return cmd


ENV = {**os.environ, **QUIET_ENV}


def start_served(cmd: list[str]) -> ServedRun:
    """Run `cmd` (train_cmd's) on the suite's warm train server (tests/helpers.py), watched while it runs. For a
    test that acts on a run's workers: its launcher is a fork of the server, so a test that signals the launcher
    itself needs a fresh process instead."""
    return serve_train(cmd[1], cmd[2:], ENV)


def torchrun(out: Path, name: str, overrides: list[str], timeout: float = 240) -> RunResult:
    """train.py under two torchrun agents (2 "nodes" × 2 processes) on this machine, c10d rendezvous."""
    port = free_port()
    # Every rank's main() writes config.yaml into the new run folder, and rank 0's check that the folder
    # holds no previous run can see another rank's copy: overwrite=true lets it replace that copy.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"localhost:{port}",
        "--rdzv-id",
        name,
        *train_cmd(["train.py"], out, name, overrides + ["run.overwrite=true"])[1:],
    ]
    logs = [open(out / f"{name}.node{n}.log", "w") for n in range(2)]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=ENV) for log in logs]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # on a timeout: SIGTERM lets an agent stop its workers, SIGKILL if it does not
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs:
            log.close()
    assert codes == [0, 0], [(out / f"{name}.node{n}.log").read_text()[-3000:] for n in range(2)]
    return RunResult(0, "", out / name)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def signal_held_rank(
    run: ServedRun, pid_dir: Path, rank: int, sig: int, reached: Callable[[], bool], timeout: float
) -> tuple[int, str, float, list[int]]:
    """A run of tests/checkpoint_train.py held by `pid_dir/hold`: once `reached()`, send `sig` to `rank`'s worker,
    release the hold and wait (≤ `timeout` s) for the run's end. (exit code, output, seconds from the signal to
    the end, every rank's pid); whatever worker is left is SIGKILLed."""
    hold, pids = pid_dir / "hold", []
    try:
        deadline = time.monotonic() + 180
        while not reached():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not reach the point to act at"
            time.sleep(0.05)
        pids = [int((pid_dir / f"rank{r}.pid").read_text()) for r in range(4)]
        os.kill(pids[rank], sig)
        t0 = time.monotonic()
        hold.unlink()
        try:
            _, output = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            raise AssertionError(f"the run did not end within {timeout:g} s of the signal") from None
        assert run.returncode is not None
        return run.returncode, output, time.monotonic() - t0, pids
    finally:
        hold.unlink(missing_ok=True)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if run.poll() is None:  # its workers are gone: the launcher ends, or is killed after a minute
            try:
                run.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()


def left_behind(pids: list[int], grace_s: float = 10) -> list[int]:
    """The pids still alive after up to `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def last_logged_step(metrics: Path) -> int:
    """The step of metrics.jsonl's last complete record (-1 if none yet)."""
    try:
        return json.loads(metrics.read_text().splitlines()[-1])["step"]
    except (OSError, IndexError, ValueError, KeyError):
        return -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_for(overrides: list[str]):
    return load_config(None, overrides)


def config_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        check_resume(config_for(overrides))
    return str(e.value)


# ---------------------------------------------------------------- shared runs
@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def exact_ref(out: Path) -> RunResult:
    """20 steps of exact HSDP on 2x2 straight through, without checkpoints: the reference of every exact
    resume below (local workers; test_torchrun_two_nodes_resumes compares two torchrun agents with it)."""
    return run_train(out, "exact-ref", EXACT)


@pytest.fixture(scope="module")
def killed_in_save(out: Path) -> dict:
    """The reference's config with checkpoints; rank 1 dies (SIGKILL) while writing step 9's; resume=auto."""
    killed = run_train(
        out,
        "exact-ckpt",
        EXACT + ["run.checkpoint_every=5", "run.keep_checkpoints=3"],
        check=False,
        script=["tests/checkpoint_train.py", "die-in-save", "9"],
    )
    after_kill = sorted(p.name for p in (killed.run_dir / "checkpoints").iterdir())
    resumed = run_train(out, "exact-ckpt", EXACT + ["run.checkpoint_every=5", "run.keep_checkpoints=3"])
    return {"killed": killed, "after_kill": after_kill, "resumed": resumed}


@pytest.fixture(scope="module")
def diloco_ref(out: Path) -> RunResult:
    """20 DiLoCo steps on 2x2 with a checkpoint every 5 (after steps 4, 9, 14, 19)."""
    return run_train(out, "diloco-ref", DILOCO + EVERY_5)


# ---------------------------------------------------------------- resume is exact
def test_kill_during_save_resumes_from_previous_checkpoint(killed_in_save: dict, exact_ref: RunResult) -> None:
    """A save killed half-way never becomes a checkpoint (the launcher removes its temporary folder);
    resume=auto takes step 4 and ends bitwise equal."""
    assert killed_in_save["killed"].returncode != 0
    assert killed_in_save["after_kill"] == ["step_4"]
    resumed = killed_in_save["resumed"]
    assert resumed.summary["resumed_from"].endswith("checkpoints/step_4")
    assert_same_run(resumed, exact_ref)  # metrics.jsonl: steps 5.. of the killed run dropped, each step once
    for key in ("final_loss", "shard_bytes", "sync_bytes"):  # Comm counters continue from the checkpoint
        assert resumed.summary[key] == exact_ref.summary[key], key
    # Only the newest keep_checkpoints=3 remain, and no leftovers of the crashed save.
    assert {p.name for p in (resumed.run_dir / "checkpoints").iterdir()} == {"step_9", "step_14", "step_19"}


def test_kill9_of_a_worker_then_resume_auto(out: Path, exact_ref: RunResult) -> None:
    """kill -9 of one worker mid-run: the launcher fails fast and leaves no process; resume=auto ends bitwise.

    The ranks are held before step 10 (after step 9's checkpoint; tests/checkpoint_train.py) until rank 1 is
    killed; released, the others go on into step 10's collectives with a dead peer."""
    pid_dir = out / "pids"
    pid_dir.mkdir()
    hold = pid_dir / "hold"
    hold.write_text("10")
    name, overrides = "exact-kill9", EXACT + ["run.checkpoint_every=10"]
    run = start_served(train_cmd(["tests/checkpoint_train.py", "pids", str(pid_dir)], out, name, overrides))
    step_9 = out / name / "checkpoints" / "step_9" / ".complete"
    returncode, stderr, exit_s, pids = signal_held_rank(run, pid_dir, 1, signal.SIGKILL, step_9.is_file, timeout=90)
    (out / "kill9.stderr").write_text(stderr)
    assert returncode != 0
    assert not left_behind(pids), "workers left behind"
    assert exit_s < 60
    resumed = run_train(out, name, overrides)  # run.resume=auto is the default
    assert resumed.summary["resumed_from"] is not None
    assert resumed.summary["final_loss"] == exact_ref.summary["final_loss"]
    assert_same_run(resumed, exact_ref)


def test_diloco_resume_between_syncs_is_bitwise(out: Path, diloco_ref: RunResult) -> None:
    """Resumed after step 9 (synced after 7, next sync after 11): replicas differ, θ_g and b exist."""
    step_9 = diloco_ref.run_dir / "checkpoints" / "step_9"
    meta = read_meta(step_9)
    assert not meta["replicas_identical"]
    assert meta["engine_meta"]["sync"]["has_global"] and meta["engine_meta"]["sync"]["momentum_units"] == [0, 1, 2, 3]
    assert read_meta(diloco_ref.run_dir / "checkpoints" / "step_19")["replicas_identical"]  # right after a sync
    resumed = run_train(out, "diloco-resumed", DILOCO + [f"run.resume={step_9}"])
    assert_same_run(resumed, diloco_ref, from_step=10)


def test_an_asynchronous_save_writes_what_a_synchronous_one_does(out: Path, diloco_ref: RunResult) -> None:
    """run.checkpoint_async (the default, diloco_ref's) stages a copy and writes it on a writer thread while
    training goes on: every checkpoint it leaves holds, tensor for tensor and byte for byte, what the
    synchronous save of the same run holds (the copy is taken at the step, not later), and the runs train
    alike. The summary says which kind of save ran and splits exposed from written seconds."""
    sync = run_train(out, "diloco-sync-save", DILOCO + EVERY_5 + ["run.checkpoint_async=false"])
    assert diloco_ref.summary["checkpoint_async"] is True and sync.summary["checkpoint_async"] is False
    assert diloco_ref.summary["checkpoints_saved"] == sync.summary["checkpoints_saved"] == 4
    assert all(s["checkpoint_write_s"] > 0 for s in (diloco_ref.summary, sync.summary))
    assert_same_run(sync, diloco_ref)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for step in (4, 9, 14, 19):
        saved = []
        for run in (diloco_ref, sync):
            dcp_to_torch_save(run.run_dir / f"checkpoints/step_{step}", out / f"async-{run.run_dir.name}-{step}.pt")
            saved.append(torch.load(out / f"async-{run.run_dir.name}-{step}.pt", weights_only=False))
        a, b = saved
        assert a.keys() == b.keys()
        tensors = [k for k in a if isinstance(a[k], torch.Tensor)]  # the extras hold wall-clock step times
        assert len(tensors) > 20 and all(torch.equal(a[k], b[k]) for k in tensors), step


def test_saved_keys_are_the_format_1_layout(diloco_ref: RunResult) -> None:
    """The DCP keys on disk are design §12.1's table, named here independently of the code that writes them: a
    checkpoint written before hsdp/run/checkpoint/ laid out the keys has these, so it still loads."""
    step_9 = diloco_ref.run_dir / "checkpoints" / "step_9"
    names = [n for n, _ in GPT(config_for(DILOCO).model).named_parameters()]
    expected = {f"rank{r}.extra" for r in range(4)}
    for m in range(2):
        expected |= {f"replica{m}.model.{n}" for n in names}
        expected |= {f"replica{m}.optim.{n}.{s}" for n in names for s in ("exp_avg", "exp_avg_sq", "step")}
    expected |= {f"sync.{b}.{n}" for b in ("global", "momentum") for n in names}
    saved = set(FileSystemReader(str(step_9)).read_metadata().state_dict_metadata)
    assert saved == expected, (sorted(saved - expected)[:5], sorted(expected - saved)[:5])
    assert read_meta(step_9)["format"] == 1


def test_fragments_resume_with_a_sync_in_flight_is_bitwise(out: Path) -> None:
    """P=2 fragments (synced after steps 5, 9, … and 7, 11, …), τ=1: step 7's checkpoint holds fragment 1's
    sync in flight and momentum for fragment 0's units only; resuming there continues bit for bit."""
    overrides = DILOCO[:-1] + ["sync.fragments=2", "sync.delay=1", "run.steps=12", "run.checkpoint_every=8"]
    ref = run_train(out, "fragments-ref", overrides)
    step_7 = ref.run_dir / "checkpoints" / "step_7"
    sync = read_meta(step_7)["engine_meta"]["sync"]
    assert sync["in_flight"] == [{"fragment": 1, "start": 7, "land": 8}] and sync["momentum_units"] == [0, 2]
    resumed = run_train(out, "fragments-resumed", overrides + [f"run.resume={step_7}"])
    assert_same_run(resumed, ref, from_step=8)


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_baseline_resume_is_bitwise(out: Path, engine: str) -> None:
    """FSDP2 and DDP checkpoints through torch's state-dict API continue bit for bit (and export)."""
    overrides = SMALL + MESH + ["run.steps=6", f"mesh.engine={engine}"]
    ref = run_train(out, f"{engine}-ref", overrides + ["run.checkpoint_every=3"])  # saves after steps 2 and 5
    resumed = run_train(out, f"{engine}-resumed", overrides + [f"run.resume={ref.run_dir}/checkpoints/step_2"])
    assert_same_run(resumed, ref, from_step=3)
    assert export_main([str(ref.run_dir / "checkpoints" / "step_5"), str(out / f"{engine}.pt")]) == 0
    exported, final = torch.load(out / f"{engine}.pt"), ref.params(0)
    assert all(torch.equal(exported[k], final[k]) for k in final)


# ---------------------------------------------------------------- resharding
def test_reshard_exact_2x2_to_2x1(out: Path, killed_in_save: dict, exact_ref: RunResult) -> None:
    """A 2x2 checkpoint continues on 2x1 (same global batch) within 1e-5 of the 2x2 continuation."""
    step_14 = killed_in_save["resumed"].run_dir / "checkpoints" / "step_14"
    run = run_train(out, "exact-2x1", EXACT + ["mesh.shard=1", "data.batch_size=4", f"run.resume={step_14}"])
    assert_close_run(run, exact_ref, from_step=15)


def test_reshard_diloco_2x2_to_2x1(out: Path, diloco_ref: RunResult) -> None:
    """θ_g and the outer momentum (flat padded buffers, cut per param) reshard too."""
    step_9 = diloco_ref.run_dir / "checkpoints" / "step_9"
    run = run_train(out, "diloco-2x1", DILOCO + ["mesh.shard=1", "data.batch_size=4", f"run.resume={step_9}"])
    assert_close_run(run, diloco_ref, from_step=10)


def test_mesh_sync_change_needs_identical_replicas(diloco_ref: RunResult) -> None:
    """Between syncs the replicas differ: another mesh.sync is refused; right after a full sync it loads."""
    ckpts = diloco_ref.run_dir / "checkpoints"
    message = config_error(DILOCO + ["mesh.sync=1", f"run.resume={ckpts / 'step_9'}"])
    assert message.startswith("mesh.sync: ")
    assert check_resume(config_for(DILOCO + ["mesh.sync=1", f"run.resume={ckpts / 'step_19'}"])) == ckpts / "step_19"


# ---------------------------------------------------------------- validation before launch
def test_bad_or_mismatched_checkpoints_name_what_differs(out: Path, diloco_ref: RunResult) -> None:
    step_9 = diloco_ref.run_dir / "checkpoints" / "step_9"

    def copy(name: str) -> Path:
        dst = out / "broken" / name / "checkpoints" / "step_9"
        shutil.copytree(step_9, dst)
        return dst

    resume = f"run.resume={step_9}"
    assert config_error(DILOCO + ["model.d_model=40", resume]).startswith("model.d_model: ")
    assert config_error(DILOCO + ["mesh.engine=ddp", "sync.warmup_steps=null", resume]).startswith("mesh.engine: ")
    assert config_error(DILOCO + ["optim.name=sgd", resume]).startswith("optim.name: ")
    assert config_error(DILOCO + ["sync.fragments=2", resume]).startswith("sync.fragments: ")
    assert config_error(DILOCO + [f"run.resume={out / 'nowhere'}"]).startswith("run.resume: ")

    shapes = copy("shapes")  # config.yaml says d_model 40, the tensors are 36 wide
    (shapes / "config.yaml").write_text((shapes / "config.yaml").read_text().replace("d_model: 36", "d_model: 40"))
    message = config_error(DILOCO + ["model.d_model=40", f"run.resume={shapes}"])
    assert message.startswith("model: ") and "shape" in message
    missing = copy("missing")
    (missing / "__1_0.distcp").unlink()
    assert "missing its data file __1_0.distcp" in config_error(DILOCO + [f"run.resume={missing}"])
    truncated = copy("truncated")
    os.truncate(truncated / "__2_0.distcp", 100)
    assert "truncated" in config_error(DILOCO + [f"run.resume={truncated}"])
    corrupt = copy("corrupt")
    (corrupt / ".metadata").write_bytes(b"not a pickle")
    assert ".metadata is missing or corrupt" in config_error(DILOCO + [f"run.resume={corrupt}"])
    incomplete = copy("incomplete")
    (incomplete / ".complete").unlink()
    assert "not a complete checkpoint" in config_error(DILOCO + [f"run.resume={incomplete}"])

    # Through train.py: exit code 2 and one line, before any worker starts.
    run = run_train(out, "mismatch", DILOCO + ["model.d_model=40", resume], check=False, timeout=120)
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: model.d_model: "), run.stderr


def test_auto_takes_the_latest_complete_checkpoint(out: Path, diloco_ref: RunResult) -> None:
    """Temporary and unmarked folders (crashed saves) are never resumed from; steps sort as numbers."""
    run_dir = out / "auto"
    shutil.copytree(diloco_ref.run_dir / "checkpoints", run_dir / "checkpoints")
    (run_dir / "checkpoints" / ".tmp_step_24").mkdir()
    shutil.copytree(run_dir / "checkpoints" / "step_4", run_dir / "checkpoints" / "step_99")
    (run_dir / "checkpoints" / "step_99" / ".complete").unlink()
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_19"
    cfg = config_for(DILOCO + [f"run.out_dir={out}", "run.name=auto"])
    assert check_resume(cfg) == run_dir / "checkpoints" / "step_19"
    assert check_resume(config_for(DILOCO + [f"run.out_dir={out}", "run.name=auto", "run.resume=never"])) is None
    assert check_resume(config_for(DILOCO + [f"run.resume={run_dir}"])) == run_dir / "checkpoints" / "step_19"


def test_prune_keeps_the_newest_and_drops_leftovers(tmp_path: Path) -> None:
    """After step 20 is complete (keep 2): 15 and 20 stay; 5, 10, crashed saves and an abandoned later
    continuation (25: the run resumed from 15) go."""
    root = tmp_path / "checkpoints"
    for step in (5, 10, 15, 20, 25):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / ".complete").write_text("{}")
    (root / "step_30").mkdir()  # renamed, never marked
    (root / ".tmp_step_35").mkdir()
    prune(tmp_path, root / "step_20", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_15", "step_20"]


def test_an_elastic_replica_prune_never_drops_later_checkpoints(tmp_path: Path) -> None:
    """drop_later=False (an elastic replica's saves): older ones beyond keep go, a later complete one stays."""
    root = tmp_path / "checkpoints"
    for step in (5, 10, 20):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / ".complete").write_text("{}")
    prune(tmp_path, root / "step_10", keep=1, drop_later=False)
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_20"]


# ---------------------------------------------------------------- export
def test_export_global_and_replicas(out: Path, diloco_ref: RunResult) -> None:
    """θ_g at the final full sync equals every replica's params; a replica between syncs differs from θ_g."""
    ckpts = diloco_ref.run_dir / "checkpoints"
    assert export_main([str(ckpts / "step_19"), str(out / "global.pt")]) == 0
    theta_g = torch.load(out / "global.pt")
    GPT(config_for(DILOCO).model).load_state_dict(theta_g)  # strict: exactly the model's keys and shapes
    for m in range(2):
        final = diloco_ref.params(m)
        assert all(torch.equal(theta_g[k], final[k]) for k in final)
    assert export_main([str(ckpts / "step_9"), str(out / "g9.pt"), "--global"]) == 0
    assert export_main([str(ckpts / "step_9"), str(out / "r1.pt"), "--replica", "1"]) == 0
    g9, r1 = torch.load(out / "g9.pt"), torch.load(out / "r1.pt")
    assert max(rel_err(r1[k], g9[k]) for k in g9) > 1e-4  # two local steps after the sync of step 7
    assert export_main([str(ckpts / "step_9"), str(out / "r5.pt"), "--replica", "5"]) == 2


def test_export_global_needs_a_global_copy(out: Path, killed_in_save: dict) -> None:
    step_19 = killed_in_save["resumed"].run_dir / "checkpoints" / "step_19"
    assert export_main([str(step_19), str(out / "none.pt"), "--global"]) == 2  # exact HSDP keeps no θ_g
    assert export_main([str(step_19), str(out / "r0.pt")]) == 0  # the default falls back to replica 0


# ---------------------------------------------------------------- multi-node launch
def test_torchrun_two_nodes_resumes(out: Path, killed_in_save: dict, exact_ref: RunResult) -> None:
    """Two torchrun agents (two "nodes" of 2 processes) resume a checkpoint saved by local workers and train the
    last steps bit for bit as the local run did: a multi-node launch trains like local workers."""
    step_14 = killed_in_save["resumed"].run_dir / "checkpoints" / "step_14"
    resumed = torchrun(out, "torchrun-resumed", EXACT + [f"run.resume={step_14}"])
    assert_same_run(resumed, exact_ref, from_step=15)


def test_last_good_on_another_rank_waits_for_rank_0_to_publish_the_save_in_flight(tmp_path: Path) -> None:
    """A rank other than 0 whose writer thread is done has written and hashed its own files only; rank 0's
    writer still renames the folder and marks it complete. A divergence found meanwhile must name that
    checkpoint, not the one before it (a clean-clone rehearsal under load named step_5 for step_7)."""
    import threading

    from hsdp.config.schema import Config
    from hsdp.run.checkpoint.find import COMPLETE
    from hsdp.run.checkpoint.store import Checkpoints

    root = tmp_path / "checkpoints"
    (root / "step_5").mkdir(parents=True)
    (root / "step_5" / COMPLETE).touch()
    ckpt = object.__new__(Checkpoints)  # the fields last_good reads, on rank 1 after its own part of step_7
    ckpt.cfg, ckpt.home, ckpt.root, ckpt.first = Config(), tmp_path, root, False
    ckpt._writer, ckpt._writer_step, ckpt._write_error = threading.Thread(target=lambda: None), 7, None
    ckpt._writer.start()

    def publish() -> None:  # rank 0, a moment later
        time.sleep(0.5)
        (root / ".tmp_step_7").mkdir()
        (root / ".tmp_step_7").rename(root / "step_7")
        (root / "step_7" / COMPLETE).touch()

    rank0 = threading.Thread(target=publish)
    rank0.start()
    assert ckpt.last_good() == root / "step_7"
    rank0.join()
