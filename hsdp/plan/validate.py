"""Predicted vs measured mean step time across the real shaped link (a benchmark, not a test).

    python -m hsdp.plan.validate [--config configs/tiny.yaml] [--rates 10mbit,30mbit,100mbit] [--out DIR]

1. Calibration: one fake-backend run of the DiLoCo config (compute only; no link time goes in).
2. Prediction at each rate (hsdp.plan.model) for exact HSDP and DiLoCo H=8 int8.
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
from hsdp.plan.calibrate import REPO, SKIP, measure_fake_run
from hsdp.plan.model import Link, predict
from hsdp.plan.report import rate_label
from hsdp.plan.workload import build_workload

H = 8
SHARED = ["wandb.mode=disabled", "run.log_every=1", "run.eval_every=0", "run.eval_batches=1", "mesh.timeout_s=120"]
RUNS = {
    "hsdp": [],
    "diloco-h8-int8": ["sync.warmup_steps=0", f"sync.every={H}", "sync.method=diloco", "sync.quantize=int8"],
}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measured_mean(run_dir: Path, run: str) -> Optional[float]:
    """Mean step time of the measured window: HSDP steps ≥ SKIP; DiLoCo the whole periods after the first."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = H if run != "hsdp" else SKIP
    times = [r["step_time_s"] for r in records if r["step"] >= first]
    if run != "hsdp":
        times = times[: len(times) // H * H]
    return statistics.mean(times) if times else None


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hsdp.plan.validate", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--rates", default="10mbit,30mbit,100mbit")
    p.add_argument("--out", default="runs/plan-validate")
    p.add_argument("--hsdp-steps", type=int, default=12)
    p.add_argument("--diloco-steps", type=int, default=5 * H)
    p.add_argument("--calibrate-steps", type=int, default=5 * H)
    a = p.parse_args(argv)
    why = missing_requirements()
    try:
        rates = parse_rates(a.rates, "--rates")
        if why:
            raise ConfigError(why)
        for extra in RUNS.values():
            load_config(a.config, [*SHARED, *extra])
    except ConfigError as e:
        print(f"validate: {e}", file=sys.stderr)
        return 2
    out = Path(a.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    loads = {"before calibration": load()}
    t0 = time.time()
    compute = measure_fake_run(a.config, [*SHARED, *RUNS["diloco-h8-int8"]], a.calibrate_steps, keep=str(out))
    loads["after calibration"] = load()
    print(f"[validate] calibration: {compute.step_s:.4f} s/step + {compute.sync_s:.4f} s per sync", flush=True)
    steps = {"hsdp": a.hsdp_steps, "diloco-h8-int8": a.diloco_steps}
    cmd = [sys.executable, "-m", "hsdp.slowlink", "--config", a.config, "--rate", a.rates, "--no-probe"]
    cmd += ["--name", "plan", "--out", str(out / "slowlink"), "--runs"]
    cmd += [f"{run}=" + ",".join([*extra, f"run.steps={steps[run]}"]) for run, extra in RUNS.items()]
    for o in [*SHARED, f"run.out_dir={out}"]:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=REPO)
    loads["after the link runs"] = load()
    rows = []
    for run, extra in RUNS.items():
        cfg = load_config(a.config, [*SHARED, *extra, f"run.steps={steps[run]}"])
        w = build_workload(cfg)
        for bps in rates:
            pred = predict(w, Link(bps), compute, cfg.run.steps)
            predicted = pred.warmup_step_time_s if run == "hsdp" else pred.period_step_time_s
            label = next(lab for lab in a.rates.split(",") if parse_rates(lab, "--rates")[0] == bps)
            measured = measured_mean(out / f"plan-{run}-{parse_label(label)}", run)
            rows.append(
                {
                    "run": run,
                    "rate": rate_label(bps),
                    "predicted_s": predicted,
                    "measured_s": measured,
                    "ratio": predicted / measured if measured else None,
                    "predicted_compute_s": compute.step_s,
                }
            )
    report = {
        "config": a.config,
        "calibration": {"step_s": compute.step_s, "sync_s": compute.sync_s, "source": compute.source},
        "load_average_1_5_15": loads,
        "wall_s": time.time() - t0,
        "slowlink_exit": proc.returncode,
        "rows": rows,
    }
    (out / "validate.json").write_text(json.dumps(report, indent=2) + "\n")
    md = table(report)
    (out / "validate.md").write_text(md + "\n")
    print(md)
    return 0 if proc.returncode == 0 else 1


def parse_label(text: str) -> str:
    """slowlink's folder label of a rate ('10mbit' → '10mbit', '0.5gbit' → '0.5gbit')."""
    from hsdp.bench.spec import parse_rate

    return parse_rate(text)[0]


def table(report: dict) -> str:
    lines = [
        f"calibration: {report['calibration']['step_s']:.4f} s/step + {report['calibration']['sync_s']:.4f} s per "
        f"param sync ({report['calibration']['source']})",
        "load average (1, 5, 15 min): " + "; ".join(f"{k}: {v}" for k, v in report["load_average_1_5_15"].items()),
        "",
        "| run | rate | predicted mean step | measured mean step | predicted / measured |",
        "|---|---|---:|---:|---:|",
    ]
    for r in report["rows"]:
        meas = f"{r['measured_s']:.3f} s" if r["measured_s"] else "–"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "–"
        lines.append(f"| {r['run']} | {r['rate']} | {r['predicted_s']:.3f} s | {meas} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
