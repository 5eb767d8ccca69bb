"""Every save that fails for a full disk says so, with the bytes free, whatever layer raised it; the previous
checkpoint stays valid and the run resumes from it once there is room.

The layers: an OSError(ENOSPC) in a rank's DCP write, torch.save's errno-less "[enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598", rank 0's own meta.json, its `.complete` marker
(after the folder was renamed into place), the final model.replica<m>.pt, and the run's metrics.jsonl and
summary.json (any write to them fails, from the open file's `write`). Each is injected into a real
run by wrapping its worker (this file doubles as the script that does it, below); one test fills a real
3 MiB tmpfs instead, where mounting one works (root). Every subprocess has a timeout.

    python tests/test_full_disk.py MODE STEP [train.py arguments ...]
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from hsdp.config.loader import load_config  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.run.checkpoint import check_resume, complete_checkpoints, save_failure, step_of  # noqa: E402
from hsdp.run.guard import SaveFailed  # noqa: E402
from hsdp.run.metrics import MetricsLogger  # noqa: E402
from tests.helpers import SMALL, run_train  # noqa: E402

ONE = SMALL + ["mesh.sync=1", "mesh.shard=2", "run.save_model=false"]
RUN = ONE + ["run.steps=4", "run.checkpoint_every=2"]  # saves after steps 1 and 3; step 3's fails
POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
FULL = re.compile(r"^error: rank \d: saving checkpoint step_3: the disk is full \(\d+ bytes free on /\S*\); ")
SCRIPT = "tests/test_full_disk.py"


# ---------------------------------------------------------------- the injected faults (run in the workers)
def fault_worker(mode: str, step: int, cfg: Config) -> None:
    """train.train_worker with a full disk at the save of `step` (or of the final model), as `mode` says."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    import hsdp.run.checkpoint.store as store
    import train

    def enospc(path: object) -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    tmp_name = f".tmp_step_{step}"
    if mode in ("enospc", "unexpected-pos"):  # rank 1's DCP data file
        real_write = FileSystemWriter.write_data

        def write_data(self: FileSystemWriter, plan, planner):
            if dist.get_rank() == 1 and Path(self.path).name == tmp_name:
                raise enospc(Path(self.path) / "__1_0.distcp") if mode == "enospc" else RuntimeError(POS)
            return real_write(self, plan, planner)

        FileSystemWriter.write_data = write_data
        if mode == "unexpected-pos":  # what a full disk leaves free; torch.save's error has no errno
            store.free_bytes = lambda path: 4096
    elif mode == "meta":  # rank 0's config.yaml, after every rank's DCP files
        real_save_config = store.save_config

        def save_config(config: Config, path: Path) -> None:
            if Path(path).parent.name == tmp_name:
                raise enospc(path)
            real_save_config(config, path)

        store.save_config = save_config
    elif mode == "marker":  # the .complete marker, after the folder was renamed to step_N
        real_write_text = Path.write_text

        def write_text(self: Path, *args, **kwargs):
            if self.name == ".complete.tmp" and self.parent.name == f"step_{step}":
                raise enospc(self)
            return real_write_text(self, *args, **kwargs)

        Path.write_text = write_text
    elif mode == "model":  # torch.save of model.replica0.pt at the end
        real_torch_save = torch.save

        def torch_save(obj, f, *args, **kwargs):
            if str(f).endswith(".pt"):
                Path(f).write_bytes(b"partial")
                raise RuntimeError(POS)
            return real_torch_save(obj, f, *args, **kwargs)

        torch.save = torch_save
        train.free_bytes = lambda path: 4096
    elif mode in ("metrics", "summary"):  # the run's own files: metrics.jsonl from step `step`'s record, summary.json
        name = f"{mode}.json" if mode == "summary" else "metrics.jsonl"
        builtins.open = io.open = full_open(builtins.open, name, step)  # pathlib's io.open too: whichever is called
    elif mode == "fill":  # a real disk: rank 0 fills it just before the save of `step`
        real_save = store.Checkpoints.save

        def save(self: store.Checkpoints, at: int, progress: store.Progress) -> Path:
            if at == step:
                self.finish()  # the earlier save (asynchronous) complete before the disk fills: step_1 is kept
                if dist.get_rank() == 0:
                    fill(Path(cfg.run.out_dir) / "filler")
                dist.barrier()
            return real_save(self, at, progress)

        store.Checkpoints.save = save
    else:
        raise ValueError(f"unknown mode {mode!r}")
    train.train_worker(cfg)


