"""The run lock: one launch per run folder at a time.

A second `train.py` of a run that is still running would resume from the first one's
checkpoint while it trains on, and the two would delete each other's files. The launcher
(under torchrun: global rank 0) holds an OS file lock on `<run.out_dir>/.<run.name>.lock`
for the run's whole life; the kernel releases it on any death, kill -9 included, so there is
never a stale lock to clean up. The file sits beside the run folder, not in it, so that taking
the lock changes nothing in the run folder (every check that can refuse a run comes first).
The file itself stays (unlinking a lock file lets two processes lock two different inodes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from hsdp.config.schema import Config, ConfigError


def lock_path(cfg: Config) -> Path:
    return cfg.run_dir.parent / f".{cfg.run.name}.lock"


def _holder(fd: int) -> str:
    """The pid the holder wrote into the lock file ("unknown" if it has not yet)."""
    with contextlib.suppress(OSError, ValueError):
        text = os.pread(fd, 32, 0).decode().strip()
        if text:
            return str(int(text))
    return "unknown"


@contextlib.contextmanager
def hold_run_lock(cfg: Config) -> Iterator[None]:
    """Hold the run's lock for the block; ConfigError naming the holder's pid if another launch has it."""
    path = lock_path(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # run.out_dir (checked writable by the config's validation)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"run.out_dir: cannot create the run lock {path} ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"run.name: {cfg.run_dir} is in use by another launch (pid {_holder(fd)}); wait for it to end, "
                "stop it, or choose another run.name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock
