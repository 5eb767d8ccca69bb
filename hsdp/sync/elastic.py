"""The sync group on torchft: replicas that die and rejoin (elastic.enabled, docs/design.md §11).

Each replica is its own torch.distributed world of `mesh.shard` ranks. Shard rank r of every replica
holds the same slice of the model, so rank r's torchft `Manager` joins the quorum of the r-th ranks of
all live replicas (replica id `replica_<m>`), and its reconfigurable gloo group carries the sync
collectives among them. `FTTransport` is that group behind the policy's `Transport` protocol:

    begin_round   manager.start_quorum()   who takes part; a replica behind the others heals here
    all_reduce    manager.allreduce(SUM)   (all-gather: the group's allgather)
    commit_round  manager.should_commit()  False if any participant failed: the policy drops the round

Healing: the state a replica needs to continue exactly where a live peer is (`HealState`): its held
shards, the inner optimizer's state, the sync policy's state (θ_g, outer momentum; nothing is in
flight at the start of a round) and the training step. The LR and the data stream are functions of
the step and of the replica's own rank, so both are right once the step is. At a param sync the state
crosses outside the round (`ElasticReplica.catch_up`): the healed replica spectates that round and the
next (its part not counted: `FTTransport.contributors`), fetching the state in between, so the live
replicas never wait for it to cross a slow link.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from hsdp.comm.groups import Comm, ring_bytes_of
from hsdp.comm.mesh import Mesh, build_elastic_mesh
from hsdp.config.schema import Config
from hsdp.sync.schedule import fragments_due


class _Done:
    """A finished collective (torchft already waited, or an errored manager made it a no-op)."""

    def wait(self) -> None:
        pass


class _Guarded:
    """An allgather on torchft's group whose failure is reported to the manager instead of raised."""

    def __init__(self, work: Any, manager: Any) -> None:
        self.work, self.manager = work, manager

    def wait(self) -> None:
        if self.work is None:
            return
        try:
            self.work.wait()
        except Exception as e:  # a peer died mid-collective: the round will not commit
            self.manager.report_error(e)
        self.work = None


