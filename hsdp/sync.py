"""Sync policies across the sync group (docs/design.md §2): warmup grad sync, periodic param sync.

    step s < warmup_steps        grads averaged across replicas (exact HSDP)
    after the update of step s   fragment f's sync starts iff s >= warmup and
                                 (s + 1 − warmup − (f+1)·every/P) % every == 0

Param sync of a fragment, per unit's held shard θ_m (fp32):
    average:  θ_m ← mean_m θ_m                           (one all-reduce)
    diloco:   Δ = θ_g − mean_m θ_m;  b = μ·b + Δ (b = Δ on the first sync)
              θ_g ← θ_g − η·(Δ + μ·b) (nesterov) or θ_g − η·b;  θ_m ← θ_g
    int8:     Δ_m = θ_g − θ_m travels as int8 + one fp32 scale per block
              (all-gather), dequantized and averaged in fp32; then the outer
              step (average + int8 is the outer step with η = 1, μ = 0).

Overlapped sync (delay τ > 0, docs/design.md §2.6): after the update of step s
each rank snapshots Δ_m = θ_g − θ_m for the due fragment and launches its
reduction async; steps s+1 … s+τ train on; after the update of step s+τ the
reduction is waited on, the outer step above gives the new θ_g (average: η = 1,
μ = 0, so θ_g exists for average too) and θ_m ← α·θ_m + (1 − α)·θ_g. τ = 0 is
the blocking sync, the same ops in the same order (α unused). `finish()` lands
whatever is still in flight when training ends (before the final eval).

θ_g and b are fp32 buffers the size of the held shard (4 bytes/element each);
an in-flight unit also holds its Δ (4 bytes/element, plus the gathered int8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hsdp.comm import Comm, _TimedWork
from hsdp.config import SyncConfig, outer_hyperparams
from kernels.outer import compute_delta, outer_step
from kernels.quant import dequantize_mean, quantize_int8

STATE_FORMAT = 1  # bump when state_dict's layout changes


def grad_sync_due(step: int, cfg: SyncConfig) -> bool:
    """Grads are averaged across the sync group on step s iff s < warmup_steps (None: always)."""
    return cfg.warmup_steps is None or step < cfg.warmup_steps


def fragments_due(step: int, cfg: SyncConfig) -> list[int]:
    """The fragments whose param sync starts after the local update of `step` (and lands τ steps later)."""
    if cfg.warmup_steps is None or step < cfg.warmup_steps:
        return []
    P, H = cfg.fragments, cfg.every
    return [f for f in range(P) if (step + 1 - cfg.warmup_steps - (f + 1) * H // P) % H == 0]


def steps_after_last_sync(steps: int, cfg: SyncConfig) -> int:
    """How many final steps of a `steps`-step run come after some fragment's last param sync (start).

    0 means the run ends on a full sync, so the final model (and val loss) is θ_g;
    otherwise it is each replica's local model. With warmup_steps None it is 0 (exact HSDP).
    With delay τ > 0 the count is from the sync's start (its Δ snapshot): those steps are not
    in θ_g, whether or not the sync landed (finish() lands it at the end of the run).
    """
    if cfg.warmup_steps is None or steps <= cfg.warmup_steps:
        return 0
    last = [
        max((s for s in range(cfg.warmup_steps, steps) if f in fragments_due(s, cfg)), default=-1)
        for f in range(cfg.fragments)
    ]
    return steps - 1 - min(last)


@dataclass
class _OuterState:
    """θ_g and outer momentum b for one unit's held shard."""

    global_params: torch.Tensor
    momentum: Optional[torch.Tensor] = None  # allocated on the first sync


@dataclass
class _Reduction:
    """One unit's Δ on its way to the sync-group mean: started, then finished (waited, averaged)."""

    delta: torch.Tensor  # Δ_m when started; mean_m Δ_m once finished
    works: list[_TimedWork] = field(default_factory=list)
    gathered: Optional[tuple[torch.Tensor, ...]] = None  # int8: (q, scales, q_all, scales_all), kept alive
    done: bool = False


@dataclass
class _DelayedSync:
    """A fragment's sync started after the update of step `start`; it lands after step `land`."""

    fragment: int
    start: int
    land: int
    reductions: list[_Reduction]  # one per unit of the fragment, in SyncPolicy.fragments[f] order


