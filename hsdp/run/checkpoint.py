"""Checkpoints with torch.distributed.checkpoint (DCP): save, validate, resume (with resharding).

A run folder's checkpoints (docs/design.md §7):

    <run_dir>/checkpoints/step_N/         the state after step N (N+1 steps done); resume starts at N+1
        .metadata, __<rank>_0.distcp       DCP: every rank's tensors and pickled extras
        meta.json                          step, engine, mesh, replicas_identical, the engine's meta
        config.yaml                        the run's resolved config at save time
        checksums.json                     SHA-256 of every file above (hsdp/run/integrity.py)
        .complete                          written last: only a folder with it is a checkpoint
    <run_dir>/checkpoints/.tmp_step_N/    a save in progress (renamed when every rank is done)
    <run_dir>/replica<m>/checkpoints/...   an elastic run: each replica's own, saved in its own world

What a rank saves: its engine's `checkpoint_state` (held shards, inner optimizer
state and sync-policy state, as DTensors of the full shapes so DCP reshards on
load; see hsdp/engines/hsdp.py, hsdp/engines/baselines.py), plus `rank{r}.extra`: its RNG
states, Comm counters and the loop's progress (step times, last losses).

Crash safety: rank 0 renames `.tmp_step_N` to `step_N` only after a barrier that
every rank reaches once its files are written, then writes `.complete`; older
checkpoints beyond `run.keep_checkpoints` are deleted only after that. A kill at
any point leaves the previous complete checkpoint as the latest.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from hsdp.atomic import fsync_dir
from hsdp.comm.mesh import Mesh
from hsdp.config.loader import from_dict, save_config
from hsdp.config.schema import Config, ConfigError
from hsdp.engines.base import Engine, SavedCheckpoint
from hsdp.engines.registry import saved_engine_class
from hsdp.model import GPT
from hsdp.run.guard import Diverged, SaveFailed, last_good_hint
from hsdp.run.integrity import (
    CHECKSUMS,
    ChecksumError,
    first_non_finite,
    hash_files,
    rank_data_files,
    verify_checksums,
    write_checksums,
)
from hsdp.run.rundir import owns_run_dir
from hsdp.sync.membership import ReplicaSeat

FORMAT = 1  # bump when the layout of meta.json or the DCP keys changes
CHECKPOINTS = "checkpoints"
COMPLETE = ".complete"
_STEP_DIR = re.compile(r"step_(\d+)")


# ---------------------------------------------------------------- finding checkpoints
def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_of(path: Path) -> Optional[int]:
    """N for a folder named step_N, else None."""
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints (with a .complete marker), oldest step first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and (p / COMPLETE).is_file()]
    return sorted(found, key=step_of)


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
    (hsdp/sync/elastic/join.py, `Join.join`), as a replica restarted within the run does. Nothing a
    replica saved is given up for a step that all of them share (docs/design.md §11)."""
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
        return max((p for p in newest if p is not None), key=step_of, default=None)
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


# ---------------------------------------------------------------- validation (before any worker starts)
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


def remove_failed_saves(run_dir: Path) -> None:
    """Delete the temporary folders of saves that never completed (a rank died mid-save; the launcher's cleanup),
    the run's own and its elastic replicas'."""
    for root in [checkpoints_dir(run_dir), *Path(run_dir).glob("replica[0-9]*/checkpoints")]:
        if root.is_dir():
            for p in root.glob(".tmp_step_*"):
                shutil.rmtree(p, ignore_errors=True)


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
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
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
    with torch.device("meta"):
        model = GPT(cfg.model)
    prefix = engine.model_key_prefix(meta["mesh"].get("replica") or 0)  # an elastic replica's: its own
    expected = {prefix + n: tuple(p.shape) or (1,) for n, p in model.named_parameters()}
    present = {
        k: tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata) and k.startswith(prefix)
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


# ---------------------------------------------------------------- the loop's side
@dataclass
class Progress:
    """What the training loop carries across a resume besides the engine's state."""

    start_step: int = 0  # the first step this process runs
    step_times: list[float] = field(default_factory=list)
    loss: Optional[float] = None  # the last logged train loss
    val_loss: Optional[float] = None
    prior_wall_s: float = 0.0  # wall time of the run before this process (up to its checkpoint)
    resumed_from: Optional[Path] = None
    tokens: Optional[int] = None  # the run's tokens trained so far, as this rank counts them (train.py)
    trained_tokens: Optional[int] = None  # of those, the tokens of the ranks whose metrics this rank writes