class FTTransport:
    """The sync collectives among the live replicas' ranks of one shard position, through torchft."""

    may_fail = True

    def __init__(self, manager: Any, pg: Any, comm: Comm) -> None:
        self.manager, self.pg, self.comm = manager, pg, comm
        self.rounds = 0
        self.participants: Optional[int] = None  # the last round's contributors (quorum less spectators)
        self.participating = True  # False: this replica spectates its rounds (a part of zeros, not counted)
        self._contributors: list[int] = [0]
        self.quorum_waits: list[float] = []  # seconds each begin_round waited for its quorum
        # per round: did a failure touch it (the quorum changed size, a replica spectated, or the round
        # before was dropped)? Only those rounds' waits count as lost (lost_s), not the peers' usual jitter.
        self.touched: list[bool] = []
        self._last_size: Optional[int] = None
        self._last_dropped = False
        self.dropped_s = 0.0  # wall time of rounds that did not commit, after their quorum
        self._round_start = 0.0
        self.open = False  # a round has begun and not been committed (e.g. one a healed replica joined)

    @property
    def size(self) -> int:
        return self.manager.num_participants()

    @property
    def contributors(self) -> list[int]:
        return self._contributors

    def begin_round(self) -> None:
        if self.open:
            return
        self.open = True
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self._round_start = time.perf_counter()  # the quorum's wait is counted in quorum_waits, not twice
        self.quorum_waits.append(self._round_start - t0)
        self._contributors = self._agree_contributors()
        self.participants = len(self._contributors)
        size = self.size
        changed = self._last_size is not None and size != self._last_size
        self.touched.append(changed or self.participants < size or self._last_dropped)
        self._last_size, self._last_dropped = size, False
        self.rounds += 1

    def _agree_contributors(self) -> list[int]:
        """Which of the round's replicas count in its means: each says whether it spectates (one float each,
        all-gathered). Only this replica knows it is spectating (ElasticReplica.catch_up)."""
        n = self.size
        mine = torch.tensor([1.0 if self.participating else 0.0])
        if n == 1:
            return [0]  # alone (a spectator's peer died: its zero part stands, the round changes nothing)
        flags = torch.zeros(n)
        # Not counted in the sync bytes: control traffic, like the quorum's own messages.
        self._guarded_all_gather(flags, mine).wait()
        if self.manager.errored():  # the round is lost already: count everyone, its result is never applied
            return list(range(n))
        return [i for i in range(n) if flags[i] > 0]

    def commit_round(self) -> bool:
        self.open = False
        error = self.manager.errored()
        ok = bool(self.manager.should_commit())
        if not ok:
            self.dropped_s += time.perf_counter() - self._round_start
            self._last_dropped = True
            why = f"{type(error.original_exception).__name__}: {error.original_exception}" if error else "a peer failed"
            print(f"elastic: sync round {self.rounds} dropped ({why})", file=sys.stderr)
        return ok

    def lost_s(self) -> float:
        """Wall time lost to peers' failures: the quorum waits beyond the usual (median) one in the rounds a
        failure touched (detection, a rejoin, a spectating replica), and dropped rounds. Untouched rounds'
        excess waits are the replicas' ordinary jitter, not counted: over 144 grad-sync rounds (one per
        step) they summed to several seconds on a loaded box, more than the failure itself cost."""
        usual = statistics.median(self.quorum_waits) if self.quorum_waits else 0.0
        touched = [w for w, t in zip(self.quorum_waits, self.touched, strict=True) if t]
        return sum(max(0.0, w - usual) for w in touched) + self.dropped_s

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> Any:
        if not self.participating:  # a spectator's part is zero (what torchft's allreduce does while healing)
            t.zero_()
        self.comm.count("sync", "all_reduce", ring_bytes_of("all_reduce", self.size, t.numel() * t.element_size()))
        work = self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM)
        if not async_op:
            work.wait()
            return _Done()
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Any:
        self.comm.count("sync", "all_gather", ring_bytes_of("all_gather", self.size, inp.numel() * inp.element_size()))
        work = self._guarded_all_gather(out, inp)
        if not async_op:
            work.wait()
        return work

    def _guarded_all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        if self.manager.errored():
            return _Done()  # the round is lost already; its result is never applied
        try:
            return _Guarded(self.pg.allgather([list(out.chunk(self.size))], [inp], AllgatherOptions()), self.manager)
        except Exception as e:
            self.manager.report_error(e)
            return _Done()


