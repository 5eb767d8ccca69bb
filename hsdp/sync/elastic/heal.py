"""HealState: what a rejoining replica copies from a live peer, and this rank's server of it.

The state a replica needs to continue exactly where a live peer is: its held shards, the inner
optimizer's state, the sync policy's state (θ_g, outer momentum; nothing is in flight at the start of a
round) and the training step. The LR and the data stream are functions of the step and of the replica's
own rank, so both are right once the step is. With elastic.heal=global a state served out of band is
lighter: θ_g stands for the held shards and the inner optimizer's state is left out, so the healed replica
goes on through the period from θ_g with its own inner optimizer (its round's Δ covers fewer steps).

The heal's own state (`stage`, phase.py's heal table): none → offered (a peer's offer, out of band) →
fetching (the offer taken) → loaded, or source lost (it died, stopped, broke the transfer or serves no more)
→ offered again (another live peer's, from the next quorum; or loaded, whole, from one closing the run); none
or loaded → loaded (a state inside the round); loaded → offered (healed again).

What a source's snapshot server answers, and what the healing rank makes of it (`fetch`):

    the state of the step asked for           loaded (a transfer cut short fails to load: `END` is last)
    "serving −2 − t" (`promise`)              published at its offer (t: the offer's step), until its round
                                              has closed: wait, up to mesh.timeout_s (slowness)
    another step (−1: its copy dropped)       it serves this heal no more: lost
    refused; no answer within elastic.        dead; stopped or cut off; died or failed mid-transfer: lost
    timeout_s; a broken transfer
"""

from __future__ import annotations

import copy
import enum
import re
import socket
import statistics
import sys
import time
import urllib.error
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.phase import HEAL_TRANSITIONS, Checked, Heal, Life, Phase
from hsdp.sync.elastic.seam import Snapshots
from hsdp.sync.seam import ReplicaState

if TYPE_CHECKING:
    from hsdp.sync.elastic.transport import FTTransport


END = "end"  # the published state's last key: a tensor of its own, so its bytes come last in the transfer


class Offer(NamedTuple):
    """A peer's offer to serve its state out of band (what torchft's quorum carries at a param sync)."""

    url: str  # its snapshot server's address
    step: int  # the step its round began after
    pace: Optional[float]  # its median step time (None before two steps)
    replica: Optional[int] = None  # the serving peer (its replica index)


def promise(step: int) -> int:
    """The step a source's server says it serves between its offer (after its `step`) and the state: −2 − step
    (−1 is torchft's "nothing", a dropped copy): the healing rank waits while it reads this."""
    return -2 - step


class Source(enum.Enum):
    """Whose state a heal loaded last."""

    TRAINING = "a training peer"
    JOINING = "a peer in its own join round"  # a resume: it was ahead
    CLOSING = "a peer closing the run"  # the run's final state, nothing left to train


