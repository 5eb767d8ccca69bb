"""Bad input ends with one line and exit code 2 before any worker starts; runs never lose data.

Covers: run folders (overwrite / resume / refuse), run.name and run.out_dir, the local mesh cap,
data checks, YAML files, sweeps from any directory, wandb online without network, the kernel
bench's --device. Signals are in tests/test_signals.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from hsdp import sweep
from hsdp.config.schema import ConfigError
from hsdp.run.metrics import MetricsLogger
from hsdp.run.preflight import load_checked_config
from hsdp.run.rundir import has_checkpoint, prepare_run_dir
from kernels import bench
from kernels.quant import MAX_BLOCK
from tests.helpers import QUIET_ENV, REPO, SMALL

TINY = str(REPO / "configs" / "tiny.yaml")
ONE = [*SMALL, "run.save_model=false", "mesh.sync=1", "mesh.shard=1"]  # a world of 1 runs in-process


def one_line_error(fn, *args, **kwargs) -> str:
    """Call fn, expect ConfigError, return its message (checked to be one non-empty line)."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg.strip() and "\n" not in msg, f"not one line: {msg!r}"
    return msg


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def stub_worker(cfg) -> None:
    """Stands in for train_worker: writes what a run writes, without training."""
    (cfg.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "seed": cfg.run.seed}) + "\n")
    (cfg.run_dir / "summary.json").write_text("{}\n")


def main_in_process(capsys, out: Path, *overrides: str, worker=stub_worker) -> tuple[int, list[str]]:
    """train.main(...) in this process; (exit code, non-empty stderr lines)."""
    rc = train.main(sets(*ONE, f"run.out_dir={out}", *overrides), worker=worker)
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def run_cli(
    args: list[str], cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    env = {**os.environ, **QUIET_ENV, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess, *words: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, f"rc={proc.returncode}\n{proc.stderr}"
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ run folders
def test_rerunning_a_name_is_refused_and_keeps_the_old_run(tmp_path, capsys):
    assert main_in_process(capsys, tmp_path, "run.name=r") == (0, [])
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    rc, err = main_in_process(capsys, tmp_path, "run.name=r", "run.seed=7")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("config error: run.name:") and "run.overwrite=true" in err[0]
    assert "metrics.jsonl" in err[0] and str(tmp_path / "r") in err[0]
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before  # nothing was touched
    # with run.overwrite=true the old outputs go and the new run writes its own
    (tmp_path / "r" / "model.replica0.pt").write_bytes(b"old")
    (tmp_path / "r" / "wandb").mkdir()
    (tmp_path / "r" / "notes.txt").write_text("mine")
    assert main_in_process(capsys, tmp_path, "run.name=r", "run.seed=7", "run.overwrite=true") == (0, [])
    assert json.loads((tmp_path / "r" / "metrics.jsonl").read_text())["seed"] == 7
    assert load_checked_config(str(tmp_path / "r" / "config.yaml")).run.seed == 7
    assert not (tmp_path / "r" / "model.replica0.pt").exists() and not (tmp_path / "r" / "wandb").exists()
    assert (tmp_path / "r" / "notes.txt").read_text() == "mine"  # only a run's own outputs are deleted


def make_checkpoint(run_dir: Path, step: int, complete: bool) -> None:
    d = run_dir / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "rank0.pt").write_bytes(b"x")
    if complete:
        (d / ".complete").write_text("")


def test_a_folder_with_a_complete_checkpoint_is_left_for_resuming(tmp_path):
    cfg = load_checked_config(None, [*ONE, f"run.out_dir={tmp_path}", "run.name=r"])
    run_dir = tmp_path / "r"
    prepare_run_dir(cfg)  # fresh: just creates the folder
    assert run_dir.is_dir() and not has_checkpoint(run_dir)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    make_checkpoint(run_dir, 10, complete=False)  # a checkpoint still being written does not count
    assert not has_checkpoint(run_dir)
    assert "run.overwrite=true" in one_line_error(prepare_run_dir, cfg)
    make_checkpoint(run_dir, 20, complete=True)
    assert has_checkpoint(run_dir)
    prepare_run_dir(cfg)  # resume=auto: returns, deletes nothing
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "checkpoints" / "step_20" / ".complete").exists()
    cfg.run.resume = "never"
    assert "run.overwrite=true" in one_line_error(prepare_run_dir, cfg)
    cfg.run.overwrite = True
    prepare_run_dir(cfg)
    assert sorted(p.name for p in run_dir.iterdir()) == []


