"""The engine interface every training engine implements (`build_engine` is in registry.py).

`train.py` drives any engine the same way (docs/design.md §13):

    engine = build_engine(cfg, mesh)              # model built, sharded/wrapped; syncs through mesh.sync_transport
    optimizer = build_optimizer(engine.named_parameters(), cfg.optim, engine.row_sharding())
    for step ...:
        engine.begin_step(step)                   # the sync policy decides: grads across replicas?
        loss = engine.forward_backward(batches)   # micro-batches; grads reduced once, on the last
        update = engine.commit_grads()            # False: the step's grad round did not commit (elastic)
        engine.clip_grad_norm_(max_norm)
        if update: optimizer.step()
        engine.zero_grad()
        synced = engine.end_step(step)            # the sync policy's param sync, if due
    engine.finish()                               # land a param sync still in flight

Checkpoints (hsdp/run/checkpoint/, docs/design.md §12.1) go through two methods, and an
engine never names a checkpoint key (the checkpoint package lays them out):
`checkpoint_state(optimizer)` is this rank's state by role, an `EngineState`
(params, inner optimizer state, the sync policy's state_dict with its buffers
cut per param; sharded tensors as DTensors of their full shape, so DCP reshards
on load), and `load_checkpoint(optimizer, saved)` builds an `EngineState` of
load targets shaped after `saved.meta`, has `saved.load` fill them in place
(one `dcp.load`) and installs them.

Engines (hsdp/engines/registry.py maps `mesh.engine` to a class): `hsdp` (this
project, eager: hsdp/engines/hsdp.py; compiled: hsdp/engines/compiled.py), `fsdp2`
and `ddp` (PyTorch baselines: hsdp/engines/baselines.py). An engine class also
answers, before any engine exists, what the config and a checkpoint need to know:
`supports_compile` / `supports_periodic_sync` / `supports_replicate` (read by
registry.check_engine_config), `state_per_replica` (whether each replica's params are its own in a
checkpoint) and `check_checkpoint`.
Baselines always average grads across every rank, so their policy is `NoSync`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
import torch.nn as nn

from hsdp.comm.mesh import Mesh
from hsdp.config.schema import Config
from hsdp.models.gpt import loss_fn
from hsdp.models.muon import RowSharding
from hsdp.sync.policy import NoSync, Sync, SyncPolicy

Batch = tuple[torch.Tensor, torch.Tensor]  # (input ids, targets)


@dataclass
class EngineState:
    """An engine's checkpointable state, by role (the checkpoint package names the keys, hsdp/run/checkpoint/keys.py).

    The tensors are the engine's own (saved from, or loaded into, in place)."""

    model: dict[str, Any]  # param name → tensor (a DTensor of the param's full shape where sharded)
    # The inner optimizer's state: param name → {state name → tensor} (state_per_replica engines), else
    # torch's optimizer state dict as get_state_dict gives it.
    optim: dict[str, Any]
    sync_meta: Optional[dict[str, Any]] = None  # the policy state_dict's JSON "meta" (None: the engine keeps none)
    sync_buffers: dict[str, dict[str, Any]] = field(default_factory=dict)  # buffer → param name → piece
    replica_own: frozenset[str] = frozenset()  # sync buffers that differ between replicas


@dataclass(frozen=True)
class SavedCheckpoint:
    """What an engine's `load_checkpoint` needs to know about the checkpoint it reads."""

    meta: dict[str, Any]  # the saving engine's `engine_meta` (meta.json): {"sync": its policy's meta}, or {}
    load: Callable[[EngineState], None]  # fills an EngineState of targets in place (one dcp.load)


