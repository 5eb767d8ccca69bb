"""The seams between a rank's training and its membership of the replicas (hsdp/sync/membership.py).

`ReplicaSeat` is what the launcher hands a worker (which replica, which start of it, where replicas meet);
`ReplicaState` is what the elastic wing may read and write of the engine's state when a replica heals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class ReplicaPolicy(Protocol):
    """What a replica's membership asks of the sync policy (hsdp/sync/policy.py): its state crosses to a
    healing peer, and a healed replica lands the round it spectated."""

    dropped: int  # rounds that did not commit

    def grad_sync(self, step: int) -> bool: ...
    def start_due(self, step: int, joined: bool = False) -> bool: ...
    def finish(self) -> list[int]: ...
    def start_global_copy(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class ReplicaState:
    """The seam between the engine and the replica's membership: what a heal may read and write, no more."""

    held: list[torch.Tensor]  # each unit's held shard (flat fp32, unit order): read, and written in place by a heal
    optimizer: torch.optim.Optimizer  # the inner optimizer (its state_dict crosses)
    policy: ReplicaPolicy  # the sync policy (its state_dict crosses)


@dataclass(frozen=True)
class ReplicaSeat:
    """An elastic worker's replica: its index, how many times it was restarted, where the replicas meet."""

    replica: int
    restart: int
    lighthouse: str
    # a restart's launcher-side marks (hsdp/core/timeline.py: killed, detected, restart), its worker's first
    marks: tuple[tuple[str, float], ...] = ()
