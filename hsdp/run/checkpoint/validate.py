"""Checking a checkpoint before any worker starts: complete, readable, intact and a fit for the config
(docs/design.md §7, §7.1). Each refusal is one line naming the key or file (ConfigError)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import yaml

from hsdp.config.loader import from_dict
from hsdp.config.schema import Config, ConfigError
from hsdp.engines.registry import saved_engine_class
from hsdp.models.gpt import GPT
from hsdp.run.checkpoint.find import COMPLETE, FORMAT, replica_newest, resolve_resume
from hsdp.run.checkpoint.integrity import CHECKSUMS, ChecksumError, verify_checksums
from hsdp.run.checkpoint.keys import model_prefix
from hsdp.run.rundir import owns_run_dir
from hsdp.sync.seam import ReplicaSeat

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def check_resume(cfg: Config, seat: Optional[ReplicaSeat] = None) -> Optional[Path]:
    """Resolve `run.resume` and check that the checkpoint is complete, readable and fits `cfg`.

    Raises ConfigError (one line naming the key or file that differs); returns the
    checkpoint folder to resume from, or None to start fresh. `seat`: an elastic replica's
    under torchrun (which process reads every file, `owns_run_dir`).
    """
    path = resolve_resume(cfg)
    if path is None:
        return None
    if cfg.run.overwrite and _inside(path, cfg.run_dir):
        raise ConfigError(
            f"run.resume: {path} is inside {cfg.run_dir}, which run.overwrite=true would delete; "
            "resume without run.overwrite, or copy the checkpoint elsewhere first"
        )
    # An elastic run: every replica's own newest checkpoint is checked (each resumes from its own).
    chosen = [p for p in replica_newest(cfg) if p is not None] if cfg.elastic.enabled else [path]
    for checkpoint in chosen:
        done = validate_checkpoint(checkpoint, cfg, seat)["step"] + 1
        if cfg.run.steps < done:
            raise ConfigError(
                f"run.steps: {cfg.run.steps} is below the {done} steps checkpoint {checkpoint} has already "
                f"trained; set run.steps above {done - 1}, or run.resume=never"
            )
    return path


def finished(cfg: Config, path: Optional[Path]) -> bool:
    """Whether the checkpoint to resume from already holds all `run.steps` steps (re-running a finished run);
    an elastic run's only when every replica's newest does (one behind still heals and finishes)."""
    if path is None:
        return False
    if cfg.elastic.enabled and cfg.run.resume == "auto":
        newest = replica_newest(cfg)
        return all(p is not None and read_meta(p)["step"] + 1 == cfg.run.steps for p in newest)
    return read_meta(path)["step"] + 1 == cfg.run.steps


def _inside(path: Path, folder: Path) -> bool:
    return Path(os.path.realpath(folder)) in Path(os.path.realpath(path)).parents


# `key` names what the user gave the path as, for the one-line error (run.resume, or export's argument).
def read_meta(path: Path, key: str = "run.resume") -> dict[str, Any]:
    """meta.json of a checkpoint folder (ConfigError if incomplete, missing, unreadable or of another format)."""
    if not (path / COMPLETE).is_file():
        raise ConfigError(f"{key}: {path} is not a complete checkpoint (no {COMPLETE} marker)")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path}/meta.json is missing or corrupt ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path}/meta.json is not a format-{FORMAT} checkpoint description")
    return meta


def read_saved_config(path: Path, key: str = "run.resume") -> Config:
    """The config the checkpoint was saved under."""
    try:
        return from_dict(yaml.safe_load((path / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise ConfigError(f"{key}: {path}/config.yaml is missing or corrupt ({type(e).__name__})") from None


def read_dcp_metadata(path: Path, key: str = "run.resume") -> Metadata:
    """DCP's .metadata, after checking that every data file it names exists and is long enough."""
    # DCP (and the DTensor it imports) loaded here, when a checkpoint is read: 0.7 CPU s of every fresh start
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any failure to read means the same to the user
        raise ConfigError(f"{key}: {path}/.metadata is missing or corrupt ({type(e).__name__})") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = path / name
        if not f.is_file():
            raise ConfigError(f"{key}: {path} is missing its data file {name}")
        if f.stat().st_size < end:
            raise ConfigError(f"{key}: {path}/{name} is truncated ({f.stat().st_size} of {end} bytes)")
    return metadata


def verify_files(path: Path, key: str = "run.resume") -> None:
    """Every file of the checkpoint matches the checksum saved with it (ConfigError naming the first that does not).

    A checkpoint whose `.complete` marker records its checksums must have them; only one from before
    checksums were written (a marker without that record) is accepted unverified.
    """
    if not (path / CHECKSUMS).is_file():
        if marker_records_checksums(path):
            raise ConfigError(
                f"{key}: checkpoint {path} is missing its {CHECKSUMS} (its {COMPLETE} marker says it was written), "
                "so its files cannot be verified; resume from an earlier checkpoint"
            )
        return
    try:
        verify_checksums(path)
    except (ChecksumError, OSError, ValueError) as e:
        raise ConfigError(f"{key}: checkpoint {path} is corrupt: {e}; resume from an earlier checkpoint") from None


def marker_records_checksums(path: Path) -> bool:
    """Whether the checkpoint's `.complete` marker records that checksums.json was written with it. Markers
    were always JSON ({"step": N}); one that is not (damaged) counts as recording them, so that it cannot
    turn a checkpoint into an unverified one."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(marker, dict) or "checksums" in marker


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
    if owns_run_dir(seat):  # under torchrun, rank 0 reads every file once for all ranks (a mismatch ends them all)
        verify_files(path)
    return meta
