"""The checkpoint's key layout: where each piece of an engine's state lives among DCP's keys (docs/design.md §12.1).

An engine hands its state by role (`EngineState`: model params, inner optimizer state, sync
state cut per param), never as keys; this module alone names them:

    engines whose replicas differ (hsdp; `Engine.state_per_replica`):
        replica{m}.model.<p>            replica m's params
        replica{m}.optim.<p>.<s>        its inner optimizer state (AdamW exp_avg, exp_avg_sq, step)
        sync.<b>.<p>                    a sync buffer identical on every replica (θ_g: sync.global, b, Δ in flight)
        replica{m}.sync.<b>.<p>         a sync buffer of the replica's own (error feedback's residual)
    one model (the fsdp2/ddp baselines, torch's state-dict API; DCP flattens the nesting):
        model.<p>, optim.state.<p>.<s>, optim.param_groups.…
    every engine:
        rank{r}.extra                   rank r's pickled extras (RNG, Comm counters, the loop's progress)
"""

from __future__ import annotations

from typing import Any, Optional

from hsdp.config.schema import ConfigError
from hsdp.engines.base import EngineState

MODEL, OPTIM, SYNC = "model", "optim", "sync"
GLOBAL_BUFFER = "global"  # the sync buffer that holds θ_g


def model_prefix(per_replica: bool, replica: int) -> str:
    """The key prefix of replica `replica`'s params (one model: the same for every replica)."""
    return f"replica{replica}.{MODEL}." if per_replica else f"{MODEL}."


def sync_prefix(buffer: str, own: bool, replica: int) -> str:
    """The key prefix of a sync buffer's per-param pieces (`own`: it differs between replicas)."""
    return f"replica{replica}.{SYNC}.{buffer}." if own else f"{SYNC}.{buffer}."


def extra_key(rank: int) -> str:
    return f"rank{rank}.extra"


def dcp_state(state: EngineState, per_replica: bool, replica: int, own_buffers: bool = True) -> dict[str, Any]:
    """An engine's state as DCP's state dict (values are the engine's own tensors: saved from, or loaded into,
    in place). `replica`: the saved replica whose keys these are; `own_buffers=False` leaves the replica's own
    sync buffers out (a load onto another mesh.sync: they belong to no replica of the new mesh)."""
    if not per_replica:
        return {MODEL: state.model, OPTIM: state.optim}
    keyed: dict[str, Any] = {model_prefix(True, replica) + n: t for n, t in state.model.items()}
    optim = f"replica{replica}.{OPTIM}."
    keyed.update({f"{optim}{n}.{k}": v for n, per_param in state.optim.items() for k, v in per_param.items()})
    for buffer, pieces in state.sync_buffers.items():
        own = buffer in state.replica_own
        if own and not own_buffers:
            continue
        prefix = sync_prefix(buffer, own, replica)
        keyed.update({prefix + n: t for n, t in pieces.items()})
    return keyed


def export_prefix(per_replica: bool, meta: dict[str, Any], replica: Optional[int], use_global: bool) -> tuple[str, str]:
    """(key prefix of the params to export, what they are): θ_g by default where the sync state has it, else
    replica 0; `replica` picks replica m's own (ConfigError naming the option when the checkpoint has no such)."""
    if not per_replica:
        if replica not in (None, 0) or use_global:
            raise ConfigError(f"--replica/--global: a {meta['engine']} checkpoint holds one model")
        return model_prefix(False, 0), f"the {meta['engine']} model"
    has_global = bool(meta["engine_meta"].get(SYNC, {}).get("has_global"))
    if use_global or (replica is None and has_global):
        if not has_global:
            raise ConfigError(
                "--global: the checkpoint has no global copy θ_g (plain average keeps none, and "
                "none exists before the end of the sync warmup); use --replica m"
            )
        return sync_prefix(GLOBAL_BUFFER, False, 0), "θ_g (the global model)"
    m = replica or 0
    if not 0 <= m < meta["mesh"]["sync"]:
        raise ConfigError(f"--replica: expected 0..{meta['mesh']['sync'] - 1}, got {m}")
    return model_prefix(True, m), f"replica {m}"
