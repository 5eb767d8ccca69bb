"""ElasticMembership: this rank's replica on torchft, as the training loop's `Membership`."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

from hsdp.comm.groups import Comm
from hsdp.comm.mesh import Mesh, build_elastic_mesh
from hsdp.config.schema import Config
from hsdp.sync.elastic.heal import HealState
from hsdp.sync.elastic.join import Join
from hsdp.sync.elastic.lighthouse import lighthouse_unreachable
from hsdp.sync.elastic.manager import build_manager
from hsdp.sync.elastic.rejoin import Rejoin
from hsdp.sync.elastic.straggler import RoundBound
from hsdp.sync.elastic.transport import FTTransport, lost_in_touched_steps
from hsdp.sync.schedule import fragments_due


class ElasticMembership:
    """Replica `replica` (its `restart`-th start) of an elastic run, meeting the others at `lighthouse`: its own
    mesh with the torchft transport as its sync group, the join and heal, its own metrics files."""

    def __init__(self, cfg: Config, replica: int, restart: int, lighthouse: str) -> None:
        self.cfg, self.replica, self.restart, self.lighthouse = cfg, replica, restart, lighthouse
        self.heal = HealState()
        self.bound = RoundBound(cfg.elastic.round_timeout_s)  # the straggler bound (straggler.py)
        self.mesh: Mesh = None
        self._round_steps = [s for s in range(cfg.run.steps) if fragments_due(s, cfg.sync)]
        self.transport: FTTransport = None  # built with the mesh (its manager needs the replica's world)
        self.joining: Join = None
        self.metrics_suffix = f".replica{replica}"  # each replica writes its own metrics and summary
        self._rounds_seen = 0  # the transport's rounds before the current step's
        self.step_held: list[bool] = []  # per step this process ran: it held a sync round
        self.step_touched: list[bool] = []  # per step: a failure touched or dropped one of its rounds

    def build_mesh(self, device: torch.device) -> Mesh:
        """The replica's own world as its mesh, with the torchft transport as its sync group."""
        c = self.cfg
        self.mesh = build_elastic_mesh(
            self.replica, c.mesh.sync, c.mesh.shard, device, c.mesh.timeout_s, self._transport
        )
        return self.mesh

    def _transport(self, comm: Comm, shard_rank: int) -> FTTransport:
        manager, pg = build_manager(self.cfg, self.replica, shard_rank, self.cfg.mesh.shard, self.lighthouse, self.heal)
        self.transport = FTTransport(
            manager,
            pg,
            comm,
            spectating=lambda: self.heal.spectating,
            partition_timeout_s=self.cfg.elastic.partition_timeout_s,
            bound=self.bound,
            lighthouse_unreachable=lambda: lighthouse_unreachable(self.lighthouse, self.cfg.elastic.timeout_s),
            heartbeat_window_s=self.cfg.elastic.timeout_s,  # the lighthouse's heartbeat timeout (run/elastic.py)
        )
        self.joining = Join(self.cfg, self.replica, self.restart, self.transport, self.heal)
        self.rejoin = Rejoin(self.joining, self.heal)  # after a cut: heal and continue at the peers' step
        return self.transport

    def logs(self, mesh: Mesh) -> bool:
        return mesh.shard_rank == 0  # each replica's first rank

    def join(self, engine: Any, optimizer: torch.optim.Optimizer, start_step: int) -> int:
        """Meet the live replicas: a restarted replica heals from one and continues at its step."""
        return self.joining.join(engine, optimizer, start_step)

    def steps(self, start: int, end: int) -> Iterator[int]:
        return self.rejoin.steps(start, end)

    def cut(self, step: int, last_step_s: Optional[float]) -> bool:
        """Whether this replica skips `step`'s training to reach its next param round within the bound
        (elastic.round_timeout_s; `last_step_s`: the previous step's time if it trained). Agreed over the
        replica's ranks (any rank past its deadline cuts them all): they must skip the same steps."""
        b = self.bound
        if not b.enabled:
            return False
        if last_step_s is not None:
            b.trained(last_step_s)
        ahead = any(s >= step for s in self._round_steps)  # a round to go to (not the run's unsynced tail)
        mine = ahead and not self.heal.engine.policy.grad_sync(step) and b.past_deadline()
        flag = torch.tensor([1.0 if mine else 0.0])
        self.mesh.comm.all_reduce(flag, "world", op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            b.cut_this_period = True
            b.cut_steps += 1
            return True
        return False

    def before_sync(self, step: int) -> None:
        self.heal.at_step(step)  # what a peer healing at this step's sync gets, and the pace it keeps up with
        self.bound.armed = True  # a round begun in this step's end_step is a param-sync round

    def after_sync(self, step: int) -> None:
        self.bound.armed = False
        # Its peers' quorum healed it while training (cut off and back, or a round behind them): the round it
        # began as its own sync ran with it spectating; finish the heal in place (rejoin.py) and continue at
        # the step it healed to, instead of a restart.
        self.rejoin.after_sync(step, self.heal.engine.policy)
        self.heal.serve(step, self.transport, self.joining.timeout)
        t, first = self.transport, self._rounds_seen
        self.step_held.append(len(t.touched) > first)
        self.step_touched.append(t.failure_in_rounds_since(first))
        self._rounds_seen = len(t.touched)

    def step_tokens(self, tokens_per_step: int) -> tuple[int, int]:
        """(the run's tokens this step, as this replica counts them: one replica's share per replica counted
        in its last sync; this replica's own share). Before its first sync: every replica."""
        share = tokens_per_step // self.cfg.mesh.sync
        counted = self.transport.participants or self.cfg.mesh.sync
        return counted * share, share

    def step_record(self) -> dict[str, Any]:
        record = {"replicas": self.transport.participants}  # the replicas counted in the last sync
        if self.bound.enabled:
            record["cut_steps"] = self.bound.cut_steps  # steps skipped so far to keep the round bound
        return record

    def stats(self, step_times: list[float]) -> dict[str, Any]:
        """`step_times`: this process's steps' times (the last ones of the run's, aligned with its steps)."""
        t = self.transport
        n = len(self.step_held)
        times = list(step_times[len(step_times) - n :]) if n else []
        return {
            "heals": self.heal.heals,
            "heal_fetches": self.heal.fetches,  # peers' states fetched out of band
            "heal_fetch_s": round(self.heal.fetch_s, 3),
            "spectated_rounds": self.joining.spectated,
            # healed out of band: the steps of that period it did not train, the step whose round it first
            # counted in, and how often its heal began again (the serving peer died before the fetch)
            "heal_skipped_steps": self.joining.skipped,
            "heal_contributes_from": self.joining.contributes_from,
            "heal_retries": self.joining.retries,
            "sync_rounds": t.rounds,
            "dropped_syncs": self.heal.engine.policy.dropped,
            "elastic_touched_rounds": t.touched_rounds(),
            "elastic_round_quorums": t.quorums,  # per round: [torchft step, quorum size, contributors]
            # what its peers' failures cost this replica: its failure-touched steps beyond its usual sync step
            "elastic_lost_s": round(lost_in_touched_steps(times, self.step_held, self.step_touched), 3),
            "elastic_quorum_lost_s": round(t.lost_s(), 3),  # the part spent waiting for quorums
            # what agreeing on a quorum costs per round (each grad-sync step is one round)
            "quorum_median_s": round(statistics.median(t.quorum_waits), 4) if t.quorum_waits else None,
            "join_s": round(self.joining.joined_s, 3),
            **self.rejoin.stats(),  # cut off mid-run (a partition, a lost lighthouse): rejoins, pauses
            # the straggler bound (elastic.round_timeout_s): rounds that counted a late replica out, this
            # replica's own late rounds, and the local steps it skipped to arrive within the bound
            "late_rounds": self.bound.late_rounds,
            "own_late_rounds": self.bound.own_late_rounds,
            "cut_steps": self.bound.cut_steps,
        }

    def shutdown(self) -> None:
        self.transport.manager.shutdown(wait=False)
