"""The sync policy: the one object that decides and does everything that crosses the sync group.

It combines the pieces of this package (docs/design.md §2):

    schedule.py    when: warmup grad sync, every H steps, fragments, delay τ
    outer.py       what θ_g does with the mean Δ (average / DiLoCo)
    codec.py       how Δ travels (fp32, int8, int4, top-k ± error feedback)
    transport      over what: the mesh's (hsdp/comm/transport.py; the c10d sync group, or torchft's)

Param sync of a fragment, per unit's held shard θ_m (fp32):
    average (no θ_g):  θ_m ← mean_m θ_m                       (one all-reduce)
    with θ_g:          Δ_m = θ_g − θ_m → codec → mean Δ → outer step → θ_m ← θ_g

Overlapped sync (delay τ > 0): after the update of step s each rank snapshots
Δ_m = θ_g − θ_m for the due fragment and starts its reduction async; steps
s+1 … s+τ train on; after the update of step s+τ the reduction is waited on, the
outer step gives the new θ_g and θ_m ← α·θ_m + (1 − α)·θ_g. τ = 0 is the
blocking sync, the same ops in the same order (α unused). `finish()` lands
whatever is still in flight when training ends (before the final eval).

The policy also owns its checkpoint state (`checkpoint_meta` / `checkpoint_buffers`
/ `load_checkpoint`), the rules a resume must satisfy (`check_resume`) and the
answer to "are the replicas identical after step s" (`replicas_identical`).
Engines only map its per-unit flat buffers to checkpoint keys.

θ_g and b are fp32 buffers the size of the held shard (4 bytes/element each);
an in-flight unit also holds its Δ (4 bytes/element, plus the codec's payload).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from hsdp.comm.transport import Transport
from hsdp.config.schema import ConfigError, SyncConfig
from hsdp.sync.codec import Codec, Reduction, build_codec
from hsdp.sync.outer import OuterOptimizer
from hsdp.sync.schedule import fragment_units, fragments_due, grad_sync_due, uses_global_copy
from kernels.outer import compute_delta

STATE_FORMAT = 1  # bump when state_dict's layout changes
Buffers = dict[str, list[Optional[torch.Tensor]]]  # buffer name → one flat tensor (or None) per unit


class Sync(Protocol):
    """What an engine and the training loop ask of a sync policy."""

    def grad_sync(self, step: int) -> bool: ...
    def backward_grad_sync(self, step: int) -> bool: ...
    def commit_grads(self, step: int, grads: list[torch.Tensor]) -> bool: ...
    def after_step(self, step: int) -> bool: ...
    def finish(self) -> list[int]: ...
    def replicas_identical(self, step: int) -> bool: ...
    def checkpoint_meta(self) -> dict[str, Any]: ...
    def checkpoint_buffers(self) -> Buffers: ...
    def empty_checkpoint_buffers(self, meta: dict[str, Any]) -> Buffers: ...
    def load_checkpoint(self, meta: dict[str, Any], buffers: Buffers) -> None: ...

    replica_buffers: frozenset[str]  # buffer names that differ between replicas


class NoSync:
    """The policy of engines whose grads are always averaged over every rank (and exact HSDP on one replica)."""

    replica_buffers: frozenset[str] = frozenset()

    def grad_sync(self, step: int) -> bool:
        return True

    def backward_grad_sync(self, step: int) -> bool:
        return True

    def commit_grads(self, step: int, grads: list[torch.Tensor]) -> bool:
        return True

    def after_step(self, step: int) -> bool:
        return False

    def finish(self) -> list[int]:
        return []

    def replicas_identical(self, step: int) -> bool:
        return True

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def checkpoint_buffers(self) -> Buffers:
        return {}

    def empty_checkpoint_buffers(self, meta: dict[str, Any]) -> Buffers:
        return {}

    def load_checkpoint(self, meta: dict[str, Any], buffers: Buffers) -> None:
        return None

    @classmethod
    def check_resume(cls, meta: dict[str, Any], step: int, saved: SyncConfig, cfg: SyncConfig, path: Path) -> None:
        return None

    @classmethod
    def global_buffer(cls, meta: dict[str, Any]) -> Optional[str]:
        return None


@dataclass
class _OuterState:
    """θ_g and outer momentum b for one unit's held shard."""

    global_params: torch.Tensor
    momentum: Optional[torch.Tensor] = None  # allocated on the first sync


