"""Predicted vs measured mean step time across the real shaped link (a benchmark, not a test).

    python -m hsdp.plan.validate [--config configs/tiny.yaml] [--set KEY=VALUE ...] [--rates 10mbit,30mbit,100mbit]
                                 [--out DIR]

1. Calibration: one fake-backend run of the DiLoCo config (compute only; no link time goes in), and
   the shard group's collectives timed on the config's mesh (hsdp.plan.collectives: loopback gloo
   inside each replica, which a fake-backend run leaves out; the inter link is not used).
2. Prediction at each rate (hsdp.plan.model) for exact HSDP and DiLoCo H=8 int8, with the measured
   shard-group times, and (a column for comparison) with the shard group free as before.
3. Measurement: `python -m hsdp.slowlink` runs both at each rate (network namespaces, tc; root),
   right after the calibration, so both see the same load of the machine.
4. The table: predicted and measured mean step (HSDP: steps ≥ SKIP; DiLoCo: whole periods after
   the first), their ratio, and the load averages (os.getloadavg) before and after each phase.

Needs root and iproute2, as slowlink does (exit 2 otherwise). Outputs: <out>/validate.json and
validate.md, the calibration run and the slowlink outputs under <out>.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hsdp.bench.netns import missing_requirements
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.plan.__main__ import parse_rates
from hsdp.plan.calibrate import REPO, SKIP, measure_fake_run, read_fake_run
from hsdp.plan.collectives import from_json, measure_shard_collectives
from hsdp.plan.goodput import OneLineParser
from hsdp.plan.model import Compute, Link, MeasuredIntra, predict
from hsdp.plan.report import rate_label
from hsdp.plan.workload import build_workload

H = 8
SHARED = ["wandb.mode=disabled", "run.log_every=1", "run.eval_every=0", "run.eval_batches=1", "mesh.timeout_s=120"]
SHARED += ["run.checkpoint_every=0"]  # configs/tiny.yaml keeps checkpoints; the measured runs save none
RUNS = {
    "hsdp": ["sync.warmup_steps=null", "sync.method=average", "sync.every=1"],  # exact HSDP: grads every step
    "diloco-h8-int8": ["sync.warmup_steps=0", f"sync.every={H}", "sync.method=diloco", "sync.quantize=int8"],
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measured_mean(run_dir: Path, periodic: bool) -> Optional[float]:
    """Mean step time of the measured window: HSDP steps ≥ SKIP; DiLoCo the whole periods after the first."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = H if periodic else SKIP
    times = [r["step_time_s"] for r in records if r["step"] >= first]
    if periodic:
        times = times[: len(times) // H * H]
    return statistics.mean(times) if times else None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m hsdp.plan.validate", description=__doc__.splitlines()[0], name="validate")
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--rates", default="10mbit,30mbit,100mbit")
    p.add_argument("--out", default="runs/plan-validate")
    p.add_argument("--hsdp-steps", type=int, default=12)
    p.add_argument("--diloco-steps", type=int, default=5 * H)
    p.add_argument("--calibrate-steps", type=int, default=5 * H)
    p.add_argument("--report-only", action="store_true", help="run nothing: the table from <out>'s runs")
    a = p.parse_args(argv)
    a.shared = [*SHARED, *a.overrides]  # every run's, the calibration's and the prediction's (e.g. the mesh)
    return a


def check_args(a: argparse.Namespace) -> list[float]:
    """The rates, after every run's config (with its steps) loads and checks; ConfigError naming the first problem.
    Needs no root: what a measurement needs is `missing_requirements`'."""
    rates = parse_rates(a.rates, "--rates")
    for flag, n in (("--hsdp-steps", a.hsdp_steps), ("--diloco-steps", a.diloco_steps)):
        if n < 1:
            raise ConfigError(f"{flag}: expected at least 1 step, got {n}")
    if a.calibrate_steps <= SKIP:
        raise ConfigError(f"--calibrate-steps: expected more than {SKIP} (the steps skipped), got {a.calibrate_steps}")
    for run, extra in RUNS.items():
        load_config(a.config, [*a.shared, *extra, f"run.steps={steps_of(a)[run]}"])
    return rates


def steps_of(a: argparse.Namespace) -> dict[str, int]:
    return {"hsdp": a.hsdp_steps, "diloco-h8-int8": a.diloco_steps}


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    try:
        rates = check_args(a)
        why = None if a.report_only else missing_requirements()
        if why:
            raise ConfigError(why)
        return report(a, rates)
    except ConfigError as e:
        print(f"validate: {e}", file=sys.stderr)
        return 2


def report(a: argparse.Namespace, rates: list[float]) -> int:
    """Measure (unless --report-only), then the table; ConfigError for an --out without the runs it needs."""
    out = Path(a.out).expanduser().resolve()
    steps = steps_of(a)
    previous = out / "validate.json"
    if a.report_only and not (out / "calibration").is_dir():
        raise ConfigError(f"--report-only: {out} holds no measured runs (no calibration/); run without it first")
    report: dict = {}
    if a.report_only and previous.is_file():
        try:
            report = json.loads(previous.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--out: {previous} is not readable JSON ({e})") from None
    if not a.report_only:
        report = measure(a, out, steps)
    compute = read_fake_run(str(out / "calibration"))
    report["calibration"] = {"step_s": compute.step_s, "sync_s": compute.sync_s, "source": compute.source}
    intra = from_json(report["intra"]) if report.get("intra") else None  # absent in a run made before it
    report["rows"] = compare(a, out, steps, rates, compute, intra)
    (out / "validate.json").write_text(json.dumps(report, indent=2) + "\n")
    md = table(report)
    (out / "validate.md").write_text(md + "\n")
    print(md)
    return 0 if report.get("slowlink_exit", 0) == 0 else 1


def measure(a: argparse.Namespace, out: Path, steps: dict[str, int]) -> dict:
    """The calibration run, then the link runs, back to back; the load averages around each."""
    out.mkdir(parents=True, exist_ok=True)
    loads = {"before calibration": load()}
    t0 = time.time()
    compute = measure_fake_run(a.config, [*a.shared, *RUNS["diloco-h8-int8"]], a.calibrate_steps, keep=str(out))
    loads["after calibration"] = load()
    print(f"[validate] calibration: {compute.step_s:.4f} s/step + {compute.sync_s:.4f} s per sync", flush=True)
    intra = measure_shard_collectives(load_config(a.config, [*a.shared, *RUNS["diloco-h8-int8"]]))
    loads["after timing the shard group"] = load()
    cmd = [sys.executable, "-m", "hsdp.slowlink", "--config", a.config, "--rate", a.rates, "--no-probe"]
    cmd += ["--name", "plan", "--out", str(out / "slowlink"), "--runs"]
    cmd += [f"{run}=" + ",".join([*extra, f"run.steps={steps[run]}"]) for run, extra in RUNS.items()]
    for o in [*a.shared, f"run.out_dir={out}"]:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=REPO)
    loads["after the link runs"] = load()
    return {
        "config": a.config,
        "overrides": a.overrides,
        "load_average_1_5_15": loads,
        "wall_s": time.time() - t0,
        "slowlink_exit": proc.returncode,
        "intra": intra.table if intra else None,
    }


def plain_steps_median(run_dir: Path) -> Optional[float]:
    """Median time of a periodic run's steps without a sync (≥ H): its compute under the link runs' load."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in records if r["step"] >= H and not r.get("synced")]
    return statistics.median(times) if times else None


def compare(
    a: argparse.Namespace,
    out: Path,
    steps: dict[str, int],
    rates: list[float],
    compute: Compute,
    intra: Optional[MeasuredIntra],
) -> list:
    """Per run and rate: predicted (fake-backend calibration and the timed shard group; `predicted_free_s`
    with the shard group free) and measured mean step; and, as a diagnostic of the communication model
    alone, the prediction with the compute the link run itself showed (the DiLoCo run's median step
    without a sync at that rate, which already holds the shard group's collectives: free there)."""
    labels = {parse_rates(lab, "--rates")[0]: parse_label(lab) for lab in a.rates.split(",") if lab}
    rows = []
    for run, extra in RUNS.items():
        cfg = load_config(a.config, [*a.shared, *extra, f"run.steps={steps[run]}"])
        w = build_workload(cfg)
        periodic = cfg.sync.warmup_steps is not None
        for bps in rates:
            measured = measured_mean(out / f"plan-{run}-{labels[bps]}", periodic)
            seen = plain_steps_median(out / f"plan-diloco-h8-int8-{labels[bps]}")
            row = {"run": run, "rate": rate_label(bps), "measured_s": measured}
            cases = (
                ("predicted_s", compute, intra),
                ("predicted_free_s", compute, None),
                ("with_link_run_compute_s", scaled(compute, seen), None),
            )
            for key, c, timed_intra in cases:
                if c is None:
                    row[key] = None
                    continue
                pred = predict(w, Link(bps, intra_measured=timed_intra), c, cfg.run.steps)
                row[key] = pred.period_step_time_s if periodic else pred.warmup_step_time_s
            predicted = row["predicted_s"]
            row["ratio"] = predicted / measured if measured and isinstance(predicted, (int, float)) else None
            rows.append(row)
    return rows


def scaled(compute: Compute, step_s: Optional[float]) -> Optional[Compute]:
    """The calibration with its step replaced by `step_s` and its sync compute scaled alike."""
    if step_s is None:
        return None
    return Compute(step_s, compute.sync_s * step_s / compute.step_s, "the link run's own plain steps")


def parse_label(text: str) -> str:
    """slowlink's folder label of a rate ('10mbit' → '10mbit', '0.5gbit' → '0.5gbit')."""
    from hsdp.bench.spec import parse_rate

    return parse_rate(text)[0]


def table(report: dict) -> str:
    loads = report.get("load_average_1_5_15", {})
    c = report["calibration"]
    intra = from_json(report["intra"]).source if report.get("intra") else "not timed (free)"
    lines = [
        f"calibration: {c['step_s']:.4f} s/step + {c['sync_s']:.4f} s per param sync ({c['source']})",
        f"shard group: {intra}",
        "load average (1, 5, 15 min): " + "; ".join(f"{k}: {v}" for k, v in loads.items()),
        "",
        "| run | rate | predicted mean step | measured mean step | predicted / measured "
        "| shard group free: predicted (ratio) | diagnostic: model with the link run's compute |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda x: f"{x:.3f} s" if x else "–"  # noqa: E731
    for r in report["rows"]:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "–"
        free = r.get("predicted_free_s")
        free_ratio = f" ({free / r['measured_s']:.2f})" if free and r["measured_s"] else ""
        lines.append(
            f"| {r['run']} | {r['rate']} | {fmt(r['predicted_s'])} | {fmt(r['measured_s'])} | {ratio} "
            f"| {fmt(free)}{free_ratio} | {fmt(r['with_link_run_compute_s'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
