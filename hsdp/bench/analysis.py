"""The numbers read off typed run records: time to target, sync-time and link-byte checks, crossovers, exposed comm.

Slow link: the target is the final val loss of the plan's target run at each rate (at a rate
where it has none, the first rate's). A run's time to target is the cumulative step time
(metrics.jsonl's `step_time_s`, which excludes evals, so `run.log_every=1` is needed) up to
the first eval whose val loss is at or below it. The crossover fits T = a + b/rate (compute +
bytes/rate) through each run's rates and solves a_run + b_run/r = a_ref + b_ref/r.

Sweep: a run's exposed communication is its median step time minus its no-comm twin's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from hsdp.bench.plan import LinkPlan
from hsdp.bench.records import LinkRun, LoggedStep, RunRecord, wall_clock

# ------------------------------------------------------------------ time to target


@dataclass(frozen=True)
class Reached:
    """The first eval at or below the target: its step, tokens, sync bytes and training seconds (None: never)."""

    step_to_target: Optional[int] = None
    tokens_to_target: Optional[int] = None
    sync_bytes_to_target: Optional[int] = None
    time_to_target_s: Optional[float] = None  # None also when not every step was logged


def time_to_target(steps: Sequence[LoggedStep], target: Optional[float]) -> Optional[Reached]:
    """Where a run's metrics first reach `target` (None without a target)."""
    if target is None:
        return None
    cum = wall_clock(list(steps))
    for s in steps:
        if s.val_loss is not None and s.val_loss <= target + 1e-9:
            return Reached(s.step, s.tokens, s.sync_bytes, cum[s.step] if cum else None)
    return Reached()


# ------------------------------------------------------------------ a run against its rate and the target run


@dataclass(frozen=True)
class Assessed:
    """What the analysis says about one finished LinkRun."""

    target_val_loss: Optional[float]
    reached: Optional[Reached] = None  # None: no target
    sync_expected_s: Optional[float] = None  # S·sync_bytes·8/rate; None unshaped
    sync_measured_over_expected: Optional[float] = None
    link_over_sync: Optional[float] = None  # link bytes / (M·S·sync_bytes); None without both
    mean_step_vs_target_run: Optional[float] = None  # None: the target run has no result at this rate
    time_to_target_vs_target_run: Optional[float] = None
    # compute utilisation: the plan's sync-free step time ÷ this run's mean step time (what Streaming DiLoCo and
    # INTELLECT-1 report); None without a sync-free step in any run of the plan
    compute_utilization: Optional[float] = None

    @property
    def time_to_target_s(self) -> Optional[float]:
        return self.reached.time_to_target_s if self.reached else None

    def to_json(self) -> dict[str, Any]:
        """slowlink.json's analysis keys of the run's entry (a key is absent where it does not apply)."""
        out: dict[str, Any] = {"target_val_loss": self.target_val_loss}
        if self.reached is not None:
            out.update(dataclasses.asdict(self.reached))
        if self.sync_expected_s is not None:
            out.update(
                sync_expected_s=self.sync_expected_s, sync_measured_over_expected=self.sync_measured_over_expected
            )
        if self.link_over_sync is not None:
            out["link_over_sync"] = self.link_over_sync
        if self.compute_utilization is not None:
            out["compute_utilization"] = self.compute_utilization
        if self.mean_step_vs_target_run is not None:
            out.update(
                mean_step_vs_target_run=self.mean_step_vs_target_run,
                time_to_target_vs_target_run=self.time_to_target_vs_target_run,
            )
        return out


Key = tuple[str, str]  # (run, rate label)


def target_losses(plan: LinkPlan, runs: Sequence[LinkRun]) -> dict[str, float]:
    """rate label → the target run's final val loss there, for the rates where it finished."""
    return {  # the condition is `r.ok`, spelled out so that the loss is known to be a float
        r.rate: r.record.final_val_loss
        for r in runs
        if r.run == plan.target and r.record is not None and r.record.final_val_loss is not None
    }


def target_at(rate: str, targets: dict[str, float]) -> Optional[float]:
    """The target at `rate`, else the first rate's (the target run failed at this one), else None."""
    return targets.get(rate, next(iter(targets.values()), None))


def assess(plan: LinkPlan, r: LinkRun, target: Optional[float]) -> Assessed:
    """A finished run (`r.ok`) on its own: time to target, and its sync seconds and link bytes against its sync
    bytes."""
    M, S = plan.mesh
    rec = r.finished
    sync_bytes = rec.sync_bytes or 0
    expected = ratio = link = None
    if r.rate_bps:  # every shard rank's sync group shares the replica's link
        expected = S * sync_bytes * 8 / r.rate_bps
        ratio = rec.sync_seconds / expected if sync_bytes else None
    if r.measured.link_bytes is not None and sync_bytes:
        link = r.measured.link_bytes / (M * S * sync_bytes)
    return Assessed(target, time_to_target(rec.metrics, target), expected, ratio, link)


def against_target_run(a: Assessed, r: LinkRun, base: LinkRun, base_a: Assessed) -> Assessed:
    """`a` with the ratios of mean step time and time to target to the target run's at the same rate (both
    runs finished)."""
    mean, base_mean = r.finished.mean_step_s, base.finished.mean_step_s
    t, base_t = a.time_to_target_s, base_a.time_to_target_s
    return dataclasses.replace(
        a,
        mean_step_vs_target_run=mean / base_mean if mean is not None and base_mean else None,
        time_to_target_vs_target_run=t / base_t if t is not None and base_t else None,
    )


