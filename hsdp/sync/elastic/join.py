"""A replica's first quorum (`Join.join`), and the out-of-band catch-up of one healed at a param sync."""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from hsdp.config.schema import Config
from hsdp.sync.elastic.heal import HealState, PeerGone
from hsdp.sync.elastic.transport import FTTransport
from hsdp.sync.schedule import fragments_due


class Join:
    """How replica `replica` (its `restart`-th start) meets the live replicas over `transport`."""

    def __init__(self, cfg: Config, replica: int, restart: int, transport: FTTransport, heal: HealState) -> None:
        self.cfg, self.replica, self.restart = cfg, replica, restart
        self.transport, self.heal = transport, heal
        self.timeout = timedelta(seconds=cfg.elastic.timeout_s)
        self.spectated = 0  # rounds this replica took part in without counting (catching up after a heal)
        self.skipped = 0  # steps of the heal's period not trained (the peers trained them while the state crossed)
        self.contributes_from: Optional[int] = None  # the step whose round a healed replica first counts in
        self.retries = 0  # heals begun again because the serving peer died before its state was fetched
        self.joined_s = 0.0

    def join(self, engine: Any, optimizer: torch.optim.Optimizer, start_step: int) -> int:
        """The first quorum: the step to train from.

        A replica behind the live ones (restarted) heals from one at their next sync round: inside a
        grad-sync round it takes the state there and joins the round; at a param-sync round it catches up
        out of band (`catch_up`). A fresh run starts once all mesh.sync replicas are in the quorum (replicas
        that start later, e.g. on other machines, are waited for up to mesh.timeout_s): a replica must not
        race ahead alone from the initial weights.
        """
        self.heal.engine, self.heal.optimizer, self.heal.step = engine, optimizer, start_step - 1
        t0 = time.perf_counter()
        fresh = self.restart == 0
        transport, manager = self.transport, self.transport.manager
        while True:
            if fresh:  # torchft's step is the training step resumed at: one resumed behind heals from one ahead
                manager.load_state_dict({**manager.state_dict(), "step": start_step})
            transport.begin_round()
            if self.heal.offer is not None:  # a peer serves its state once this round closes
                step = self.catch_up(engine.policy)
                break
            if self.heal.healed_to is not None:  # healed inside the peers' round
                t = self.heal.healed_to
                if self.heal.peer_joining:
                    transport.commit_round()  # the peer's join round, which it commits too
                elif engine.policy.grad_sync(t + 1):
                    pass  # the peers' round is step t+1's grads: left open, this replica's step t+1 joins it
                elif not engine.policy.start_due(t, joined=True):
                    transport.commit_round()  # the peers' round had nothing to sync at t
                step = t + 1
                break
            if not fresh:
                raise RuntimeError(
                    f"replica {self.replica} was restarted but found no live replica to heal from "
                    "(the others finished or died); it would train alone from the initial weights"
                )
            transport.commit_round()
            if transport.participants >= self.cfg.mesh.sync:
                step = start_step
                break
            if time.perf_counter() - t0 > self.cfg.mesh.timeout_s:
                raise RuntimeError(
                    f"only {transport.participants} of mesh.sync={self.cfg.mesh.sync} replicas joined within "
                    f"mesh.timeout_s={self.cfg.mesh.timeout_s:g}; a fresh elastic run starts with all of them"
                )
            time.sleep(0.2)
        self.joined_s = time.perf_counter() - t0
        self.heal.training = True
        return step

    def catch_up(self, policy: Any, spectated: bool = False) -> int:
        """Heal out of band, from the peers' param-sync round this replica was just healed into (begun after
        their step t); returns the step to train from.

        1. Spectate that round: take part in its collectives with a part that does not count (the peers
           need every quorum member in them), keep nothing.
        2. Fetch the peer's state after that round while the peers train on (the slow part behind a slow
           link) and load it: params, inner optimizer, θ_g, outer momentum, step.
        3. Train the rest of the period from there and contribute to the peers' next round like any of
           them: the steps the peers trained while the state crossed (the fetch's time over the peer's pace,
           sent with its offer) are skipped, so the peers do not wait for this replica at that round.
        If the peer died before its state was fetched, this replica heals again at the next round.
        `spectated`: step 1 is done already (a replica that rejoined after a cut ran it as its own sync).
        """
        cfg, heal = self.cfg, self.heal
        last = cfg.run.steps - 1
        policy.start_global_copy()  # a θ_g for the first round's Δ (not counted, and replaced in step 2)
        while True:
            url, t, pace = heal.offer
            heal.offer = None
            if not spectated:
                self._spectate(policy, t)
            spectated = False
            at = min(t + cfg.sync.delay, last)  # the round lands τ steps after it began (or at the end)
            closed = time.perf_counter()
            gone = None
            try:
                state = heal.fetch(url, at, cfg.mesh.timeout_s, self.timeout)
            except PeerGone as e:
                gone = e
            # The replica's ranks heal again together, or none does (the peer may have died between their fetches).
            if self._replica_max(gone is not None):
                why = gone or "the replica serving another of its ranks is gone"
                print(f"elastic: replica {self.replica}: {why}; healing again at the next round", file=sys.stderr)
                self._heal_again()
                continue
            heal.load_full(state)
            break
        heal.spectating = False
        following = next((s for s in range(at + 1, cfg.run.steps) if fragments_due(s, cfg.sync)), None)
        if following is None:  # the peers sync no more: train on alone to the end, as they do
            return at + 1
        # Every rank of the replica trains the same steps (their shard collectives pair up): the largest lag's.
        self.skipped = self._replica_max(steps_behind(time.perf_counter() - closed, pace, following - at))
        self.contributes_from = following
        return at + 1 + self.skipped

    def _replica_max(self, value: int) -> int:
        """The largest `value` among this replica's ranks (its shard group, in its own world)."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.heal.engine.units[0].held_flat.device)
        self.transport.comm.all_reduce(t, "shard", op=dist.ReduceOp.MAX)
        return int(t.item())

    def _heal_again(self) -> None:
        """The peer serving this replica's state died: set its torchft step back, so the next round's quorum
        heals it again from a live peer (begun here; its offer is what catch_up continues with)."""
        manager = self.transport.manager
        manager.load_state_dict({**manager.state_dict(), "step": 0})
        self.heal.healed_to = None
        self.transport.begin_round()
        self.retries += 1
        if self.heal.offer is None:
            raise RuntimeError(
                f"replica {self.replica} lost the replica it was healing from and found no other to heal from"
            )

    def _spectate(self, policy: Any, step: int) -> None:
        """The peers' round begun after `step` (already begun here), run through to its land."""
        if policy.start_due(step, joined=True):
            policy.finish()  # τ > 0: land it now; the peers land it τ steps later, with the same mean
        else:
            self.transport.commit_round()
        self.spectated += 1


def steps_behind(lag_s: float, pace_s: Optional[float], period: int) -> int:
    """How many of the `period` steps up to the peers' next round a healed replica skips: the steps the peers
    trained (at `pace_s` a step) in the `lag_s` it spent fetching its state, so both reach that round
    together. At least one step is left to train (a fetch longer than the period makes the peers wait for
    the rest, which is what a spectated round would cost them too); none skipped without a pace."""
    if not pace_s or pace_s <= 0:
        return 0
    return min(math.floor(lag_s / pace_s + 0.5), period - 1)  # the nearest whole step
