"""Checking a checkpoint before any worker starts: complete, readable, intact and a fit for the config
(docs/design.md §12.1, §12.2). Each refusal is one line naming the key or file (ConfigError).

Two kinds of refusal: a checkpoint that does not fit the config (another model, engine, optimizer, mesh)
is the config's problem and always an error; one whose own files are damaged or incomplete
(`CorruptCheckpoint`: a marker, meta.json, config.yaml, DCP's .metadata or a data file missing, truncated or
not matching its checksum) is the disk's. With `run.resume: auto` a damaged checkpoint is skipped and the
newest intact one is resumed (`choose_resume`; the damaged one is moved aside, never deleted, by
`ResumePlan.set_aside`); a checkpoint named by path stays an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import yaml

from hsdp.config.loader import from_dict
from hsdp.config.schema import Config, ConfigError
from hsdp.engines.registry import saved_engine_class
from hsdp.models.gpt import GPT
from hsdp.run.checkpoint.find import (
    COMPLETE,
    FORMAT,
    complete_checkpoints,
    move_aside,
    replica_newest,
    resolve_resume,
    step_of,
)
from hsdp.run.checkpoint.integrity import CHECKSUMS, ChecksumError, verify_checksums
from hsdp.run.checkpoint.keys import model_prefix
from hsdp.sync.seam import ReplicaSeat

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


class CorruptCheckpoint(ConfigError):
    """A checkpoint's own files are damaged or incomplete (not a mismatch with the config). `reason`: what is wrong,
    without the config key."""

    def __init__(self, key: str, message: str, reason: Optional[str] = None) -> None:
        super().__init__(f"{key}: {message}")
        self.reason = message if reason is None else reason


@dataclass
class ResumePlan:
    """What `run.resume` resolves to once every check passed: the checkpoint to resume from (None: start fresh),
    the last step it holds, and the newer checkpoints of the run folder skipped as damaged (auto only)."""

    path: Optional[Path] = None
    step: Optional[int] = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (folder, what is wrong with it), newest first
    replica_steps: list[Optional[int]] = field(default_factory=list)  # an elastic run: each replica's newest step

    def finished(self, steps: int) -> bool:
        """Whether the checkpoint already holds all `steps` steps (re-running a finished run); an elastic run's
        only when every replica's newest does (one behind still heals and finishes)."""
        if self.replica_steps:
            return all(s is not None and s + 1 == steps for s in self.replica_steps)
        return self.step is not None and self.step + 1 == steps

    def set_aside(self) -> Optional[str]:
        """Move the skipped (damaged) checkpoints into `checkpoints/corrupt/` (never deleted: a damaged file may
        still be worth a look) and return the one line that says so, or None when none was skipped. Called once,
        by the process that owns the run folder, after every check passed."""
        if not self.skipped or self.path is None:
            return None
        what = "; ".join(f"{p.name} is damaged ({why})" for p, why in self.skipped)
        moved = [move_aside(p) for p, _ in self.skipped]
        where = ", ".join(str(m) for m in moved)
        return f"warning: resuming from {self.path.name}: {what}; moved to {where}"


def check_resume(cfg: Config, seat: Optional[ReplicaSeat] = None) -> Optional[Path]:
    """Resolve `run.resume` and check that the checkpoint is complete, readable and fits `cfg` (`choose_resume`'s
    checkpoint: with auto, the newest intact one). Raises ConfigError (one line naming the key or file that
    differs); returns the checkpoint folder to resume from, or None to start fresh."""
    return choose_resume(cfg, seat).path


