"""Run an ablation sweep and print its results as a markdown table.

    python -m hsdp.sweep configs/ablations/sync.yaml [--set key=value ...] [--only run,run] [--plot] [--no-run]

A sweep file names a base config, overrides shared by every run, and one list
of overrides per run:

    base: configs/tiny.yaml
    set: [run.eval_every=100]
    columns: [final_val_loss, sync_bytes]        # summary.json fields
    ratio: sync_bytes                            # optional: first run's / column ("N× fewer")
    relative: [median_step_time_s, hsdp]         # optional: column / that run's ("0.72×")
    nocomm: true                                 # optional: also run each with mesh.backend=fake
    runs:
      hsdp: []
      diloco-h32: [sync.warmup_steps=0, sync.every=32, sync.method=diloco]

Each run is the checkout's `train.py` in its own process (so one crash does not
end the sweep), started in the directory the sweep was started from and with
`run.overwrite=true` (a sweep re-runs its runs) and `run.out_dir` made absolute;
its outputs land in `<out_dir>/<sweep>-<run>/` as usual.

`nocomm: true` measures exposed communication: each run also runs as
`<run>-nocomm` with `mesh.backend=fake` (torch's fake process group: every
collective returns at once, with this rank's own data, so the step is the same
compute with no communication), and the table gets `nocomm_step_time_s` and
`exposed_comm_s` = median step time − the no-comm twin's, i.e. the time the
step spends on communication that was not hidden behind compute. A relative `base:`
is looked up beside the sweep file first, then in the checkout. The table is
printed and written to `<out_dir>/<sweep>.md` (the first run's out_dir).

`--plot` also writes, next to the table, `<sweep>-tokens.png`, `<sweep>-sync_bytes.png`
and `<sweep>-wall.png`: each run's val loss (metrics.jsonl's evals) against tokens,
against sync bytes sent per rank (log x) and against training wall-clock, the
cumulative `step_time_s` (evals excluded; only runs that logged every step,
`run.log_every=1`, get a wall-clock curve). matplotlib is the optional `plot` extra
(`pip install -e ".[plot]"`) and is imported only then. `--no-run` runs nothing and
makes the table (and plots) from the run folders already there.

Bad input (missing, empty or malformed sweep file, unknown keys, a bad run
config) exits 2 with one line before any run starts; SIGINT/SIGTERM stops the
current run (and its workers) and exits 130/143.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from hsdp.config.schema import ConfigError
from hsdp.config.loader import load_config, read_yaml
from hsdp.run.launch import Interrupted, StopSignals

REPO = Path(__file__).resolve().parents[1]
SWEEP_KEYS = ("base", "set", "columns", "ratio", "relative", "nocomm", "runs")
NOCOMM = "-nocomm"  # suffix of a run's no-communication twin (nocomm: true)
STOP_WAIT_S = 30.0  # a run's launcher stops its workers within seconds; then it is killed


def resolve_base(base: str, sweep_file: Path) -> Path:
    """The base config: absolute as given, else beside the sweep file, else in the checkout."""
    given = Path(base).expanduser()
    candidates = [given] if given.is_absolute() else [sweep_file.parent / given, REPO / given]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"base: {base} not found (looked for {' and '.join(str(c) for c in candidates)})")


def str_list(path: str, key: str, value: Any) -> list[str]:
    """A spec file's list of `section.key=value` strings ([] if absent), or ConfigError naming the key."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: {path}: expected a list of section.key=value strings, got {value!r}")
    return value


def read_spec(path: str, kind: str, keys: tuple[str, ...]) -> dict:
    """A spec file (sweep, slow-link) as a mapping whose keys are all in `keys`, or ConfigError naming the problem."""
    expected = f"a mapping with keys {', '.join(keys)}"
    spec = read_yaml(path, key=kind, expected=expected)
    if not isinstance(spec, dict):
        raise ConfigError(f"{kind}: {path}: expected {expected}")
    unknown = [k for k in spec if k not in keys]
    if unknown:
        raise ConfigError(f"{kind}: {path}: unknown keys {unknown} (expected: {', '.join(keys)})")
    return spec


