"""Saving and restoring a rank's state: the training loop's side of the checkpoint (docs/design.md §12.1).

What a rank saves is handed to it, never laid out by its owner: the engine's `EngineState` (params,
inner optimizer state, the sync policy's state_dict cut per param), named by keys.py, plus this rank's
`RankExtras` (RNG states, Comm counters, the loop's progress), a torch `Stateful` stored pickled under
`rank{r}.extra`. One `dcp.save` / `dcp.load` per checkpoint, every rank collectively.

Crash safety: rank 0 renames `.tmp_step_N` to `step_N` only after a barrier that every rank reaches
once its files are written, then writes `.complete`; older checkpoints beyond `run.keep_checkpoints`
are deleted only after that. A kill at any point leaves the previous complete checkpoint as the latest.

Asynchronous saves (`run.checkpoint_async`, the default): the training thread checks the state (finite),
copies it (the staged state: its own tensors, which training then goes on changing, are never written)
and hands it to a writer thread, which does everything above on a process group of its own (gloo: its
barriers and DCP's collectives never interleave with training's) while training goes on. One save is in
flight at a time: the next one, and the run's end (`finish`), wait for it and raise its error there. What
training waits for is `checkpoint_save_s` in summary.json; the writes themselves, `checkpoint_write_s`.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from hsdp.comm.mesh import Mesh
from hsdp.config.loader import save_config
from hsdp.config.schema import Config
from hsdp.core.atomic import fsync_dir
from hsdp.engines.base import Engine, EngineState, SavedCheckpoint
from hsdp.run.checkpoint.find import (
    COMPLETE,
    FORMAT,
    checkpoint_step,
    checkpoints_dir,
    complete_checkpoints,
    latest_checkpoint,
    replica_home,
    resolve_resume,
    step_of,
)
from hsdp.run.checkpoint.integrity import (
    CHECKSUMS,
    first_non_finite,
    hash_files,
    rank_data_files,
    tensors_of,
    write_checksums,
)
from hsdp.run.checkpoint.keys import dcp_state, extra_key
from hsdp.run.checkpoint.validate import read_meta
from hsdp.run.guard import Diverged, SaveFailed, last_good_hint
from hsdp.sync.seam import ReplicaSeat


# ---------------------------------------------------------------- the loop's side
@dataclass
class Progress:
    """What the training loop carries across a resume besides the engine's state."""

    start_step: int = 0  # the first step this process runs
    step_times: list[float] = field(default_factory=list)
    trained_times: Optional[list[float]] = None  # of those, the steps this rank trained (not a skipped one's)
    loss: Optional[float] = None  # the last logged train loss
    val_loss: Optional[float] = None
    prior_wall_s: float = 0.0  # wall time of the run before this process (up to its checkpoint)
    resumed_from: Optional[Path] = None
    tokens: Optional[int] = None  # the run's tokens trained so far, as this rank counts them (train.py)
    trained_tokens: Optional[int] = None  # of those, the tokens of the ranks whose metrics this rank writes


@dataclass(frozen=True)
class Part:
    """A piece of the run's state that a checkpoint carries besides the engine's and the loop's progress (torch's
    `Stateful` as two callables): e.g. the sync policy's round ledger, the pacer's periods. Registered once with
    `Checkpoints(parts=...)`: every save takes `state()`, a resume hands the saved value to `load`."""

    state: Callable[[], Any]
    load: Callable[[Any], None]


# Parts that checkpoints from before parts were registered kept in the loop's progress, under these names.
PROGRESS_PARTS = ("ledger", "pace")