def choose_resume(cfg: Config, seat: Optional[ReplicaSeat] = None) -> ResumePlan:
    """The checkpoint to resume from, checked: complete, readable, intact and a fit for `cfg`.

    auto (not elastic): the run folder's newest checkpoint that passes; newer damaged ones
    (`CorruptCheckpoint`) are listed in the plan's `skipped` and nothing is changed here. A checkpoint
    that does not fit the config is an error, as is a folder with checkpoints none of which is intact.
    A path, or an elastic run's replica checkpoints: any refusal is an error. `seat`: an elastic
    replica's under torchrun.
    """
    path = resolve_resume(cfg)
    if path is None:
        return ResumePlan()
    if cfg.run.overwrite and _inside(path, cfg.run_dir):
        raise ConfigError(
            f"run.resume: {path} is inside {cfg.run_dir}, which run.overwrite=true would delete; "
            "resume without run.overwrite, or copy the checkpoint elsewhere first"
        )
    if cfg.elastic.enabled:
        # Every replica's own newest checkpoint is checked (each resumes from its own); a damaged one is an error.
        newest = replica_newest(cfg)
        steps: list[Optional[int]] = []
        for checkpoint in newest:
            steps.append(
                None
                if checkpoint is None
                else _check_steps(cfg, checkpoint, validate_checkpoint(checkpoint, cfg, seat))
            )
        return ResumePlan(path, step_of(path), replica_steps=steps)
    if cfg.run.resume != "auto":
        return ResumePlan(path, _check_steps(cfg, path, validate_checkpoint(path, cfg, seat)))
    skipped: list[tuple[Path, str]] = []
    for checkpoint in reversed(complete_checkpoints(cfg.run_dir)):
        try:
            meta = _validate_or_corrupt(checkpoint, cfg, seat)
        except CorruptCheckpoint as e:
            skipped.append((checkpoint, e.reason.replace(f"{checkpoint}/", "")))
            continue
        return ResumePlan(checkpoint, _check_steps(cfg, checkpoint, meta), skipped)
    damaged = "; ".join(f"{p.name}: {why}" for p, why in skipped)
    raise ConfigError(
        f"run.resume: no intact checkpoint in {path.parent} ({damaged}); nothing was changed: "
        "run.overwrite=true starts the run over (deleting them), or name one with run.resume=PATH"
    )


def _check_steps(cfg: Config, checkpoint: Path, meta: dict[str, Any]) -> int:
    """The checkpoint's last step, after checking that run.steps does not end before it."""
    done = meta["step"] + 1
    if cfg.run.steps < done:
        raise ConfigError(
            f"run.steps: {cfg.run.steps} is below the {done} steps checkpoint {checkpoint} has already "
            f"trained; set run.steps above {done - 1}, or run.resume=never"
        )
    return int(meta["step"])


def _validate_or_corrupt(path: Path, cfg: Config, seat: Optional[ReplicaSeat]) -> dict[str, Any]:
    """`validate_checkpoint`, except that a checkpoint which seems not to fit, or whose meta.json lacks a field, is
    first re-hashed: a same-size change of meta.json or config.yaml reads as another config until the checksums
    say otherwise (then CorruptCheckpoint). Every process checks here (rare: only after a refusal)."""
    try:
        return validate_checkpoint(path, cfg, seat)
    except CorruptCheckpoint:
        raise
    except (ConfigError, KeyError, TypeError) as e:
        read_dcp_metadata(path)
        verify_files(path)
        if isinstance(e, ConfigError):
            raise
        raise CorruptCheckpoint(
            "run.resume", f"{path}/meta.json does not describe a checkpoint ({type(e).__name__}: {e})"
        ) from None


def _inside(path: Path, folder: Path) -> bool:
    return Path(os.path.realpath(folder)) in Path(os.path.realpath(path)).parents