class HealState:
    """What a rejoining replica copies from a live peer (torchft's state_dict / load_state_dict pair).

    In a grad-sync round (one per step; the warmup) the state crosses inside the round, as torchft does.
    In a param-sync round it crosses outside it, so the live replicas never wait for it behind a slow
    link: torchft's heal carries only where to fetch it (`offer`); the peer serves its state once that
    round has closed (`serve`, from its own snapshot server, while it trains on) and the rejoining
    replica fetches it (`fetch`) and trains the rest of the period to contribute to the peers' next round
    (replica.py). An offer moves the replica's life to healing (`life`, the phase's one owner).
    """

    def __init__(
        self, life: Life, faults: Optional[FaultPoints] = None, replica: Optional[int] = None, light: bool = False
    ) -> None:
        self.life, self.faults, self.replica = life, faults, replica
        self.light = light  # elastic.heal=global: a state served out of band carries θ_g and the outer state only
        self.state: Optional[ReplicaState] = None  # the engine's seam, attached at the join
        # this rank's server of its state for a peer healing out of band, and its client (manager.py)
        self.snapshots: Optional[Snapshots] = None
        self.step = -1  # the last finished step (set by the training loop, through the membership)
        self._stage = Checked("elastic heal", HEAL_TRANSITIONS, Heal.NONE)
        self._offer: Optional[Offer] = None  # the last offer (`offer`: while it is not taken)
        self._healed_to = -1  # the step of the last offer or state (`healed_to`: None while none)
        self.source: Optional[Source] = None  # whose state was loaded last
        self.asked_at: Optional[int] = None  # a peer healed from this rank in the round begun after this step
        self.served_round: Optional[int] = None  # the round after which the served state was published
        self._serving_fault_round: Optional[int] = None  # that round's number for the during_serve point
        self._promised = 0  # the peers the last offer promised this rank's state to (`promised_to`)
        self.owed = 0  # the peers the published state is owed to (a source leaving at the end waits: `linger`)
        self.sent_whole = 0  # the published state's transfers sent whole (`sent`)
        self.heals = 0
        self.fetches = 0  # peers' states fetched out of band
        self.fetch_s = 0.0  # wall time fetching them
        self.fetch_bytes = 0  # the tensor bytes of the states fetched
        self.tried: list[Optional[int]] = []  # the sources whose offers this rank took, in order (replica indices)
        self.source_replica: Optional[int] = None  # the replica whose state was loaded last
        self.lost_s = 0.0  # wall time from giving up on a source to loading another's state
        self._lost_at: Optional[float] = None
        self._step_clock: deque[float] = deque(maxlen=9)  # when the last steps reached their sync (pace)
        # The run's close (replica.py `_close`): this replica closes (a peer behind gets its whole state inside
        # the round); whether its state holds the run's last param round (it committed it, or loaded a state
        # that did). Whether the state it loaded last is the run's final one: `final`.
        self.closing = False
        self.applied_last = True

    # ------------------------------------------------------------ the heal's state (phase.py's heal table)
    @property
    def stage(self) -> Heal:
        return self._stage.state

    @property
    def offer(self) -> Optional[Offer]:
        """A peer's offer not yet taken (None: none, or taken)."""
        return self._offer if self.stage is Heal.OFFERED else None

    @offer.setter
    def offer(self, value: None) -> None:
        """`offer = None`: take it (as `take_offer`; a test's stand-in for the catch-up does this)."""
        assert value is None, "an offer comes only in a quorum (load_state_dict)"
        self.take_offer()

    def take_offer(self) -> Offer:
        """offered → fetching: the catch-up takes the offer (spectates its round, then fetches the state)."""
        assert self._offer is not None, "an offer is taken only once one came"
        self._stage.enter(Heal.FETCHING, f"the offer after the peer's step {self._offer.step} taken")
        self.tried.append(self._offer.replica)
        return self._offer

    def source_lost(self, why: str) -> None:
        """fetching → source lost: the source died, stopped, broke the transfer or serves this heal no more (`why`);
        the next quorum heals this replica again, from another live peer."""
        self._stage.enter(Heal.LOST, why)
        self._lost_at = self._lost_at if self._lost_at is not None else time.perf_counter()

    @property
    def healed_to(self) -> Optional[int]:
        """The step of the peer's offer or state this rank healed to (None: no heal, or one begun again)."""
        return None if self.stage in (Heal.NONE, Heal.LOST) else self._healed_to

    @property
    def peer_joining(self) -> bool:
        """The state came from a peer in its own join round (a resume: it was ahead)."""
        return self.source is Source.JOINING

    @property
    def final(self) -> bool:
        """The state came from a peer closing the run: the run's final state."""
        return self.source is Source.CLOSING

    def _server(self) -> Snapshots:
        assert self.snapshots is not None, "the snapshot server is built with the manager (manager.py)"
        return self.snapshots

    @property
    def seam(self) -> ReplicaState:
        if self.state is None:
            raise RuntimeError("elastic heal: the replica's state is asked for before its join attached it")
        return self.state

    @property
    def training(self) -> bool:
        """Past the join: a peer healing now catches up out of band."""
        return self.life.has_trained

    @property
    def spectating(self) -> bool:
        """Healed out of band and not caught up: this replica spectates its rounds (FTTransport asks). Healing
        from the offer on, inside the quorum, so the round the offer came in already counts it out."""
        return self.life.phase is Phase.HEALING

    def at_step(self, step: int) -> None:
        """`step` finished its update and is about to sync: what a peer healing at its sync gets, and when
        (the pace a healing peer keeps up with)."""
        self.step = step
        self._step_clock.append(time.perf_counter())

    def pace(self) -> Optional[float]:
        """This replica's median step time over its last steps (None before two)."""
        t = list(self._step_clock)
        return statistics.median(b - a for a, b in zip(t, t[1:])) if len(t) > 1 else None

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a peer healing in the round begun after `step` (torchft's quorum thread
        calls it while the training thread waits in begin_round)."""
        if self.closing:  # the run's end: the whole state, inside the round (nobody trains on while it crosses)
            return {**self.full_state(), "final": True}
        if not self.training or self.seam.policy.grad_sync(self.step + 1) or self.snapshots is None:
            # Before training (a fresh run's replicas meeting: the initial state) or in a grad round (every
            # step is one): the state crosses inside the round.
            return self.full_state()
        self.asked_at = self.step
        # Until its state is published, its server says so (a healing peer waits for it, and gives up on any
        # other answer): this replaces an earlier copy, whose peer has caught up (this quorum waited for it).
        self.snapshots.send_checkpoint(dst_ranks=[], step=promise(self.step), state_dict={}, timeout=timedelta())
        offer = {"step": self.step, "snapshot": self.snapshots.address(), "step_s": self.pace()}
        return {**offer, "replica": self.replica}

    def full_state(self, light: bool = False) -> dict[str, Any]:
        """This rank's state for a healing peer; `light` (elastic.heal=global): where the policy keeps θ_g for every
        unit, θ_g stands for the params (the peer goes on from θ_g) and the inner optimizer's state stays here."""
        # Copies: they are sent from another thread while this replica trains on.
        seam = self.seam
        policy = copy.deepcopy(seam.policy.state_dict())
        # Error-feedback residuals are each replica's own: a healed replica starts from zero (docs/design.md §9).
        policy["buffers"]["error"] = [None] * len(policy["buffers"]["error"])
        policy["meta"]["error_units"] = []
        thetas = self._global_params(policy)
        light = light and all(g is not None for g in thetas)
        optimizer = {} if light else {"optimizer": copy.deepcopy(seam.optimizer.state_dict())}
        return {
            # A unit whose params are θ_g (just after its sync) is not sent twice: a fifth less behind a slow link.
            "held": [
                None if g is not None and (light or torch.equal(held, g)) else held.detach().clone()
                for held, g in zip(seam.held, thetas, strict=True)
            ],
            **optimizer,
            "policy": policy,
            "step": self.step,
            "joining": not self.training,  # the round the state crosses in is this rank's join round
            "applied": self.applied_last,  # it holds the run's last param round (the close asks)
            "replica": self.replica,  # whose state it is
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's state, or its offer to serve it (torchft calls this on the training thread, in begin_round)."""
        if "snapshot" in state:
            self._offer = Offer(state["snapshot"], int(state["step"]), state.get("step_s"), state.get("replica"))
            self._healed_to = self._offer.step
            self._stage.enter(Heal.OFFERED, f"a peer offers its state after its step {self._healed_to}")
            self.life.enter(Phase.HEALING, f"a peer offers its state after its step {self._healed_to}")
            return
        self.load_full(state)

    def _global_params(self, policy_state: dict[str, Any]) -> list[Optional[torch.Tensor]]:
        """θ_g per unit from a policy state dict (None for each unit where the policy keeps none)."""
        return policy_state["buffers"].get("global") or [None] * len(self.seam.held)

    @torch.no_grad()
    def load_full(self, state: dict[str, Any]) -> None:
        self._stage.enter(Heal.LOADED, f"a peer's state after its step {state['step']} loaded")
        seam = self.seam
        for mine, held, g in zip(seam.held, state["held"], self._global_params(state["policy"]), strict=True):
            source = g if held is None else held  # a unit sent as None equals its θ_g (full_state)
            assert source is not None, "a peer's state left out a unit's held shard without its θ_g"
            mine.copy_(source)
        if "optimizer" in state:  # not in a light state (elastic.heal=global): this replica's own goes on
            seam.optimizer.load_state_dict(state["optimizer"])
        seam.policy.load_state_dict(state["policy"])
        self.step = self._healed_to = int(state["step"])
        final, joining = bool(state.get("final", False)), bool(state.get("joining", False))
        self.source = Source.CLOSING if final else Source.JOINING if joining else Source.TRAINING
        self.applied_last = bool(state.get("applied", True))
        self.source_replica = state.get("replica")
        self.heals += 1
        if self._lost_at is not None:  # a source was lost on the way: what that cost
            self.lost_s += time.perf_counter() - self._lost_at
            self._lost_at = None

    def serve(self, step: int, transport: FTTransport, timeout: timedelta) -> None:
        """After `step`'s sync, once `transport` has no round open: publish this rank's state to a peer that
        healed from it in a round that has now closed, and drop that copy once a later round closed (the
        peer caught up)."""
        if transport.open:
            return
        rounds = transport.rounds
        if self.asked_at is not None and step >= self.asked_at:
            self._serving_fault_round = transport.fault_round(rounds)
            if self.faults is not None:
                self.faults.at("before_serve", self._serving_fault_round)
            state = {**self.full_state(self.light), END: torch.ones(1)}  # END's bytes last: a cut transfer fails
            self.owed, self.sent_whole = self._promised, 0
            self._server().send_checkpoint(dst_ranks=[], step=step, state_dict=state, timeout=timeout)
            self.asked_at, self.served_round = None, rounds
        elif self.served_round is not None and rounds > self.served_round:
            self._server().send_checkpoint(dst_ranks=[], step=-1, state_dict={}, timeout=timeout)
            self.served_round, self.owed = None, 0

    def promised_to(self, dst_ranks: list[int], state: dict[str, Any]) -> None:
        """torchft's quorum sends `state` (this rank's `state_dict` under "user", by the name it was registered
        with) to the healing ranks `dst_ranks`: where it is an offer, the state this rank publishes next is owed to
        that many peers."""
        if any(isinstance(mine, dict) and "snapshot" in mine for mine in state.get("user", {}).values()):
            self._promised = len(dst_ranks)

    def sent(self) -> None:
        """This rank's snapshot server has sent a state whole (on the server's thread)."""
        self.sent_whole += 1

    def linger(self, wait_s: float, logs: bool, peers_alive: Callable[[], bool] = lambda: True) -> None:
        """At the run's end, before this rank's snapshot server stops: the state it published last (the last
        step's `serve` ran after that round landed) stays up until every peer it is owed to has been sent it, up to
        `wait_s` (mesh.timeout_s: what such a peer waits for a promised state), or until `peers_alive()` (asked each
        second: the lighthouse's heartbeats) says no other replica is left. Without this a source that finishes the
        run while peers heal from it leaves them no state and, when no other replica is left, no heal at all."""
        if self.served_round is None or self.sent_whole >= self.owed:
            return
        if logs:
            print(
                f"elastic: replica {self.replica}: serving its state to {self.owed - self.sent_whole} healing "
                f"peer(s) before leaving (up to mesh.timeout_s={wait_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        asked = t0
        alive = True
        while self.sent_whole < self.owed and time.perf_counter() - t0 < wait_s and alive:
            time.sleep(0.05)
            if time.perf_counter() - asked > 1.0:
                alive, asked = peers_alive(), time.perf_counter()
        if self.sent_whole < self.owed and logs:
            why = f"within {wait_s:g} s" if alive else "before every other replica was gone"
            print(
                f"elastic: replica {self.replica}: {self.sent_whole} of {self.owed} healing peer(s) fetched its state "
                f"{why}; leaving",
                file=sys.stderr,
                flush=True,
            )

    def sending(self) -> None:
        """This rank's snapshot server has sent part of its published state to a healing peer (called on the
        server's thread, once per transfer): the during_serve fault point."""
        if self.faults is not None and self._serving_fault_round is not None:
            self.faults.at("during_serve", self._serving_fault_round)

    def fetch(self, offer: Offer, step: int, wait_s: float, timeout: timedelta) -> dict[str, Any]:
        """The state `offer`'s source publishes after `step` once its round has closed. Waits while its server
        says it is promised (up to `wait_s`, mesh.timeout_s: a slow source is no failure); SourceLost at once
        when the server refuses, answers another step or breaks the transfer, and when one request has no
        answer within `timeout` (elastic.timeout_s: a stopped or cut-off source)."""
        t0 = time.perf_counter()
        while True:
            try:
                state = self._server().recv_checkpoint(src_rank=0, metadata=offer.url, step=step, timeout=timeout)
                self.fetch_s += time.perf_counter() - t0
                self.fetches += 1
                self.fetch_bytes += _tensor_bytes(state)
                return state
            except Exception as e:
                waited = time.perf_counter() - t0
                why = _lost(e, promise(offer.step), timeout)
                if why is None and waited > wait_s:
                    why = f"did not serve its promised state within {wait_s:g} s (mesh.timeout_s)"
                if why is not None:
                    self.fetch_s += waited
                    source = f"replica {offer.replica}" if offer.replica is not None else offer.url
                    raise SourceLost(f"its source, {source}, {why} ({waited:.1f} s into the fetch)") from e
                time.sleep(0.05)


def _tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a (nested) state."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class SourceLost(RuntimeError):
    """The peer a replica was healing from died, stopped, broke the transfer or serves that heal no more
    (replica.py heals again, from another live peer)."""


def _lost(e: BaseException, promised: int, timeout: timedelta) -> Optional[str]:
    """Why a failed request for a source's state means that source is lost (None: its server answered that the
    state is promised, or an answer this rank cannot read: wait on)."""
    if _refused(e):  # its server listened from its start: refused means the process is gone
        return "is gone (its server refuses connections)"
    if isinstance(e, urllib.error.HTTPError):
        served = re.search(r"serving (-?\d+)", str(e.reason))  # torchft's answer to another step
        if e.code == 400 and (served is None or int(served[1]) == promised):
            return None  # promised (or an answer not understood: waited on, up to mesh.timeout_s)
        return f"serves this heal no more (HTTP {e.code}: {e.reason})"
    if _timed_out(e):
        return f"did not answer within {timeout.total_seconds():g} s (elastic.timeout_s): stopped or cut off"
    return f"broke the transfer ({type(e).__name__}: {str(e)[:120]})"


def _chain(e: Optional[BaseException]) -> list[BaseException]:
    """`e`, the error it wraps (urllib's URLError keeps the socket's in `reason`), and its causes."""
    seen: list[BaseException] = []
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        reason = getattr(e, "reason", None)
        e = reason if isinstance(reason, BaseException) else (e.__cause__ or e.__context__)
    return seen


def _refused(e: Optional[BaseException]) -> bool:
    """Whether `e` is a refused connection."""
    return any(isinstance(c, ConnectionRefusedError) for c in _chain(e))


def _timed_out(e: Optional[BaseException]) -> bool:
    """Whether `e` is a request that got no answer in time (connecting, or reading the answer)."""
    return any(isinstance(c, (TimeoutError, socket.timeout)) for c in _chain(e))
