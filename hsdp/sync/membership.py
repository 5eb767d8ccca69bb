"""This rank's membership of the replicas: its mesh and sync transport, its join, its duties around a sync.

The training loop calls a `Membership` unconditionally; `build_membership` picks the implementation once,
from the config:

    LocalMembership     the c10d sync group of one torch.distributed world: membership fixed for the run
    ElasticReplica      a replica of an elastic run on torchft (hsdp/sync/elastic/replica.py, docs/design.md §9)

Which replica a worker is and which start of it travel explicitly, as a `ReplicaSeat` the launcher hands
the worker (hsdp/run/replicas.py; under torchrun `enter_torchrun_replica`'s result).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional, Protocol

import torch

from hsdp.comm.mesh import Mesh, build_mesh
from hsdp.config.schema import Config
from hsdp.sync.seam import ReplicaSeat, ReplicaState


class Membership(Protocol):
    """What the training loop asks of this rank's place among the replicas."""

    metrics_suffix: str  # this process's metrics<suffix>.jsonl and summary<suffix>.json

    def build_mesh(self, device: torch.device) -> Mesh:
        """The mesh, built with its sync transport (the engine's policy syncs through it)."""

    def logs(self, mesh: Mesh) -> bool:
        """Whether this rank writes the metrics and summary files."""

    def join(self, state: ReplicaState, start_step: int) -> int:
        """Meet the other replicas before the first step; returns the step to train from."""

    def steps(self, start: int, end: int) -> Iterator[int]:
        """The steps this rank trains, from `start` to before `end`: one after another, except that an elastic
        replica that was cut off and rejoined continues at the step it healed to (later than the next), and one
        healed whole to the run's end by a closing peer trains none (it closes the run when they run out)."""

    def cut(self, step: int, last_step_s: Optional[float]) -> bool:
        """Whether to skip `step`'s training (forward, backward, update) and go on to its sync: a slow replica
        keeping elastic.round_timeout_s (`last_step_s`: the previous step's time if it trained, else None)."""

    def before_sync(self, step: int) -> None:
        """After `step`'s update, before its param sync."""

    def after_sync(self, step: int) -> None:
        """After `step`'s param sync (and the final land). After the run's last step, before the final eval, an
        elastic replica closes the run here: the replicas meet until they hold one model (closing.py)."""

    def step_record(self) -> dict[str, Any]:
        """Fields for a metrics record."""

    def step_tokens(self, tokens_per_step: int) -> tuple[int, int]:
        """(tokens the run trained this step as this rank counts them, tokens of the ranks whose metrics
        file this process writes), given the whole mesh's `tokens_per_step`."""

    def stats(self, step_times: list[float]) -> dict[str, Any]:
        """Fields for the summary (`step_times`: the run's step times, this process's steps last)."""

    def sync_wait_s(self) -> float:
        """Seconds this rank waited to agree on its rounds' members (an elastic run's quorums), besides the
        policy's own wait in the rounds' weight exchange."""

    def shutdown(self) -> None:
        """Leave the replicas (after the summary)."""


class LocalMembership:
    """One torch.distributed world of every rank: the c10d sync group, nothing to join or serve."""

    metrics_suffix = ""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    def build_mesh(self, device: torch.device) -> Mesh:
        m = self.cfg.mesh
        return build_mesh(m.sync, m.shard, device, m.timeout_s, m.replicate)

    def logs(self, mesh: Mesh) -> bool:
        return mesh.rank == 0

    def join(self, state: ReplicaState, start_step: int) -> int:
        return start_step

    def steps(self, start: int, end: int) -> Iterator[int]:
        return iter(range(start, end))

    def cut(self, step: int, last_step_s: Optional[float]) -> bool:
        return False  # every rank trains every step

    def before_sync(self, step: int) -> None:
        pass

    def after_sync(self, step: int) -> None:
        pass

    def step_record(self) -> dict[str, Any]:
        return {}

    def step_tokens(self, tokens_per_step: int) -> tuple[int, int]:
        return tokens_per_step, tokens_per_step  # every rank trains every step; rank 0's files cover them all

    def stats(self, step_times: list[float]) -> dict[str, Any]:
        return {}

    def sync_wait_s(self) -> float:
        return 0.0  # the c10d group has no quorum: a round's first collective is where it waits

    def shutdown(self) -> None:
        pass


def build_membership(cfg: Config, seat: Optional[ReplicaSeat]) -> Membership:
    """The membership `cfg` asks for; an elastic run's needs the worker's `seat` (from its launcher)."""
    if not cfg.elastic.enabled:
        return LocalMembership(cfg)
    if seat is None:
        raise RuntimeError("elastic.enabled: this worker was started without its replica seat (hsdp/run/launch.py)")
    from hsdp.sync.elastic.replica import ElasticReplica

    return ElasticReplica(cfg, seat)
