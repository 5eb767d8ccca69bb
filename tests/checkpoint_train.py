"""train.py with test-only behaviour around checkpoints, by wrapping the worker (the loop has no test hooks).

    python tests/checkpoint_train.py pids DIR [train.py arguments ...]
        each rank writes DIR/rank{r}.pid when it starts; while the file DIR/hold exists, every
        rank waits before its batch of each step from the step that file names on (it holds the
        number), so a test can act on a run that is held in the middle (kill -9 or SIGSTOP a
        worker, launch the run a second time) however slow the machine; deleting the file
        releases the run
    python tests/checkpoint_train.py die-in-save STEP [train.py arguments ...]
        rank 1 kills itself (SIGKILL) while writing the checkpoint of step STEP: its DCP data
        file is half on disk and the save never completes

Numerics are untouched: the hold is a wait before a batch is read, and the kill happens inside the save.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.data.tokens import Data  # noqa: E402

HOLD_POLL_S = 0.05


def held_from(hold: Path) -> int | None:
    """The step the hold file names, or None once it is gone (released)."""
    try:
        return int(hold.read_text())
    except (FileNotFoundError, ValueError):  # released, or being written
        return None if not hold.exists() else 0


def pids_worker(pid_dir: str, cfg: Config) -> None:
    """train.train_worker, recording this rank's pid; waits before a step's batch while DIR/hold holds it."""
    (Path(pid_dir) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    hold = Path(pid_dir) / "hold"
    real_batch = Data.train_batch

    def train_batch(self: Data, step: int, micro: int):
        while (start := held_from(hold)) is not None and step >= start:
            time.sleep(HOLD_POLL_S)
        return real_batch(self, step, micro)

    Data.train_batch = train_batch
    train.train_worker(cfg)


def die_in_save_worker(step: int, cfg: Config) -> None:
    """train.train_worker, except that rank 1 is killed in the middle of writing step `step`'s checkpoint."""
    real_write = FileSystemWriter.write_data

    def write_data(self: FileSystemWriter, plan, planner):
        future = real_write(self, plan, planner)
        if dist.get_rank() == 1 and Path(self.path).name == f".tmp_step_{step}":
            future.wait()
            for f in Path(self.path).glob("__1_*.distcp"):  # leave half of this rank's file
                os.truncate(f, f.stat().st_size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_data
    train.train_worker(cfg)


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "pids":
        worker = functools.partial(pids_worker, arg)
    elif mode == "die-in-save":
        worker = functools.partial(die_in_save_worker, int(arg))
    else:
        sys.exit(f"unknown mode {mode!r} (expected pids or die-in-save)")
    sys.exit(train.main(sys.argv[3:], worker=worker))