class FullFile:
    """An open file whose `write` fails as on a full disk once `fails(text)` says so (everything else passes)."""

    def __init__(self, file, fails) -> None:
        self._file, self._fails = file, fails

    def write(self, text: str) -> int:
        if self._fails(text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._file.name)
        return self._file.write(text)

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self) -> FullFile:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def full_open(real_open, name: str, step: int):
    """`open` whose files opened for writing with `name` in their name (a temp name too) fail to write: a
    metrics.jsonl from the record of `step` on, anything else at once."""

    def fails(text: str) -> bool:
        if name != "metrics.jsonl":
            return True
        with contextlib.suppress(ValueError):
            return json.loads(text)["step"] >= step
        return False

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and name in Path(file).name and any(c in mode for c in "wa"):
            return FullFile(f, fails)
        return f

    return open_


def fill(path: Path) -> None:
    """Write zeros to `path` until the disk is full."""
    block = b"\0" * 4096
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


# ---------------------------------------------------------------- the tests
def config_at(out: Path, name: str) -> Config:
    return load_config(None, [*RUN, f"run.out_dir={out}", f"run.name={name}"])


def last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def assert_step_1_kept(out: Path, name: str) -> None:
    """Nothing of the failed save is left; step_1 is the newest checkpoint and passes every check (checksums)."""
    root = out / name / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1"], sorted(p.name for p in root.iterdir())
    assert check_resume(config_at(out, name)) == root / "step_1"


@pytest.mark.parametrize("mode", ["enospc", "unexpected-pos", "meta", "marker"])
def test_a_full_disk_during_a_checkpoint_save_says_so(tmp_path: Path, mode: str) -> None:
    res = run_train(tmp_path, mode, RUN, check=False, script=[SCRIPT, mode, "3"])
    assert res.returncode == 1, res.stderr[-3000:]
    line = last_line(res.stderr)
    assert FULL.match(line), line
    assert line.endswith(f"; the last complete checkpoint, {tmp_path / mode / 'checkpoints' / 'step_1'}, is kept")
    if mode == "unexpected-pos":
        assert "(4096 bytes free on /" in line, line
    assert "Traceback" not in res.stderr
    assert_step_1_kept(tmp_path, mode)
    if mode == "enospc":  # with room again, the same command resumes from step_1 and finishes
        again = run_train(tmp_path, mode, RUN)
        assert again.summary["resumed_from"] == str(tmp_path / mode / "checkpoints" / "step_1")
        assert [r["step"] for r in again.metrics] == list(range(4))


def test_a_full_disk_saving_the_final_model_says_so(tmp_path: Path) -> None:
    res = run_train(
        tmp_path, "model", ONE + ["run.steps=2", "run.save_model=true"], check=False, script=[SCRIPT, "model", "0"]
    )
    assert res.returncode == 1, res.stderr[-3000:]
    line = last_line(res.stderr)
    assert re.match(r"^error: rank 0: saving model\.replica0\.pt: the disk is full \(4096 bytes free on /", line), line
    assert not (tmp_path / "model" / "model.replica0.pt").exists()  # no partial file left


REAL_OPEN = io.open


# the one line of a failed write of the run's own files (hsdp/run/metrics.py): the file and the bytes free
def run_file_full(path: Path) -> re.Pattern:
    return re.compile(rf"^saving {re.escape(str(path))}: the disk is full \(\d+ bytes free on /\S*\)$")


@pytest.mark.parametrize("mode", ["metrics", "summary"])
def test_a_full_disk_writing_metrics_or_the_summary_says_so(tmp_path: Path, mode: str) -> None:
    """One line, not a traceback; the records written before stay whole; with room again the same command resumes
    from the last checkpoint and says so."""
    run = RUN + ["run.checkpoint_async=false"]  # step_1 complete before step 2 (an async save dies with its run)
    res = run_train(tmp_path, mode, run, check=False, script=[SCRIPT, mode, "2"])
    assert res.returncode == 1, res.stderr[-3000:]
    run_dir = tmp_path / mode
    name = "metrics.jsonl" if mode == "metrics" else "summary.json"
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: "), res.stderr[-3000:]
    assert run_file_full(run_dir / name).match(lines[0].removeprefix("error: rank 0: ")), lines[0]
    assert [r["step"] for r in res.metrics] == ([0, 1] if mode == "metrics" else [0, 1, 2, 3])
    assert sorted(p.name for p in run_dir.iterdir() if "summary" in p.name) == []  # no summary, not half of one
    if mode == "metrics":  # step_1 saved before step 2's record failed: the same command goes on from it
        again = run_train(tmp_path, mode, run)
        assert f"resuming from step 1 ({run_dir / 'checkpoints' / 'step_1'})" in again.stderr.splitlines()
        assert [r["step"] for r in again.metrics] == list(range(4))


