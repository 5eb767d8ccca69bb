"""Paced rounds (sync.every_s, docs/design.md §8.12): each replica trains the steps of a period that fit a
wall-time window, so no replica waits for a slower one beyond the window's end.

The schedule stays the step-counted one (schedule.py): a round starts after every H/P nominal steps (the
slots), and `sync.every` = H caps a period. Paced, a period's window is `every_s`/P seconds from the end
of the round that began it (its *meeting*: the end of the warmup, or the loop's first step after the
warmup when there was none, or a resume). Before each step of a
period the replica asks whether that step would end past the window (by its longest recent step: an
underrated step makes the others wait, an overrated one costs only this replica a step); if so it skips
the period's remaining nominal steps and goes to the round. Every period trains its first step. A replica
whose window fits more than H steps goes to the round after H and waits there: set H above the window's
steps at the fastest replica's pace.

A skipped step is not a lost batch: a replica's data position is the count of steps it trained
(`position`), so its stream goes on where it stopped. Its LR is the schedule's at the nominal step: every
replica follows the same schedule by rounds, whatever its speed. The round's outer mean weights each
replica's Δ by the steps it trained into it (the policy's ledger, sync.weighting=tokens).

The decision is agreed over the replica's own ranks (its shard group, and on a three-level mesh its site's
replicate group): they run one step's collectives together, so they skip the same steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from hsdp.comm.mesh import Mesh
from hsdp.config.schema import Config, SyncConfig
from hsdp.sync.schedule import fragments_due, grad_sync_due, last_round_step

RECENT_STEPS = 4  # the step-time estimate looks back this far: the machine's load changes


class Pacer:
    """One replica's paced periods: `cut(step)` says whether to skip a step; `met(step)` after each step's
    sync. `agree(flag)`: True if any of the replica's ranks says True (a MAX over its own ranks)."""

    def __init__(
        self,
        cfg: SyncConfig,
        steps: int,
        agree: Callable[[bool], bool],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg, self.agree, self.clock = cfg, agree, clock
        self.window_s = cfg.every_s / cfg.fragments
        self.last_round = last_round_step(steps, cfg)  # past it the run's unsynced tail: every step trains
        self.met_at: Optional[float] = None  # the period's start, on this rank's clock
        self.recent: list[float] = []  # the last trained steps' times (s)
        self.in_period = 0  # steps trained in this period
        self.cut_steps = 0  # nominal steps skipped so far (their batches stay in the stream)
        self.periods: list[int] = []  # steps trained in each finished paced period
        # Whether the run has yet to time a trained step: its first (a compile, cold caches) is left out of the
        # estimate, or it would starve the first window (a 30 s compile step would cut every step). Kept in a
        # checkpoint: a resumed run paces as the uninterrupted one did (its own first step is not left out).
        self.first_trained = True

    def position(self, step: int) -> int:
        """The data position of nominal `step`: the steps this replica trained before it."""
        return step - self.cut_steps

    def every_replica_trains(self, step: int) -> bool:
        """Whether no replica may skip `step`: the warmup's steps are lockstep rounds, the tail past the last
        round has no round to reach."""
        return grad_sync_due(step, self.cfg) or step > self.last_round

    def cut(self, step: int, last_step_s: Optional[float]) -> bool:
        """Whether to skip `step` (`last_step_s`: the previous step's time without its sync, if it trained)."""
        if last_step_s is not None and not grad_sync_due(step - 1, self.cfg):  # a warmup step waits for all
            if self.first_trained:  # this life's first step compiles and warms up: not the pace of the next
                self.first_trained = False
            else:
                self.recent = [*self.recent[1 - RECENT_STEPS :], last_step_s]
        if self.every_replica_trains(step):
            return False
        if self.met_at is None:  # no meeting yet (no warmup, or resumed): the window starts with the loop
            self.met_at = self.clock()
        late = (
            self.in_period > 0
            and self.met_at is not None
            and bool(self.recent)
            and self.clock() + max(self.recent) > self.met_at + self.window_s
        )
        if self.agree(late):
            self.cut_steps += 1
            return True
        self.in_period += 1
        return False

    def met(self, step: int) -> None:
        """After `step`'s sync: a round began (or the warmup ended) here, so a new period starts now."""
        w = self.cfg.warmup_steps
        began = bool(fragments_due(step, self.cfg)) and w is not None and step >= w
        if began or (w is not None and step == w - 1):
            if began:
                self.periods.append(self.in_period)
            self.met_at, self.in_period = self.clock(), 0

    def state_dict(self) -> dict[str, Any]:
        return {"cut_steps": self.cut_steps, "periods": list(self.periods), "first_trained": self.first_trained}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.cut_steps, self.periods = int(saved["cut_steps"]), list(saved["periods"])
        self.first_trained = bool(saved.get("first_trained", False))

    def stats(self) -> dict[str, Any]:
        """For summary.json: the steps skipped, and the steps trained in each paced period."""
        return {"paced_cut_steps": self.cut_steps, "paced_period_steps": self.periods}


def build_pacer(cfg: Config, mesh: Mesh) -> Optional[Pacer]:
    """This replica's Pacer when sync.every_s paces its rounds (None: step-counted rounds; a checkpoint restores
    its state, train.py's parts). Its ranks agree over the shard group and the site's replicate group."""
    if cfg.sync.every_s <= 0:
        return None

    def agree(flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=mesh.device)
        for group in ("shard", "replicate"):
            if mesh.comm.size(group) > 1:
                mesh.comm.all_reduce(t, group, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    return Pacer(cfg.sync, cfg.run.steps, agree)