@pytest.mark.parametrize("name", [".", "..", "", "a/b", "../escape", "x\0y"])
def test_run_name_must_be_one_folder_name(name):
    assert "run.name" in one_line_error(load_checked_config, None, [f"run.name={name}"])


def test_run_name_linking_outside_out_dir_is_rejected(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out" / "r").symlink_to(tmp_path / "elsewhere")
    msg = one_line_error(load_checked_config, None, [f"run.out_dir={tmp_path / 'out'}", "run.name=r"])
    assert "run.name" in msg and "outside run.out_dir" in msg


# ------------------------------------------------------------------ run.out_dir
def test_out_dir_problems_exit_2_before_anything_is_written(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = {
        str(a_file): "is a file",
        str(a_file / "sub"): "cannot be created",
        "/proc/hsdp-runs": "/proc",
        "/sys/kernel": "/sys",
    }
    for out_dir, words in cases.items():
        msg = one_line_error(load_checked_config, None, [f"run.out_dir={out_dir}"])
        assert msg.startswith("run.out_dir:") and words in msg, msg
    (tmp_path / "r").write_text("not a folder")
    assert "exists and is not a folder" in one_line_error(
        load_checked_config, None, [f"run.out_dir={tmp_path}", "run.name=r"]
    )
    # unwritable: root may write anywhere, so stand in for a normal user's permission check
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real_access(p, mode, **kw))
    assert "is not writable" in one_line_error(load_checked_config, None, [f"run.out_dir={locked}"])
    assert "cannot be created: " in one_line_error(load_checked_config, None, [f"run.out_dir={locked}/new/deeper"])
    # and through the CLI entry point: exit 2, one line, nothing created
    rc, err = main_in_process(capsys, locked / "new")
    assert rc == 2 and len(err) == 1 and "run.out_dir" in err[0] and not (locked / "new").exists()


# ------------------------------------------------------------------ local mesh cap
def test_local_mesh_is_capped_by_the_machine(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # gloo: 4 ranks per core
    gloo = [*ONE, "mesh.backend=gloo"]
    load_checked_config(None, [*gloo, "mesh.sync=2", "mesh.shard=2"])
    msg = one_line_error(load_checked_config, None, [*gloo, "mesh.sync=5", "mesh.shard=1"])
    assert "mesh.sync×mesh.shard" in msg and "5" in msg and "at most 4" in msg
    if torch.cuda.is_available():  # nccl (auto on CUDA): one rank per GPU
        n = torch.cuda.device_count()
        assert "GPUs" in one_line_error(load_checked_config, None, [*ONE, f"mesh.sync={n + 1}"])
    # under torchrun the environment's world is checked instead (at launch), not this machine
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "5")
    assert load_checked_config(None, [*gloo, "mesh.sync=5"]).world_size == 5


def test_nccl_needs_cuda():
    if torch.cuda.is_available():
        assert load_checked_config(None, [*ONE, "mesh.backend=nccl"]).mesh.backend == "nccl"
    else:
        assert "mesh.backend" in one_line_error(load_checked_config, None, [*ONE, "mesh.backend=nccl"])


# ------------------------------------------------------------------ data
def test_text_shorter_than_a_window_names_the_split(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"x" * 1000)  # val: the last 100 bytes
    base = ["data.source=text", f"data.path={f}"]
    msg = one_line_error(load_checked_config, None, [*base, "model.seq_len=128"])
    assert "data.path" in msg and "val split" in msg and "100 tokens" in msg and "129" in msg
    assert "train split" in one_line_error(
        load_checked_config, None, [*base, "model.seq_len=128", "data.val_fraction=0.9"]
    )
    load_checked_config(None, [*base, "model.seq_len=99"])  # exactly one window fits
    f.write_bytes(b"")
    assert "train split" in one_line_error(load_checked_config, None, base)


def test_synthetic_and_stdlib_splits_are_checked_too():
    assert "model.seq_len" in one_line_error(
        load_checked_config, None, ["data.source=synthetic", "model.seq_len=70000"]
    )
    load_checked_config(None, ["data.source=synthetic", "model.seq_len=65535"])


def test_tokens_file_of_odd_length_names_the_file(tmp_path):
    good = np.arange(100, dtype=np.uint16)
    train_bin = tmp_path / "train.bin"
    train_bin.write_bytes(good.tobytes() + b"\x00")
    base = ["data.source=tokens", f"data.path={train_bin}", "model.seq_len=8"]
    msg = one_line_error(load_checked_config, None, base)
    assert "data.path" in msg and str(train_bin) in msg and "odd byte length" in msg
    train_bin.write_bytes(good.tobytes())
    (tmp_path / "val.bin").write_bytes(good.tobytes()[:-1])
    assert "val.bin" in one_line_error(load_checked_config, None, base)


def test_vocab_size_below_2_is_rejected():
    assert "model.vocab_size" in one_line_error(
        load_checked_config, None, ["data.source=synthetic", "model.vocab_size=1"]
    )


def test_bad_data_exits_2_before_workers_start(tmp_path, capsys):
    bad = tmp_path / "train.bin"
    np.full(500, 999, dtype=np.uint16).tofile(bad)
    rc, err = main_in_process(
        capsys,
        tmp_path / "out",
        "data.source=tokens",
        f"data.path={bad}",
        "model.seq_len=8",
        "model.vocab_size=257",
        worker=None,
    )
    assert rc == 2 and len(err) == 1 and "token id 999" in err[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ config files
@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["is empty"]),
        ("# only a comment\n", ["is empty"]),
        (
            "run:\n  steps: 3\nmodel:\n  n_layer: 2\nrun:\n  seed: 1\n",
            ["duplicate key run", "line 5", "first at line 1"],
        ),
        ("run:\n  steps: 3\n  seed: 1\n  steps: 4\n", ["duplicate key run.steps", "line 4", "first at line 2"]),
        ("run:\n  steps: 3\n  seed: [1, 2\n", ["line 4, column 1"]),
        ("run:\n  steps: 3\n bad indent: 1\n", ["line 3, column 2"]),
    ],
)
def test_bad_yaml_files(tmp_path, text, words):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    msg = one_line_error(load_checked_config, str(p))
    assert msg.startswith(f"--config: {p}"), msg
    for w in words:
        assert w in msg, msg