class Engine(ABC):
    """A model on a mesh: forward/backward over micro-batches, grads reduced, a sync policy's seam."""

    name: ClassVar[str]  # mesh.engine's value (the compiled hsdp engine shares "hsdp": same state)
    supports_compile: ClassVar[bool] = False  # compile.enabled is allowed
    supports_periodic_sync: ClassVar[bool] = False  # sync.warmup_steps < run.steps is allowed
    supports_replicate: ClassVar[bool] = False  # mesh.replicate > 1: replicas inside a site (three-level mesh)
    sync_class: ClassVar[type[NoSync | SyncPolicy]] = NoSync  # the policy class whose checkpoint state it saves
    state_per_replica: ClassVar[bool] = False  # each replica's params/optimizer state are its own (hsdp)
    mesh: Mesh
    policy: Sync

    # ------------------------------------------------------------ what an engine class answers before it exists
    @classmethod
    @abstractmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> Engine:
        """The model built and wrapped on `mesh` with the config's sync policy (one phase: ready to train)."""

    @classmethod
    def check_checkpoint(cls, path: Path, meta: dict[str, Any], saved: Config, cfg: Config) -> None:
        """ConfigError unless a run configured by `cfg` can resume this engine's checkpoint `meta`."""
        cls.sync_class.check_resume(meta["engine_meta"].get("sync", {}), meta["step"], saved.sync, cfg.sync, path)

    # ------------------------------------------------------------ what each engine provides
    @abstractmethod
    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of token ids (training or eval forward)."""

    @abstractmethod
    def set_reduce_grads(self, reduce: bool) -> None:
        """False on non-final micro-steps: grads accumulate locally and are reduced once per step."""

    @abstractmethod
    def set_grad_sync(self, sync_grads: bool) -> None:
        """Whether this step's grads are averaged across the sync group too (exact HSDP / warmup)."""

    @abstractmethod
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """What the optimizer updates, under the model's own names (held shards for hsdp)."""

    def row_sharding(self) -> Optional[RowSharding]:
        """How the params of `named_parameters` split each matrix's rows over ranks (None: each is whole)."""
        return None

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global grad norm (0: only measure it); returns the norm before clipping."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This replica's full fp32 params on CPU, under `hsdp.models.gpt.GPT`'s names."""

    @abstractmethod
    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> EngineState:
        """This rank's state by role: params, inner optimizer state, sync-policy state.

        Tensors alias the live state (save before training on). Sharded state is a
        DTensor of the full shape, so a checkpoint loads onto another shard layout.
        """

    @abstractmethod
    def load_checkpoint(self, optimizer: torch.optim.Optimizer, saved: SavedCheckpoint) -> None:
        """Restore what `checkpoint_state` saved (possibly from another mesh.shard or mesh.sync): build the
        targets after `saved.meta`, `saved.load(targets)`, install them."""

    def replicas_identical(self, step: int) -> bool:
        """Whether every replica holds the same params after `step` (then a checkpoint may load
        onto another mesh.sync): the sync policy's answer."""
        return self.policy.replicas_identical(step)

    def held_buffers(self) -> list[torch.Tensor]:
        """This rank's held shard of each unit (flat fp32, unit order), the tensors themselves: what an elastic
        replica sends a peer that heals from it and overwrites in place when it heals (hsdp/sync/elastic/).
        None for the baselines: they hold no shards of their own (and run no elastic replicas)."""
        return []

    # ------------------------------------------------------------ the step, shared by all engines
    def forward_backward(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward over the step's micro-batches; returns the step's mean loss (detached)."""
        total = torch.zeros((), device=self.mesh.device)
        for i, (x, y) in enumerate(batches):
            self.set_reduce_grads(i == len(batches) - 1)
            loss = loss_fn(self(x), y) / len(batches)
            loss.backward()
            total += loss.detach()
        return total

    def begin_step(self, step: int) -> None:
        self.set_grad_sync(self.policy.backward_grad_sync(step))

    def commit_grads(self) -> bool:
        """After the backward: False if this step must not update (a grad round of a transport that may
        fail, which did not commit; only the hsdp engines have one, see HSDPEngine.commit_grads)."""
        return True

    def end_step(self, step: int) -> bool:
        """After the optimizer update of `step`: the policy's param sync; True if one happened."""
        return self.policy.after_step(step)

    def finish(self) -> None:
        """End of training: land whatever the policy still has in flight."""
        self.policy.finish()

    def stats(self) -> dict[str, Any]:
        """Engine-specific figures for summary.json (e.g. compile time)."""
        return {}

    def artifacts(self) -> dict[str, str]:
        """Extra files for the run folder, name → text (e.g. the compiled schedule.txt)."""
        return {}