class Checkpoints:
    """Saves this rank's state every `run.checkpoint_every` steps and restores it at start."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        engine: Engine,
        optimizer: torch.optim.Optimizer,
        t_start: float,
        seat: Optional[ReplicaSeat] = None,
    ) -> None:
        self.cfg, self.mesh, self.engine, self.optimizer = cfg, mesh, engine, optimizer
        # An elastic replica (`seat`) saves and loads its own checkpoints in its own world; its
        # first rank is then the world's rank 0, not the run's.
        self.seat = seat
        replica = self.replica = None if seat is None else seat.replica
        self.home = cfg.run_dir if replica is None else replica_home(cfg.run_dir, replica)
        self.root = checkpoints_dir(self.home)
        self.first = dist.get_rank() == 0
        self.t_start = t_start
        self.resumed_from: Optional[Path] = None
        self.last_load_s: Optional[float] = None  # this rank's seconds in the load, and in all saves
        self.saves, self.save_s = 0, 0.0

    # ------------------------------------------------------------ resume
    def resume(self) -> Progress:
        """Restore the checkpoint `run.resume` names (decided by rank 0 for every rank); else a fresh start."""
        if self.cfg.mesh.backend == "fake":  # nothing moves between ranks, so nothing could be restored right
            return Progress()
        if self.seat is not None and self.seat.restart > 0:
            return Progress()  # a replica restarted within the run heals from a live one instead (newer)
        # An elastic replica resumes from its own newest checkpoint; one behind the others heals at the join.
        choice = [str(resolve_resume(self.cfg, self.replica) or "") if self.first else None]
        dist.broadcast_object_list(choice, src=0)  # every rank loads the same one, even if a save lands now
        if not choice[0]:
            return Progress()
        path = Path(choice[0])
        meta = read_meta(path)
        keys = frozenset(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        same_replicas = meta["mesh"]["sync"] == self.mesh.sync_size
        # A rank absent from the checkpoint (a bigger world) takes rank 0's RNG and counters.
        extra_key = f"rank{self.mesh.rank}.extra"
        extra_key = extra_key if extra_key in keys else "rank0.extra"
        extras: dict[str, Any] = {}

        def load(targets: dict[str, Any]) -> None:
            targets[extra_key] = b""
            dcp.load(targets, storage_reader=FileSystemReader(str(path)))
            extras.update(pickle.loads(targets.pop(extra_key)))

        saved = SavedCheckpoint(
            keys=keys,
            replica=self.mesh.sync_rank if same_replicas else 0,
            meta=meta["engine_meta"],
            load=load,
            same_replicas=same_replicas,
        )
        t0 = time.perf_counter()
        self.engine.load_checkpoint(self.optimizer, saved)
        self._restore_extras(extras)
        self.last_load_s = round(time.perf_counter() - t0, 4)
        self.resumed_from = path
        p = extras["progress"]
        return Progress(
            start_step=meta["step"] + 1,
            step_times=p["step_times"],
            loss=p["loss"],
            val_loss=p["val_loss"],
            prior_wall_s=p["wall_s"],
            resumed_from=path,
            tokens=p.get("tokens"),  # None: a checkpoint from before these were saved
            trained_tokens=p.get("trained_tokens"),
        )

    def _restore_extras(self, extras: dict[str, Any]) -> None:
        rng = extras["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and self.mesh.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.mesh.device)
        comm = self.mesh.comm
        for counter in ("bytes", "seconds", "calls"):
            getattr(comm, counter).clear()
            getattr(comm, counter).update(extras["comm"][counter])

    def _extras(self, progress: Progress) -> bytes:
        comm = self.mesh.comm
        cuda = torch.cuda.get_rng_state(self.mesh.device) if self.mesh.device.type == "cuda" else None
        return pickle.dumps(
            {
                "rng": {
                    "torch": torch.get_rng_state(),
                    "cuda": cuda,
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                },
                "comm": {c: dict(getattr(comm, c)) for c in ("bytes", "seconds", "calls")},
                "progress": {
                    "step_times": list(progress.step_times),
                    "loss": progress.loss,
                    "val_loss": progress.val_loss,
                    "wall_s": progress.prior_wall_s + time.perf_counter() - self.t_start,
                    "tokens": progress.tokens,
                    "trained_tokens": progress.trained_tokens,
                },
            }
        )

    # ------------------------------------------------------------ save
    def stats(self) -> dict[str, Any]:
        """For summary.json: where this run resumed from and this rank's time in checkpoint I/O."""
        return {
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoint_load_s": self.last_load_s,
            "checkpoints_saved": self.saves,
            "checkpoint_save_s": round(self.save_s, 4),
        }

    def due(self, step: int) -> bool:
        every = self.cfg.run.checkpoint_every
        return every > 0 and (step + 1) % every == 0

    def maybe_save(self, step: int, progress: Progress) -> None:
        """After the update, sync and log of `step`: save if it is a checkpoint step."""
        if self.due(step):
            self.save(step, progress)

    def save(self, step: int, progress: Progress) -> Path:
        """Write `checkpoints/step_{step}` atomically (collective: every rank calls it).

        Refuses (Diverged, on every rank) a state that holds a NaN or inf, before anything is
        written: a bad state is never checkpointed, so pruning never removes the last good one.
        A save that fails on rank 0 removes its temporary folder before the error propagates.
        """
        t0 = time.perf_counter()
        tmp, final = self.root / f".tmp_step_{step}", self.root / f"step_{step}"
        rank0 = self.first
        state = self.engine.checkpoint_state(self.optimizer)
        self._refuse_non_finite(step, state)
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
            tmp.mkdir(parents=True)
        try:
            dist.barrier()
            state[f"rank{self.mesh.rank}.extra"] = self._extras(progress)
            meta = {
                "format": FORMAT,
                "step": step,
                "engine": self.cfg.mesh.engine,
                "mesh": {"sync": self.mesh.sync_size, "shard": self.mesh.shard_size, "replica": self.replica},
                "replicas_identical": self.engine.replicas_identical(step),
                "engine_meta": self.engine.checkpoint_meta(),
                "saved_at": time.time(),
            }
            dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
            dist.barrier()  # every rank's files are written (DCP's metadata only on rank 0's side)
            digests = [None] * dist.get_world_size() if rank0 else None
            mine = hash_files(tmp, rank_data_files(tmp, dist.get_rank()))  # each rank hashes its own (DCP's) files
            dist.gather_object(mine, digests, dst=0)
            if rank0:
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
                save_config(self.cfg, tmp / "config.yaml")
                checksums = write_checksums(tmp, {k: v for d in digests for k, v in d.items()})
                _fsync_files([tmp / "meta.json", tmp / "config.yaml", checksums])  # DCP fsyncs its own files
                publish(tmp, final)
                # An elastic replica has no later checkpoints to drop (it resumed from its own newest): never
                # delete one (a run's resume never deletes what a replica saved).
                prune(self.home, final, self.cfg.run.keep_checkpoints, drop_later=self.replica is None)
        except BaseException as e:
            if rank0:  # a full disk must not stay full of a save that will never complete
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, CheckpointException):  # DCP's report holds every rank's traceback: name the first
                rank, (error, _) = next(iter(sorted(e.failures.items(), key=lambda kv: kv[0])))
                raise SaveFailed(
                    f"saving checkpoint step_{step} failed on rank {rank}: {type(error).__name__}: {error}"
                    f"{'' if 'No space left' in str(error) else _disk_full_hint(self.cfg.run_dir)}"
                ) from None
            if isinstance(e, OSError):
                raise SaveFailed(f"saving checkpoint step_{step} failed: {type(e).__name__}: {e}") from e
            raise
        self.saves += 1
        self.save_s += time.perf_counter() - t0
        return final

    def _refuse_non_finite(self, step: int, state: dict[str, Any]) -> None:
        """Diverged on every rank if any rank's state holds a NaN or inf (one flag all-reduced, uncounted)."""
        bad_key = first_non_finite(state)
        flag = torch.tensor([0.0 if bad_key is None else 1.0 + self.mesh.rank], device=self.mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            where = f"{bad_key} on rank {self.mesh.rank}" if bad_key else f"rank {int(flag) - 1}'s state"
            raise Diverged(
                f"step {step}: the state to checkpoint holds a non-finite value ({where}); not saved; "
                + last_good_hint(latest_checkpoint(self.home))
            )

    def last_good(self) -> Optional[Path]:
        """The newest complete checkpoint (every checkpoint is finite), for the divergence message."""
        return latest_checkpoint(self.home)


def prune(run_dir: Path, newest: Path, keep: int, drop_later: bool = True) -> None:
    """After `newest` is complete: delete older complete checkpoints beyond the `keep` newest, later ones
    (an abandoned continuation, after resuming from an earlier checkpoint; not with `drop_later=False`)
    and crashed saves (rank 0)."""
    done = complete_checkpoints(run_dir)
    older = [p for p in done if step_of(p) <= step_of(newest)]
    later = [p for p in done if step_of(p) > step_of(newest)] if drop_later else []
    for old in older[:-keep] + later:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)
    for p in checkpoints_dir(run_dir).iterdir():  # crashed saves: temporary folders, renamed but never marked
        if p != newest and (
            p.name.startswith(".tmp_step_") or (step_of(p) is not None and not (p / COMPLETE).is_file())
        ):
            shutil.rmtree(p, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename a fully written checkpoint into place, then mark it complete (rank 0)."""
    if final.exists():  # renamed by a save that crashed before its marker: never loaded, so replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    marker = final / (COMPLETE + ".tmp")
    # The marker records the checksums file, so a checkpoint that lost it is refused, not loaded unverified.
    record = {"step": step_of(final), **({"checksums": CHECKSUMS} if (final / CHECKSUMS).is_file() else {})}
    marker.write_text(json.dumps(record) + "\n")
    os.replace(marker, final / COMPLETE)
    fsync_dir(final)


def _disk_full_hint(folder: Path) -> str:
    """torch.save reports a write cut short by a full disk as `unexpected pos`, without the errno: say so
    when the run folder's file system is (nearly) full."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f" (No space left on device: {free} bytes free in {folder})" if free < 2**20 else ""


def _fsync_files(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
