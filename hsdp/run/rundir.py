"""The run folder `<run.out_dir>/<run.name>/`: check where it goes, and never clobber a previous run.

Policy (`prepare_run_dir`): a folder that already holds a run's outputs is
replaced only with `run.overwrite=true`; one that holds a complete checkpoint is
left as it is for resuming (unless `run.resume=never`); otherwise the run is
refused with a ConfigError, before any worker starts.

A run that trained all its `run.steps` leaves a completion record, `finished.json`, written last
(after summary.json, atomically) with the config it trained: re-running the same command finds the
record and changes nothing (`finished_line`), whatever checkpoints it kept or keeps; a longer
`run.steps` continues it from its newest checkpoint, and the record goes (`clear_finished`) until
that run finishes in its turn. Another config (a seed, a learning rate) is another command: the
record does not answer for it, and the run folder's usual rules do.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import yaml

from hsdp.config.schema import Config, ConfigError, to_dict
from hsdp.core.atomic import write_json
from hsdp.sync.seam import ReplicaSeat

FINISHED = "finished.json"  # the completion record (an elastic replica under torchrun: finished.replica<m>.json)
# What a run writes into its folder (train.py, hsdp/run/metrics.py, wandb with dir=run folder).
OUTPUT_FILES = ("metrics.jsonl", "summary.json", "config.yaml", "replicas.json", "wandb.id", FINISHED)
OUTPUT_DIRS = ("checkpoints", "wandb")
# + an elastic run's per-replica files, and its replicas' checkpoint homes (replica<m>/checkpoints)
OUTPUT_GLOBS = (
    "model.replica*.pt",
    "metrics.replica*.jsonl",
    "summary.replica*.json",
    "finished.replica*.json",
    "replica[0-9]*",
)
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
    model.replica{m}.pt need. An elastic replica under torchrun (`seat`) owns nothing: its run
    folder was prepared before any replica started (`train.py --prepare`), which `check_prepared`
    asks, so any replica may die and none's start deletes another's files.
    """
    run_dir = cfg.run_dir
    if not owns_run_dir(seat):
        if seat is not None:
            check_prepared(cfg)
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
    """Whether this process checks and writes the run folder's own files (config.yaml): the launcher
    (or `train.py --prepare`), or global rank 0 under torchrun, where every rank runs train.py's main();
    no process of an elastic replica under torchrun (`seat`, hsdp/run/launch.py's torchrun_seat): no
    replica is special, and the folder is prepared before any starts."""
    if "WORLD_SIZE" not in os.environ:
        return True
    if seat is not None:
        return False
    return os.environ.get("RANK", "0") == "0"


def check_prepared(cfg: Config) -> None:
    """An elastic replica under torchrun: ConfigError (one line) unless its run folder was prepared for this
    config (`train.py --prepare` wrote config.yaml, and it trains what this replica's config trains)."""
    saved = cfg.run_dir / "config.yaml"
    how = "run `python train.py --prepare` with the same --config and --set once before the replicas start"
    if not saved.is_file():
        raise ConfigError(f"run.name: {cfg.run_dir} is not prepared (no config.yaml); {how} (docs/usage.md)")
    try:
        theirs = trained_config(yaml.safe_load(saved.read_text()))
    except (OSError, ValueError, yaml.YAMLError, AttributeError) as e:
        raise ConfigError(f"run.name: {saved} is unreadable ({type(e).__name__}); {how}") from None
    mine = trained_config(to_dict(cfg))
    keys = (mine.keys() | theirs.keys()) - PER_REPLICA
    differ = sorted(k for k in keys if mine.get(k) != theirs.get(k))
    if differ:
        k = differ[0]
        raise ConfigError(
            f"{k}: {cfg.run_dir} was prepared with {theirs.get(k)!r}, this replica's config has {mine.get(k)!r}; "
            "give every replica the preparation's --config and --set"
        )


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