def sync_free_step_s(runs: Sequence[LinkRun]) -> Optional[float]:
    """The step time without sync traffic that every run of a plan is measured against: the fastest of its
    runs' sync-free medians (the runs share the model and mesh, so their compute is the same; a run's own may
    be slower where a heal or a slow spell fell on its local steps). None if no run logged such a step."""
    frees = [r.finished.sync_free_step_s for r in runs if r.ok]
    known = [f for f in frees if f is not None]
    return min(known) if known else None


def evaluate_results(plan: LinkPlan, runs: Sequence[LinkRun]) -> dict[Key, Assessed]:
    """Every finished run assessed: target, time to target, sync-time and link checks, ratios to the target run."""
    targets = target_losses(plan, runs)
    out = {(r.run, r.rate): assess(plan, r, target_at(r.rate, targets)) for r in runs if r.ok}
    free = sync_free_step_s(runs)
    for r in runs:
        mean = r.finished.mean_step_s if r.ok else None
        if r.ok and free is not None and mean:
            key = (r.run, r.rate)
            out[key] = dataclasses.replace(out[key], compute_utilization=free / mean)
    ref = {r.rate: r for r in runs if r.run == plan.target and r.ok}
    for r in runs:
        base = ref.get(r.rate)
        if base is not None and r.ok:
            key = (r.run, r.rate)
            out[key] = against_target_run(out[key], r, base, out[(base.run, base.rate)])
    return out


# ------------------------------------------------------------------ crossovers


@dataclass(frozen=True)
class Crossover:
    """Where a run beats the target run on one criterion: at the measured rates, and by the fitted curves."""

    wins_at_mbit: list[float]
    measured_at_mbit: list[float]
    crossover_mbit: Optional[float]  # the rate where the fitted curves meet
    wins: Optional[str]  # below | above (the crossover) | all | never; None without two fits


@dataclass(frozen=True)
class Crossovers:
    mean_step_s: Crossover  # throughput
    time_to_target_s: Crossover


def fit_time(points: list[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """Least squares T(rate) = a + b / rate over (rate_mbit, seconds); None with fewer than 2 rates."""
    if len({p for p, _ in points}) < 2:
        return None
    xs = [1 / p for p, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def crossing(
    mine: Optional[tuple[float, float]], ref: Optional[tuple[float, float]]
) -> tuple[Optional[float], Optional[str]]:
    """Where a + b/r (mine) meets the reference's: (r*, below|above), or (None, all|never|None)."""
    if not mine or not ref:
        return None, None
    (a1, b1), (a0, b0) = mine, ref
    da, db = a1 - a0, b0 - b1  # mine costs da more compute, saves db on the link (bits/Mbit·s)
    if da <= 0 and db >= 0:
        return None, "all"
    if da >= 0 and db <= 0:
        return None, "never"
    return db / da, "below" if da > 0 else "above"


def crossovers(plan: LinkPlan, runs: Sequence[LinkRun], assessed: dict[Key, Assessed]) -> dict[str, Crossovers]:
    """Per run but the target: the rates (measured) where it beats the target run, and the fitted crossover.

    Two criteria: mean step time (throughput) and time to the target val loss; only shaped rates count.
    """

    def value(r: LinkRun, criterion: str) -> Optional[float]:
        if criterion == "mean_step_s":
            return r.finished.mean_step_s
        return assessed[(r.run, r.rate)].time_to_target_s

    def measured(rs: Sequence[LinkRun], criterion: str) -> list[tuple[str, float, float]]:
        """(rate label, Mbit/s, the criterion's value) of each shaped run that has a value."""
        points = []
        for r in rs:
            v = value(r, criterion)
            if r.rate_mbit is not None and v is not None:
                points.append((r.rate, r.rate_mbit, v))
        return points

    shaped = [r for r in runs if r.rate_mbit and r.ok]
    ref = [r for r in shaped if r.run == plan.target]
    out: dict[str, Crossovers] = {}
    for run in plan.runs:
        if run == plan.target:
            continue
        mine = [r for r in shaped if r.run == run]
        found: dict[str, Crossover] = {}
        for criterion in ("mean_step_s", "time_to_target_s"):
            at_mine, at_ref = measured(mine, criterion), measured(ref, criterion)
            pairs = [(mbit, a, b) for label, mbit, a in at_mine for label_b, _, b in at_ref if label_b == label]
            fit_mine = fit_time([(mbit, t) for _, mbit, t in at_mine])
            fit_ref = fit_time([(mbit, t) for _, mbit, t in at_ref])
            at, wins = crossing(fit_mine, fit_ref)
            found[criterion] = Crossover(
                wins_at_mbit=sorted(rate for rate, a, b in pairs if a < b),
                measured_at_mbit=sorted(p for p, _, _ in pairs),
                crossover_mbit=at,
                wins=wins,
            )
        out[run] = Crossovers(**found)
    return out


# ------------------------------------------------------------------ sweeps


def exposed_comm(run: Optional[RunRecord], nocomm: Optional[RunRecord]) -> Optional[tuple[float, float]]:
    """(the no-comm twin's median step, the difference): the communication not hidden behind compute."""
    step = run.median_step_time_s if run else None
    bare = nocomm.median_step_time_s if nocomm else None
    if step is None or bare is None:
        return None
    return bare, step - bare
