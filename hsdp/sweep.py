"""Run an ablation sweep and print its results as a markdown table.

    python -m hsdp.sweep configs/ablations/sync.yaml [--set key=value ...] [--only run,run]

A sweep file names a base config, overrides shared by every run, and one list
of overrides per run:

    base: configs/tiny.yaml
    set: [run.eval_every=100]
    columns: [final_val_loss, sync_bytes]        # summary.json fields
    ratio: sync_bytes                            # optional: column / first run's
    runs:
      hsdp: []
      diloco-h32: [sync.warmup_steps=0, sync.every=32, sync.method=diloco]

Each run is `python train.py` in its own process (so one crash does not end the
sweep); its outputs land in `<out_dir>/<sweep>-<run>/` as usual. The table is
printed and written to `<out_dir>/<sweep>.md`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from hsdp.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def load_sweep(path: str) -> dict:
    spec = yaml.safe_load(Path(path).read_text())
    for key in ("base", "runs", "columns"):
        if key not in spec:
            raise ConfigError(f"{path}: missing key {key!r}")
    return spec


def run_one(base: str, overrides: list[str]) -> int:
    cmd = [sys.executable, str(REPO / "train.py"), "--config", base]
    for o in overrides:
        cmd += ["--set", o]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO).returncode


def format_value(column: str, value) -> str:
    if value is None:
        return "–"
    if column.endswith("bytes"):
        return f"{value / 2**20:,.1f} MiB"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def table(name: str, spec: dict, summaries: dict[str, dict]) -> str:
    cols = spec["columns"]
    ratio = spec.get("ratio")
    head = ["run", *cols] + ([f"{ratio} ratio"] if ratio else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = next(iter(summaries.values()), {})
    for run, s in summaries.items():
        row = [run] + [format_value(c, s.get(c)) for c in cols]
        if ratio:
            a, b = s.get(ratio), first.get(ratio)
            row.append(f"{b / a:.1f}× fewer" if a and b else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run an ablation sweep")
    p.add_argument("sweep")
    p.add_argument("--set", action="append", default=[], help="extra override for every run")
    p.add_argument("--only", default="", help="comma-separated runs to (re)run; the others' existing "
                                              "summaries are reused in the table")
    args = p.parse_args(argv)
    try:
        spec = load_sweep(args.sweep)
        name = Path(args.sweep).stem
        shared = [*spec.get("set", []), *args.set]
        plans = {run: [*shared, *extra, f"run.name={name}-{run}"] for run, extra in spec["runs"].items()}
        cfgs = {run: load_config(spec["base"], o) for run, o in plans.items()}  # validate all before running any
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    only = set(filter(None, args.only.split(",")))
    if only - set(plans):
        print(f"config error: --only: unknown runs {sorted(only - set(plans))} (expected: {', '.join(plans)})",
              file=sys.stderr)
        return 2
    summaries = {}
    for run, overrides in plans.items():
        rc = run_one(spec["base"], overrides) if not only or run in only else 0
        path = cfgs[run].run_dir / "summary.json"
        summaries[run] = json.loads(path.read_text()) if rc == 0 and path.is_file() else {}
    md = table(name, spec, summaries)
    out = Path(cfgs[next(iter(cfgs))].run.out_dir) / f"{name}.md"
    out.write_text(md + "\n")
    print(md)
    return 0 if all(summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
