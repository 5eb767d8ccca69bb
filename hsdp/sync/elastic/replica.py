"""ElasticReplica: one rank's elastic life on torchft, the training loop's `Membership` of an elastic run.

The one object that owns the replica's phase (phase.py has the table of phases and transitions): it builds the mesh
with the torchft transport, joins (a fresh run's meeting, or a restart's heal), catches up after a heal at a param
sync (spectate, fetch, skip), rejoins after a cut, keeps the straggler bound's cuts, and reports. The parts it
drives: transport.py (the rounds; quorum.py settles their members), heal.py (what crosses to a healing peer),
straggler.py (elastic.round_timeout_s), manager.py (torchft's Manager), faults.py (elastic.faults). Its join is a
walk through `JoinStep`s, each a method returning the next. It meets the engine only through `ReplicaState`.

A restarted replica behind the live ones heals at their next sync round: inside a grad-sync round it takes the state
there and joins the round; at a param-sync round it heals out of band (`_catch_up`):

1. spectate that round: take part in its collectives with a part that does not count (the peers need every quorum
   member in them), keep nothing;
2. fetch the peer's state after that round while the peers train on (the slow part behind a slow link) and load it:
   params, inner optimizer, θ_g, outer momentum, step;
3. train the rest of the period from there and contribute to the peers' next round like any of them: the steps the
   peers trained while the state crossed (the fetch's time over the peer's pace, sent with its offer) are skipped, so
   the peers do not wait for this replica at that round.

If its source is lost before its state is loaded (heal.py), it heals again from another live peer. A replica cut off
mid-run pauses at its sync (quorum.py); when a quorum answers and the peers went on without it, that quorum heals it,
and the same catch-up follows after the round it began as its own sync (docs/design.md §9).

After the last step's sync every replica closes the run (`_close`, closing.py): rounds that meet the others and
compare their models, in which one behind heals whole, until all of them hold one model (or, if they cannot, one
line: ReplicasDiffer), so the final eval and the summary see the run's one final model.
"""

from __future__ import annotations

import enum
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from hsdp.comm.groups import Comm
from hsdp.comm.mesh import Mesh, build_elastic_mesh
from hsdp.config.schema import Config
from hsdp.core import timeline
from hsdp.sync.elastic.closing import Records, RunClose, closes_level
from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.heal import HealState, SourceLost
from hsdp.sync.elastic.lighthouse import lighthouse_unreachable, others_heartbeat, quorum_status
from hsdp.sync.elastic.manager import build_manager
from hsdp.sync.elastic.phase import Heal, Phase, PhaseLog
from hsdp.sync.elastic.quorum import RoundSettings
from hsdp.sync.elastic.straggler import RoundBound
from hsdp.sync.elastic.transport import FTTransport, lost_in_touched_steps
from hsdp.sync.schedule import fragments_due
from hsdp.sync.seam import ReplicaPolicy, ReplicaSeat, ReplicaState


class JoinStep(enum.Enum):
    """The walk of `ElasticReplica.join`: each step a method of the replica that returns the next one.

    meet          ask for a quorum (a fresh run's meeting, or a restart's heal) → by how it healed this
                  replica: healed whole, healed out of band, healed in the round; else count (a fresh
                  run) or fail (a restart finding no live peer)
    count         a fresh run's meeting that healed nobody → joined (every replica came) or meet again
    healed whole  by a replica closing the run: its final state, nothing left to train → joined
    out of band   a peer's offer at a param sync: catch up (spectate, fetch, skip) → joined
    in the round  the peer's state crossed inside its round (a grad-sync round, or before training) → joined
    """

    MEET = "meet"
    COUNT = "count"
    WHOLE = "healed whole"
    OUT_OF_BAND = "out of band"
    IN_ROUND = "in the round"
    JOINED = "joined"


@dataclass
class _Join:
    """What the join's steps share: the step it would train from, whether this is the replica's first start
    (a restart must find a live peer), when it began and how long a fresh run waits for all replicas; `step`:
    the step to train from, once joined."""

    start: int
    fresh: bool
    t0: float
    wait_s: float
    step: int = -1


