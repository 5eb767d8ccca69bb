"""Where a chaos soak's time went, fault by fault: a slow-link chaos run against its calm run (no torch).

    python scripts/chaos_breakdown.py runs/chaos-soak2 [--run chaos] [--tail-s S] [--top N]

Reads the folder's slowlink.json (the runs, the chaos run's applied faults with their times) and, from each
run's directory (its `dir`; if that is not there, the folder of that name beside FOLDER), every replica's
metrics.replica<m>.jsonl. Prints markdown: one row per applied fault (its kind, replica, when, what it cost),
totals per kind, and the cost no fault is charged with.

One clock. The faults' times count from when every replica had logged a step (hsdp/bench/chaos.py). A record's
`elapsed_s` counts from its process's start, and a restarted life carries its earlier life's last value on
(hsdp/run/metrics.py CARRIED), so the time a replica was down is in no record: each life (replica, life) gets its
own offset, t = elapsed_s + offset. Relative offsets come from the param-sync rounds (replicas in one round log
its `synced` step within ~0.1 s: the median difference over shared synced steps, lives joined along the pairs
that share the most); the absolute one from the faults (a fault applied at A with the replica's last logged step
s: step s was logged before A, its next record after A; a kill is over when the replacement's first record is
there, unless the killed life logged once more before it died), clipped into what every such bound allows;
with no bound, t = 0 when the last replica logged its first step. The calm run gets the same relative
alignment and that t = 0.

Two costs per fault, each under a rule stated here, so they add up to totals that are checked:

lost replica-steps = gap + idle / pace
    gap     a replica's step numbers that no record of it holds (a kill's restart; a heal after a cut or a
            stop, which jumps it to its peers' step): charged to its own faults whose windows overlap the
            interval from the start of the record before the gap (that record holds the pause at its sync)
            to the record after it, in proportion to the overlap; with none of its own, to the other faults
            (the lighthouse's included) that overlap; else `unattributed`. Summed over faults and the
            unattributed line, this is slowlink.json's `steps_lost`.
    idle    per replica and param round (two consecutive synced records of one life, no gap between them or
            right after the second): its round's duration minus the calm run's same round (the median over
            its replicas), positive parts only: a replica that waited at a quorum, for a stopped or slowed
            peer, a dropped round's timeout, or ran slowed itself. Charged as gaps are (its own faults first).
            A round with no fault in its window goes to `unattributed` (net: faster rounds count there too).
    pace    seconds per step of the calm run (its frontier's last step time over its steps; ~0.18 s): its
            wall pace, syncs and the 2-core host's contention included. The calm median step (~0.10 s)
            would turn one calm round's ~5.9 s into ~58 steps where 32 were trained.

delay s: seconds of the run's wall time
    The run's frontier T(s): the first time any replica logged step s or later. For each param round (the
    calm run's synced steps) its excess = chaos round duration - calm round duration; the excesses sum to
    the chaos frontier's end minus the calm one's. A round whose chaos window overlaps fault windows
    charges a positive excess to them in proportion to the overlap; a negative one (faster than calm: with a
    replica down, two trainers share the host's two cores instead of three) is not credited to any fault
    and is shown as its own line. Rounds with no fault: `unattributed`, net.

A fault's window is [applied, over + tail]: the tail (default one calm round) holds the heal that follows
at the first round after a stop, a cut or a lighthouse restart. Overlapping windows share a cost by overlap;
faults queued on one replica (applied when the earlier one ended: soaks before a fault drawn for a held
replica moved to a free one) overlap it. Records before a replica's
first or after its last are outside every rule; so are work trained and then discarded at a heal (its
local period, never merged: the run's `merged` goodput counts that), and what the run's close and summary
took after the last step's record.

Limits: sharing by window overlap is a convention, not causality (a kill whose replacement was held up by a
lighthouse outage keeps the whole gap: its own fault comes first); a round's positive excess in a fault
window includes that round's ordinary jitter (~±0.5 s here); idle replica-seconds and delay seconds count
the same stall in two units (replicas waiting vs the run waiting) and are not to be added together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

EPS_S = 0.5  # the chaos controller's lag between reading a metrics file and its clock (a 0.2 s tick, slack)
KILL_LAG_S = 1.0  # a kill is over at the first tick that sees the replacement's record: at most this later
MIN_SHARED = 3  # synced steps two lives must share to align them
Life = tuple[int, int]  # (replica, life)


@dataclass(frozen=True)
class Fault:
    """An applied fault of slowlink.json (`over_s` None: still on at the end)."""

    index: int
    label: str
    kind: str
    replica: Optional[int]
    applied_s: float
    over_s: Optional[float]
    step: Optional[int]


@dataclass
class Record:
    """A metrics record's fields this script uses; `t` once aligned."""

    replica: int
    life: int
    step: int
    elapsed_s: float
    step_time_s: float
    synced: bool
    t: float = 0.0


