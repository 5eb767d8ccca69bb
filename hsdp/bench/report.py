"""Markdown: a sweep's table, and the slow-link benchmark's tables (runs, probes, sync check, crossovers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from hsdp.bench.analysis import Assessed, Crossover, Crossovers, Key, exposed_comm
from hsdp.bench.plan import NOCOMM, LinkPlan
from hsdp.bench.records import LinkRun, RunRecord
from hsdp.bench.spec import SweepSpec

if TYPE_CHECKING:  # (for the annotations only: a sweep has no probes)
    from hsdp.bench.probe import ProbeResult


def mib(b: Optional[float]) -> str:
    return "–" if b is None else f"{b / 2**20:,.1f} MiB"


def secs(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f} s"


def times(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}×"


def row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# ------------------------------------------------------------------ sweeps


def format_value(column: str, value: Any) -> str:
    if value is None:
        return "–"
    if column.endswith("bytes"):
        return mib(value)
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def ratio_cell(value: Any, reference: Any, is_reference: bool) -> str:
    """A sweep's `ratio:` column: the reference (first) run's value over this run's, in words that read right:
    "1× (reference)" on its own row, "N× fewer" / "N× more" elsewhere (3 digits), "same" within them; "–" where
    either is missing or not a positive number."""
    if is_reference:
        return "1× (reference)" if isinstance(reference, (int, float)) and reference > 0 else "–"
    if not (isinstance(value, (int, float)) and isinstance(reference, (int, float)) and value > 0 and reference > 0):
        return "–"
    fewer = reference / value
    if f"{fewer:.3g}" == "1" or f"{1 / fewer:.3g}" == "1":
        return "same"
    return f"{fewer:.3g}× fewer" if fewer > 1 else f"{1 / fewer:.3g}× more"


def sweep_table(spec: SweepSpec, records: Mapping[str, Optional[RunRecord]]) -> str:
    """One row per run (with `nocomm`, the twins fold into their run's row); None: the run left no summary."""
    cols = list(spec["columns"])
    values = {run: dict(r.summary) if r else {} for run, r in records.items()}
    if spec.get("nocomm"):
        cols += ["nocomm_step_time_s", "exposed_comm_s"]
        values = {run: v for run, v in values.items() if run in spec["runs"]}
        for run, v in values.items():
            pair = exposed_comm(records[run], records.get(run + NOCOMM))
            if pair:
                v.update(nocomm_step_time_s=pair[0], exposed_comm_s=pair[1])
    ratio, relative = spec.get("ratio"), spec.get("relative")
    head = ["run", *cols] + ([f"{ratio} ratio"] if ratio else []) + ([" vs ".join(relative)] if relative else [])
    lines = [row(head), "|" + "---|" * len(head)]
    reference = next(iter(values), None)  # the ratio column's: the first run
    reference_values = next(iter(values.values()), {})
    for run, v in values.items():
        cells = [run] + [format_value(c, v.get(c)) for c in cols]
        if ratio:
            cells.append(ratio_cell(v.get(ratio), reference_values.get(ratio), run == reference))
        if relative:
            a, b = v.get(relative[0]), values.get(relative[1], {}).get(relative[0])
            cells.append(f"{a / b:.2f}×" if a and b else "–")
        lines.append(row(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------ the slow-link benchmark


def rate_text(r: LinkRun) -> str:
    return "unshaped" if r.rate_bps is None else f"{r.rate_mbit:g} Mbit/s"


def run_row(r: LinkRun, a: Assessed) -> str:
    """The runs table's row of a finished run (`r.ok`)."""
    rec = r.finished
    reached = a.reached
    ttt = a.time_to_target_s
    if reached is not None and reached.step_to_target is None and a.target_val_loss is not None:
        to_target = "not reached"
    else:
        to_target = secs(ttt, 1) if ttt is not None else "–"
    tok = reached.tokens_to_target if reached else None
    return row(
        [
            r.run,
            rate_text(r),
            rec.steps,
            secs(rec.median_step_time_s),
            secs(rec.mean_step_s),
            times(a.mean_step_vs_target_run),
            secs(rec.train_time_s, 1),
            f"{rec.final_val_loss:.4f}",
            mib(rec.sync_bytes),
            mib(r.measured.link_bytes),
            to_target,
            times(a.time_to_target_vs_target_run),
            "–" if tok is None else f"{tok / 1e6:.2f}M",
            mib(reached.sync_bytes_to_target if reached else None),
            "–" if a.compute_utilization is None else f"{a.compute_utilization:.2f}",
        ]
    )


def runs_table(plan: LinkPlan, runs: Sequence[LinkRun], assessed: Mapping[Key, Assessed]) -> list[str]:
    M, S = plan.mesh
    pinned = "; each on its own CPU core" if plan.pin_cores else ""
    lines = [
        f"Mesh {M}×{S} (replicas or sites × ranks in each), one network namespace per replica or site, "
        f"one-way delay {plan.delay_ms:g} ms{pinned}; target = final val loss of `{plan.target}` at the same rate.",
        "",
        "| run | rate | steps | median step | mean step | mean vs "
        + plan.target
        + " | train time | final val | sync bytes | link bytes | to target | vs "
        + plan.target
        + " | tokens at target | sync bytes at target | compute util. |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if not r.ok:
            lines.append(f"| {r.run} | {rate_text(r)} | failed (exit {r.measured.returncode}) |" + " |" * 12)
        else:
            lines.append(run_row(r, assessed[(r.run, r.rate)]))
    return lines


def probes_table(probes: Sequence[ProbeResult]) -> list[str]:
    lines = [
        "",
        "Probe: one all_reduce (fp32, gloo) on the sync group across the link, vs ring bytes / rate; "
        "the same size on a shard group stays inside a namespace.",
        "",
        "| rate | tensor | ring bytes | expected (bytes·8/rate) | measured (median) | measured / expected "
        "| effective rate | same size, shard group |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in probes:
        lines.append(
            f"| {p.rate} | {mib(p.tensor_bytes)} | {mib(p.ring_bytes)} | {secs(p.expected_s)} | "
            f"{secs(p.sync_s_median)} | {times(p.measured_over_expected)} | "
            f"{p.effective_mbit:.1f} Mbit/s | {secs(p.shard_s_median)} |"
        )
    return lines


def sync_check_table(plan: LinkPlan, checked: Sequence[tuple[LinkRun, Assessed]]) -> list[str]:
    lines = [
        "",
        f"Sync collectives in the runs: Comm's recorded seconds on the sync group vs "
        f"S·sync_bytes·8/rate (S = {plan.mesh[1]} sync groups share a replica's or site's link; overlapped or delayed "
        "syncs hide part of their time, so only blocking ones should be near 1×); link bytes = "
        "what the replicas' veths sent, vs M·S·sync_bytes.",
        "",
        "| run | rate | sync calls | recorded | expected | recorded / expected | link / (M·S·sync) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r, a in checked:
        lines.append(
            f"| {r.run} | {rate_text(r)} | {r.finished.sync_calls} | {secs(r.finished.sync_seconds, 1)} | "
            f"{secs(a.sync_expected_s, 1)} | {times(a.sync_measured_over_expected)} | "
            f"{times(a.link_over_sync)} |"
        )
    return lines


def crossover_cells(c: Crossover) -> tuple[str, str]:
    """(the measured rates where the run wins, what the fit says)."""
    wins = ", ".join(f"{w:g}" for w in c.wins_at_mbit) or "none"
    at, side = c.crossover_mbit, c.wins
    fit = {None: "–", "all": "wins at every rate", "never": "never wins"}.get(
        side, f"wins {side} {at:,.0f} Mbit/s" if at is not None else "–"
    )
    return wins, fit


def crossover_table(plan: LinkPlan, cross: Mapping[str, Crossovers]) -> list[str]:
    lines = [
        "",
        f"Crossover vs `{plan.target}` (fit T = a + b/rate through the measured rates):",
        "",
        "| run | mean step: wins at (Mbit/s) | fitted crossover | time to target: wins at | fitted crossover |",
        "|---|---|---:|---|---:|",
    ]
    for run, c in cross.items():
        (a0, a1), (b0, b1) = crossover_cells(c.mean_step_s), crossover_cells(c.time_to_target_s)
        lines.append(f"| {run} | {a0} | {a1} | {b0} | {b1} |")
    return lines


def fault_lines(runs: Sequence[LinkRun]) -> list[str]:
    """One line per run with injected faults: what was injected, when (the steps every replica had logged),
    and what the elastic run's summary counted (rejoins, dropped syncs, failures)."""
    lines = []
    for r in runs:
        f = r.measured.faults
        if not f:
            continue
        parts = []
        if "partition" in f:
            p = f["partition"]
            parts.append(
                f"replica {p['replica']}'s link down at its step {p['step']} for {p['seconds']:g} s "
                f"(steps logged at the cut {p.get('steps_at_cut', '–')}, "
                f"at the restore {p.get('steps_at_restore', '–')})"
            )
        if "kill" in f:
            parts.append(f"replica {f['kill']['replica']}'s node killed at its step {f['kill']['step']}")
        if "slow" in f:
            parts.append(f"replica {f['slow']['replica']}'s node {f['slow']['factor']:g}× slower")
        if f.get("chaos"):
            applied = [x for x in f.get("faults", []) if x.get("applied_s") is not None]
            parts.append(f"chaos {f['chaos']['seed']}:{f['chaos']['mtbf_s']:g}, {len(applied)} faults (table below)")
        if "after" in f and not f.get("chaos"):  # a kill's or cut's run: its final models (the chaos table has them)
            after = f["after"]
            parts.append(f"replicas equal: {equal_cell(after, len(after.get('steps_lost', {})))}")
        s = r.record.summary if r.record else {}
        counted = [f"{k} {s[k]}" for k in ("rejoins", "dropped_syncs", "replica_failures", "heals") if k in s]
        lines.append(f"- {r.run} @ {r.rate}: {'; '.join(parts)}" + (f"; {', '.join(counted)}" if counted else ""))
    return ["", "Faults injected:", "", *lines] if lines else []


def ledger_table(runs: Sequence[LinkRun]) -> list[str]:
    """The rounds' ledger of each run (docs/design.md §8.12): goodput (tokens merged into the global model ÷
    tokens trained, every replica), the most any replica waited at syncs as a share of its wall time, and
    the tokens each replica trained. Empty when no run reports it."""
    rows = [r for r in runs if r.ok and r.finished.summary.get("goodput") is not None]
    if not rows:
        return []
    lines = [
        "",
        "Rounds' ledger: goodput = tokens merged ÷ tokens trained (all replicas); wait = the most any replica "
        "spent waiting at syncs (quorums, the weight exchange) ÷ its wall time.",
        "",
        "| run | rate | wall time | final val | goodput | wait (max) | tokens trained per replica | steps skipped |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        rec = r.finished
        s = rec.summary
        ledger = s.get("replica_ledger") or {}
        trained = ", ".join(f"{m}: {e['trained_tokens'] / 1e6:.2f}M" for m, e in ledger.items())
        skipped = ", ".join(f"{m}: {e.get('skipped_steps', '–')}" for m, e in ledger.items())
        wait = s.get("wait_fraction")
        lines.append(
            row(
                [
                    r.run,
                    rate_text(r),
                    secs(rec.wall_time_s, 1),
                    f"{rec.final_val_loss:.4f}",
                    f"{s['goodput']:.3f}",
                    "–" if wait is None else f"{wait:.3f}",
                    trained,
                    skipped,
                ]
            )
        )
    return lines


FAULT_KINDS = ("kill", "partition", "slow", "chaos")  # what a run's measured faults may hold (hsdp/bench/*.py)


def had_faults(r: LinkRun) -> bool:
    """Whether faults were injected into the run (a kill, a cut, a slow node, a chaos schedule)."""
    return any(k in (r.measured.faults or {}) for k in FAULT_KINDS)


def chaos_table(plan: LinkPlan, runs: Sequence[LinkRun], assessed: Mapping[Key, Assessed]) -> list[str]:
    """The chaos runs (hsdp/bench/chaos.py) against the target run at their rate: the faults by kind, the
    replicas that failed on their own and were restarted, goodput two ways (the target run's time to its
    final val loss ÷ this run's; its wall time ÷ this run's, for the same steps) and merged ÷ trained tokens,
    the steps the replicas did not train, and what the schedule left behind (checkpoints whose checksums
    hold, the replicas' final params bitwise equal, processes left in the namespaces). No goodput is taken
    against a target run that had faults itself (it is no calm baseline)."""
    chaos = [r for r in runs if r.measured.faults and "chaos" in r.measured.faults]
    if not chaos:
        return []
    target = {r.rate: r for r in runs if r.run == plan.target and r.ok and not had_faults(r)}
    faulty = sorted({r.rate for r in runs if r.run == plan.target and had_faults(r)})
    note = (
        [f"`{plan.target}` had faults injected at {', '.join(faulty)}: no goodput is taken against it there.", ""]
        if faulty
        else []
    )
    lines = [
        "",
        f"Chaos (goodput against `{plan.target}` at the same rate: its time to its final val loss ÷ the run's, "
        "and its wall time ÷ the run's; merged = tokens merged ÷ tokens trained):",
        "",
        *note,
        "| run | rate | seed:MTBF | faults | restarted on their own | wall time | final val | vs target | "
        "goodput (to target) | goodput (wall) | merged | steps lost | checkpoints valid | replicas equal | "
        "processes left |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in chaos:
        f = r.measured.faults or {}
        kinds: dict[str, int] = {}
        for fault in f.get("faults", []):
            kinds[fault["kind"]] = kinds.get(fault["kind"], 0) + 1
        after = f.get("after", {})
        base = target.get(r.rate)
        a = assessed.get((r.run, r.rate))
        ttt = a.time_to_target_vs_target_run if a and base is not None else None
        wall = r.finished.wall_time_s if r.ok else None
        base_wall = base.finished.wall_time_s if base is not None and base.ok else None
        val = r.finished.final_val_loss if r.ok else None
        base_val = base.finished.final_val_loss if base is not None and base.ok else None
        n_ckpt, bad = after.get("checkpoints", 0), len(after.get("invalid_checkpoints", []))
        merged = r.finished.summary.get("goodput") if r.ok else None
        lines.append(
            row(
                [
                    r.run,
                    rate_text(r),
                    f"{f['chaos'].get('seed')}:{f['chaos'].get('mtbf_s'):g}" if f.get("chaos") else "–",
                    ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none",
                    len(f.get("crashes", [])),
                    secs(wall, 1),
                    "failed" if val is None else f"{val:.4f}",
                    "–" if val is None or not base_val else f"{val / base_val - 1:+.1%}",
                    "–"
                    if base is None
                    else to_target_cell(ttt, a, r.finished.steps if r.ok else None, wall, base_wall),
                    "–" if not wall or not base_wall else f"{base_wall / wall:.2f}",
                    "–" if merged is None else f"{merged:.3f}",
                    sum(after.get("steps_lost", {}).values()),
                    f"{n_ckpt - bad}/{n_ckpt}",
                    equal_cell(after, plan.mesh[0]),
                    after.get("processes_left", "–"),
                ]
            )
        )
    return lines


def to_target_cell(
    ttt: Optional[float], a: Optional[Assessed], steps: Optional[int], wall: Optional[float], base_wall: Optional[float]
) -> str:
    """The chaos table's goodput to the target: the target run's time to its final val loss ÷ the run's (`ttt`:
    their ratio), or, where the run's time to it is not in its records (steps missing from its metrics, as a
    healed replica's are), the wall times' ratio when the target was first met at the run's last step (both runs
    then reached it at their ends), else the step it was met at. "not reached" only where no eval met it."""
    if ttt is not None:
        return f"{1 / ttt:.2f}"
    step = a.reached.step_to_target if a is not None and a.reached is not None else None
    if step is None:
        return "not reached"
    if steps is not None and step == steps - 1 and wall and base_wall:
        return f"{base_wall / wall:.2f} (at its end)"
    return f"reached at step {step}"


def equal_cell(after: dict[str, Any], replicas: int) -> str:
    """Whether the chaos run's final models were bitwise equal (only asked when it ended on a sync), and how
    many of its replicas finished."""
    if after.get("ends_on_sync") is False:
        cell = "– (no final sync)"
    else:
        cell = {True: "yes", False: "NO", None: "–"}[after.get("replicas_equal")]
    models = after.get("models", replicas)
    return cell + (f" ({models} of {replicas} finished)" if models < replicas else "")


def link_tables(
    plan: LinkPlan,
    runs: Sequence[LinkRun],
    assessed: Mapping[Key, Assessed],
    probes: Sequence[ProbeResult],
    cross: Mapping[str, Crossovers],
) -> str:
    """slowlink.md: the runs, then (where there are any) the probes, the sync-time check and the crossovers."""
    lines = runs_table(plan, runs, assessed) + fault_lines(runs) + chaos_table(plan, runs, assessed)
    lines += ledger_table(runs)
    if probes:
        lines += probes_table(probes)
    checked = [(r, assessed[(r.run, r.rate)]) for r in runs if r.ok and assessed[(r.run, r.rate)].sync_expected_s]
    if checked:
        lines += sync_check_table(plan, checked)
    if cross:
        lines += crossover_table(plan, cross)
    return "\n".join(lines)