class RankExtras:
    """A rank's state besides the engine's (torch's `Stateful`): RNG states, Comm counters (§4.2) and the loop's
    progress (step times, last losses, wall time, tokens). Saved pickled under `rank{r}.extra`."""

    def __init__(
        self, mesh: Mesh, t_start: float, progress: Optional[Progress] = None, parts: Optional[dict[str, Part]] = None
    ) -> None:
        self.mesh, self.t_start = mesh, t_start
        self.saving = progress  # the loop's progress to save (None when loading)
        self.parts = parts or {}  # the registered parts' states are saved beside it
        self.progress: dict[str, Any] = {}  # the loaded progress
        self.part_states: dict[str, Any] = {}  # the loaded parts' states, by name

    def state_dict(self) -> dict[str, Any]:
        comm, progress = self.mesh.comm, self.saving
        assert progress is not None, "RankExtras.state_dict: built to load (no progress to save)"
        cuda = torch.cuda.get_rng_state(self.mesh.device) if self.mesh.device.type == "cuda" else None
        return {
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": cuda,
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
            "comm": {c: dict(getattr(comm, c)) for c in ("bytes", "seconds", "calls")},
            "progress": {
                "step_times": list(progress.step_times),
                "trained_times": None if progress.trained_times is None else list(progress.trained_times),
                "loss": progress.loss,
                "val_loss": progress.val_loss,
                "wall_s": progress.prior_wall_s + time.perf_counter() - self.t_start,
                "tokens": progress.tokens,
                "trained_tokens": progress.trained_tokens,
            },
            "parts": {name: part.state() for name, part in self.parts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and self.mesh.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.mesh.device)
        comm = self.mesh.comm
        for counter in ("bytes", "seconds", "calls"):
            getattr(comm, counter).clear()
            getattr(comm, counter).update(state["comm"][counter])
        self.progress = state["progress"]
        saved = state.get("parts") or {n: self.progress[n] for n in PROGRESS_PARTS if self.progress.get(n) is not None}
        self.part_states = dict(saved)


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
        parts: Optional[dict[str, Part]] = None,
    ) -> None:
        """`parts`: the run's other state a checkpoint carries (`Part`), each restored by `resume`."""
        self.cfg, self.mesh, self.engine, self.optimizer = cfg, mesh, engine, optimizer
        self.parts = parts or {}
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
        self.saves, self.save_s = 0, 0.0  # save_s: what the training thread spent in save() (exposed)
        self.write_s = 0.0  # the writes' own seconds (on the writer thread when asynchronous)
        self.background = cfg.run.checkpoint_async
        self._writer: Optional[threading.Thread] = None
        self._writer_step: Optional[int] = None  # the step the writer thread saves
        self._write_error: Optional[BaseException] = None
        self._group: Any = None  # the writer's process group (created by the first asynchronous save)

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
        import torch.distributed.checkpoint as dcp  # here, not at the top: a run that never resumes nor saves
        # does without DCP and the DTensor it imports (0.7 CPU s of every fresh start)

        meta = read_meta(path)
        keys = frozenset(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        # Another mesh.sync (a checkpoint of identical replicas): every replica loads replica 0's state, and
        # none loads a replica's own sync buffers (they belong to no replica of the new mesh: left zero).
        same_replicas = meta["mesh"]["sync"] == self.mesh.sync_size
        replica = self.mesh.sync_rank if same_replicas else 0
        # A rank absent from the checkpoint (a bigger world) takes rank 0's RNG and counters.
        mine = extra_key(self.mesh.rank) if extra_key(self.mesh.rank) in keys else extra_key(0)
        extras = RankExtras(self.mesh, self.t_start)
        loaded: dict[str, Any] = {}

        def load(targets: EngineState) -> None:
            keyed = dcp_state(targets, self.engine.state_per_replica, replica, own_buffers=same_replicas)
            keyed[mine] = b""
            dcp.load(keyed, storage_reader=dcp.FileSystemReader(str(path)))
            loaded.update(pickle.loads(keyed.pop(mine)))

        saved = SavedCheckpoint(meta=meta["engine_meta"], load=load)
        t0 = time.perf_counter()
        self.engine.load_checkpoint(self.optimizer, saved)
        extras.load_state_dict(loaded)  # after the engine's install (DDP's dummy backward moves the counters)
        self.last_load_s = round(time.perf_counter() - t0, 4)
        self.resumed_from = path
        for name, part in self.parts.items():  # the registered parts (a checkpoint without one: left as built)
            if extras.part_states.get(name) is not None:
                part.load(extras.part_states[name])
        p = extras.progress
        return Progress(
            start_step=meta["step"] + 1,
            step_times=p["step_times"],
            trained_times=p.get("trained_times"),  # None: a checkpoint from before skipped steps were told apart
            loss=p["loss"],
            val_loss=p["val_loss"],
            prior_wall_s=p["wall_s"],
            resumed_from=path,
            tokens=p.get("tokens"),  # None: a checkpoint from before these were saved
            trained_tokens=p.get("trained_tokens"),
        )

    # ------------------------------------------------------------ save
    def stats(self) -> dict[str, Any]:
        """For summary.json: where this run resumed from and this rank's time in checkpoint I/O."""
        return {
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoint_load_s": self.last_load_s,
            "checkpoints_saved": self.saves,
            "checkpoint_save_s": round(self.save_s, 4),  # what training waited for (all of it when synchronous)
            "checkpoint_write_s": round(self.write_s, 4),
            "checkpoint_async": self.background,
        }

    def due(self, step: int) -> bool:
        """Whether a checkpoint is saved after the update, sync and log of `step`."""
        every = self.cfg.run.checkpoint_every
        return every > 0 and (step + 1) % every == 0

    def save(self, step: int, progress: Progress) -> Path:
        """Write `checkpoints/step_{step}` atomically (collective: every rank calls it); asynchronously, hand
        it to the writer thread after the previous save is complete (module docstring). Returns its path.

        Refuses (Diverged, on every rank) a state that holds a NaN or inf, before anything is
        written: a bad state is never checkpointed, so pruning never removes the last good one.
        A save that fails on rank 0 removes what it wrote before the error propagates; any failure
        is SaveFailed, which says so when the disk is full (`save_failure`), whatever layer raised it.
        """
        t0 = time.perf_counter()
        self.finish()  # one save in flight: the previous one complete, its error raised here
        engine_state = self.engine.checkpoint_state(self.optimizer)
        state = dcp_state(engine_state, self.engine.state_per_replica, self.mesh.sync_rank)
        self._refuse_non_finite(step, state)
        extras = RankExtras(self.mesh, self.t_start, progress, self.parts)
        state[extra_key(self.mesh.rank)] = pickle.dumps(extras.state_dict())
        meta = {
            "format": FORMAT,
            "step": step,
            "engine": self.cfg.mesh.engine,
            "mesh": {
                "sync": self.mesh.sync_size,
                "replicate": self.mesh.replicate_size,  # in-site replicas: their ranks save one copy (DCP dedups)
                "shard": self.mesh.shard_size,
                "replica": self.replica,
            },
            "replicas_identical": self.engine.replicas_identical(step),
            "engine_meta": {} if engine_state.sync_meta is None else {"sync": engine_state.sync_meta},
            "saved_at": time.time(),
        }
        staged = stage(state) if self.background else None
        if staged is None:  # synchronous (or a state this copy cannot stage: tensor subclasses, e.g. DTensor)
            self.background = False
            final = self._write(step, state, meta, group=None)
            self.save_s += time.perf_counter() - t0
            return final
        if self._group is None:  # collective: every rank reaches its first save together
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.cfg.mesh.timeout_s))
        self._writer = threading.Thread(
            target=self._write_in_background, args=(step, staged, meta), name=f"checkpoint-step_{step}", daemon=True
        )
        self._writer_step = step
        self._writer.start()
        self.save_s += time.perf_counter() - t0
        return self.root / f"step_{step}"

    def finish(self) -> None:
        """Wait for the save in flight (if any); its failure is raised here, on the training thread."""
        self._join_writer()
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    def _write_in_background(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            self._write(step, state, meta, group=self._group)
        except BaseException as e:  # raised on the training thread by the next save or the run's end
            self._write_error = e

    def _write(self, step: int, state: dict[str, Any], meta: dict[str, Any], group: Any) -> Path:
        """The save's I/O (every rank; `group`: the process group of its collectives, None: the default)."""
        import torch.distributed.checkpoint as dcp  # on first use (see load)

        t0 = time.perf_counter()
        tmp, final = self.root / f".tmp_step_{step}", self.root / f"step_{step}"
        rank0 = self.first
        needed = state_bytes(state) * dist.get_world_size()  # about what this save writes (ranks hold alike shards)
        try:
            if rank0:
                shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's leftovers
                tmp.mkdir(parents=True)
            dist.barrier(group=group)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=group)
            dist.barrier(group=group)  # every rank's files are written (DCP's metadata only on rank 0's side)
            digests: Optional[list[Any]] = [None] * dist.get_world_size() if rank0 else None
            mine = hash_files(tmp, rank_data_files(tmp, dist.get_rank()))  # each rank hashes its own (DCP's) files
            dist.gather_object(mine, digests, dst=0, group=group)
            if rank0:
                assert digests is not None  # rank 0's list, filled by gather_object
                (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
                save_config(self.cfg, tmp / "config.yaml")
                checksums = write_checksums(tmp, {k: v for d in digests for k, v in d.items()})
                _fsync_files([tmp / "meta.json", tmp / "config.yaml", checksums])  # DCP fsyncs its own files
                publish(tmp, final)
                # An elastic replica has no later checkpoints to drop (it resumed from its own newest): never
                # delete one (a run's resume never deletes what a replica saved).
                prune(self.home, final, self.cfg.run.keep_checkpoints, drop_later=self.replica is None)
        except BaseException as e:
            free = free_bytes(self.root)  # before the cleanup below gives the partial files' space back
            if rank0:  # a full disk must not stay full of a save that will never complete
                shutil.rmtree(tmp, ignore_errors=True)
                if final.is_dir() and not (final / COMPLETE).is_file():  # renamed, but its marker could not be written
                    shutil.rmtree(final, ignore_errors=True)
            failure = save_failure(f"checkpoint step_{step}", e, self.root, free, needed)
            if failure is None:
                raise
            kept = latest_checkpoint(self.home)
            raise SaveFailed(
                f"{failure}; "
                + (f"the last complete checkpoint, {kept}, is kept" if kept else "no checkpoint was saved before it")
            ) from None
        self.saves += 1
        self.write_s += time.perf_counter() - t0
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
        """The newest complete checkpoint (every checkpoint is finite), for the divergence message, once the save
        in flight (if any) has ended: it was staged from a finite step, so it is the last good one when written
        (its error, if any, is still raised by finish)."""
        self._join_writer()
        return latest_checkpoint(self.home)

    def _join_writer(self) -> None:
        """Wait for the save in flight (if any) to be published: on rank 0 its writer thread; on another rank
        that thread, then rank 0's rename and marker (the divergence check that follows names the newest)."""
        if self._writer is None:
            return
        self._writer.join()
        self._writer = None
        if self._write_error is None and not self.first and self._writer_step is not None:
            self._wait_for_publish(self._writer_step)

    def _wait_for_publish(self, step: int, poll_s: float = 0.05) -> None:
        """Wait (up to mesh.timeout_s) for rank 0 to publish step_{step}: another rank's writer is done once its
        own files are written and hashed, while rank 0's goes on to rename the folder and mark it complete."""
        marker = self.root / f"step_{step}" / COMPLETE
        deadline = time.monotonic() + self.cfg.mesh.timeout_s
        while not marker.is_file() and time.monotonic() < deadline:
            time.sleep(poll_s)


def stage(state: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A copy of a DCP state dict that training cannot change: plain tensors copied to the CPU, a DTensor
    (the hsdp engine's sharded state) cloned where it lives (its local shard, same mesh and placements: no
    communication), bytes and numbers kept. None if it holds another tensor subclass (nothing to stage it
    with: the save is then synchronous)."""
    from torch.distributed.tensor import DTensor

    def copy(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.detach().clone()
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
                raise TypeError(type(value).__name__)
            return value.detach().to("cpu", copy=True)
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy(v) for v in value)
        return value  # bytes, numbers, strings: immutable

    try:
        return {k: copy(v) for k, v in state.items()}
    except TypeError:
        return None


def prune(run_dir: Path, newest: Path, keep: int, drop_later: bool = True) -> None:
    """After `newest` is complete: delete older complete checkpoints beyond the `keep` newest, later ones
    (an abandoned continuation, after resuming from an earlier checkpoint; not with `drop_later=False`)
    and crashed saves (rank 0)."""
    done = complete_checkpoints(run_dir)
    older = [p for p in done if checkpoint_step(p) <= checkpoint_step(newest)]
    later = [p for p in done if checkpoint_step(p) > checkpoint_step(newest)] if drop_later else []
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


# A write cut short: torch.save's zip writer reports it without the errno ("[enforce fail at
# inline_container.cc:…] . unexpected pos 704 vs 598", "PytorchStreamWriter failed writing file …").
SHORT_WRITE = ("unexpected pos", "failed writing")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded")
NEARLY_FULL = 1 << 20  # bytes free below which a cut-short write is a full disk whatever the save needs


def free_bytes(path: Path) -> Optional[int]:
    """Bytes free to this process on the file system of `path` (its nearest existing folder); None if unknown."""
    for folder in [Path(path), *Path(path).parents]:
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds `path` (its nearest existing folder)."""
    folder = Path(os.path.abspath(path))
    while not folder.exists():
        folder = folder.parent
    while not os.path.ismount(folder) and folder != folder.parent:
        folder = folder.parent
    return folder


def _causes(error: BaseException) -> list[tuple[Optional[int], BaseException]]:
    """`error`, its causes and contexts, and in place of a DCP CheckpointException (a BaseException whose text
    holds every rank's traceback) the per-rank errors it carries, each with the rank that raised it."""
    found: list[tuple[Optional[int], BaseException]] = []
    seen: list[BaseException] = []
    todo: list[tuple[Optional[int], BaseException]] = [(None, error)]
    while todo:
        rank, e = todo.pop(0)
        if any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [(rank, c) for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            for r, f in sorted(failures.items(), key=lambda kv: kv[0]):
                first = f[0] if isinstance(f, tuple) else f
                if isinstance(first, BaseException):
                    todo.append((r, first))
        else:
            found.append((rank, e))
    return found


def _says(e: BaseException, words: tuple[str, ...]) -> bool:
    return any(w in str(e) for w in words)


def disk_full(error: BaseException, free: Optional[int], needed: int = 0) -> bool:
    """Whether `error` (from any layer of a save) means the disk is full: an OSError with ENOSPC / EDQUOT
    anywhere in it, a message that says so, or a write cut short (torch.save's zip writer drops the errno)
    while fewer bytes are free than the save needs (or under 1 MiB)."""
    causes = [e for _, e in _causes(error)]
    if any(isinstance(e, OSError) and e.errno in DISK_FULL for e in causes):
        return True
    if any(_says(e, DISK_FULL_WORDS) for e in causes):
        return True
    short = any(_says(e, SHORT_WRITE) for e in causes)
    return short and free is not None and free < max(needed, NEARLY_FULL)


def save_failure(what: str, error: BaseException, folder: Path, free: Optional[int], needed: int = 0) -> Optional[str]:
    """The one line for a save of `what` into `folder` that failed with `error` (`free`: bytes free when it failed;
    `needed`: about what the save writes), or None when it is no write failure (an interrupt, a bug outside
    DCP: its traceback says more than a line would)."""
    dcp_report = getattr(error, "failures", None) is not None
    if not isinstance(error, Exception) and not dcp_report:  # KeyboardInterrupt, SystemExit: not a failed write
        return None
    where = f"{free} bytes free on {mount_point(folder)}" if free is not None else f"on {mount_point(folder)}"
    if disk_full(error, free, needed):
        return f"saving {what}: the disk is full ({where})"
    causes = _causes(error)
    # the first error that is a write's (an OSError, a write cut short), else the first rank's in DCP's report
    rank, culprit = next(
        ((r, e) for r, e in causes if isinstance(e, OSError) or _says(e, SHORT_WRITE)),
        next(((r, e) for r, e in causes if r is not None), (None, None)),
    )
    if culprit is None:
        return None
    on = f" on rank {rank}" if rank is not None else ""
    return f"saving {what} failed{on}: {type(culprit).__name__}: {culprit} ({where})"


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of the tensors of this rank's state dict (a DTensor's local shard)."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def _fsync_files(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