def test_fragments_at_most_the_model_units():
    model = ["model.n_layer=2", "sync.every=8", "sync.warmup_steps=0"]  # 4 units: embedding, 2 blocks, head
    load_checked_config(None, [*model, "sync.fragments=4"])
    msg = one_line_error(load_checked_config, None, [*model, "sync.fragments=8"])
    assert "sync.fragments" in msg and "4 units" in msg


def test_quant_block_cap_comes_from_the_kernel():
    load_checked_config(None, [f"sync.quant_block={MAX_BLOCK}"])
    msg = one_line_error(load_checked_config, None, [f"sync.quant_block={MAX_BLOCK + 1}"])
    assert "sync.quant_block" in msg and str(MAX_BLOCK) in msg


@pytest.mark.parametrize("passes", ["ours", "inductor", "none"])
def test_compile_passes_choices_stay_accepted(passes):
    assert load_checked_config(None, [f"compile.passes={passes}"]).compile.passes == passes


def test_wandb_mode_needs_the_package_unless_disabled(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert "wandb.mode" in one_line_error(load_checked_config, None, ["wandb.mode=offline"])
    load_checked_config(None, ["wandb.mode=disabled"])


# ------------------------------------------------------------------ sweeps
SWEEP = """base: {base}
set: [{sets}]
columns: [final_loss, steps]
runs:
  a: [run.seed=1]
"""


def write_sweep(folder: Path, base: str, text: str = SWEEP) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    sets_ = ", ".join([*ONE, "run.steps=2", "run.out_dir=out"])
    path = folder / "sw.yaml"
    path.write_text(text.format(base=base, sets=sets_))
    return path


class TimedPopen(subprocess.Popen):
    """subprocess.Popen whose wait() without a timeout is a hang guard: killed and TimeoutExpired after 120 s."""

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            return super().wait(timeout)
        try:
            return super().wait(120)
        except subprocess.TimeoutExpired:
            self.kill()
            super().wait()
            raise


def test_sweep_runs_from_any_directory_and_replaces_its_old_runs(tmp_path, monkeypatch, capsys):
    """A relative base beside the sweep file; run.out_dir relative to where the sweep was started.

    The sweep runs in this process, started from another directory (its run is a train.py process of its own,
    with a hang guard); `python -m hsdp.sweep` itself is test_sweep_cli_missing_file_from_another_directory's."""
    spec_dir, cwd = tmp_path / "specs", tmp_path / "work"
    (spec_dir).mkdir()
    (spec_dir / "base.yaml").write_text("run:\n  steps: 5\n")
    path = write_sweep(spec_dir, "base.yaml")
    cwd.mkdir()
    old = cwd / "out" / "sw-a"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"old": true}\n')  # a previous sweep's run: replaced, not refused
    monkeypatch.chdir(cwd)
    for name, value in QUIET_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(subprocess, "Popen", TimedPopen)
    assert sweep.main([str(path)]) == 0, capsys.readouterr().err[-3000:]
    summary = json.loads((old / "summary.json").read_text())
    assert summary["steps"] == 2  # the sweep's `set` overrode the base's 5
    assert "old" not in (old / "metrics.jsonl").read_text()
    table = (cwd / "out" / "sw.md").read_text()
    assert "| a |" in table and "final_loss" in table