class HealState:
    """What a rejoining replica copies from a live peer (torchft's state_dict / load_state_dict pair).

    In a grad-sync round (one per step; the warmup) the state crosses inside the round, as torchft does.
    In a param-sync round it crosses outside it, so the live replicas never wait for it behind a slow
    link: torchft's heal carries only where to fetch it (`offer`); the peer serves its state once that
    round has closed (`publish`, from its own snapshot server, while it trains on) and the rejoining
    replica fetches it (`fetch`) and spectates the peers' next round to catch up (ElasticReplica.join).
    """

    def __init__(self) -> None:
        self.engine: Any = None  # attached once built (the transport, and so the manager, come first)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.snapshots: Any = None  # this rank's server of its state for a peer healing out of band (build_elastic)
        self.step = -1  # the last finished step (set by the training loop)
        self.training = False  # past the join (ElasticReplica.join): a peer healing now catches up out of band
        self.healed_to: Optional[int] = None  # set when a peer's state (or its offer) was loaded
        self.peer_joining = False  # the state came from a peer in its own join round (a resume: it was ahead)
        self.offer: Optional[tuple[str, int]] = None  # (a peer's snapshot address, the step its round began after)
        self.asked_at: Optional[int] = None  # a peer healed from this rank in the round begun after this step
        self.served_round: Optional[int] = None  # the round after which the served state was published
        self.heals = 0
        self.fetch_s = 0.0  # wall time fetching peers' state out of band

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a peer healing in the round begun after `step` (torchft's quorum thread
        calls it while the training thread waits in begin_round)."""
        if not self.training or self.engine.policy.grad_sync(self.step + 1) or self.snapshots is None:
            # Before training (a fresh run's replicas meeting: the initial state) or in a grad round (every
            # step is one): the state crosses inside the round.
            return self.full_state()
        self.asked_at = self.step
        return {"step": self.step, "snapshot": self.snapshots.address()}

    def full_state(self) -> dict[str, Any]:
        # Copies: they are sent from another thread while this replica trains on.
        policy = copy.deepcopy(self.engine.policy.state_dict())
        thetas = self._global_params(policy)
        return {
            # A unit whose params are θ_g (just after its sync) is not sent twice: a fifth less behind a slow link.
            "held": [
                None if g is not None and torch.equal(u.held_flat, g) else u.held_flat.detach().clone()
                for u, g in zip(self.engine.units, thetas, strict=True)
            ],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "policy": policy,
            "step": self.step,
            "joining": not self.training,  # the round the state crosses in is this rank's join round
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's state, or its offer to serve it (torchft calls this on the training thread, in begin_round)."""
        if "snapshot" in state:
            self.offer = (state["snapshot"], int(state["step"]))
            self.healed_to = int(state["step"])
            return
        self.load_full(state)

    def _global_params(self, policy_state: dict[str, Any]) -> list[Optional[torch.Tensor]]:
        """θ_g per unit from a policy state dict (None for each unit where the policy keeps none)."""
        return policy_state.get("global_params") or [None] * len(self.engine.units)

    @torch.no_grad()
    def load_full(self, state: dict[str, Any]) -> None:
        for u, held, g in zip(self.engine.units, state["held"], self._global_params(state["policy"]), strict=True):
            u.held_flat.copy_(g if held is None else held)
        self.optimizer.load_state_dict(state["optimizer"])
        self.engine.policy.load_state_dict(state["policy"])
        self.step = self.healed_to = int(state["step"])
        self.peer_joining = bool(state.get("joining", False))
        self.heals += 1

    def publish(self, step: int, round_: int, timeout: timedelta) -> None:
        """Serve this rank's state after `step` to the peer that healed from it (fetched while training on)."""
        self.snapshots.send_checkpoint(dst_ranks=[], step=step, state_dict=self.full_state(), timeout=timeout)
        self.asked_at, self.served_round = None, round_

    def unpublish(self, timeout: timedelta) -> None:
        """Drop the served copy (the peer has caught up: a later round closed)."""
        self.snapshots.send_checkpoint(dst_ranks=[], step=-1, state_dict={}, timeout=timeout)
        self.served_round = None

    def fetch(self, url: str, step: int, wait_s: float, timeout: timedelta) -> dict[str, Any]:
        """A peer's state after `step`, once it serves it (it publishes when its round has closed)."""
        t0 = time.perf_counter()
        while True:
            try:
                state = self.snapshots.recv_checkpoint(src_rank=0, metadata=url, step=step, timeout=timeout)
                self.fetch_s += time.perf_counter() - t0
                return state
            except Exception as e:  # 400: still serving an older state; a refused or cut connection
                if time.perf_counter() - t0 > wait_s:
                    raise RuntimeError(f"no state of step {step} from {url} within {wait_s:g} s: {e}") from e
                time.sleep(0.05)