@dataclass
class Cost:
    """What one fault cost: gap steps, idle replica-seconds, run delay seconds."""

    fault: Fault
    gap: float = 0.0
    idle_s: float = 0.0
    delay_s: float = 0.0

    def steps(self, pace_s: float) -> float:
        return self.gap + self.idle_s / pace_s


@dataclass
class Breakdown:
    """The attribution of one chaos run against its calm run."""

    costs: list[Cost]
    pace_s: float
    tail_s: float
    start_s: float  # the frontier's first step: chaos − calm
    end_s: float  # the frontier's last step: chaos − calm (the run's delay)
    unattributed_gap: float = 0.0
    unattributed_idle_s: float = 0.0
    unattributed_delay_s: float = 0.0  # net, rounds with no fault
    speedup_s: float = 0.0  # faster-than-calm rounds inside fault windows (not credited)
    steps_lost: int = 0  # every gap's steps
    offsets: dict[Life, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- reading
def read_records(path: Path, replica: int) -> list[Record]:
    """A replica's metrics records in file order (a torn line skipped)."""
    out: list[Record] = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
            rec = Record(
                replica,
                int(r.get("life") or 0),
                int(r["step"]),
                float(r["elapsed_s"]),
                float(r.get("step_time_s") or 0.0),
                bool(r.get("synced")),
            )
        except (ValueError, KeyError, TypeError):
            continue
        out.append(rec)
    return out


def read_run(run_dir: Path) -> dict[int, list[Record]]:
    """replica → its records, for every metrics.replica<m>.jsonl of a run directory."""
    runs: dict[int, list[Record]] = {}
    for p in sorted(run_dir.glob("metrics.replica*.jsonl")):
        m = int(p.name[len("metrics.replica") : -len(".jsonl")])
        runs[m] = read_records(p, m)
    return runs


def run_dir_of(folder: Path, run: dict[str, Any]) -> Path:
    """A run's directory: its `dir`, or the folder of that name beside the slow-link folder."""
    d = Path(run["dir"])
    if d.is_dir():
        return d
    beside = folder.parent / d.name
    if beside.is_dir():
        return beside
    raise FileNotFoundError(f"{run['run']}: neither {d} nor {beside} exists")


def pick_runs(doc: dict[str, Any], name: Optional[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the chaos run, the calm run it is measured against): `name`, or the first run with applied faults; the
    calm run is slowlink.json's `target_run` at the same rate."""
    runs = doc["runs"]
    chaos = [r for r in runs if (r.get("faults") or {}).get("faults") and (name is None or r["run"] == name)]
    if not chaos:
        raise SystemExit(f"no run with applied faults{'' if name is None else f' named {name}'}")
    target = doc.get("target_run", "calm")
    calm = [r for r in runs if r["run"] == target and r.get("rate") == chaos[0].get("rate")]
    if not calm:
        raise SystemExit(f"no calm run {target!r} at {chaos[0].get('rate')}")
    return chaos[0], calm[0]


def faults_of(run: dict[str, Any]) -> list[Fault]:
    """The run's applied faults (one the run ended before is left out), in the order applied."""
    out = []
    for i, f in enumerate(run["faults"]["faults"]):
        if f.get("applied_s") is None:
            continue
        out.append(
            Fault(i, f["fault"], f["kind"], f.get("replica"), float(f["applied_s"]), f.get("over_s"), f.get("step"))
        )
    return sorted(out, key=lambda f: (f.applied_s, f.index))


# ---------------------------------------------------------------- one clock
def _bounds(
    records: dict[int, list[Record]], faults: Sequence[Fault], crashes: Sequence[dict[str, Any]]
) -> dict[Life, tuple[float, float]]:
    """Per life, [lo, hi] of its offset from the faults' applied times and kills' ends (module docstring)."""
    lo: dict[Life, float] = defaultdict(lambda: -float("inf"))
    hi: dict[Life, float] = defaultdict(lambda: float("inf"))
    for f in faults:
        if f.replica is None or f.step is None or f.replica not in records:
            continue
        recs = records[f.replica]
        at = next((r for r in recs if r.step == f.step), None)
        after = next((r for r in recs if r.step > f.step), None)
        if at is not None:
            key = (f.replica, at.life)
            hi[key] = min(hi[key], f.applied_s + EPS_S - at.elapsed_s)
        if after is not None:
            key = (f.replica, after.life)
            lo[key] = max(lo[key], f.applied_s - EPS_S - after.elapsed_s)
        crashed = any(c.get("replica") == f.replica and abs(c["at_s"] - (f.over_s or -1e9)) < EPS_S for c in crashes)
        # Over when the replica logged past the kill's step: the replacement's first record, unless the killed
        # life logged once more before it died (then over as soon as the replacement started: no bound).
        back = after is not None and at is not None and after.life > at.life
        if f.kind == "kill" and f.over_s is not None and after is not None and back and not crashed:
            key = (f.replica, after.life)
            hi[key] = min(hi[key], f.over_s + EPS_S - after.elapsed_s)
            lo[key] = max(lo[key], f.over_s - KILL_LAG_S - after.elapsed_s)
    return {k: (lo[k], hi[k]) for k in set(lo) | set(hi)}


def _sync_edges(records: dict[int, list[Record]]) -> dict[tuple[Life, Life], tuple[float, int]]:
    """(a, b) → (median of elapsed_a − elapsed_b over their shared synced steps, how many), lives of two replicas."""
    synced: dict[Life, dict[int, float]] = defaultdict(dict)
    for recs in records.values():
        for r in recs:
            if r.synced:
                synced[(r.replica, r.life)][r.step] = r.elapsed_s
    edges = {}
    lives = sorted(synced)
    for i, a in enumerate(lives):
        for b in lives[i + 1 :]:
            if a[0] == b[0]:
                continue
            shared = set(synced[a]) & set(synced[b])
            if len(shared) >= MIN_SHARED:
                d = statistics.median(synced[a][s] - synced[b][s] for s in shared)
                edges[(a, b)], edges[(b, a)] = (d, len(shared)), (-d, len(shared))
    return edges


def align(
    records: dict[int, list[Record]], faults: Sequence[Fault] = (), crashes: Sequence[dict[str, Any]] = ()
) -> tuple[dict[Life, float], list[str]]:
    """Each life's offset (t = elapsed_s + offset) and the bounds it breaks by more than a second (module
    docstring); sets every record's `t`."""
    lives = sorted({(r.replica, r.life) for recs in records.values() for r in recs})
    edges = _sync_edges(records)
    bounds = _bounds(records, faults, crashes)
    first = {k: min(r.elapsed_s for r in records[k[0]] if r.life == k[1]) for k in lives}
    offsets: dict[Life, float] = {}
    left = set(lives)
    while left:
        # one component: from the life with the most shared steps, along the pairs that share the most
        seed = max(sorted(left), key=lambda k: sum(n for (a, _), (_, n) in edges.items() if a == k))
        rel = {seed: 0.0}
        while True:
            nxt = [(n, b, rel[a] + d) for (a, b), (d, n) in edges.items() if a in rel and b in left and b not in rel]
            if not nxt:
                break
            n, b, value = max(nxt, key=lambda x: (x[0], x[1]))
            rel[b] = value
        # t = 0 when the last replica logged its first step: only for a component that holds every first life
        firsts = [(m, min(r.life for r in recs)) for m, recs in records.items() if recs]
        guess = -max(first[k] + rel[k] for k in firsts) if all(k in rel for k in firsts) else None
        shift = _shift(guess, [(bounds[k][0] - v, bounds[k][1] - v) for k, v in rel.items() if k in bounds])
        for k, v in rel.items():
            offsets[k] = v + shift
        left -= set(rel)
    violations = []
    for k, (lo_k, hi_k) in sorted(bounds.items()):
        if k in offsets and not lo_k - 1.0 <= offsets[k] <= hi_k + 1.0:
            violations.append(f"replica {k[0]} life {k[1]}: offset {offsets[k]:.2f} outside [{lo_k:.2f}, {hi_k:.2f}]")
    for recs in records.values():
        for r in recs:
            r.t = r.elapsed_s + offsets[(r.replica, r.life)]
    return offsets, violations


def _shift(guess: Optional[float], allowed: Sequence[tuple[float, float]]) -> float:
    """The shift nearest `guess` that the most of the `allowed` intervals hold (all of them, if they agree); with
    no guess, the middle of their common part (or 0 with nothing to go by)."""
    ends = [x for iv in allowed for x in iv if abs(x) != float("inf")]
    if guess is None:
        lo = max((iv[0] for iv in allowed), default=-float("inf"))
        hi = min((iv[1] for iv in allowed), default=float("inf"))
        if lo <= hi and abs(lo) != float("inf") and abs(hi) != float("inf"):
            return (lo + hi) / 2
        guess = statistics.median(ends) if ends else 0.0
    points = sorted({guess, *ends})

    def held(x: float) -> int:
        return sum(lo <= x <= hi for lo, hi in allowed)

    best = max(held(x) for x in points)
    return min((x for x in points if held(x) == best), key=lambda x: abs(x - guess))


# ---------------------------------------------------------------- the run's frontier and its rounds
class Frontier:
    """T(s): the first time any replica logged step s or a later one."""

    def __init__(self, records: dict[int, list[Record]]) -> None:
        best: dict[int, float] = {}
        for recs in records.values():
            for r in recs:
                best[r.step] = min(best.get(r.step, float("inf")), r.t)
        self.steps = sorted(best)
        self.suffix = [0.0] * len(self.steps)
        low = float("inf")
        for i in range(len(self.steps) - 1, -1, -1):
            low = min(low, best[self.steps[i]])
            self.suffix[i] = low

    def __call__(self, step: int) -> float:
        i = bisect_left(self.steps, step)
        if i == len(self.steps):
            raise ValueError(f"no replica logged step {step} or later")
        return self.suffix[i]


def round_ends(calm: dict[int, list[Record]]) -> list[int]:
    """The param rounds' last steps: the calm run's synced steps, and its last step."""
    ends = {r.step for recs in calm.values() for r in recs if r.synced}
    ends.add(max(r.step for recs in calm.values() for r in recs))
    return sorted(ends)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def window(f: Fault, tail_s: float, end_s: float) -> tuple[float, float]:
    return f.applied_s, (f.over_s if f.over_s is not None else end_s) + tail_s


def share(
    faults: Sequence[Fault], t0: float, t1: float, tail_s: float, end_s: float, own: Optional[int] = None
) -> dict[int, float]:
    """fault index → its share (summing to 1) of the interval [t0, t1] by the overlap of its window; `own`: a
    replica whose own faults are charged first. {} when no window overlaps."""
    if t1 <= t0:
        t1 = t0 + 1e-6

    def weights(pool: Iterable[Fault]) -> dict[int, float]:
        w = {f.index: _overlap(t0, t1, *window(f, tail_s, end_s)) for f in pool}
        return {k: v for k, v in w.items() if v > 0}

    w = weights(f for f in faults if own is not None and f.replica == own)
    if not w:
        w = weights(f for f in faults if own is None or f.replica != own)
    total = sum(w.values())
    return {k: v / total for k, v in w.items()} if total else {}


# ---------------------------------------------------------------- the attribution
def breakdown(
    chaos: dict[int, list[Record]],
    calm: dict[int, list[Record]],
    faults: Sequence[Fault],
    crashes: Sequence[dict[str, Any]] = (),
    tail_s: Optional[float] = None,
) -> Breakdown:
    """Align both runs, then charge every gap, idle replica-round and slower frontier round (module docstring)."""
    offsets, violations = align(chaos, faults, crashes)
    align(calm)
    ends = round_ends(calm)
    fc, fk = Frontier(chaos), Frontier(calm)
    s0 = min(fk.steps[0], fc.steps[0])
    pace_s = (fk(ends[-1]) - fk(s0)) / max(1, ends[-1] - s0)
    calm_rounds = [fk(e) - fk(p) for p, e in zip(ends, ends[1:])]
    tail = tail_s if tail_s is not None else (statistics.median(calm_rounds) if calm_rounds else 0.0)
    end_t = fc(ends[-1])
    costs = {f.index: Cost(f) for f in faults}
    b = Breakdown(list(costs.values()), pace_s, tail, fc(s0) - fk(s0), fc(ends[-1]) - fk(ends[-1]))
    b.offsets, b.violations = offsets, violations

    # delay: the frontier's rounds
    prev = s0
    for e in ends:
        excess = (fc(e) - fc(prev)) - (fk(e) - fk(prev))
        shares = share(faults, fc(prev), fc(e), tail, end_t)
        if not shares:
            b.unattributed_delay_s += excess
        elif excess <= 0:
            b.speedup_s += excess
        else:
            for i, part in shares.items():
                costs[i].delay_s += excess * part
        prev = e

    # gaps and idle replica-rounds
    calm_round = _calm_replica_rounds(calm, ends)
    stride = _stride(chaos)
    end_set = set(ends)
    for m, recs in chaos.items():
        gap_after = set()
        for p, n in zip(recs, recs[1:]):
            gap = n.step - p.step - stride
            if gap <= 0:
                continue
            gap_after.add(p.step)
            b.steps_lost += gap
            shares = share(faults, p.t - p.step_time_s, n.t, tail, end_t, own=m)
            if not shares:
                b.unattributed_gap += gap
            for i, part in shares.items():
                costs[i].gap += gap * part
        synced = [r for r in recs if r.synced and r.step in end_set]
        for a, c in zip(synced, synced[1:]):
            if a.life != c.life or c.step in gap_after or (a.step, c.step) not in calm_round:
                continue
            if any(a.step < g < c.step for g in gap_after) or a.step in gap_after:
                continue
            excess = (c.t - a.t) - calm_round[(a.step, c.step)]
            shares = share(faults, a.t, c.t, tail, end_t, own=m)
            if not shares:
                b.unattributed_idle_s += excess
            elif excess > 0:
                for i, part in shares.items():
                    costs[i].idle_s += excess * part
    return b


def _stride(records: dict[int, list[Record]]) -> int:
    """The usual step between two records (run.log_every)."""
    diffs = [n.step - p.step for recs in records.values() for p, n in zip(recs, recs[1:]) if n.step > p.step]
    return statistics.mode(diffs) if diffs else 1


def _calm_replica_rounds(calm: dict[int, list[Record]], ends: Sequence[int]) -> dict[tuple[int, int], float]:
    """(a round's first end, its next) → the calm run's duration of that round (median over its replicas)."""
    per: dict[tuple[int, int], list[float]] = defaultdict(list)
    for recs in calm.values():
        at = {r.step: r.t for r in recs if r.synced or r.step == ends[-1]}
        for p, e in zip(ends, ends[1:]):
            if p in at and e in at:
                per[(p, e)].append(at[e] - at[p])
    return {k: statistics.median(v) for k, v in per.items()}


# ---------------------------------------------------------------- the tables
def fmt(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"


def render(b: Breakdown, top: int = 0) -> str:
    """The markdown: per fault (or the `top` costliest by lost replica-steps), per kind, the unattributed."""
    p = b.pace_s
    lines = [
        f"Calm pace {p:.3f} s/step (idle seconds → steps); fault window tail {b.tail_s:.1f} s. "
        "Rules: scripts/chaos_breakdown.py's docstring.",
        "",
        "| # | fault | kind | replica | applied s | over s | gap steps | idle replica-s | lost replica-steps "
        "| delay s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(b.costs, key=lambda c: -c.steps(p))[:top] if top else b.costs
    for c in rows:
        f = c.fault
        over = "–" if f.over_s is None else fmt(f.over_s)
        who = "–" if f.replica is None else str(f.replica)
        lines.append(
            f"| {f.index} | `{f.label}` | {f.kind} | {who} | {fmt(f.applied_s)} | {over} | {fmt(c.gap, 0)} | "
            f"{fmt(c.idle_s)} | {fmt(c.steps(p), 0)} | {fmt(c.delay_s)} |"
        )
    lines += [
        "",
        "| kind | faults | lost replica-steps | delay s | replica-steps per fault | delay s per fault |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    kinds: dict[str, list[Cost]] = defaultdict(list)
    for c in b.costs:
        kinds[c.fault.kind].append(c)
    for kind, cs in sorted(kinds.items(), key=lambda kv: -sum(c.steps(p) for c in kv[1])):
        steps, delay = sum(c.steps(p) for c in cs), sum(c.delay_s for c in cs)
        lines.append(
            f"| {kind} | {len(cs)} | {fmt(steps, 0)} | {fmt(delay)} | {fmt(steps / len(cs), 0)} | "
            f"{fmt(delay / len(cs))} |"
        )
    steps_all = sum(c.steps(p) for c in b.costs)
    delay_all = sum(c.delay_s for c in b.costs)
    lines.append(f"| **all faults** | {len(b.costs)} | {fmt(steps_all, 0)} | {fmt(delay_all)} | | |")
    un_steps = b.unattributed_gap + b.unattributed_idle_s / p
    unattributed_s = b.unattributed_delay_s + b.speedup_s + b.start_s
    lines += [
        "",
        "| not charged to a fault | replica-steps | delay s |",
        "|---|---:|---:|",
        f"| rounds with no fault window (net: slower and faster than calm) | "
        f"{fmt(b.unattributed_idle_s / p, 0)} | {fmt(b.unattributed_delay_s)} |",
        f"| gaps with no fault window | {fmt(b.unattributed_gap, 0)} | |",
        f"| rounds in fault windows faster than calm (a replica down: fewer trainers share the host) | | "
        f"{fmt(b.speedup_s)} |",
        f"| the first step (chaos − calm) | | {fmt(b.start_s)} |",
        f"| **total** | {fmt(steps_all + un_steps, 0)} | {fmt(delay_all + unattributed_s)} |",
        "",
        f"Check: the frontier's last step came {fmt(b.end_s)} s after the calm run's; gap steps charged "
        f"{fmt(sum(c.gap for c in b.costs) + b.unattributed_gap, 0)} of {b.steps_lost} steps no record holds.",
    ]
    if b.violations:
        lines += ["", "Clock: offsets outside a fault's bound by over 1 s: " + "; ".join(b.violations)]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a slow-link run folder (its slowlink.json)")
    ap.add_argument("--run", help="the chaos run's name (default: the first with applied faults)")
    ap.add_argument("--tail-s", type=float, help="a fault window's tail after its end (default: one calm round)")
    ap.add_argument("--top", type=int, default=0, help="only the N costliest faults (by lost replica-steps)")
    args = ap.parse_args(argv)
    doc = json.loads((args.folder / "slowlink.json").read_text())
    chaos_run, calm_run = pick_runs(doc, args.run)
    chaos = read_run(run_dir_of(args.folder, chaos_run))
    calm = read_run(run_dir_of(args.folder, calm_run))
    faults = faults_of(chaos_run)
    b = breakdown(chaos, calm, faults, chaos_run["faults"].get("crashes") or [], args.tail_s)
    print(f"{chaos_run['run']} vs {calm_run['run']} at {chaos_run.get('rate')}: {len(faults)} faults applied\n")
    print(render(b, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