class SyncPolicy:
    """Decides, each step, whether grads or params cross the sync group, and does the param sync."""

    def __init__(self, cfg: SyncConfig, held: list[torch.Tensor], comm: Comm) -> None:
        self.cfg = cfg
        self.held = held  # each unit's flat fp32 held shard (updated in place)
        self.comm = comm
        self.M = comm.size("sync")
        self.lr, self.mu = outer_hyperparams(cfg)
        self.delay, self.alpha = cfg.delay, cfg.alpha
        # A delayed sync needs θ_g even for average: Δ_m is taken against it at the snapshot.
        self.uses_global = cfg.method == "diloco" or cfg.quantize == "int8" or cfg.delay > 0
        self.outer: list[Optional[_OuterState]] = [None] * len(held)
        # Units are dealt round-robin into fragments.
        self.fragments = [list(range(f, len(held), cfg.fragments)) for f in range(cfg.fragments)]
        self.in_flight: list[_DelayedSync] = []  # in start order, so every rank waits in the same order
        self.landed: list[int] = []  # fragments whose sync landed in the last after_step / finish
        if cfg.warmup_steps == 0:
            self._start_global_copy()

    def grad_sync(self, step: int) -> bool:
        return grad_sync_due(step, self.cfg)

    def after_step(self, step: int) -> bool:
        """Called after the local update of `step`; True if a param sync started after it.

        With τ = 0 a sync starts and lands in this call (the `synced` flag of metrics.jsonl: the
        steps of `fragments_due`). With τ > 0 the flag still marks the start step (when the bytes
        are sent); `self.landed` lists the fragments that landed in this call.
        """
        if self.cfg.warmup_steps is not None and step == self.cfg.warmup_steps - 1:
            self._start_global_copy()  # end of warmup: replicas are identical here
        self.landed = []
        # Land before starting: a fragment never has two syncs in flight (τ < every), and every
        # rank issues and waits on the sync group's collectives in this same order.
        for sync in [s for s in self.in_flight if s.land == step]:
            self.land_sync(sync)
        due = fragments_due(step, self.cfg)
        for f in due:
            if self.delay == 0:
                for u in self.fragments[f]:
                    self.sync_params(u)
                self.landed.append(f)
            else:
                self.start_sync(f, step)
        return bool(due)

    def finish(self) -> list[int]:
        """End of training: land every sync still in flight (in start order); returns their fragments.

        Call after the last step's after_step and before the final eval; a no-op when nothing is
        in flight (always with τ = 0).
        """
        self.landed = []
        for sync in list(self.in_flight):
            self.land_sync(sync)
        return self.landed

    def _start_global_copy(self) -> None:
        if self.uses_global:
            self.outer = [_OuterState(global_params=h.clone()) for h in self.held]

    # ------------------------------------------------------------ blocking param sync (τ = 0)
    @torch.no_grad()
    def sync_params(self, u: int) -> None:
        """Sync one unit now: reduce, outer step, θ_m ← θ_g (or the plain average)."""
        held = self.held[u]
        if not self.uses_global:
            self.comm.all_reduce(held, "sync")
            held.div_(self.M)
            return
        red = self.snapshot_delta(u, async_op=False)
        self.finish_reduction(red)
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
        for u, red in zip(self.fragments[sync.fragment], sync.reductions):
            self.finish_reduction(red)
            self.apply_outer_step(u, red.delta, merge=True)
        self.in_flight.remove(sync)
        self.landed.append(sync.fragment)

    # ------------------------------------------------------------ the pieces of one unit's sync
    def snapshot_delta(self, u: int, async_op: bool) -> _Reduction:
        """Δ_m = θ_g − θ_m for unit u, and the start of its sync-group reduction."""
        held = self.held[u]
        delta = torch.empty_like(held)
        compute_delta(self.outer[u].global_params, held, delta)
        return self.start_reduction(delta, async_op)

    def start_reduction(self, delta: torch.Tensor, async_op: bool) -> _Reduction:
        """Launch the reduction of delta: fp32 all-reduce(sum), or int8 values + scales all-gathered."""
        red = _Reduction(delta)
        if self.cfg.quantize == "none":
            red.works.append(self.comm.all_reduce(delta, "sync", async_op=async_op))
            return red
        q, scales = quantize_int8(delta, self.cfg.quant_block)
        q_all = torch.empty(self.M * q.numel(), dtype=torch.int8, device=q.device)
        s_all = torch.empty(self.M * scales.numel(), dtype=torch.float32, device=q.device)
        red.works.append(self.comm.all_gather(q_all, q, "sync", async_op=async_op))
        red.works.append(self.comm.all_gather(s_all, scales, "sync", async_op=async_op))
        red.gathered = (q, scales, q_all, s_all)
        return red

    def finish_reduction(self, red: _Reduction) -> None:
        """Wait for the reduction; red.delta ← mean over replicas of Δ_m (idempotent)."""
        if red.done:
            return
        for work in red.works:
            work.wait()
        if self.cfg.quantize == "none":
            red.delta.div_(self.M)
        else:
            _, _, q_all, s_all = red.gathered
            dequantize_mean(q_all.view(self.M, -1), s_all.view(self.M, -1), self.cfg.quant_block, red.delta)
        red.works, red.gathered, red.done = [], None, True

    def apply_outer_step(self, u: int, mean_delta: torch.Tensor, merge: bool) -> None:
        """θ_g ← outer step with mean Δ; θ_m ← θ_g, or with merge (a delayed sync) α·θ_m + (1 − α)·θ_g."""
        state = self.outer[u]
        held = self.held[u]
        first = state.momentum is None
        if first:
            state.momentum = torch.empty_like(held)
        # α = 0 adopts θ_g: let the kernel write it into held, exactly as the blocking sync does.
        out = torch.empty_like(held) if merge and self.alpha > 0 else held
        outer_step(out, state.global_params, state.momentum, mean_delta, self.lr, self.mu, self.cfg.nesterov, first)
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
                self.finish_reduction(red)
        return {
            "format": STATE_FORMAT,
            "fragments": self.cfg.fragments,
            "has_global": any(s is not None for s in self.outer),
            "global_params": [s.global_params if s is not None else None for s in self.outer],
            "momentum": [s.momentum if s is not None else None for s in self.outer],
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
        self.in_flight = []
        for s in state["in_flight"]:
            units = self.fragments[s["fragment"]]
            reds = [
                _Reduction(own(d, self.held[u], f"in_flight mean_delta of unit {u}"), done=True)
                for u, d in zip(units, s["mean_delta"], strict=True)
            ]
            self.in_flight.append(_DelayedSync(s["fragment"], s["start"], s["land"], reds))