class ElasticReplica:
    """This rank's part of an elastic run: its replica's mesh, the torchft transport, the join and heal."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.replica = int(os.environ["HSDP_REPLICA"])  # set by the launcher (hsdp/run/elastic.py)
        self.heal = HealState()
        self.transport: Optional[FTTransport] = None
        self.joined_at = 0.0
        self.spectated = 0  # rounds this replica took part in without counting (catching up after a heal)
        self.timeout = timedelta(seconds=cfg.elastic.timeout_s)

    def mesh(self, device: torch.device) -> Mesh:
        """The replica's own mesh, with the torchft transport as its sync group."""
        c = self.cfg
        mesh = build_elastic_mesh(self.replica, c.mesh.sync, c.mesh.shard, device, c.mesh.timeout_s)
        self.transport = build_elastic(c, self.replica, mesh.shard_rank, mesh.shard_size, mesh.comm, self.heal)
        mesh.sync_transport = self.transport
        return mesh

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
        fresh = int(os.environ.get("HSDP_RESTART", "0")) == 0
        manager = self.transport.manager
        while True:
            if fresh:  # torchft's step is the training step resumed at: one resumed behind heals from one ahead
                manager.load_state_dict({**manager.state_dict(), "step": start_step})
            self.transport.begin_round()
            if self.heal.offer is not None:  # a peer serves its state once this round closes
                step = self.catch_up(engine.policy)
                break
            if self.heal.healed_to is not None:  # healed inside the peers' round
                t = self.heal.healed_to
                if self.heal.peer_joining:
                    self.transport.commit_round()  # the peer's join round, which it commits too
                elif engine.policy.grad_sync(t + 1):
                    pass  # the peers' round is step t+1's grads: left open, this replica's step t+1 joins it
                elif not engine.policy.start_due(t, joined=True):
                    self.transport.commit_round()  # the peers' round had nothing to sync at t
                step = t + 1
                break
            if not fresh:
                raise RuntimeError(
                    f"replica {self.replica} was restarted but found no live replica to heal from "
                    "(the others finished or died); it would train alone from the initial weights"
                )
            self.transport.commit_round()
            if self.transport.participants >= self.cfg.mesh.sync:
                step = start_step
                break
            if time.perf_counter() - t0 > self.cfg.mesh.timeout_s:
                raise RuntimeError(
                    f"only {self.transport.participants} of mesh.sync={self.cfg.mesh.sync} replicas joined within "
                    f"mesh.timeout_s={self.cfg.mesh.timeout_s:g}; a fresh elastic run starts with all of them"
                )
            time.sleep(0.2)
        self.joined_at = time.perf_counter() - t0
        self.heal.training = True
        return step

    def catch_up(self, policy: Any) -> int:
        """Heal out of band, from the peers' param-sync round this replica was just healed into (begun after
        their step t); returns the step to train from.

        1. Spectate that round: take part in its collectives with a part that does not count (the peers
           need every quorum member in them), keep nothing.
        2. Fetch the peer's state after that round while the peers train on (the slow part behind a slow
           link: nobody waits for it) and load it: params, inner optimizer, θ_g, outer momentum, step.
        3. Spectate the peers' next round: its mean Δ takes this replica's θ_g and momentum exactly where
           the peers' are, and its params to θ_g (τ = 0, or α = 0), then train on with everyone.
        If the peers reached that next round first, they healed this replica again there: start over.
        """
        cfg, transport = self.cfg, self.transport
        last = cfg.run.steps - 1
        transport.participating = False
        policy.start_global_copy()  # a θ_g for the first round's Δ (not counted, and replaced in step 2)
        while True:
            url, t = self.heal.offer
            self.heal.offer = None
            self._spectate(policy, t)
            at = min(t + cfg.sync.delay, last)  # the round lands τ steps after it began (or at the end)
            self.heal.load_full(self.heal.fetch(url, at, cfg.mesh.timeout_s, self.timeout))
            following = next((s for s in range(at + 1, cfg.run.steps) if fragments_due(s, cfg.sync)), None)
            if following is None:  # the peers sync no more: train on alone to the end, as they do
                break
            # From here this replica can be a heal source itself (another replica restarted meanwhile): it
            # offers the round it is in and, once that round has closed, serves its state after it.
            self.heal.training, self.heal.step = True, following
            transport.begin_round()
            if self.heal.offer is not None:
                continue
            self._spectate(policy, following)
            self.heal.step = min(following + cfg.sync.delay, last)
            self.after_step(self.heal.step)
            break
        transport.participating = True
        return self.heal.step + 1

    def _spectate(self, policy: Any, step: int) -> None:
        """The peers' round begun after `step` (already begun here), run through to its land."""
        if policy.start_due(step, joined=True):
            policy.finish()  # τ > 0: land it now; the peers land it τ steps later, with the same mean
        else:
            self.transport.commit_round()
        self.spectated += 1

    def after_step(self, step: int) -> None:
        """After the training loop's sync: serve this rank's state to a peer that healed from it in a round
        that has now closed, and drop that copy once a later round closed (the peer caught up)."""
        h, transport = self.heal, self.transport
        if transport.open:
            return
        if h.asked_at is not None and step >= h.asked_at:
            h.publish(step, transport.rounds, self.timeout)
        elif h.served_round is not None and transport.rounds > h.served_round:
            h.unpublish(self.timeout)

    def step_record(self) -> dict[str, Any]:
        return {"replicas": self.transport.participants}

    def stats(self) -> dict[str, Any]:
        return {
            "heals": self.heal.heals,
            "heal_fetch_s": round(self.heal.fetch_s, 3),  # fetching a peer's state, out of band
            "spectated_rounds": self.spectated,
            "sync_rounds": self.transport.rounds,
            "dropped_syncs": self.heal.engine.policy.dropped,
            "elastic_lost_s": round(self.transport.lost_s(), 3),
            # what agreeing on a quorum costs per round (each grad-sync step is one round)
            "quorum_median_s": round(statistics.median(self.transport.quorum_waits), 4)
            if self.transport.quorum_waits
            else None,
            "join_s": round(self.joined_at, 3),
        }

    def shutdown(self) -> None:
        self.transport.manager.shutdown(wait=False)