# ---------------------------------------------------------------- the completion record
def finished_path(run_dir: Path, replica: Optional[int] = None) -> Path:
    """The run's completion record; an elastic replica's own under torchrun (no launcher merges there)."""
    return Path(run_dir) / (FINISHED if replica is None else f"finished.replica{replica}.json")


# Keys that say how a run is kept, watched or found, not what it trains: a re-run that changes only these (and
# run.steps, compared on its own) is the same run. The wandb section as a whole.
NOT_TRAINED = frozenset(
    {
        "run.steps",
        "run.resume",
        "run.overwrite",
        "run.checkpoint_every",
        "run.keep_checkpoints",
        "run.out_dir",
        "run.name",
        "mesh.timeout_s",
        "elastic.replica",
        "elastic.lighthouse",
    }
)


# Keys one replica's command may set apart from the others' (the benchmark's slow node, a replica's own faults).
PER_REPLICA = frozenset({"run.slowdown", "elastic.faults"})


def trained_config(config: dict[str, Any]) -> dict[str, Any]:
    """`section.key → value` of a config mapping (to_dict's) without the NOT_TRAINED keys, JSON-normalised."""
    flat = {
        f"{section}.{key}": value
        for section, values in config.items()
        if section != "wandb" and isinstance(values, dict)
        for key, value in values.items()
    }
    return json.loads(json.dumps({k: v for k, v in sorted(flat.items()) if k not in NOT_TRAINED}))


def write_finished(cfg: Config, summary: str, replica: Optional[int] = None) -> Path:
    """Record that the run (or elastic replica) trained all `cfg.run.steps` steps, its summary being `summary` (a
    file name in the run folder), and the config it trained. Written last, atomically (temp name, fsync, rename):
    it exists only complete."""
    path = finished_path(cfg.run_dir, replica)
    steps = cfg.run.steps
    record = {
        "steps": steps,
        "last_step": steps - 1,
        "summary": summary,
        "finished_at": time.time(),
        "config": trained_config(to_dict(cfg)),
    }
    write_json(path, record)
    return path


def read_finished(run_dir: Path, replica: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The completion record, or None if there is none (or it is not one: a record is written whole or not at all,
    so that only happens to a file edited by hand, which then counts as no record)."""
    try:
        record = json.loads(finished_path(run_dir, replica).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("steps"), int) and isinstance(record.get("summary"), str)
    return record if ok else None


def finished_line(cfg: Config) -> Optional[str]:
    """The one line for re-running a finished run ("finished at step N, nothing to do (its summary)"), or None
    when there is something to do: no completion record, one of another config (NOT_TRAINED aside),
    `run.resume` other than auto, `run.overwrite`, or a longer `run.steps` (continued from the newest
    checkpoint). A shorter `run.steps` than the run finished with is a ConfigError. An elastic run: the
    launcher's record, or under torchrun every replica's own."""
    if cfg.run.resume != "auto" or cfg.run.overwrite:
        return None
    record = read_finished(cfg.run_dir)
    if record is None and cfg.elastic.enabled:
        records = [read_finished(cfg.run_dir, m) for m in range(cfg.mesh.sync)]
        if all(r is not None for r in records):
            record = min(records, key=lambda r: r["steps"] if r else 0)
    if record is None or record.get("config", trained_config(to_dict(cfg))) != trained_config(to_dict(cfg)):
        return None
    done = record["steps"]
    if cfg.run.steps < done:
        raise ConfigError(
            f"run.steps: {cfg.run.steps} is below the {done} steps {cfg.run_dir} has finished; "
            f"set run.steps={done} (nothing to do) or more (continues from its newest checkpoint), "
            "or run.overwrite=true to start over"
        )
    if cfg.run.steps > done:
        return None
    return f"finished at step {done - 1}, nothing to do ({cfg.run_dir / record['summary']})"


def clear_finished(cfg: Config, replica: Optional[int] = None) -> None:
    """A run that trains again (a longer run.steps, or resumed by path) is no longer finished: drop its record."""
    finished_path(cfg.run_dir, replica).unlink(missing_ok=True)