def load_sweep(path: str) -> dict:
    """Read and check a sweep file; `base` comes back as an absolute path, lists as lists."""
    spec = read_spec(path, "sweep", SWEEP_KEYS)
    for key in ("base", "runs", "columns"):
        if key not in spec:
            raise ConfigError(f"sweep: {path}: missing key {key!r}")
    if not isinstance(spec["base"], str):
        raise ConfigError(f"base: {path}: expected a config file path, got {spec['base']!r}")
    spec["base"] = str(resolve_base(spec["base"], Path(path).expanduser().resolve()))
    spec["set"] = str_list(path, "set", spec.get("set"))
    spec["columns"] = str_list(path, "columns", spec["columns"])
    if not spec["columns"]:
        raise ConfigError(f"columns: {path}: expected at least one summary.json field")
    if spec.get("ratio") is not None and not isinstance(spec["ratio"], str):
        raise ConfigError(f"ratio: {path}: expected a summary.json field, got {spec['ratio']!r}")
    if not isinstance(spec.setdefault("nocomm", False), bool):
        raise ConfigError(f"nocomm: {path}: expected true or false, got {spec['nocomm']!r}")
    runs = spec["runs"]
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: {path}: expected a mapping of run name to a list of overrides, got {runs!r}")
    spec["runs"] = {str(run): str_list(path, f"runs.{run}", extra) for run, extra in runs.items()}
    relative = spec.get("relative")
    if relative is not None and not (
        isinstance(relative, list) and len(relative) == 2 and all(isinstance(r, str) for r in relative)
    ):
        raise ConfigError(f"relative: {path}: expected [summary.json field, run name], got {relative!r}")
    if relative is not None and relative[1] not in spec["runs"]:
        raise ConfigError(f"relative: {path}: {relative[1]!r} is not one of the runs ({', '.join(spec['runs'])})")
    return spec


