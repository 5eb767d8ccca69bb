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

Each run is the checkout's `train.py` in its own process (so one crash does not
end the sweep), started in the directory the sweep was started from and with
`run.overwrite=true` (a sweep re-runs its runs) and `run.out_dir` made absolute;
its outputs land in `<out_dir>/<sweep>-<run>/` as usual. A relative `base:`
is looked up beside the sweep file first, then in the checkout. The table is
printed and written to `<out_dir>/<sweep>.md` (the first run's out_dir).

Bad input (missing, empty or malformed sweep file, unknown keys, a bad run
config) exits 2 with one line before any run starts; SIGINT/SIGTERM stops the
current run (and its workers) and exits 130/143.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hsdp.config import ConfigError, load_config, read_yaml
from hsdp.launch import Interrupted, StopSignals

REPO = Path(__file__).resolve().parents[1]
SWEEP_KEYS = ("base", "set", "columns", "ratio", "runs")
STOP_WAIT_S = 30.0  # a run's launcher stops its workers within seconds; then it is killed


def resolve_base(base: str, sweep_file: Path) -> Path:
    """The base config: absolute as given, else beside the sweep file, else in the checkout."""
    given = Path(base).expanduser()
    candidates = [given] if given.is_absolute() else [sweep_file.parent / given, REPO / given]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"base: {base} not found (looked for {' and '.join(str(c) for c in candidates)})")


def _str_list(path: str, key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: {path}: expected a list of section.key=value strings, got {value!r}")
    return value


def load_sweep(path: str) -> dict:
    """Read and check a sweep file; `base` comes back as an absolute path, lists as lists."""
    spec = read_yaml(path, key="sweep", expected="a mapping with keys base, runs, columns")
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep: {path}: expected a mapping with keys base, runs, columns")
    unknown = [k for k in spec if k not in SWEEP_KEYS]
    if unknown:
        raise ConfigError(f"sweep: {path}: unknown keys {unknown} (expected: {', '.join(SWEEP_KEYS)})")
    for key in ("base", "runs", "columns"):
        if key not in spec:
            raise ConfigError(f"sweep: {path}: missing key {key!r}")
    if not isinstance(spec["base"], str):
        raise ConfigError(f"base: {path}: expected a config file path, got {spec['base']!r}")
    spec["base"] = str(resolve_base(spec["base"], Path(path).expanduser().resolve()))
    spec["set"] = _str_list(path, "set", spec.get("set"))
    spec["columns"] = _str_list(path, "columns", spec["columns"])
    if not spec["columns"]:
        raise ConfigError(f"columns: {path}: expected at least one summary.json field")
    if spec.get("ratio") is not None and not isinstance(spec["ratio"], str):
        raise ConfigError(f"ratio: {path}: expected a summary.json field, got {spec['ratio']!r}")
    runs = spec["runs"]
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: {path}: expected a mapping of run name to a list of overrides, got {runs!r}")
    spec["runs"] = {str(run): _str_list(path, f"runs.{run}", extra) for run, extra in runs.items()}
    return spec


def run_one(base: str, overrides: list[str], stop: StopSignals) -> int:
    """One run as `python <checkout>/train.py` in the current directory; its return code.

    On SIGINT/SIGTERM the run gets the same signal (its launcher stops its workers), and is
    killed if it has not exited after STOP_WAIT_S; then Interrupted propagates.
    """
    cmd = [sys.executable, str(REPO / "train.py"), "--config", base]
    for o in overrides:
        cmd += ["--set", o]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except Interrupted as e:
        stop.disarm()
        proc.send_signal(e.signum)
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


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
        shared = [*spec["set"], *args.set]
        only = set(filter(None, args.only.split(",")))
        if only - set(spec["runs"]):
            raise ConfigError(f"--only: unknown runs {sorted(only - set(spec['runs']))} "
                              f"(expected: {', '.join(spec['runs'])})")
        plans = {run: [*shared, *extra, f"run.name={name}-{run}"] for run, extra in spec["runs"].items()}
        runs = [run for run in plans if not only or run in only]
        for run in runs:  # a sweep re-runs its runs: replace their previous outputs
            plans[run].append("run.overwrite=true")
        cfgs = {run: load_config(spec["base"], o) for run, o in plans.items()}  # validate all before running any
        for run, cfg in cfgs.items():  # relative out_dirs mean "from where the sweep was started"
            plans[run].append(f"run.out_dir={Path(cfg.run.out_dir).expanduser().resolve()}")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    summaries = {}
    run = None
    try:
        with StopSignals() as stop:
            stop.arm()
            for run, overrides in plans.items():
                rc = run_one(spec["base"], overrides, stop) if run in runs else 0
                path = cfgs[run].run_dir.resolve() / "summary.json"
                summaries[run] = json.loads(path.read_text()) if rc == 0 and path.is_file() else {}
    except Interrupted as e:
        print(f"interrupted by {e}: stopped run {name}-{run}", file=sys.stderr)
        return e.exit_code
    md = table(name, spec, summaries)
    out = Path(cfgs[next(iter(cfgs))].run.out_dir).expanduser().resolve() / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md + "\n")
    print(md)
    return 0 if all(summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
