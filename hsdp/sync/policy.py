"""The sync policy: the one object that decides and does everything that crosses the sync group.

It combines the pieces of this package (docs/design.md §8):

    schedule.py    when: warmup grad sync, every H steps, fragments, delay τ (schedule hsdp or torchft)
    outer.py       what θ_g does with the mean Δ (average / DiLoCo; η, μ per round)
    codec.py       how Δ travels (fp32, int8, int4, int2, top-k ± error feedback)
    transport      over what: the mesh's (hsdp/comm/transport.py; the c10d sync group, or torchft's)

Param sync of a fragment, per unit's held shard θ_m (fp32):
    average (no θ_g):  θ_m ← mean_m θ_m                       (one all-reduce)
    with θ_g:          Δ_m = θ_g − θ_m → codec → mean Δ → outer step → θ_m ← θ_g

One param-sync path, a round of the transport (`start_due` → `land`): after the
update of step s the due fragments' syncs start (`start_round`: each unit's Δ_m =
θ_g − θ_m, or θ_m itself for plain average, goes into the codec, async when τ > 0; a
lossy codec's payloads of all the round's units leave in one all-gather); after the
update of step s+τ the round lands: every reduction is finished (waited, mean),
the transport says whether the round committed, and only then each unit's `apply`
(outer step → new θ_g, θ_m ← α·θ_m + (1 − α)·θ_g). τ = 0 is the special case that
lands in the same call (schedule hsdp: α = 0, θ_m ← θ_g; schedule torchft mixes α at
every sync, §8.9); the elastic round is the same path on a transport whose rounds may
fail to commit (then nothing is applied). `finish()` lands whatever is still in flight
when training ends (before the final eval). With `sync.eager` (§8.10) the start also
moves θ_m to θ̂_m, the outer step with its own Δ_m for the mean, and the land replaces
θ̂_m by the real θ_g: θ_m ← θ_m + (θ_g − θ̂_m).

Its state (θ_g, b, e, the syncs in flight) is one object, `SyncState`
(hsdp/sync/state.py), with one `state_dict` that the checkpoint stores as it is
(`state_dict` / `empty_state_dict` / `load_state_dict` here). The policy also owns
the rules a resume must satisfy (`check_resume`) and the answer to "are the
replicas identical after step s" (`replicas_identical`).

θ_g and b are fp32 buffers the size of the held shard (4 bytes/element each); a
round holds each due unit's Δ until it lands (4 bytes/element, plus the codec's payload).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Protocol, cast

import torch

from hsdp.comm.transport import Transport
from hsdp.config.schema import ConfigError, SyncConfig
from hsdp.sync.codec import Codec, PackedCodec, Reduction, build_codec, send_round
from hsdp.sync.outer import OuterOptimizer
from hsdp.sync.schedule import fragment_units, fragments_due, grad_sync_due, uses_global_copy, weights_by_tokens
from hsdp.sync.state import REPLICA_BUFFERS, OuterState, PendingSync, SyncState
from kernels.outer import compute_delta


class Sync(Protocol):
    """What an engine and the training loop ask of a sync policy."""

    def grad_sync(self, step: int) -> bool: ...
    def backward_grad_sync(self, step: int) -> bool: ...
    def commit_grads(self, step: int, grads: list[torch.Tensor]) -> bool: ...
    def after_step(self, step: int) -> bool: ...
    def note_trained(self, step: int, applied: bool) -> None: ...
    def ledger(self) -> dict[str, Any]: ...
    def load_ledger(self, saved: dict[str, Any]) -> None: ...
    def finish(self) -> list[int]: ...
    def replicas_identical(self, step: int) -> bool: ...
    def state_dict(self) -> dict[str, Any]: ...  # {"meta": JSON structure, "buffers": name → per-unit flat}
    def empty_state_dict(self, meta: dict[str, Any]) -> dict[str, Any]: ...  # load targets for a saved meta
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    replica_buffers: frozenset[str]  # buffer names that differ between replicas


class NoSync:
    """The policy of engines whose grads are always averaged over every rank (and exact HSDP on one replica)."""

    replica_buffers: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.trained_steps = 0  # every step's grads cross every rank: each trained step is merged

    def grad_sync(self, step: int) -> bool:
        return True

    def note_trained(self, step: int, applied: bool) -> None:
        self.trained_steps += applied

    def ledger(self) -> dict[str, Any]:
        return {"since_sync": [], "trained": self.trained_steps, "merged": self.trained_steps, "wait_s": 0.0}

    def load_ledger(self, saved: dict[str, Any]) -> None:
        self.trained_steps = int(saved["trained"])

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

    def state_dict(self) -> dict[str, Any]:
        return {"meta": {}, "buffers": {}}

    def empty_state_dict(self, meta: dict[str, Any]) -> dict[str, Any]:
        return {"meta": meta, "buffers": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    @classmethod
    def check_resume(cls, meta: dict[str, Any], step: int, saved: SyncConfig, cfg: SyncConfig, path: Path) -> None:
        return None


class SyncPolicy:
    """Decides, each step, whether grads or params cross the sync group, and does the param sync."""

    replica_buffers = REPLICA_BUFFERS  # state buffers that differ between replicas (hsdp/sync/state.py)

    def __init__(
        self, cfg: SyncConfig, held: list[torch.Tensor], transport: Transport, codec: Optional[Codec] = None
    ) -> None:
        self.cfg = cfg
        self.held = held  # each unit's flat fp32 held shard (updated in place)
        self.transport = transport
        self.codec = codec or build_codec(cfg)
        self.outer_opt = OuterOptimizer.from_config(cfg)
        self.delay = cfg.delay
        self.torchft = cfg.schedule == "torchft"  # torchft's timing and merge (docs/design.md §8.9)
        # schedule hsdp: τ = 0 lands as it starts, θ_m ← θ_g; torchft mixes α at every sync
        self.alpha = cfg.alpha if cfg.delay > 0 or self.torchft else 0.0
        self.eager = cfg.eager  # θ_m ← θ̂_m at the start, corrected at the land (docs/design.md §8.10)
        if self.eager and transport.may_fail:
            raise ConfigError("sync.eager: not on a transport whose rounds may fail (an elastic run)")
        self.uses_global = uses_global_copy(cfg)
        self.fragments = fragment_units(len(held), cfg.fragments)
        self.state = SyncState(held, self.fragments)  # θ_g, b, e and the syncs in flight: what a checkpoint keeps
        self.landed: list[int] = []  # fragments whose sync landed in the last after_step / finish
        self.dropped = 0  # rounds that did not commit (an elastic replica failed during them): not applied
        self.residual_before: dict[int, torch.Tensor] = {}  # elastic + error feedback: see settle_residuals
        # The round ledger (docs/design.md §8.12): the steps this replica trained since each fragment's last
        # sync began (its weight in that fragment's next round), and of all it trained, how many reached the
        # global model (a grad-sync step whose round committed; a param round that committed counting it).
        self.weighted = weights_by_tokens(cfg)
        # A paced run's replicas train unequal steps: every round exchanges what each trained (with the weights
        # when weighted), so each replica knows the run's tokens at its rounds (hsdp/run/ledger.py).
        self.exchanges_counts = self.weighted or cfg.every_s > 0
        self.since_sync = [0] * cfg.fragments
        self.trained_steps = 0
        self.local_steps = 0  # trained steps that were not grad-sync rounds (periods and the unsynced tail)
        self.replicas_local_steps: Optional[float] = None  # Σ over the replicas of local_steps, at the last round
        self.merged_steps = 0.0
        self.wait_s = 0.0  # in the rounds' weight exchange: until the last replica arrived (weighted only)
        self.round_weights: list[list[float]] = []  # per weighted round: every counted replica's steps
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

    def note_trained(self, step: int, applied: bool) -> None:
        """The loop trained `step` (a step a paced replica skipped is not noted); `applied`: its update ran."""
        self.trained_steps += 1
        if self.grad_sync(step):
            self.merged_steps += applied  # its grads crossed the replicas in the step's own round
        else:
            self.since_sync = [n + 1 for n in self.since_sync]
            self.local_steps += 1

    def ledger(self) -> dict[str, Any]:
        """The round ledger, as a checkpoint keeps it per rank (RankExtras) and a resume restores it."""
        return {
            "since_sync": list(self.since_sync),
            "trained": self.trained_steps,
            "merged": self.merged_steps,
            "wait_s": self.wait_s,
            "local": self.local_steps,
            "replicas_local": self.replicas_local_steps,
        }

    def load_ledger(self, saved: dict[str, Any]) -> None:
        if len(saved["since_sync"]) == len(self.since_sync):  # another sync.fragments: counted afresh
            self.since_sync = list(saved["since_sync"])
        self.trained_steps, self.merged_steps = int(saved["trained"]), float(saved["merged"])
        self.wait_s = float(saved.get("wait_s") or 0.0)
        self.local_steps = int(saved.get("local") or 0)
        replicas_local = saved.get("replicas_local")
        self.replicas_local_steps = None if replicas_local is None else float(replicas_local)

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
            self.land(landing)
        return self.start_due(step)

    def start_due(self, step: int, joined: bool = False) -> bool:
        """The param syncs due after `step`, as one round of the transport: start them; τ = 0 lands them at once.

        `joined`: the round has already begun (an elastic replica that just healed into its peers' round
        at `step`, hsdp/sync/elastic/replica.py)."""
        due = fragments_due(step, self.cfg)
        if not due:
            return False
        if not joined:
            self.transport.begin_round()
        started = self.start_round(due, step)
        if self.delay == 0:
            self.land(started)
        return True

    def finish(self) -> list[int]:
        """End of training: land every sync still in flight (in start order); returns their fragments."""
        self.landed = []
        if self.in_flight:
            self.land(list(self.in_flight))
        return self.landed

    def replicas_identical(self, step: int) -> bool:
        """True after an exact-HSDP (warmup) step, or when every fragment landed θ_m ← θ_g after `step`.

        Only the params: the inner optimizer states are never synced, so they differ after the warmup.
        """
        if self.transport.size == 1 or grad_sync_due(step, self.cfg):
            return True
        if self.in_flight or self.alpha > 0 or self.eager:
            return False
        # The syncs that landed after `step` started τ steps earlier (τ = 0: they started now).
        return len(fragments_due(step - self.delay, self.cfg)) == len(self.fragments)

    def start_global_copy(self) -> None:
        """θ_g ← θ_m (the end of the warmup, or the start of a run without one), if the method keeps θ_g."""
        if self.uses_global:
            self.state.start_global_copy()

    # ------------------------------------------------------------ one param sync: start → land (finish, commit) → apply
    @torch.no_grad()
    def start_round(self, due: list[int], step: int) -> list[PendingSync]:
        """Start the due fragments' reductions (async when τ > 0); their syncs land after step + τ. A packed
        codec's payloads (every unit of every due fragment, in order) leave in one all-gather (send_round);
        the fp32 codec's all-reduces have started per unit."""
        own = [self.since_sync[f] for f in due]
        for f in due:
            self.since_sync[f] = 0
        factors = self.round_factors(own) if self.exchanges_counts else [None] * len(due)
        syncs = []
        for f, steps, c in zip(due, own, factors):
            mine = None if c is None else float(c[1])  # the fp32 sum takes this replica's own factor
            reds = [self.start_reduction(u, mine) for u in self.fragments[f]]
            for red in reds:
                red.factors = None if c is None else c[0]
            syncs.append(PendingSync(f, step, step + self.delay, reds, own_steps=steps))
        if self.codec.packed:
            send_round([red for sync in syncs for red in sync.reductions], self.transport, self.delay > 0)
        self.state.in_flight.extend(syncs)
        return syncs

    def start(self, f: int, step: int) -> PendingSync:
        """Fragment f's sync alone, as a round of its own."""
        return self.start_round([f], step)[0]

    @torch.no_grad()
    def land(self, syncs: list[PendingSync]) -> None:
        """Land the syncs of one round: finish every reduction (wait, mean); if the round commits, apply
        each unit's, else (a failed elastic round) none of them: θ_m and θ_g stay as they were."""
        for sync in syncs:
            for red in sync.reductions:
                self.codec.finish(red, self.transport)
        commit = self.transport.commit_round()
        self.settle_residuals(commit)
        for sync in syncs:
            if commit:
                for u, red in zip(self.fragments[sync.fragment], sync.reductions):
                    self.apply(u, red.delta)
                self.landed.append(sync.fragment)
                if self.transport.counted:  # this replica's steps reached θ_g for this fragment's 1/P
                    self.merged_steps += sync.own_steps / len(self.fragments)
            self.state.in_flight.remove(sync)
        self.dropped += not commit

    def round_factors(self, own: list[int]) -> list[Optional[tuple[torch.Tensor, float]]]:
        """sync.weighting=tokens: per due fragment, every contributing replica's factor c_j = M·w_j/Σw (w: the
        steps each trained since the fragment's last sync; tokens ∝ steps) and this replica's own, from one
        tiny all-gather of the weights over the sync transport before the payloads, with each replica's
        local_steps beside them (`replicas_local_steps`). None for a fragment nobody trained (the plain mean),
        and for every fragment when the run is not weighted (a paced run with sync.weighting=equal exchanges
        the counts only). Its wait (the last replica's arrival) is the round's wait_s."""
        mine = torch.tensor([*own, self.local_steps], dtype=torch.float32)
        gathered = torch.zeros(self.transport.size * len(mine), dtype=torch.float32)  # a lost round: 0s
        t0 = time.perf_counter()
        self.transport.all_gather(gathered, mine, async_op=False).wait()
        self.wait_s += time.perf_counter() - t0
        rows = self.transport.contributed_rows(gathered).view(-1, len(mine)).double()
        self.replicas_local_steps = float(rows[:, -1].sum())
        rows = rows[:, :-1]
        if not self.weighted:
            return [None] * len(own)
        self.round_weights.append(rows.sum(1).tolist())
        total, M = rows.sum(0), rows.shape[0]
        return [
            None if total[i] <= 0 else ((rows[:, i] * M / total[i]).float(), own[i] * M / float(total[i]))
            for i in range(len(own))
        ]

    def start_reduction(self, u: int, factor: Optional[float] = None) -> Reduction:
        """Unit u's part of a round, through the codec: Δ_m = θ_g − θ_m, or without θ_g (plain average,
        τ = 0) θ_m itself, reduced in place unless a round may fail (then a copy, which a drop discards).
        A packed codec only encodes it here (start_round sends the round's payloads together). `factor`:
        this replica's weight in a weighted round, taken by the fp32 sum before it is sent."""
        held = self.held[u]
        if not self.uses_global:
            x = held.clone() if self.transport.may_fail else held
            return self.codec_start(x, factor=factor)
        outer = self.state.outer[u]
        assert outer is not None, "a param sync before the global copy θ_g (start_global_copy)"
        delta = torch.empty_like(held)
        compute_delta(outer.global_params, held, delta)
        if self.eager:  # θ̂_m: this round's outer step with Δ_m for the mean; the replica trains on from it
            estimate = torch.empty_like(held)
            self.outer_opt.tentative(estimate, outer.global_params, outer.momentum, delta, outer.rounds)
            held.copy_(estimate)
            self.state.eager[u] = estimate
        error = self.state.error_of(u) if self.cfg.error_feedback else None
        self.keep_residual(u)
        return self.codec_start(delta, error, factor)

    def codec_start(
        self, x: torch.Tensor, error: Optional[torch.Tensor] = None, factor: Optional[float] = None
    ) -> Reduction:
        """A packed codec's encode (sent with the round), or the fp32 codec's all-reduce, started now."""
        if self.codec.packed:
            return cast(PackedCodec, self.codec).encode(x, error)
        if factor is not None and factor != 1.0:  # Σ_j c_j x_j / M: the weighted mean (x is this round's)
            x.mul_(factor)
        return self.codec.start(x, self.transport, self.delay > 0, error=error)

    # ---- error feedback on a transport that may fail (elastic, docs/design.md §9): a residual changes only
    # in a round that committed and counted this replica's part; otherwise it is put back as it was.
    def keep_residual(self, u: int) -> None:
        """Before the codec updates unit u's residual in a round that may not count: keep a copy."""
        error = self.state.error[u]
        if self.transport.may_fail and error is not None:
            self.residual_before[u] = error.clone()

    def settle_residuals(self, committed: bool) -> None:
        """After a round's commit: put the kept residuals back unless the round applied this replica's part."""
        if self.residual_before and not (committed and self.transport.counted):
            for u, before in self.residual_before.items():
                error = self.state.error[u]
                assert error is not None  # kept only where it existed (keep_residual)
                error.copy_(before)
        self.residual_before.clear()

    def apply(self, u: int, mean: torch.Tensor) -> None:
        """Unit u's landed round: θ_m ← the mean (plain average), or θ_g ← outer step with the mean Δ (round
        r's η, μ) and θ_m ← α·θ_m + (1 − α)·θ_g (hsdp τ = 0: α = 0, θ_m ← θ_g), or with eager
        θ_m ← θ_m + (θ_g − θ̂_m)."""
        held = self.held[u]
        if not self.uses_global:
            if mean is not held:
                held.copy_(mean)
            return
        state = self.state.outer[u]
        assert state is not None, "a param sync before the global copy θ_g (start_global_copy)"
        momentum = state.momentum
        first = momentum is None
        if momentum is None:
            momentum = state.momentum = torch.empty_like(held)
        eager = self.state.eager[u]
        # α = 0 adopts θ_g: let the kernel write it into held directly.
        out = torch.empty_like(held) if self.alpha > 0 or eager is not None else held
        self.outer_opt.step(out, state.global_params, momentum, mean, first, state.rounds)
        state.rounds += 1
        if eager is not None:  # the estimate replaced by θ_g; the local steps since the start kept
            held.add_(torch.sub(out, eager, out=eager))
            self.state.eager[u] = None
        elif out is not held and self.torchft:  # torchft's merge: θ_g.lerp(θ_m, α)
            held.copy_(out.lerp_(held, self.alpha))
        elif out is not held:
            held.lerp_(out, 1.0 - self.alpha)  # θ_m + (1 − α)(θ_g − θ_m); exact at α = 1

    # ------------------------------------------------------------ checkpointable state (hsdp/sync/state.py)
    @property
    def in_flight(self) -> list[PendingSync]:
        return self.state.in_flight

    @property
    def outer(self) -> list[Optional[OuterState]]:
        return self.state.outer

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The sync state's one serialised form ({"meta", "buffers"}, hsdp/sync/state.py).

        A sync in flight is stored as its already-reduced mean Δ and its land step: this waits for the
        reduction to *finish* (the collective only), but the outer step and merge still happen at the land
        step, so a run that checkpoints computes exactly what one that does not computes; loading starts
        no collective. The tensors alias the policy's buffers: save or clone them before training on.
        """
        for sync in self.in_flight:
            for red in sync.reductions:
                self.codec.finish(red, self.transport)
        return self.state.state_dict()

    def empty_state_dict(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Load targets shaped after a saved state_dict's `meta` (zeroed buffers)."""
        return self.state.empty_state_dict(meta)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

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
        if meta.get("eager_units") and not cfg.eager:
            raise ConfigError(
                f"sync.eager: checkpoint {path} has eager syncs in flight (saved with eager true), config has false"
            )
        if cfg.eager and meta["in_flight"] and not meta.get("eager_units"):
            raise ConfigError(
                f"sync.eager: checkpoint {path} has a param sync in flight started without eager, config has true"
            )
        per_round = [k for k, v in per_round_keys(cfg).items() if v]
        if meta.get("format") == 1 and meta.get("momentum_units") and per_round:
            raise ConfigError(
                f"sync.{per_round[0]}: checkpoint {path} (sync state format 1) has no round counts, which the "
                "per-round outer lr / momentum need"
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


def per_round_keys(cfg: SyncConfig) -> dict[str, bool]:
    """The keys that make η or μ depend on the round (docs/design.md §8.11), and whether each is set."""
    return {
        "outer_momentum_warmup": cfg.outer_momentum_warmup > 0,
        "outer_lr_warmup": cfg.outer_lr_warmup > 0,
        "outer_lr_schedule": cfg.outer_lr_schedule != "constant",
    }


def build_sync(cfg: SyncConfig, held: list[torch.Tensor], transport: Transport) -> SyncPolicy:
    """The configured policy over `held` (each unit's flat fp32 held shard), syncing through `transport`."""
    return SyncPolicy(cfg, held, transport)
