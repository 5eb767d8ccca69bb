"""The run folder `<run.out_dir>/<run.name>/`: check where it goes, and never clobber a previous run.

Policy (`prepare_run_dir`): a folder that already holds a run's outputs is
replaced only with `run.overwrite=true`; one that holds a complete checkpoint is
left as it is for resuming (unless `run.resume=never`); otherwise the run is
refused with a ConfigError, before any worker starts.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from hsdp.config.schema import Config, ConfigError
from hsdp.sync.seam import ReplicaSeat

# What a run writes into its folder (train.py, hsdp/run/metrics.py, wandb with dir=run folder).
OUTPUT_FILES = ("metrics.jsonl", "summary.json", "config.yaml", "replicas.json", "wandb.id")
OUTPUT_DIRS = ("checkpoints", "wandb")
# + an elastic run's per-replica files, and its replicas' checkpoint homes (replica<m>/checkpoints)
OUTPUT_GLOBS = ("model.replica*.pt", "metrics.replica*.jsonl", "summary.replica*.json", "replica[0-9]*")
# Kernel file systems: writing run outputs there is at best an error, at worst a device write.
FORBIDDEN_ROOTS = (Path("/proc"), Path("/sys"))


def has_checkpoint(run_dir: Path) -> bool:
    """True if `run_dir/checkpoints/step_*` (or an elastic replica's `run_dir/replica<m>/checkpoints/step_*`)
    holds a complete checkpoint (a `.complete` file marks one)."""
    roots = [Path(run_dir) / "checkpoints", *Path(run_dir).glob("replica[0-9]*/checkpoints")]
    steps = [d for root in roots if root.is_dir() for d in root.glob("step_*") if d.is_dir()]
    return any((d / ".complete").is_file() for d in steps)


def previous_outputs(run_dir: Path) -> list[str]:
    """Names of a previous run's outputs in `run_dir` (empty if none, or if the folder does not exist)."""
    if not run_dir.is_dir():
        return []
    found = [n for n in OUTPUT_FILES if (run_dir / n).exists()] + [n for n in OUTPUT_DIRS if (run_dir / n).exists()]
    for pattern in OUTPUT_GLOBS:
        found += sorted(p.name for p in run_dir.glob(pattern))
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def prepare_run_dir(cfg: Config, seat: Optional[ReplicaSeat] = None) -> None:
    """Create the run folder; refuse to reuse one that holds a previous run unless asked to.

    - no previous outputs: create the folder (and its parents);
    - `run.overwrite=true`: delete the previous run's outputs (only the files a run
      writes: other files in the folder are left alone) and start fresh;
    - a complete checkpoint in `checkpoints/` and `run.resume != never`: return with
      the folder untouched: train.py then resumes from the checkpoint
      (hsdp/run/checkpoint/) and continues metrics.jsonl; this function only makes
      sure that nothing is deleted or overwritten before that;
    - otherwise: ConfigError naming `run.overwrite=true`.

    Under torchrun only global rank 0 checks and deletes (every rank runs train.py's
    main(), and rank 0 may already have written config.yaml when another rank looks);
    the other ranks only create the folder, which per-node files such as
    model.replica{m}.pt need.
    """
    run_dir = cfg.run_dir
    if not owns_run_dir(seat):
        _mkdir(run_dir)
        return
    found = previous_outputs(run_dir)
    if found and cfg.run.overwrite:
        try:
            for name in found:
                _remove(run_dir / name)
        except OSError as e:
            raise ConfigError(f"run.overwrite: cannot delete the previous run in {run_dir} ({e.strerror})") from None
    elif found and not (cfg.run.resume != "never" and has_checkpoint(run_dir)):
        raise ConfigError(
            f"run.name: {run_dir} already holds a run ({', '.join(found)}); set run.overwrite=true "
            "to replace it or choose another run.name"
        )
    _mkdir(run_dir)


def owns_run_dir(seat: Optional[ReplicaSeat] = None) -> bool:
    """Whether this process checks and writes the run folder's own files (config.yaml): the launcher,
    or global rank 0 under torchrun, where every rank runs train.py's main(); for an elastic replica
    under torchrun (`seat`, hsdp/run/launch.py's torchrun_seat) rank 0 of replica 0's first start."""
    if "WORLD_SIZE" not in os.environ:
        return True
    if seat is not None:
        return os.environ.get("RANK") == "0" and seat.replica == 0 and seat.restart == 0
    return os.environ.get("RANK", "0") == "0"


def _mkdir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.out_dir: cannot create {run_dir} ({e.strerror})") from None


def check_output_dir(cfg: Config) -> None:
    """run.out_dir must be (or become) a writable folder outside /proc and /sys, and run.name a folder in it.

    Nothing is created here (validation runs before any output is written).
    """
    out_dir = Path(cfg.run.out_dir).expanduser()
    if "\0" in cfg.run.out_dir:
        raise ConfigError(f"run.out_dir: expected a path, got {cfg.run.out_dir!r}")
    resolved = Path(os.path.abspath(out_dir)).resolve()
    for root in FORBIDDEN_ROOTS:
        if resolved == root or root in resolved.parents:
            raise ConfigError(
                f"run.out_dir: {cfg.run.out_dir} is under {root}, a kernel file system; choose a folder on disk"
            )
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise ConfigError(f"run.out_dir: {existing} is a broken symbolic link")
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file, not a folder" if existing == out_dir else f"cannot be created: {existing} is a file"
        raise ConfigError(f"run.out_dir: {cfg.run.out_dir} {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == out_dir else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"run.out_dir: {cfg.run.out_dir} {what}")
    run_dir = cfg.run_dir
    if run_dir.is_symlink() and Path(os.path.realpath(run_dir)).parent != Path(os.path.realpath(out_dir)):
        raise ConfigError(f"run.name: {run_dir} is a link to {os.path.realpath(run_dir)}, outside run.out_dir")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run.name: {run_dir} exists and is not a folder")
    if run_dir.is_dir() and not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"run.name: {run_dir} is not writable")