class ElasticReplica(PhaseLog):
    """Replica `seat.replica` (its `seat.restart`-th start) of an elastic run, meeting the others at
    `seat.lighthouse`: its own mesh with the torchft transport as its sync group, its join and heals, its
    own metrics files. Its phase (PhaseLog) changes only through `enter`, along phase.py's table."""

    def __init__(self, cfg: Config, seat: ReplicaSeat) -> None:
        super().__init__()
        self.cfg, self.replica, self.restart, self.lighthouse = cfg, seat.replica, seat.restart, seat.lighthouse
        self.metrics_suffix = f".replica{seat.replica}"  # each replica writes its own metrics and summary
        self.timeout = timedelta(seconds=cfg.elastic.timeout_s)
        self.bound = RoundBound(cfg.elastic.round_timeout_s)  # the straggler bound (straggler.py)
        self._round_steps = [s for s in range(cfg.run.steps) if fragments_due(s, cfg.sync)]
        self._mesh: Optional[Mesh] = None
        self._transport: Optional[FTTransport] = None  # built with the mesh (its manager needs the replica's world)
        self._faults: Optional[FaultPoints] = None
        self._heal: Optional[HealState] = None
        self._rounds_seen = 0  # the transport's rounds before the current step's
        self.step_held: list[bool] = []  # per step this process ran: it held a sync round
        self.step_touched: list[bool] = []  # per step: a failure touched or dropped one of its rounds
        # the join and the catch-up after a heal
        self.spectated = 0  # rounds this replica took part in without counting (catching up after a heal)
        self.skipped = 0  # steps of the heal's period not trained (the peers trained them while the state crossed)
        self.contributes_from: Optional[int] = None  # the step whose round a healed replica first counts in
        self.retries = 0  # heals begun again because the source was lost before its state was loaded
        self.joined_s = 0.0
        # rejoins after a cut
        self.resume_at: Optional[int] = None  # the step to train next, after a rejoin
        self.heals_seen = 0
        self.rejoins = 0  # times this replica was cut off mid-run and healed from a live one when back
        self.paused_s = 0.0  # the quorum waits of the rounds it rejoined in: paused at its sync, cut off
        # the run's close (`_close`), once; the last round's drops before it and the steps it weighs (to redo it)
        self.last, self._closed = cfg.run.steps - 1, False
        self._records: Optional[Records] = None
        self._dropped_before: Optional[int] = None
        self._since_sync: Optional[list[int]] = None
        self.closing_heals = 0  # healed whole from a replica closing the run (at its join, or after a cut)
        self.closer: Optional[RunClose] = None  # the close, once begun

    # ------------------------------------------------------------ the parts, once built
    @property
    def mesh(self) -> Mesh:
        assert self._mesh is not None, "the replica's mesh is built first (build_mesh)"
        return self._mesh

    @property
    def transport(self) -> FTTransport:
        assert self._transport is not None, "the replica's transport is built with its mesh"
        return self._transport

    @property
    def heal(self) -> HealState:
        assert self._heal is not None, "the replica's heal state is built with its mesh"
        return self._heal

    @property
    def policy(self) -> ReplicaPolicy:
        return self.heal.seam.policy

    # ------------------------------------------------------------ starting → joining
    def build_mesh(self, device: torch.device) -> Mesh:
        """The replica's own world as its mesh, with the torchft transport as its sync group."""
        c = self.cfg
        m = c.mesh
        self._mesh = build_elastic_mesh(self.replica, m.sync, m.shard, device, m.timeout_s, self._build, m.replicate)
        return self._mesh

    def _build(self, comm: Comm, site_rank: int) -> FTTransport:
        """This rank's faults, heal state, torchft manager and transport (its manager heartbeats from here)."""
        cfg = self.cfg
        faults = FaultPoints(
            cfg.elastic.faults, cfg.mesh.sync, self.replica, self.restart, site_rank, cfg.run_dir, cfg.mesh.timeout_s
        )
        faults.at("start", 0)
        self._faults = faults
        self._records = Records(cfg.run_dir, self.replica, site_rank)
        self._records.forget_own()  # an earlier launch's: this life has not closed
        self._heal = HealState(self, faults, self.replica, light=cfg.elastic.heal == "global")
        site = cfg.mesh.replicate * cfg.mesh.shard  # the replica's (a site's) own world: its manager's group
        manager, pg = build_manager(cfg, self.replica, site_rank, site, self.lighthouse, self._heal)
        settings = RoundSettings(
            partition_timeout_s=cfg.elastic.partition_timeout_s,
            heartbeat_window_s=cfg.elastic.timeout_s,  # for a restarted lighthouse's heartbeats (quorum.py)
            lighthouse_unreachable=lambda: lighthouse_unreachable(self.lighthouse, cfg.elastic.timeout_s),
            lighthouse_status=lambda: quorum_status(self.lighthouse, cfg.elastic.timeout_s),
            spectating=lambda: self.heal.spectating,
            on_cut=self._on_cut,
            bound=self.bound,
            faults=faults,
        )
        self._transport = FTTransport(manager, pg, comm, settings)
        timeline.mark("manager")
        self.enter(Phase.JOINING, "its manager heartbeats")
        return self._transport

    def _on_cut(self, cut: bool) -> None:
        """The transport found no quorum (`cut`), or one again: training ⇄ cut off (healing, if it healed)."""
        if cut and self.phase is Phase.TRAINING:
            self.enter(Phase.CUT_OFF, "no quorum answers")
        elif not cut and self.phase is Phase.CUT_OFF:
            self.enter(Phase.TRAINING, "a quorum answers again")

    def logs(self, mesh: Mesh) -> bool:
        return mesh.shard_rank == 0 and mesh.replicate_rank == 0  # each replica's (site's) first rank

    def join(self, state: ReplicaState, start_step: int) -> int:
        """The first quorum: the step to train from.

        A replica behind the live ones (restarted) heals from one at their next sync round (module docstring).
        A fresh run starts once all mesh.sync replicas are in the quorum (replicas that start later, e.g. on
        other machines, are waited for up to the longer of mesh.timeout_s and elastic.partition_timeout_s: a
        slow machine's start is not a failure): a replica must not race ahead alone from the initial weights.
        A walk through `JoinStep`s, each a method returning the next, until joined.
        """
        heal, transport = self.heal, self.transport
        heal.state, heal.step = state, start_step - 1
        wait_s = max(self.cfg.mesh.timeout_s, self.cfg.elastic.partition_timeout_s)
        walk = _Join(start_step, fresh=self.restart == 0, t0=time.perf_counter(), wait_s=wait_s)
        walks: dict[JoinStep, Callable[[_Join], JoinStep]] = {
            JoinStep.MEET: self._meet,
            JoinStep.COUNT: self._count,
            JoinStep.WHOLE: self._healed_whole,
            JoinStep.OUT_OF_BAND: self._healed_out_of_band,
            JoinStep.IN_ROUND: self._healed_in_round,
        }
        at = JoinStep.MEET
        while at is not JoinStep.JOINED:
            at = walks[at](walk)
        self.joined_s = time.perf_counter() - walk.t0
        timeline.mark("healed")
        transport.joined_at = transport.rounds  # elastic.faults count this life's rounds from here
        if heal.heals and self.mesh.shard_rank == 0 and self.mesh.replicate_rank == 0:
            print(
                f"elastic: replica {self.replica} healed from a live replica at its step {heal.healed_to}, "
                f"training from step {walk.step}",
                file=sys.stderr,
                flush=True,
            )
        return walk.step

    def _meet(self, walk: _Join) -> JoinStep:
        """Ask for a quorum; what follows is how that quorum healed this replica (its heal's state)."""
        manager, heal = self.transport.manager, self.heal
        if walk.fresh:  # torchft's step is the training step resumed at: one resumed behind heals from one ahead
            manager.load_state_dict({**manager.state_dict(), "step": walk.start})
        self.transport.begin_round()
        timeline.mark("quorum")  # the first answered (a fresh run's later meetings keep it)
        if heal.stage is Heal.LOADED:
            return JoinStep.WHOLE if heal.final else JoinStep.IN_ROUND
        if heal.stage is Heal.OFFERED:  # a peer serves its state once this round closes (healing now)
            return JoinStep.OUT_OF_BAND
        if not walk.fresh:
            raise RuntimeError(
                f"replica {self.replica} was restarted but found no live replica to heal from "
                "(the others finished or died); it would train alone from the initial weights"
            )
        return JoinStep.COUNT

    def _count(self, walk: _Join) -> JoinStep:
        """A fresh run's meeting that healed nobody: joined once every replica came; else met again (0.2 s on),
        up to the wait."""
        transport = self.transport
        transport.commit_round()
        if (transport.participants or 0) >= self.cfg.mesh.sync:
            walk.step = walk.start
            self.enter(Phase.TRAINING, "every replica met")
            return JoinStep.JOINED
        if time.perf_counter() - walk.t0 > walk.wait_s:
            raise RuntimeError(
                f"only {transport.participants} of mesh.sync={self.cfg.mesh.sync} replicas joined within "
                f"{walk.wait_s:g} s (the longer of mesh.timeout_s and elastic.partition_timeout_s); a fresh "
                "elastic run starts with all of them"
            )
        time.sleep(0.2)
        return JoinStep.MEET

    def _healed_whole(self, walk: _Join) -> JoinStep:
        """Healed whole by a replica closing the run: its final state, nothing left to train."""
        self.transport.commit_round()  # that round (its members disagreed on closing: dropped everywhere)
        walk.step = self.cfg.run.steps
        self.closing_heals += 1
        self.enter(Phase.TRAINING, "healed from a replica closing the run: its final state")
        return JoinStep.JOINED

    def _healed_out_of_band(self, walk: _Join) -> JoinStep:
        """A peer's offer at a param sync: spectate its round, fetch its state, skip what the peers trained."""
        walk.step = self._catch_up()
        return JoinStep.JOINED

    def _healed_in_round(self, walk: _Join) -> JoinStep:
        """The peer's state crossed inside its round (begun after its step t): train from t + 1."""
        heal, transport = self.heal, self.transport
        t = heal.healed_to
        assert t is not None, "a loaded heal knows its step"
        if heal.peer_joining:
            transport.commit_round()  # the peer's join round, which it commits too
        elif self.policy.grad_sync(t + 1):
            pass  # the peers' round is step t+1's grads: left open, this replica's step t+1 joins it
        elif not self.policy.start_due(t, joined=True):
            transport.commit_round()  # the peers' round had nothing to sync at t
        walk.step = t + 1
        self.enter(Phase.TRAINING, f"healed inside the peers' round at their step {t}")
        return JoinStep.JOINED

    # ------------------------------------------------------------ healing (out of band) → training
    def _catch_up(self, spectated: bool = False) -> int:
        """Heal out of band from the peers' param-sync round this replica was just healed into (begun after
        their step t); returns the step to train from. `spectated`: that round ran already (a replica that
        rejoined after a cut ran it as its own sync)."""
        cfg, heal, policy = self.cfg, self.heal, self.policy
        last = cfg.run.steps - 1
        policy.start_global_copy()  # a θ_g for the first round's Δ (not counted, and replaced by the fetch)
        assert heal.stage is Heal.OFFERED, "a catch-up begins at a peer's offer"
        while heal.stage is Heal.OFFERED:  # offered → fetching → loaded, or source lost → offered (another source)
            offer = heal.take_offer()
            t, pace = offer.step, offer.pace
            if not spectated:
                self._spectate(t)
            spectated = False
            at = min(t + cfg.sync.delay, last)  # the round lands τ steps after it began (or at the end)
            closed = time.perf_counter()
            lost: Optional[SourceLost] = None
            self.faults.at("before_fetch", self.transport.fault_round(self.transport.rounds))
            try:
                state = heal.fetch(offer, at, cfg.mesh.timeout_s, self.timeout)
            except SourceLost as e:
                lost = e
            # The replica's ranks heal again together, or none does (the peer may have died between their fetches).
            if self._replica_max(lost is not None):
                why = str(lost or "the source of another of its ranks was lost")
                print(
                    f"elastic: replica {self.replica}: {why}; asking the quorum for another",
                    file=sys.stderr,
                    flush=True,
                )
                heal.source_lost(why)
                self._heal_again()
            else:
                heal.load_full(state)
        if heal.final:  # its source lost, the quorum asked again met peers closing the run: their final state
            self.transport.commit_round()  # that round (its members disagreed on closing: dropped everywhere)
            self.closing_heals += 1
            self.enter(Phase.TRAINING, "healed again, from a replica closing the run: its final state")
            return cfg.run.steps
        self.enter(Phase.TRAINING, f"caught up: the state after the peers' step {at} loaded")
        following = next((s for s in range(at + 1, cfg.run.steps) if fragments_due(s, cfg.sync)), None)
        if following is None:  # the peers sync no more: train on alone to the end, as they do
            return at + 1
        # Every rank of the replica trains the same steps (their shard and in-site collectives pair up): the
        # largest lag's.
        self.skipped = self._replica_max(steps_behind(time.perf_counter() - closed, pace, following - at))
        self.contributes_from = following
        return at + 1 + self.skipped

    @property
    def faults(self) -> FaultPoints:
        assert self._faults is not None
        return self._faults

    def _spectate(self, step: int) -> None:
        """The peers' round begun after `step` (already begun here), run through to its land: the one place
        the wing drives the sync policy's round (a healing replica's round; the engine drives every other)."""
        if self.policy.start_due(step, joined=True):
            self.policy.finish()  # τ > 0: land it now; the peers land it τ steps later, with the same mean
        else:
            self.transport.commit_round()
        self.spectated += 1

    def _replica_max(self, value: int) -> int:
        """The largest `value` among this replica's ranks: its own world, every shard and (on a three-level mesh)
        every in-site replica, since all of them must train the same steps and heal together."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.heal.seam.held[0].device)
        self.transport.comm.all_reduce(t, "world", op=dist.ReduceOp.MAX)
        return int(t.item())

    def _heal_again(self) -> None:
        """Its source lost (heal.py): set its torchft step back, so the quorum asked now heals it again from a live
        peer (its offer is what _catch_up continues with; or, from peers closing the run, their final state
        whole). A quorum whose heal failed in torchft (it named the lost source again, its death not yet seen by
        the lighthouse: dropped) is asked again, up to mesh.timeout_s; one with no other replica: one line."""
        manager, transport, heal = self.transport.manager, self.transport, self.heal
        self.retries, t0 = self.retries + 1, time.perf_counter()
        while True:
            manager.load_state_dict({**manager.state_dict(), "step": 0})
            transport.begin_round()
            if heal.stage is Heal.OFFERED or (heal.stage is Heal.LOADED and heal.final):
                return
            error = manager.errored()
            if heal.stage is Heal.LOADED or transport.size < 2 or error is None:
                raise RuntimeError(
                    f"replica {self.replica} lost the replica it was healing from and found no other to heal from "
                    "out of band"
                )
            transport.commit_round()  # the round its heal failed in (dropped)
            why = str(error.original_exception).splitlines()[0][:200]
            if time.perf_counter() - t0 > self.cfg.mesh.timeout_s:
                raise RuntimeError(
                    f"replica {self.replica}: no heal within mesh.timeout_s after its source was lost: {why}"
                )
            print(
                f"elastic: replica {self.replica}: the heal failed ({why}); asking again", file=sys.stderr, flush=True
            )

    # ------------------------------------------------------------ training: the loop's duties
    def steps(self, start: int, end: int) -> Iterator[int]:
        """`start`, `start + 1`, ... before `end`; after a rejoin, the step it healed to instead of the next."""
        self.heals_seen = self.heal.heals  # the join's heal (a restarted replica) is not a rejoin
        step = start
        while step < end:
            yield step
            step, self.resume_at = (step + 1 if self.resume_at is None else self.resume_at), None
        # No last step here (healed whole to the run's end, at its join or after a cut): close it now (after
        # the last step, `after_sync` has closed it already).
        self._close()

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
        mine = ahead and not self.policy.grad_sync(step) and b.past_deadline()
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
        if step == self.last:  # the close asks whether the last round committed, and may do it again
            policy = self.policy
            self._dropped_before = policy.dropped
            since = getattr(policy, "since_sync", None)  # the steps the round weighs (sync.weighting=tokens)
            self._since_sync = list(since) if since is not None else None

    def after_sync(self, step: int) -> None:
        self.bound.armed = False
        heals = self.heal.heals
        self._rejoin_if_healed(step)
        if step == self.last and self.heal.heals == heals and self._dropped_before is not None:
            # its own last round (healed in place, the state it loaded says): did it land here?
            self.heal.applied_last = self.policy.dropped == self._dropped_before
        self.heal.serve(step, self.transport, self.timeout)
        t, first = self.transport, self._rounds_seen
        self.step_held.append(len(t.touched) > first)
        self.step_touched.append(t.failure_in_rounds_since(first))
        self._rounds_seen = len(t.touched)
        if step == self.last:
            self._close()  # before the final eval: every replica evaluates the run's one final model

    def _rejoin_if_healed(self, step: int) -> None:
        """Its peers' quorum healed it while training (cut off and back, or a round behind them): the round it
        began as its own sync ran with it spectating; finish the heal in place and continue at the step it
        healed to, instead of a restart."""
        heal = self.heal
        if heal.stage is Heal.OFFERED:  # healed out of band: the round it came in is over (spectated)
            self.paused_s += self.transport.quorum_waits[-1]  # that round's quorum: the pause
            self.policy.finish()  # τ > 0: that round lands now, as a restarted replica's spectated round does
            self.resume_at = self._catch_up(spectated=True)
            self.heals_seen, self.rejoins = heal.heals, self.rejoins + 1
            print(
                f"elastic: rejoined after a cut: healed from a live replica at its step {heal.healed_to}, "
                f"training on from step {self.resume_at} (this replica was at {step + 1})",
                file=sys.stderr,
                flush=True,
            )
        elif heal.heals > self.heals_seen and heal.final:
            # Healed whole by a replica closing the run (this one was behind it): the run's final state, so
            # nothing is left to train; the round it came in was dropped on every side.
            self.heals_seen = heal.heals
            self.closing_heals += 1
            if step < self.last:
                self.resume_at = self.cfg.run.steps
            print(
                f"elastic: healed from a replica closing the run (its state after step {heal.healed_to}); this "
                f"replica was at step {step}",
                file=sys.stderr,
                flush=True,
            )
        elif heal.heals > self.heals_seen:
            # Healed inside a grad-sync round (the warmup): the peer's state replaced this replica's in the
            # middle of its own step. Rare (a cut inside the warmup) and not worth a second path: a restart
            # heals it cleanly.
            raise RuntimeError(
                f"rejoined after a cut inside a grad-sync round (step {step}, the warmup): restarting to heal"
            )

    # ------------------------------------------------------------ closing the run: one model at the end
    def _close(self) -> None:
        """After the run's last step (its sync landed): meet the other replicas until every one holds one model
        (closing.py `RunClose`); nothing to do where the run ends apart by design. Once."""
        if self._closed:
            return
        self._closed = True
        if not closes_level(self.cfg):
            return
        assert self._records is not None, "the close's records are set up with the mesh"
        self.closer = RunClose(
            self.cfg,
            self.replica,
            self._records,
            self.transport,
            self.heal,
            self.policy,
            catch_up=lambda spectated: self._catch_up(spectated=spectated),
            replica_max=self._replica_max,
            logs=self.logs(self.mesh),
            counted=self.mesh.replicate_rank == 0,
            since_sync=self._since_sync,
        )
        self.closer.run()

    # ------------------------------------------------------------ reporting, leaving
    def step_tokens(self, tokens_per_step: int) -> tuple[int, int]:
        """(the run's tokens this step, as this replica counts them: one replica's share per replica counted
        in its last sync; this replica's own share). Before its first sync: every replica."""
        share = tokens_per_step // self.cfg.mesh.sync
        counted = self.transport.participants or self.cfg.mesh.sync
        return counted * share, share

    def step_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"replicas": self.transport.participants}  # the replicas counted in the last sync
        if self.bound.enabled:
            record["cut_steps"] = self.bound.cut_steps  # steps skipped so far to keep the round bound
        return record

    def stats(self, step_times: list[float]) -> dict[str, Any]:
        """`step_times`: this process's steps' times (the last ones of the run's, aligned with its steps)."""
        t, heal = self.transport, self.heal
        n = len(self.step_held)
        times = list(step_times[len(step_times) - n :]) if n else []
        return {
            "heals": heal.heals,
            "heal_fetches": heal.fetches,  # peers' states fetched out of band: their wall time and tensor bytes
            **{"heal_fetch_s": round(heal.fetch_s, 3), "heal_fetch_bytes": heal.fetch_bytes},
            "spectated_rounds": self.spectated,
            # healed out of band: the steps of that period it did not train, the step whose round it first
            # counted in, and how often its heal began again (its source lost before the load)
            "heal_skipped_steps": self.skipped,
            "heal_contributes_from": self.contributes_from,
            "heal_retries": self.retries,
            # whose state it loaded last, the sources its heals tried in order, the time from a lost one to a load
            "heal_source": heal.source_replica,
            "heal_sources": heal.tried,
            "heal_lost_s": round(heal.lost_s, 3),
            # the rounds held after this life's join; the join's meetings (a fresh replica meets alone until its
            # peers start, a restarted one heals in the peers' round) vary with start-up times and are apart
            "sync_rounds": t.rounds - (t.joined_at or 0) - (self.closer.rounds if self.closer else 0),
            "join_meetings": t.joined_at or 0,
            "dropped_syncs": self.policy.dropped,
            "elastic_touched_rounds": t.touched_rounds(),
            "elastic_round_quorums": t.quorums,  # per round: [torchft step, quorum size, contributors]
            "elastic_phases": [f"{phase}: {why}" for phase, why in self.history],  # this life's transitions
            "elastic_faults": self.faults.fired,  # elastic.faults done by this rank
            # what its peers' failures cost this replica: its failure-touched steps beyond its usual sync step
            "elastic_lost_s": round(lost_in_touched_steps(times, self.step_held, self.step_touched), 3),
            "elastic_quorum_lost_s": round(t.lost_s(), 3),  # the part spent waiting for quorums
            # what agreeing on a quorum costs per round (each grad-sync step is one round)
            "quorum_median_s": round(statistics.median(t.quorum_waits), 4) if t.quorum_waits else None,
            "join_s": round(self.joined_s, 3),
            **timeline.summary(),  # this life's start by phase: a restart's from its death to its first trained step
            # cut off mid-run (a partition, a lost lighthouse): rejoins, pauses
            "rejoins": self.rejoins,
            "rejoin_paused_s": round(self.paused_s, 3),
            "quorum_failures": t.quorum.failures,
            "lighthouse_restarts_seen": t.quorum.lighthouse_restarts,  # found by its quorum id going back
            "quorum_failed_s": round(t.quorum.failed_s, 3),
            # the straggler bound (elastic.round_timeout_s): rounds that counted a late replica out, this
            # replica's own late rounds, and the local steps it skipped to arrive within the bound
            "late_rounds": self.bound.late_rounds,
            "own_late_rounds": self.bound.own_late_rounds,
            "cut_steps": self.bound.cut_steps,
            # the run's close (docs/design.md §9.7, "The close"): its meetings and their time, the replicas it
            # closed with, the last round done again, whole heals from a closing replica, and the verdict
            **(self.closer.stats() if self.closer else {"closing_verdict": None}),
            "closing_heals": self.closing_heals + (self.closer.heals if self.closer else 0),
        }

    def sync_wait_s(self) -> float:
        """Its quorums' waits: where a replica that arrives first waits for the others (torchft's quorum)."""
        return float(sum(self.transport.quorum_waits))

    def shutdown(self) -> None:
        self.enter(Phase.LEAVING, "the run is over")
        # peers healing from this replica's last round fetch its state before its server stops
        alive = functools.partial(others_heartbeat, self.lighthouse, self.cfg.elastic.timeout_s)
        self.heal.linger(self.cfg.mesh.timeout_s, self.logs(self.mesh), alive)
        self.transport.manager.shutdown(wait=False)


def steps_behind(lag_s: float, pace_s: Optional[float], period: int) -> int:
    """How many of the `period` steps up to the peers' next round a healed replica skips: the steps the peers
    trained (at `pace_s` a step) in the `lag_s` it spent fetching its state, so both reach that round
    together. At least one step is left to train (a fetch longer than the period makes the peers wait for
    the rest, which is what a spectated round would cost them too); none skipped without a pace."""
    if not pace_s or pace_s <= 0:
        return 0
    return min(math.floor(lag_s / pace_s + 0.5), period - 1)  # the nearest whole step
