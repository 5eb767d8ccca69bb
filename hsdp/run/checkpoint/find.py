"""Finding checkpoints: the run folder's checkpoint folders, an elastic run's per-replica homes, and which
checkpoint `run.resume` names (docs/design.md §12.1)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from hsdp.config.schema import Config, ConfigError
from hsdp.core.atomic import fsync_dir

FORMAT = 1  # bump when the layout of meta.json or the DCP keys changes
CHECKPOINTS = "checkpoints"
COMPLETE = ".complete"
CORRUPT = "corrupt"  # checkpoints/corrupt/: damaged checkpoints run.resume=auto skipped (never resumed, never pruned)
_STEP_DIR = re.compile(r"step_(\d+)")


# ---------------------------------------------------------------- finding checkpoints
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_of(path: Path) -> Optional[int]:
    """N for a folder named step_N, else None."""
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def checkpoint_step(path: Path) -> int:
    """N for a checkpoint folder step_N (a sort key for paths known to be ones); ValueError for another path."""
    step = step_of(path)
    if step is None:
        raise ValueError(f"not a checkpoint folder (step_N): {path}")
    return step


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (with a .complete marker), oldest step first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


# ---------------------------------------------------------------- an elastic run's (one home per replica)
def replica_home(run_dir: Path, replica: int) -> Path:
    """Where an elastic run's replica keeps its checkpoints: each replica saves its own, in its own world."""
    return Path(run_dir) / f"replica{replica}"


def replica_newest(cfg: Config) -> list[Optional[Path]]:
    """An elastic run's resume points: each replica's newest complete checkpoint (None where it has none).

    The replicas need not agree: one that was down while the others saved is behind. Each resumes from
    its own newest state, and one behind the newest heals from a replica ahead at their first quorum
    (hsdp/sync/elastic/replica.py, `ElasticReplica.join`), as a replica restarted within the run does. Nothing a
    replica saved is given up for a step that all of them share (docs/design.md §9)."""
    return [latest_checkpoint(replica_home(cfg.run_dir, m)) for m in range(cfg.mesh.sync)]


def elastic_resume_note(cfg: Config) -> Optional[str]:
    """One line when an elastic run's replicas resume from different steps (who heals from whom), else None."""
    if not cfg.elastic.enabled or cfg.run.resume != "auto" or cfg.run.overwrite:
        return None
    steps = [step_of(p) if p is not None else None for p in replica_newest(cfg)]
    ahead = max((s for s in steps if s is not None), default=None)
    if ahead is None or all(s == ahead for s in steps):
        return None
    have = ", ".join(f"replica {m} step_{s}" if s is not None else f"replica {m} none" for m, s in enumerate(steps))
    behind = [str(m) for m, s in enumerate(steps) if s != ahead]
    many = len(behind) > 1
    return (
        f"note: the replicas' newest checkpoints differ ({have}); each resumes from its own, and "
        f"replica{'s' if many else ''} {', '.join(behind)} heal{'' if many else 's'} from step_{ahead} when they meet"
    )


def resolve_resume(cfg: Config, replica: Optional[int] = None) -> Optional[Path]:
    """The checkpoint `run.resume` asks for: None (start fresh) or a complete checkpoint's folder.

    auto: the latest complete checkpoint of the run folder, if any; never: None; a path:
    a checkpoint folder, or a run folder (then its latest complete checkpoint). An elastic run
    (auto only): `replica`'s own newest checkpoint; without `replica`, the newest of any replica's.
    """
    resume = cfg.run.resume
    if resume == "never":
        return None
    if resume == "auto" and cfg.elastic.enabled:
        if cfg.run.overwrite:
            return None
        newest = replica_newest(cfg)
        if replica is not None:
            return newest[replica] if replica < len(newest) else None
        return max((p for p in newest if p is not None), key=checkpoint_step, default=None)
    if resume == "auto":  # run.overwrite=true replaces the run, its checkpoints included: nothing to resume
        return None if cfg.run.overwrite else latest_checkpoint(cfg.run_dir)
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"run.resume: expected auto, never or a checkpoint folder, got {resume!r} (no such folder)")
    if step_of(path) is None and checkpoints_dir(path).is_dir():  # a run folder
        latest = latest_checkpoint(path)
        if latest is None:
            raise ConfigError(f"run.resume: run folder {resume} has no complete checkpoint")
        return latest
    return path


def remove_failed_saves(run_dir: Path) -> None:
    """Delete the temporary folders of saves that never completed (a rank died mid-save; the launcher's cleanup),
    the run's own and its elastic replicas'."""
    for root in [checkpoints_dir(run_dir), *Path(run_dir).glob("replica[0-9]*/checkpoints")]:
        if root.is_dir():
            for p in root.glob(".tmp_step_*"):
                shutil.rmtree(p, ignore_errors=True)


def move_aside(checkpoint: Path) -> Path:
    """Move a damaged checkpoint folder into `checkpoints/corrupt/` (step_N, or step_N.1, … if that is taken), where
    nothing resumes from it, prunes it or lists it as a checkpoint; returns its new path. ConfigError if it cannot."""
    root = checkpoint.parent / CORRUPT
    dest, n = root / checkpoint.name, 0
    while dest.exists():
        n += 1
        dest = root / f"{checkpoint.name}.{n}"
    try:
        root.mkdir(exist_ok=True)
        os.rename(checkpoint, dest)
        fsync_dir(root)
        fsync_dir(checkpoint.parent)
    except OSError as e:
        raise ConfigError(f"run.resume: cannot move the damaged checkpoint {checkpoint} aside ({e.strerror})") from None
    return dest
