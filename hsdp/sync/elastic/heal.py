"""HealState: what a rejoining replica copies from a live peer, and this rank's server of it.

The state a replica needs to continue exactly where a live peer is: its held shards, the inner
optimizer's state, the sync policy's state (θ_g, outer momentum; nothing is in flight at the start of a
round) and the training step. The LR and the data stream are functions of the step and of the replica's
own rank, so both are right once the step is.

The heal's own state (`stage`, phase.py's heal table): none → offered (a peer's offer, out of band) →
fetching (the offer taken) → loaded, or none again (the serving peer died); none or loaded → loaded (a
state inside the round); loaded → offered (healed again).
"""

from __future__ import annotations

import copy
import enum
import statistics
import time
from collections import deque
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.phase import HEAL_TRANSITIONS, Checked, Heal, Life, Phase
from hsdp.sync.elastic.seam import Snapshots
from hsdp.sync.seam import ReplicaState

if TYPE_CHECKING:
    from hsdp.sync.elastic.transport import FTTransport


class Offer(NamedTuple):
    """A peer's offer to serve its state out of band (what torchft's quorum carries at a param sync)."""

    url: str  # its snapshot server's address
    step: int  # the step its round began after
    pace: Optional[float]  # its median step time (None before two steps)


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

    def __init__(self, life: Life, faults: Optional[FaultPoints] = None) -> None:
        self.life, self.faults = life, faults
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
        self.heals = 0
        self.fetches = 0  # peers' states fetched out of band
        self.fetch_s = 0.0  # wall time fetching them
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
        return self._offer

    def peer_gone(self) -> None:
        """fetching → none: the serving peer died before its state was fetched; the next quorum heals again."""
        self._stage.enter(Heal.NONE, "the serving peer is gone: healed again at the next round")

    @property
    def healed_to(self) -> Optional[int]:
        """The step of the peer's offer or state this rank healed to (None: no heal, or one begun again)."""
        return None if self.stage is Heal.NONE else self._healed_to

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
        return {"step": self.step, "snapshot": self.snapshots.address(), "step_s": self.pace()}

    def full_state(self) -> dict[str, Any]:
        # Copies: they are sent from another thread while this replica trains on.
        seam = self.seam
        policy = copy.deepcopy(seam.policy.state_dict())
        # Error-feedback residuals are each replica's own: a healed replica starts from zero (docs/design.md §9).
        policy["buffers"]["error"] = [None] * len(policy["buffers"]["error"])
        policy["meta"]["error_units"] = []
        thetas = self._global_params(policy)
        return {
            # A unit whose params are θ_g (just after its sync) is not sent twice: a fifth less behind a slow link.
            "held": [
                None if g is not None and torch.equal(held, g) else held.detach().clone()
                for held, g in zip(seam.held, thetas, strict=True)
            ],
            "optimizer": copy.deepcopy(seam.optimizer.state_dict()),
            "policy": policy,
            "step": self.step,
            "joining": not self.training,  # the round the state crosses in is this rank's join round
            "applied": self.applied_last,  # it holds the run's last param round (the close asks)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A peer's state, or its offer to serve it (torchft calls this on the training thread, in begin_round)."""
        if "snapshot" in state:
            self._offer = Offer(state["snapshot"], int(state["step"]), state.get("step_s"))
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
        seam.optimizer.load_state_dict(state["optimizer"])
        seam.policy.load_state_dict(state["policy"])
        self.step = self._healed_to = int(state["step"])
        final, joining = bool(state.get("final", False)), bool(state.get("joining", False))
        self.source = Source.CLOSING if final else Source.JOINING if joining else Source.TRAINING
        self.applied_last = bool(state.get("applied", True))
        self.heals += 1

    def serve(self, step: int, transport: FTTransport, timeout: timedelta) -> None:
        """After `step`'s sync, once `transport` has no round open: publish this rank's state to a peer that
        healed from it in a round that has now closed, and drop that copy once a later round closed (the
        peer caught up)."""
        if transport.open:
            return
        rounds = transport.rounds
        if self.asked_at is not None and step >= self.asked_at:
            if self.faults is not None:
                self.faults.at("before_serve", transport.fault_round(rounds))
            self._server().send_checkpoint(dst_ranks=[], step=step, state_dict=self.full_state(), timeout=timeout)
            self.asked_at, self.served_round = None, rounds
        elif self.served_round is not None and rounds > self.served_round:
            self._server().send_checkpoint(dst_ranks=[], step=-1, state_dict={}, timeout=timeout)
            self.served_round = None

    def fetch(self, url: str, step: int, wait_s: float, timeout: timedelta) -> dict[str, Any]:
        """A peer's state after `step`, once it serves it (it publishes when its round has closed)."""
        t0 = time.perf_counter()
        while True:
            try:
                state = self._server().recv_checkpoint(src_rank=0, metadata=url, step=step, timeout=timeout)
                self.fetch_s += time.perf_counter() - t0
                self.fetches += 1
                return state
            except Exception as e:  # 400: still serving an older state; a refused or cut connection
                if _refused(e):  # its server listened from its start: refused means the peer is gone
                    raise PeerGone(f"the replica serving its state at {url} is gone ({e})") from e
                if time.perf_counter() - t0 > wait_s:
                    raise RuntimeError(f"no state of step {step} from {url} within {wait_s:g} s: {e}") from e
                time.sleep(0.05)


class PeerGone(RuntimeError):
    """The peer a replica was healing from died before its state was fetched (replica.py heals again)."""


def _refused(e: Optional[BaseException]) -> bool:
    """Whether `e` (urllib's URLError wraps the socket's error in `reason`) is a refused connection."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionRefusedError):
            return True
        reason = getattr(e, "reason", None)
        e = reason if isinstance(reason, BaseException) else (e.__cause__ or e.__context__)
    return False