def test_sweep_base_falls_back_to_the_checkout(tmp_path):
    spec = sweep.load_sweep(str(write_sweep(tmp_path, "configs/tiny.yaml")))
    assert spec["base"] == str(REPO / "configs" / "tiny.yaml")
    assert "base" in one_line_error(sweep.load_sweep, str(write_sweep(tmp_path, "nope.yaml")))


@pytest.mark.parametrize(
    "text, words",
    [
        (None, ["sweep: file not found"]),
        ("", ["is empty"]),
        ("base: [unclosed\n", ["not valid YAML", "line 2"]),
        ("- a\n- b\n", ["expected a mapping"]),
        ("base: configs/tiny.yaml\ncolumns: [steps]\n", ["missing key 'runs'"]),
        ("base: configs/tiny.yaml\ncolumns: [steps]\nruns: {a: []}\nrunz: {}\n", ["unknown keys ['runz']"]),
        ("base: configs/tiny.yaml\ncolumns: [steps]\nruns: {a: run.seed=1}\n", ["runs.a"]),
        ("base: configs/tiny.yaml\ncolumns: [steps]\nruns: {a: [run.stepz=1]}\n", ["run.stepz"]),
        ("base: configs/tiny.yaml\ncolumns: [steps]\nruns: {a: []}\nruns: {b: []}\n", ["duplicate key runs"]),
    ],
)
def test_bad_sweep_files_exit_2_with_one_line(tmp_path, capsys, text, words):
    path = tmp_path / "sw.yaml"
    if text is not None:
        path.write_text(text)
    assert sweep.main([str(path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("config error: "), err
    for w in words:
        assert w in err[0], err[0]


def test_sweep_cli_missing_file_from_another_directory(tmp_path):
    assert_one_line_exit_2(run_cli(["-m", "hsdp.sweep", "missing.yaml"], cwd=tmp_path), "missing.yaml")


# ------------------------------------------------------------------ wandb
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_wandb_online_without_network_warns_once_and_the_run_goes_on(tmp_path):
    env = {
        "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
        "WANDB_API_KEY": "a" * 40,
        "HSDP_WANDB_TIMEOUT_S": "2",
        "WANDB_SILENT": "true",
    }
    proc = run_cli(
        ["train.py", *sets(*ONE, "run.steps=3", f"run.out_dir={tmp_path}", "run.name=w", "wandb.mode=online")],
        env=env,
        timeout=120,  # a hang guard only (a busy box took 50 s to start wandb's service and give up)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: wandb")]
    assert len(warnings) == 1 and "continuing without wandb" in warnings[0], proc.stderr
    assert "timeout 2 s, $HSDP_WANDB_TIMEOUT_S" in warnings[0]  # wandb.init was given the bound from the env
    assert "Traceback" not in proc.stderr
    assert len((tmp_path / "w" / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "w" / "summary.json").read_text())["steps"] == 3


def test_wandb_is_imported_only_when_enabled_and_a_broken_one_only_warns(tmp_path, monkeypatch, capsys):
    cfgs = {
        mode: load_checked_config(None, [f"wandb.mode={mode}", f"run.out_dir={tmp_path}", f"run.name={mode}"])
        for mode in ("disabled", "offline")
    }
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError, as without wandb
    for mode, cfg in cfgs.items():
        cfg.run_dir.mkdir()
        log = MetricsLogger(cfg, cfg.run_dir, enabled=True)
        log.log({"step": 0, "loss": 1.0})
        log.summary({"final_loss": 1.0})
        log.close()
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning")]
        assert err == [] if mode == "disabled" else (len(err) == 1 and "continuing without wandb" in err[0]), err
        assert json.loads((cfg.run_dir / "metrics.jsonl").read_text())["loss"] == 1.0
        assert (cfg.run_dir / "summary.json").is_file()


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """One run folder, one wandb run: a second logger on the folder (a resume, a restarted replica 0)
    asks wandb to resume the same id, and does not resend the steps wandb already holds."""
    inits, logged = [], []

    class FakeRun:
        def __init__(self, step: int) -> None:
            self.step, self.summary = step, {}

        def log(self, data, step):
            logged.append(step)

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.Settings = lambda **kw: kw
    fake.init = lambda **kw: inits.append(kw) or FakeRun(step=0 if len(inits) == 1 else 3)
    cfg = load_checked_config(None, ["wandb.mode=offline", f"run.out_dir={tmp_path}", "run.name=w"])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg.run_dir.mkdir()
    for continue_after, steps in ((None, range(3)), (1, range(2, 5))):  # the second life resumes after step 1
        log = MetricsLogger(cfg, cfg.run_dir, enabled=True, continue_after=continue_after)
        for step in steps:
            log.log({"step": step, "loss": 1.0})
        log.close()
    assert inits[0]["id"] == inits[1]["id"] and all(kw["resume"] == "allow" for kw in inits)
    assert logged == [0, 1, 2, 3, 4]  # step 2 is in wandb from the first life (its run.step said 3)
    assert (cfg.run_dir / "wandb.id").read_text().strip() == inits[0]["id"]


# ------------------------------------------------------------------ kernels.bench
def test_bench_bad_device_exits_2_with_one_line(capsys):
    bad = ["nosuchdevice", "mps", "cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        assert bench.main(["--device", device]) == 2, device
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("bench: --device:") and device in err[0], err
    assert_one_line_exit_2(run_cli(["-m", "kernels.bench", "--device", "nosuchdevice"]), "--device")
