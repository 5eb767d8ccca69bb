"""Beyond this machine: a step's compute from FLOPs on a named GPU, and what a replica failure costs.

Compute (the scaling-laws paper's T_comp = 6ND / (R·Q), per step): a rank computes its share of the
step's tokens at `mfu` × its GPU's peak,

    step_s = flops_per_token · tokens_per_step / (M · S · peak · mfu)

with the peak from hsdp.models.gpt's table (dense 16-bit tensor-core FLOP/s, as train.py's MFU uses) or
`--flops`. Codec and outer-step compute (`sync_s`) are not projected: they are memory-bound passes
over the held shard, small next to a step at these sizes; calibrate on a run to include them.

Failure (docs/design.md §9): the survivors lose about `elastic.heartbeat_timeout_s` (the lighthouse drops a
silent replica) plus one sync; the restarted replica meets them once its dead life is dropped (after the longer
of `elastic.restart_delay_s` and `elastic.heartbeat_timeout_s`), fetches its state from a live peer over the
inter link (held params, AdamW moments, DiLoCo's outer momentum, per rank, S ranks on one link), and trains
again from the next sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.config.schema import Config, ConfigError
from hsdp.models.gpt import PEAK_TFLOPS_16BIT
from hsdp.plan.model import Compute, Link, Timeline
from hsdp.plan.workload import Workload, state_bytes_per_rank


def gpu_peak_flops(name: str) -> float:
    """A GPU's dense 16-bit peak FLOP/s by (part of) its name, from hsdp.models.gpt's table."""
    for gpu, tflops in PEAK_TFLOPS_16BIT.items():
        if name.lower() == gpu.lower():
            return tflops * 1e12
    for gpu, tflops in PEAK_TFLOPS_16BIT.items():
        if name.lower() in gpu.lower():
            return tflops * 1e12
    known = ", ".join(PEAK_TFLOPS_16BIT)
    raise ConfigError(f"--gpu: unknown GPU {name!r} (known: {known}; or give --flops PEAK_FLOP_PER_S)")


def projected_compute(w: Workload, peak_flops: float, mfu: float) -> Compute:
    """One step's compute on GPUs of `peak_flops` at `mfu` (the paper's T_comp per step)."""
    step_s = w.flops_per_token * w.tokens_per_step / (w.M * w.R * w.S * peak_flops * mfu)
    step_s += w.muon_flops_per_step() / (peak_flops * mfu)  # Muon's Newton–Schulz (bf16 matmuls)
    return Compute(step_s=step_s, sync_s=0.0, source=f"{peak_flops / 1e12:g} TFLOP/s × MFU {mfu:g}")


@dataclass
class FailureCost:
    survivor_lost_s: float  # elastic.heartbeat_timeout_s + one sync
    heal_bytes_per_rank: int
    heal_s: float  # restart delay + the state over the link


def failure_cost(w: Workload, link: Link, compute: Compute, cfg: Config) -> FailureCost:
    """What one replica failure costs at this link (an estimate from the elastic design, §9)."""
    tl = Timeline(w, link, Compute(step_s=0.0, sync_s=0.0))
    if w.sync.warmup_steps is None:  # exact HSDP: a round per step, one step's grad all-reduces
        one_sync = sum(tl.inter_time(w.grad_sync_message(u)) for u in range(len(w.units)))
    else:
        one_sync = max(  # one round: the largest fragment's units
            sum(tl.inter_time(m) for m in w.round_sync_messages(units)) for units in w.fragments()
        )
    heal = state_bytes_per_rank(w)
    e = cfg.elastic
    meets_s = max(e.restart_delay_s, e.heartbeat_timeout_s)  # a restart meets no quorum before its dead life is dropped
    heal_s = meets_s + w.S * heal * 8 * link.overhead / link.inter_bps + link.latency_s
    return FailureCost(e.heartbeat_timeout_s + one_sync + compute.sync_s, heal, heal_s)