def test_a_full_disk_in_a_one_worker_run_is_one_line_too(tmp_path: Path) -> None:
    """One worker runs in the launcher's own process (no zygote): its failure is worded as a spawned rank's."""
    one = SMALL + ["mesh.sync=1", "mesh.shard=1", "run.save_model=false", "run.steps=4", "run.checkpoint_every=0"]
    res = run_train(tmp_path, "one", one, check=False, script=[SCRIPT, "metrics", "2"])
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    line = last_line(res.stderr)
    assert run_file_full(tmp_path / "one" / "metrics.jsonl").match(line.removeprefix("error: rank 0: ")), line


def test_a_metrics_logger_write_on_a_full_disk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: each write of the logger (a record, the summary) that fails is SaveFailed's line naming the file;
    a failed summary write leaves the previous summary.json as it was, and no temp file."""
    cfg = load_config(None, ["wandb.mode=disabled", f"run.out_dir={tmp_path}", "run.name=m"])
    cfg.run_dir.mkdir()
    log = MetricsLogger(cfg, cfg.run_dir, enabled=True)
    log.log({"step": 0, "loss": 1.0})
    log.summary({"final_loss": 1.0})
    log.close()
    for module in (builtins, io):  # builtins.open and io.open (pathlib's): whichever a writer calls
        monkeypatch.setattr(module, "open", full_open(REAL_OPEN, "metrics.jsonl", 1))
    log = MetricsLogger(cfg, cfg.run_dir, enabled=True, continue_after=0)
    with pytest.raises(SaveFailed) as failed:
        log.log({"step": 1, "loss": 1.0})
    assert run_file_full(cfg.run_dir / "metrics.jsonl").match(str(failed.value)), failed.value
    for module in (builtins, io):
        monkeypatch.setattr(module, "open", full_open(REAL_OPEN, "summary.json", 0))
    with pytest.raises(SaveFailed) as failed:
        log.summary({"final_loss": 2.0})
    assert run_file_full(cfg.run_dir / "summary.json").match(str(failed.value)), failed.value
    assert json.loads((cfg.run_dir / "summary.json").read_text()) == {"final_loss": 1.0}
    assert sorted(p.name for p in cfg.run_dir.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_save_failure_names_what_it_can() -> None:
    """The one line for each kind of failure (no processes): a full disk however it is reported; another write
    failure with its error and the bytes free; an interrupt or a bug: None (the traceback is the report)."""
    from torch.distributed.checkpoint.api import CheckpointException

    here = Path("/")

    def line(e: BaseException, free: int | None = 0, needed: int = 0) -> str | None:
        return save_failure("checkpoint step_3", e, here, free, needed)

    full = "saving checkpoint step_3: the disk is full (0 bytes free on /)"
    enospc = OSError(errno.ENOSPC, "No space left on device", "/x/__1_0.distcp")
    assert line(enospc) == full
    assert line(CheckpointException("save failed", {1: (enospc, None)})) == full
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = enospc
    assert line(wrapped) == full
    assert line(RuntimeError(POS)) == full  # no errno, but nothing free
    assert line(RuntimeError(POS), free=5 << 20, needed=10 << 20) == full.replace("0 bytes", f"{5 << 20} bytes")
    big = 10 << 30
    assert line(RuntimeError(POS), free=big, needed=1 << 20) == (
        f"saving checkpoint step_3 failed: RuntimeError: {POS} ({big} bytes free on /)"
    )
    denied = PermissionError(errno.EACCES, "Permission denied", "/x")
    assert line(CheckpointException("save failed", {2: (denied, None)}), free=big) == (
        f"saving checkpoint step_3 failed on rank 2: PermissionError: {denied} ({big} bytes free on /)"
    )
    assert line(KeyboardInterrupt()) is None
    assert line(ValueError("a bug")) is None


def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    """A 3 MiB tmpfs filled just before step 3's save: the save's own error, whichever layer raises it, says the
    disk is full; step_1 stays valid; with the filler gone the run resumes from it and finishes."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, timeout=30
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        res = run_train(disk, "full", RUN, check=False, script=[SCRIPT, "fill", "3"])
        assert res.returncode == 1, res.stderr[-3000:]
        line = last_line(res.stderr)
        assert "saving checkpoint step_3: the disk is full (" in line and f" bytes free on {disk})" in line, line
        assert_step_1_kept(disk, "full")
        (disk / "filler").unlink()
        again = run_train(disk, "full", RUN)
        assert again.summary["resumed_from"] == str(disk / "full" / "checkpoints" / "step_1")
        assert [step_of(p) for p in complete_checkpoints(disk / "full")] == [1, 3]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)


if __name__ == "__main__":
    import train

    worker = functools.partial(fault_worker, sys.argv[1], int(sys.argv[2]))
    sys.exit(train.main(sys.argv[3:], worker=worker))
