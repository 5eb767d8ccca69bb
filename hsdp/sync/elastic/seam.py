"""The torchft seam: what the elastic wing calls of torchft, and nothing more (docs/design.md §9).

torchft ships no types, so these Protocols say which of its methods the wing relies on: a version that
changes one of them changes this file. (The engine's seam is hsdp/sync/seam.py, `ReplicaState`.)

    Manager     torchft.manager.Manager: the quorum, the step, the commit, a round's errors, its all-reduce
    ProcessGroup  its reconfigurable gloo group (torch_compat.elastic_gloo_group): the all-gathers
    Work        what a collective hands back (hsdp/comm/transport.py's `Work`: `wait()`)
    Errored     what `Manager.errored()` returns: the error reported in the current round
    Snapshots   torchft's HTTP checkpoint transport: this rank's server of its state for a peer healing out of
                band, and the client that fetches a peer's (manager.py builds it, heal.py uses it)

manager.py builds the Manager, its group and the Snapshots (`build_manager`); transport.py and quorum.py drive
the first two, heal.py serves and fetches through the last. State dicts stay `dict[str, Any]`: tensors and
numbers by name, as torchft's are.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Protocol

import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from hsdp.comm.transport import Work

__all__ = ["Errored", "Manager", "ProcessGroup", "Snapshots", "Work"]


class Errored(Protocol):
    """torchft's ExceptionWithTraceback: the error a round's collective (or this replica) reported."""

    @property
    def original_exception(self) -> BaseException: ...


class Manager(Protocol):
    """The methods of torchft's `Manager` the wing calls (one per rank; its group is the rank's sync group)."""

    def start_quorum(self, *, timeout: Optional[timedelta] = None) -> None:
        """Ask the lighthouse for this round's quorum; heals this replica (load_state_dict) if it is behind."""

    def num_participants(self) -> int:
        """The replicas in the current quorum."""

    def participating_rank(self) -> Optional[int]:
        """This replica's rank in the current quorum (None: not in it)."""

    def current_step(self) -> int:
        """torchft's step: the rounds committed (a healed replica takes its peer's)."""

    def errored(self) -> Optional[Errored]:
        """The error reported in the current round, if any (its collectives are no-ops then)."""

    def report_error(self, e: Exception) -> None:
        """Fail the current round on this replica: it will not commit."""

    def should_commit(self) -> bool:
        """After a round's last collective: whether every participant got through it."""

    def allreduce(self, tensor: torch.Tensor, *, reduce_op: torch.distributed.ReduceOp.RedOpType) -> Work:
        """The round's all-reduce over the quorum (a no-op once the round errored)."""

    def state_dict(self) -> dict[str, int]:
        """Its own state: the step (and torchft's bookkeeping)."""

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Set its own state: the wing sets the step (a fresh run's, a heal begun again, a closing meeting)."""

    def shutdown(self, wait: bool = True) -> None:
        """Stop heartbeating and serving."""


class ProcessGroup(Protocol):
    """torchft's reconfigurable process group, as the wing uses it: a round's all-gathers."""

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensor: list[torch.Tensor], opts: AllgatherOptions
    ) -> Work:
        """Every member's `input_tensor[0]` into `output_tensors[0]` (one chunk per member, in quorum order)."""


class Snapshots(Protocol):
    """torchft's HTTP checkpoint transport: serves this rank's state and fetches a peer's (heal.py)."""

    def address(self) -> str:
        """Where a peer fetches this rank's state (manager.py advertises the route to the lighthouse)."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta) -> None:
        """Publish `state_dict` as this rank's state after `step` (step -1 and {}: drop the copy)."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict[str, Any]:
        """The state a peer published after `step` at the address `metadata`."""
