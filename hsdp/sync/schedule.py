"""When things cross the sync group (docs/design.md §8): the schedule of one SyncConfig.

    step s < warmup_steps        grads averaged across replicas (exact HSDP)
    fragment f's slots           the steps s >= warmup with (s + 1 − warmup − (f+1)·every/P) % every == 0
    after the update of step s   fragment f's sync starts iff s is a slot (schedule hsdp: it lands τ steps
                                 later) or s + τ is one (schedule torchft, §8.9: it lands at the slot)
    units → fragments            round-robin: fragment f holds units f, f+P, f+2P, …

Pure functions of the config and the step; the policy, `train.py` (the end-of-run
note) and the tests share them.
"""

from __future__ import annotations

from hsdp.config.schema import SyncConfig


def grad_sync_due(step: int, cfg: SyncConfig) -> bool:
    """Grads are averaged across the sync group on step s iff s < warmup_steps (None: always)."""
    return cfg.warmup_steps is None or step < cfg.warmup_steps


def slots_due(step: int, cfg: SyncConfig) -> list[int]:
    """The fragments whose slot is the update of `step` (docs/design.md §8.2): where a blocking sync happens."""
    if cfg.warmup_steps is None or step < cfg.warmup_steps:
        return []
    P, H = cfg.fragments, cfg.every
    return [f for f in range(P) if (step + 1 - cfg.warmup_steps - (f + 1) * H // P) % H == 0]


def start_offset(cfg: SyncConfig) -> int:
    """How many steps before its slot a fragment's sync starts: 0 (schedule hsdp: it starts at the slot and
    lands τ later) or τ (schedule torchft: it starts τ before the slot and lands at it, §8.9)."""
    return cfg.delay if cfg.schedule == "torchft" else 0


def fragments_due(step: int, cfg: SyncConfig) -> list[int]:
    """The fragments whose param sync starts after the local update of `step` (and lands τ steps later)."""
    return slots_due(step + start_offset(cfg), cfg)


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


def fragment_units(n_units: int, fragments: int) -> list[list[int]]:
    """The units of each fragment (dealt round-robin, so each fragment holds a similar share of params)."""
    return [list(range(f, n_units, fragments)) for f in range(fragments)]


def uses_global_copy(cfg: SyncConfig) -> bool:
    """Whether the sync keeps θ_g: DiLoCo, a lossy codec (Δ is taken against θ_g), a delayed sync (its Δ_m
    is snapshotted against θ_g, even for plain averaging) or a merge with α > 0 (θ_m is mixed with θ_g)."""
    lossy = cfg.quantize != "none" or cfg.topk > 0
    return cfg.method == "diloco" or lossy or cfg.delay > 0 or cfg.alpha > 0


def weights_by_tokens(cfg: SyncConfig) -> bool:
    """Whether the outer mean weights each replica's Δ by the tokens it trained since the fragment's last
    sync (sync.weighting tokens, or auto on a paced run: docs/design.md §8.12)."""
    return cfg.weighting == "tokens" or (cfg.weighting == "auto" and cfg.every_s > 0)


def last_round_step(steps: int, cfg: SyncConfig) -> int:
    """The last step of a `steps`-step run after which a param sync starts (-1: none)."""
    if cfg.warmup_steps is None:
        return -1
    return max((s for s in range(cfg.warmup_steps, steps) if fragments_due(s, cfg)), default=-1)