def with_nocomm_twins(runs: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each run followed by its `<run>-nocomm` twin: the same overrides plus mesh.backend=fake."""
    out = {}
    for run, extra in runs.items():
        out[run] = extra
        out[run + NOCOMM] = [*extra, "mesh.backend=fake"]
    return out


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


def exposed_comm(summary: dict, nocomm: dict) -> dict:
    """The no-comm twin's median step and the difference: communication not hidden behind compute."""
    step, bare = summary.get("median_step_time_s"), nocomm.get("median_step_time_s")
    if step is None or bare is None:
        return {}
    return {"nocomm_step_time_s": bare, "exposed_comm_s": step - bare}


def table(name: str, spec: dict, summaries: dict[str, dict]) -> str:
    """The markdown table: one row per run (no-comm twins fold into their run's row)."""
    cols = list(spec["columns"])
    if spec.get("nocomm"):
        cols += ["nocomm_step_time_s", "exposed_comm_s"]
        summaries = {
            run: {**s, **exposed_comm(s, summaries.get(run + NOCOMM, {}))}
            for run, s in summaries.items()
            if run in spec["runs"]
        }
    ratio, relative = spec.get("ratio"), spec.get("relative")
    head = ["run", *cols] + ([f"{ratio} ratio"] if ratio else []) + ([" vs ".join(relative)] if relative else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = next(iter(summaries.values()), {})
    for run, s in summaries.items():
        row = [run] + [format_value(c, s.get(c)) for c in cols]
        if ratio:
            a, b = s.get(ratio), first.get(ratio)
            row.append(f"{b / a:.1f}× fewer" if a and b else "–")
        if relative:
            a, b = s.get(relative[0]), summaries.get(relative[1], {}).get(relative[0])
            row.append(f"{a / b:.2f}×" if a and b else "–")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- plots (--plot)

PLOTS = ("tokens", "sync_bytes", "wall")


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run folder (a torn last line is skipped); [] if there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a torn last line
            records.append(json.loads(line))
    return records


def wall_clock(records: list[dict]) -> Optional[dict[int, float]]:
    """step → cumulative step_time_s (training seconds, evals excluded), if every step from 0 was logged."""
    if [r["step"] for r in records] != list(range(len(records))):
        return None  # run.log_every > 1: the unlogged steps' times are not in metrics.jsonl
    total, out = 0.0, {}
    for r in records:
        total += r["step_time_s"]
        out[r["step"]] = total
    return out


def plot_runs(
    run_dirs: dict[str, Path], out_dir: Path, prefix: str, title: str = "", target: Optional[float] = None
) -> list[Path]:
    """Val-loss curves of run folders → `<out_dir>/<prefix>-{tokens,sync_bytes,wall}.png`; the paths written.

    From each run's metrics.jsonl, the val loss at its evals against: tokens; sync bytes sent per
    rank so far (log x; evals before the first sync, at 0 bytes, have no point); training
    wall-clock = cumulative `step_time_s`, which excludes evals and is complete only when every
    step was logged (`run.log_every=1`): other runs get no wall-clock curve and are named on
    stdout. `target` (a val loss) is drawn as a dashed line. matplotlib is imported here only.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    no_wall = []
    for run, run_dir in run_dirs.items():
        records = read_records(run_dir)
        evals = [r for r in records if "val_loss" in r]
        if not evals:
            continue
        wall = wall_clock(records)
        if wall is None:
            no_wall.append(run)
        curves[run] = {
            "tokens": [(r["tokens"], r["val_loss"]) for r in evals],
            "sync_bytes": [(r["sync_bytes"], r["val_loss"]) for r in evals if r.get("sync_bytes", 0) > 0],
            "wall": [(wall[r["step"]], r["val_loss"]) for r in evals] if wall else [],
        }
    if no_wall:
        print(
            f"note: no wall-clock curve for {', '.join(no_wall)} (not every step in metrics.jsonl; set run.log_every=1)"
        )
    labels = {
        "tokens": "tokens",
        "sync_bytes": "sync bytes sent per rank (log scale)",
        "wall": "training time, s (Σ step_time_s, evals excluded)",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in PLOTS:
        if not any(c[kind] for c in curves.values()):
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for run, c in curves.items():
            if not c[kind]:
                continue
            xs, ys = zip(*c[kind])
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=run)
            ax.plot(xs[-1], ys[-1], marker="o", markersize=7, color=line.get_color())  # where the run ended
        if target is not None:
            ax.axhline(target, color="0.4", linestyle="--", linewidth=1, label=f"target {target:.4f}")
        if kind == "sync_bytes":
            ax.set_xscale("log")
        ax.set_xlabel(labels[kind])
        ax.set_ylabel("val loss")
        ax.set_title(title or prefix, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}-{kind}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="run an ablation sweep")
    p.add_argument("sweep")
    p.add_argument("--set", action="append", default=[], help="extra override for every run")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated runs to (re)run; the others' existing summaries are reused in the table",
    )
    p.add_argument(
        "--plot",
        action="store_true",
        help="also write PNGs of val loss vs tokens, sync bytes and wall-clock next to the table (needs matplotlib)",
    )
    p.add_argument("--no-run", action="store_true", help="run nothing: table (and plots) from existing run folders")
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before the runs, not after them)
        except ImportError:
            print("--plot: needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
            return 2
    try:
        spec = load_sweep(args.sweep)
        name = Path(args.sweep).stem
        shared = [*spec["set"], *args.set]
        only = set(filter(None, args.only.split(",")))
        if only - set(spec["runs"]):
            raise ConfigError(
                f"--only: unknown runs {sorted(only - set(spec['runs']))} (expected: {', '.join(spec['runs'])})"
            )
        all_runs = with_nocomm_twins(spec["runs"]) if spec["nocomm"] else spec["runs"]
        plans = {run: [*shared, *extra, f"run.name={name}-{run}"] for run, extra in all_runs.items()}
        runs = [] if args.no_run else [run for run in plans if not only or run.removesuffix(NOCOMM) in only]
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
    if args.plot:
        dirs = {run: cfgs[run].run_dir.resolve() for run in spec["runs"]}
        for path in plot_runs(dirs, out.parent, name, title=f"{name} ({Path(spec['base']).name})"):
            print(f"wrote {path}")
    return 0 if all(summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