def build_elastic(cfg: Config, replica: int, shard_rank: int, shard: int, comm: Comm, heal: HealState) -> FTTransport:
    """This rank's torchft Manager (over its replica group's store) and the transport on top of it."""
    from torchft.manager import Manager  # lazy: only elastic runs need torchft
    from torchft.process_group import ProcessGroupGloo

    # torchft's checkpoint transport deserialises a peer's state from a read-only buffer, which torch warns
    # about on each heal; the tensors are copied into this replica's own buffers at once.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")

    timeout = timedelta(seconds=cfg.elastic.timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    # Where the peers reach this replica (its manager, and its state for a peer that heals from it).
    host = "127.0.0.1" if not cfg.elastic.lighthouse else address_towards(cfg.elastic.lighthouse)
    manager = Manager(
        pg=pg,
        load_state_dict=heal.load_state_dict,
        state_dict=heal.state_dict,
        min_replica_size=cfg.elastic.min_replicas,
        use_async_quorum=False,  # heal before the round's collectives, on the training thread
        init_sync=False,  # replicas start from the same seeded init: no copy at step 0
        timeout=timeout,
        # A quorum waits for the peers' next sync (up to sync.every steps away), not only for failures.
        quorum_timeout=timedelta(seconds=max(cfg.mesh.timeout_s, 6 * cfg.elastic.timeout_s)),
        connect_timeout=timeout,
        rank=shard_rank,
        world_size=shard,
        replica_id=f"replica_{replica}",
        lighthouse_addr=cfg.elastic.lighthouse or None,
        hostname=host,
        checkpoint_transport=_http_transport(timeout, host),
        heartbeat_interval=timedelta(milliseconds=100),
    )
    heal.snapshots = _http_transport(timeout, host)  # this rank's state, for a peer healing out of band
    return FTTransport(manager, pg, comm)


def _http_transport(timeout: timedelta, host: str):
    """torchft's HTTP checkpoint transport (heals), advertising `host` instead of this machine's hostname."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _Transport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]  # torchft's own server (private, as its address() uses)
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

    return _Transport(timeout=timeout, num_chunks=0)


def address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host: what the other replicas can reach it at.

    torchft advertises it for this replica's manager; the hostname (its default) may resolve to a
    loopback address (127.0.1.1 on Debian) or to an interface the peers cannot reach.
    """
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route and source address
        return s.getsockname()[0]