@dataclass
class _DelayedSync:
    """A fragment's sync started after the update of step `start`; it lands after step `land`."""

    fragment: int
    start: int
    land: int
    reductions: list[Reduction]  # one per unit of the fragment, in SyncPolicy.fragments[f] order


class SyncPolicy:
    """Decides, each step, whether grads or params cross the sync group, and does the param sync."""

    # Checkpoint buffers that differ between replicas (each replica saves its own); the rest are
    # identical on every replica (θ_g, b, an in-flight mean Δ).
    replica_buffers = frozenset({"error"})

    def __init__(
        self, cfg: SyncConfig, held: list[torch.Tensor], transport: Transport, codec: Optional[Codec] = None
    ) -> None:
        self.cfg = cfg
        self.held = held  # each unit's flat fp32 held shard (updated in place)
        self.transport = transport
        self.codec = codec or build_codec(cfg)
        self.outer_opt = OuterOptimizer.from_config(cfg)
        self.delay, self.alpha = cfg.delay, cfg.alpha
        self.uses_global = uses_global_copy(cfg)
        self.outer: list[Optional[_OuterState]] = [None] * len(held)
        # Error feedback: each replica's residual per unit (fp32, allocated on its first sync).
        self.error: list[Optional[torch.Tensor]] = [None] * len(held)
        self.residual_before: dict[int, torch.Tensor] = {}  # elastic + error feedback: see settle_residuals
        self.fragments = fragment_units(len(held), cfg.fragments)
        self.in_flight: list[_DelayedSync] = []  # in start order, so every rank waits in the same order
        self.landed: list[int] = []  # fragments whose sync landed in the last after_step / finish
        self.dropped = 0  # rounds that did not commit (an elastic replica failed during them): not applied
        if cfg.warmup_steps == 0:
            self.start_global_copy()

    def grad_sync(self, step: int) -> bool:
        """Whether `step` averages its grads across the replicas (the warmup, exact HSDP)."""
        return grad_sync_due(step, self.cfg)

    def backward_grad_sync(self, step: int) -> bool:
        """Whether `step`'s backward averages its grads over the c10d sync group too. On a transport that may
        fail, a grad-sync step's grads cross the replicas after the backward instead, in a round of their
        own (`commit_grads`), so a failure drops the step whole instead of ending the run."""
        return self.grad_sync(step) and not self.transport.may_fail

    @torch.no_grad()
    def commit_grads(self, step: int, grads: list[torch.Tensor]) -> bool:
        """After `step`'s backward; False if the step must not update. A grad-sync step on a transport that
        may fail (warmup / exact HSDP, elastic): each unit's grad shard (the shard group's mean) summed over
        the replicas in this step's round and divided by their number; if the round did not commit, the
        grads are zeroed and False. Any other step: nothing to do."""
        if self.backward_grad_sync(step) or not self.grad_sync(step):
            return True
        self.transport.begin_round()  # nothing if open: a replica that healed into this round
        works = [self.transport.all_reduce_sum(g, async_op=True) for g in grads]
        for w in works:
            w.wait()
        n = len(self.transport.contributors)
        if not self.transport.commit_round():
            self.dropped += 1
            for g in grads:
                g.zero_()
            return False
        for g in grads:
            g.div_(n)
        return True

    def after_step(self, step: int) -> bool:
        """Called after the local update of `step`; True if a param sync started after it.

        With τ = 0 a sync starts and lands in this call (the `synced` flag of metrics.jsonl: the
        steps of `fragments_due`). With τ > 0 the flag still marks the start step (when the bytes
        are sent); `self.landed` lists the fragments that landed in this call.
        """
        if self.cfg.warmup_steps is not None and step == self.cfg.warmup_steps - 1:
            self.start_global_copy()  # end of warmup: replicas are identical here
        self.landed = []
        # Land before starting: a fragment never has two syncs in flight (τ < every), and every
        # rank issues and waits on the sync group's collectives in this same order.
        landing = [s for s in self.in_flight if s.land == step]
        if landing:
            self.land_syncs(landing)
        return self.start_due(step)

    def start_due(self, step: int, joined: bool = False) -> bool:
        """The param syncs due after `step`, as one round of the transport: run them (τ = 0) or start them.

        `joined`: the round has already begun (an elastic replica that just healed into its peers' round
        at `step`, hsdp/sync/elastic/join.py)."""
        due = fragments_due(step, self.cfg)
        if not due:
            return False
        if not joined:
            self.transport.begin_round()
        if self.delay > 0:
            for f in due:
                self.start_sync(f, step)
        elif self.transport.may_fail:
            self.sync_round(due)
        else:
            for f in due:
                for u in self.fragments[f]:
                    self.sync_params(u)
                self.landed.append(f)
        return True

    def finish(self) -> list[int]:
        """End of training: land every sync still in flight (in start order); returns their fragments."""
        self.landed = []
        if self.in_flight:
            self.land_syncs(list(self.in_flight))
        return self.landed

    def replicas_identical(self, step: int) -> bool:
        """True after an exact-HSDP (warmup) step, or when every fragment landed θ_m ← θ_g after `step`.

        Only the params: the inner optimizer states are never synced, so they differ after the warmup.
        """
        if self.transport.size == 1 or grad_sync_due(step, self.cfg):
            return True
        if self.in_flight or (self.delay > 0 and self.alpha > 0):
            return False
        # The syncs that landed after `step` started τ steps earlier (τ = 0: blocking, they started now).
        return len(fragments_due(step - self.delay, self.cfg)) == len(self.fragments)

    def start_global_copy(self) -> None:
        """θ_g ← θ_m (the end of the warmup, or the start of a run without one), if the method keeps θ_g."""
        if self.uses_global:
            self.outer = [_OuterState(global_params=h.clone()) for h in self.held]

    # ------------------------------------------------------------ blocking param sync (τ = 0)
    @torch.no_grad()
    def sync_params(self, u: int) -> None:
        """Sync one unit now: reduce, outer step, θ_m ← θ_g (or the plain average)."""
        held = self.held[u]
        if not self.uses_global:
            self.transport.all_reduce_sum(held, async_op=False)
            held.div_(len(self.transport.contributors))
            return
        red = self.snapshot_delta(u, async_op=False)
        self.codec.finish(red, self.transport)
        self.apply_outer_step(u, red.delta, merge=False)

    # ------------------------------------------------------------ overlapped param sync (τ > 0)
    @torch.no_grad()
    def start_sync(self, f: int, step: int) -> None:
        """Snapshot Δ_m of fragment f's units and launch their reductions; they land after step + τ."""
        reductions = [self.snapshot_delta(u, async_op=True) for u in self.fragments[f]]
        self.in_flight.append(_DelayedSync(f, step, step + self.delay, reductions))

    @torch.no_grad()
    def land_sync(self, sync: _DelayedSync) -> None:
        """Wait for a fragment's reductions, then the outer step and θ_m ← α·θ_m + (1 − α)·θ_g."""
        self.land_syncs([sync])

    @torch.no_grad()
    def land_syncs(self, syncs: list[_DelayedSync]) -> None:
        """Land the syncs of one round: wait for every reduction; if the round commits, each unit's outer
        step and merge, else (a failed elastic round) none of them."""
        for sync in syncs:
            for red in sync.reductions:
                self.codec.finish(red, self.transport)
        commit = self.transport.commit_round()
        self.settle_residuals(commit)
        for sync in syncs:
            if commit:
                for u, red in zip(self.fragments[sync.fragment], sync.reductions):
                    self.apply_outer_step(u, red.delta, merge=True)
                self.landed.append(sync.fragment)
            self.in_flight.remove(sync)
        self.dropped += not commit

    @torch.no_grad()
    def sync_round(self, fragments: list[int]) -> None:
        """A blocking round on a transport that may fail (elastic): every reduction first, then, only if the
        round commits, every unit's update; a round that does not commit leaves θ_m and θ_g as they were."""
        units = [u for f in fragments for u in self.fragments[f]]
        if self.uses_global:
            reds = [self.snapshot_delta(u, async_op=False) for u in units]
            for red in reds:
                self.codec.finish(red, self.transport)
            n, means = None, [red.delta for red in reds]
        else:
            means = [self.held[u].clone() for u in units]  # reduced apart from θ_m, which a drop keeps
            for t in means:
                self.transport.all_reduce_sum(t, async_op=False)
            n = len(self.transport.contributors)
        committed = self.transport.commit_round()
        self.settle_residuals(committed)
        if not committed:
            self.dropped += 1
            return
        for u, mean in zip(units, means):
            if n is None:
                self.apply_outer_step(u, mean, merge=False)
            else:
                self.held[u].copy_(mean).div_(n)
        self.landed.extend(fragments)

    # ------------------------------------------------------------ the pieces of one unit's sync
    def snapshot_delta(self, u: int, async_op: bool) -> Reduction:
        """Δ_m = θ_g − θ_m for unit u, and the start of its reduction through the codec."""
        held = self.held[u]
        delta = torch.empty_like(held)
        compute_delta(self.outer[u].global_params, held, delta)
        if self.cfg.error_feedback and self.error[u] is None:
            self.error[u] = torch.zeros_like(held)
        self.keep_residual(u)
        return self.codec.start(delta, self.transport, async_op, error=self.error[u])

    # ---- error feedback on a transport that may fail (elastic, docs/design.md §11): a residual changes only
    # in a round that committed and counted this replica's part; otherwise it is put back as it was.
    def keep_residual(self, u: int) -> None:
        """Before the codec updates unit u's residual in a round that may not count: keep a copy."""
        if self.transport.may_fail and self.error[u] is not None:
            self.residual_before[u] = self.error[u].clone()

    def settle_residuals(self, committed: bool) -> None:
        """After a round's commit: put the kept residuals back unless the round applied this replica's part."""
        if not (committed and self.transport.counted):
            for u, before in self.residual_before.items():
                self.error[u].copy_(before)
        self.residual_before.clear()

    def apply_outer_step(self, u: int, mean_delta: torch.Tensor, merge: bool) -> None:
        """θ_g ← outer step with mean Δ; θ_m ← θ_g, or with merge (a delayed sync) α·θ_m + (1 − α)·θ_g."""
        state = self.outer[u]
        held = self.held[u]
        first = state.momentum is None
        if first:
            state.momentum = torch.empty_like(held)
        # α = 0 adopts θ_g: let the kernel write it into held, exactly as the blocking sync does.
        out = torch.empty_like(held) if merge and self.alpha > 0 else held
        self.outer_opt.step(out, state.global_params, state.momentum, mean_delta, first)
        if out is not held:
            held.lerp_(out, 1.0 - self.alpha)  # θ_m + (1 − α)(θ_g − θ_m); exact at α = 1

    # ------------------------------------------------------------ checkpointable state
    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """θ_g, b and the in-flight syncs, as plain tensors (flat fp32, the held shard's shape).

        A sync in flight is stored as its already-reduced mean Δ and its land step: this waits
        for the reduction to *finish* (the collective only), but the outer step and merge still
        happen at the land step, so a run that checkpoints computes exactly what one that does
        not computes; loading starts no collective. The tensors alias the policy's buffers
        (like nn.Module.state_dict): save or clone them before training on.
        """
        for sync in self.in_flight:
            for red in sync.reductions:
                self.codec.finish(red, self.transport)
        return {
            "format": STATE_FORMAT,
            "fragments": self.cfg.fragments,
            "has_global": any(s is not None for s in self.outer),
            "global_params": [s.global_params if s is not None else None for s in self.outer],
            "momentum": [s.momentum if s is not None else None for s in self.outer],
            "error": list(self.error),
            "in_flight": [
                {
                    "fragment": s.fragment,
                    "start": s.start,
                    "land": s.land,
                    "mean_delta": [r.delta for r in s.reductions],
                }
                for s in self.in_flight
            ],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (tensors are copied onto the held shards' device)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"SyncPolicy.load_state_dict: expected format {STATE_FORMAT}, got {state.get('format')}")
        if state["fragments"] != self.cfg.fragments or len(state["global_params"]) != len(self.held):
            raise ValueError(
                f"SyncPolicy.load_state_dict: state of {len(state['global_params'])} units in "
                f"{state['fragments']} fragments, policy has {len(self.held)} in {self.cfg.fragments}"
            )

        def own(t: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
            if t.shape != like.shape:
                raise ValueError(
                    f"SyncPolicy.load_state_dict: {what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}"
                )
            return torch.empty_like(like).copy_(t)

        if state["has_global"]:
            self.outer = [
                _OuterState(own(g, h, f"global_params[{u}]"), None if b is None else own(b, h, f"momentum[{u}]"))
                for u, (h, g, b) in enumerate(zip(self.held, state["global_params"], state["momentum"]))
            ]
        else:
            self.outer = [None] * len(self.held)
        errors = state.get("error") or [None] * len(self.held)  # absent in states saved without the codec's
        self.error = [
            None if e is None else own(e, h, f"error[{u}]") for u, (h, e) in enumerate(zip(self.held, errors))
        ]
        self.in_flight = []
        for s in state["in_flight"]:
            units = self.fragments[s["fragment"]]
            reds = [
                Reduction(own(d, self.held[u], f"in_flight mean_delta of unit {u}"), done=True)
                for u, d in zip(units, s["mean_delta"], strict=True)
            ]
            self.in_flight.append(_DelayedSync(s["fragment"], s["start"], s["land"], reds))

    # ------------------------------------------------------------ the checkpoint's view of that state
    def checkpoint_meta(self) -> dict[str, Any]:
        """The saved state's structure (JSON): which buffers exist, so a load can allocate them first."""
        state = self.state_dict()
        return {
            "format": state["format"],
            "fragments": state["fragments"],
            "has_global": bool(state["has_global"]),
            "momentum_units": [u for u, b in enumerate(state["momentum"]) if b is not None],
            "error_units": [u for u, e in enumerate(state["error"]) if e is not None],
            "in_flight": [{k: s[k] for k in ("fragment", "start", "land")} for s in state["in_flight"]],
        }

    def checkpoint_buffers(self) -> Buffers:
        """The state's tensors by name, each a per-unit list of flat buffers (aliases: save before training on)."""
        return self._buffers_of(self.state_dict())

    def empty_checkpoint_buffers(self, meta: dict[str, Any]) -> Buffers:
        """Zeroed buffers shaped after a saved `checkpoint_meta` (load targets; padding stays zero)."""
        return self._buffers_of(self._empty_state(meta))

    def load_checkpoint(self, meta: dict[str, Any], buffers: Buffers) -> None:
        """Install buffers filled in from a checkpoint (as returned by `empty_checkpoint_buffers`)."""
        state = self._empty_state(meta)
        state["global_params"], state["momentum"] = buffers["global"], buffers["momentum"]
        state["error"] = buffers["error"]
        for i, s in enumerate(state["in_flight"]):
            s["mean_delta"] = [d for d in buffers[f"in_flight{i}"] if d is not None]
        self.load_state_dict(state)

    def _buffers_of(self, state: dict[str, Any]) -> Buffers:
        buffers: Buffers = {"global": state["global_params"], "momentum": state["momentum"], "error": state["error"]}
        for i, s in enumerate(state["in_flight"]):
            per_unit: list[Optional[torch.Tensor]] = [None] * len(self.held)
            for u, delta in zip(self.fragments[s["fragment"]], s["mean_delta"]):
                per_unit[u] = delta
            buffers[f"in_flight{i}"] = per_unit
        return buffers

    def _empty_state(self, meta: dict[str, Any]) -> dict[str, Any]:
        zeros = torch.zeros_like
        return {
            "format": meta["format"],
            "fragments": meta["fragments"],
            "has_global": meta["has_global"],
            "global_params": [zeros(h) if meta["has_global"] else None for h in self.held],
            "momentum": [zeros(h) if u in meta["momentum_units"] else None for u, h in enumerate(self.held)],
            "error": [zeros(h) if u in meta.get("error_units", ()) else None for u, h in enumerate(self.held)],
            "in_flight": [
                {**s, "mean_delta": [zeros(self.held[u]) for u in self.fragments[s["fragment"]]]}
                for s in meta["in_flight"]
            ],
        }

    @classmethod
    def check_resume(cls, meta: dict[str, Any], step: int, saved: SyncConfig, cfg: SyncConfig, path: Path) -> None:
        """ConfigError unless a policy configured by `cfg` can continue the state `meta` describes."""
        if meta["fragments"] != cfg.fragments:
            raise ConfigError(
                f"sync.fragments: checkpoint {path} was saved with {meta['fragments']}, config has {cfg.fragments}"
            )
        if meta["in_flight"] and cfg.delay == 0:
            raise ConfigError(
                f"sync.delay: checkpoint {path} has a param sync in flight (saved with sync.delay="
                f"{saved.delay}), config has 0"
            )
        if meta.get("error_units") and not cfg.error_feedback:
            raise ConfigError(
                f"sync.error_feedback: checkpoint {path} holds error-feedback residuals, config has false"
            )
        w = cfg.warmup_steps
        if uses_global_copy(cfg) and w is not None and step >= w - 1 and not meta["has_global"]:
            raise ConfigError(
                f"sync.method: checkpoint {path} (step {step}, past the warmup) has no global "
                f"copy θ_g, which this config's sync needs"
            )

    @classmethod
    def global_buffer(cls, meta: dict[str, Any]) -> Optional[str]:
        """The name of the checkpoint buffer holding θ_g, if the saved state has one."""
        return "global" if meta.get("has_global") else None


def build_sync(cfg: SyncConfig, held: list[torch.Tensor], transport: Transport) -> SyncPolicy:
    """The configured policy over `held` (each unit's flat fp32 held shard), syncing through `transport`."""
    return SyncPolicy(cfg, held, transport)