# `key` names what the user gave the path as, for the one-line error (run.resume, or export's argument).
def read_meta(path: Path, key: str = "run.resume") -> dict[str, Any]:
    """meta.json of a checkpoint folder (ConfigError if incomplete, missing, unreadable or of another format)."""
    if not (path / COMPLETE).is_file():
        raise CorruptCheckpoint(key, f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(key, f"{path}/meta.json is missing or corrupt ({type(e).__name__})") from None
    if not isinstance(meta, dict) or "format" not in meta:
        raise CorruptCheckpoint(key, f"{path}/meta.json is not a checkpoint description")
    if meta["format"] != FORMAT:  # written by another version of this code: not damaged, not ours to read
        raise ConfigError(f"{key}: {path}/meta.json is not a format-{FORMAT} checkpoint description")
    return meta


def read_saved_config(path: Path, key: str = "run.resume") -> Config:
    """The config the checkpoint was saved under."""
    try:
        return from_dict(yaml.safe_load((path / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise CorruptCheckpoint(key, f"{path}/config.yaml is missing or corrupt ({type(e).__name__})") from None


def read_dcp_metadata(path: Path, key: str = "run.resume") -> Metadata:
    """DCP's .metadata, after checking that every data file it names exists and is long enough."""
    # DCP (and the DTensor it imports) loaded here, when a checkpoint is read: 0.7 CPU s of every fresh start
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read means the same to the user
        raise CorruptCheckpoint(key, f"{path}/.metadata is missing or corrupt ({type(e).__name__})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise CorruptCheckpoint(key, f"{path} is missing its data file {name}")
        if f.stat().st_size < end:
            raise CorruptCheckpoint(key, f"{path}/{name} is truncated ({f.stat().st_size} of {end} bytes)")
    return metadata


def verify_files(path: Path, key: str = "run.resume") -> None:
    """Every file of the checkpoint matches the checksum saved with it (ConfigError naming the first that does not).

    A checkpoint whose `.complete` marker records its checksums must have them; only one from before
    checksums were written (a marker without that record) is accepted unverified.
    """
    if not (path / CHECKSUMS).is_file():
        if marker_records_checksums(path):
            raise CorruptCheckpoint(
                key,
                f"checkpoint {path} is missing its {CHECKSUMS} (its {COMPLETE} marker says it was written), "
                "so its files cannot be verified; resume from an earlier checkpoint",
                f"its {CHECKSUMS} is missing (its {COMPLETE} marker says it was written)",
            )
        return
    try:
        verify_checksums(path)
    except (ChecksumError, OSError, ValueError) as e:
        raise CorruptCheckpoint(
            key, f"checkpoint {path} is corrupt: {e}; resume from an earlier checkpoint", str(e)
        ) from None


def marker_records_checksums(path: Path) -> bool:
    """Whether the checkpoint's `.complete` marker records that checksums.json was written with it. Markers
    were always JSON ({"step": N}); one that is not (damaged) counts as recording them, so that it cannot
    turn a checkpoint into an unverified one."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(marker, dict) or "checksums" in marker


def reads_every_file() -> bool:
    """Whether this process re-hashes a checkpoint's files: a launcher, or rank 0 of a torchrun world (an elastic
    replica's world is its own: each replica's rank 0 reads, none is special)."""
    return "WORLD_SIZE" not in os.environ or os.environ.get("RANK", "0") == "0"


def validate_checkpoint(path: Path, cfg: Config, seat: Optional[ReplicaSeat] = None) -> dict[str, Any]:
    """ConfigError unless `path` is a complete, intact checkpoint `cfg` can continue; returns its meta."""
    meta = read_meta(path)
    saved = read_saved_config(path)
    for key, old in vars(saved.model).items():
        new = getattr(cfg.model, key)
        if old != new:
            raise ConfigError(f"model.{key}: checkpoint {path} has {old!r}, config has {new!r}")
    for key, old, new in [
        ("mesh.engine", meta["engine"], cfg.mesh.engine),
        ("optim.name", saved.optim.name, cfg.optim.name),
    ]:
        if old != new:
            raise ConfigError(f"{key}: checkpoint {path} was saved with {old!r}, config has {new!r}")
    engine = saved_engine_class(meta["engine"])
    engine.check_checkpoint(path, meta, saved, cfg)
    metadata = read_dcp_metadata(path)
    import torch.distributed.checkpoint.metadata as dcp_metadata  # loaded by read_dcp_metadata

    with torch.device("meta"):
        model = GPT(cfg.model)
    prefix = model_prefix(engine.state_per_replica, meta["mesh"].get("replica") or 0)  # an elastic replica's: its own
    expected = {prefix + n: tuple(p.shape) or (1,) for n, p in model.named_parameters()}
    present = {
        k: tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, dcp_metadata.TensorStorageMetadata) and k.startswith(prefix)
    }
    for key, shape in expected.items():
        if key not in present:
            raise ConfigError(f"model: checkpoint {path} has no tensor {key}")
        if present[key] != shape:
            raise ConfigError(
                f"model: checkpoint {path} has {key} of shape {present[key]}, the config's model has {shape}"
            )
    extra = sorted(set(present) - set(expected))
    if extra:
        raise ConfigError(f"model: checkpoint {path} has tensor {extra[0]}, which the config's model lacks")
    # Last: the checks above name what differs; this one finds bytes that changed without changing sizes.
    if reads_every_file():  # under torchrun, rank 0 reads every file once for all ranks (a mismatch ends them all)
        verify_files(path)
    return meta
