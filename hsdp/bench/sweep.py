"""Running an ablation sweep: each variant (and its no-comm twin) as a train.py process, then the table and plots.

A sweep file names a base config, overrides shared by every run, and one list of overrides
per run:

    base: configs/tiny.yaml
    set: [run.eval_every=100]
    columns: [final_val_loss, sync_bytes]        # summary.json fields
    ratio: sync_bytes                            # optional: first run's / column ("N× fewer"/"N× more")
    relative: [median_step_time_s, hsdp]         # optional: column / that run's ("0.72×")
    nocomm: true                                 # optional: also run each with mesh.backend=fake
    runs:
      hsdp: []
      diloco-h32: [sync.warmup_steps=0, sync.every=32, sync.method=diloco]

Each run is the checkout's `train.py` in its own process (so one crash does not end the
sweep), started in the directory the sweep was started from and with `run.overwrite=true`
(a sweep re-runs its runs) and `run.out_dir` made absolute; its outputs land in
`<out_dir>/<sweep>-<run>/` as usual. A relative `base:` is looked up beside the sweep file
first, then in the checkout.

`nocomm: true` measures exposed communication: each run also runs as `<run>-nocomm` with
`mesh.backend=fake` (torch's fake process group: every collective returns at once, with this
rank's own data, so the step is the same compute with no communication), and the table gets
`nocomm_step_time_s` and `exposed_comm_s` = median step time − the no-comm twin's, i.e. the
time the step spends on communication that was not hidden behind compute.

The table is printed and written to `<out_dir>/<sweep>.md` (the first run's out_dir).
`--plot` also writes, next to it, `<sweep>-tokens.png`, `<sweep>-sync_bytes.png` and
`<sweep>-wall.png` (hsdp.bench.plot). `--no-run` runs nothing and makes the table (and plots)
from the run folders already there.

`--resume` continues an interrupted sweep: runs that finished (summary.json) are kept, a run
with a checkpoint resumes from it, the others start over.

Exit codes: 0 when every run asked for (`--only`'s, else all; with `--no-run`, read from its
folder) has a summary.json; else 1, with one line per failed run on stderr naming it and why
(train.py's exit code, or no/unreadable summary.json). Runs not asked for only fill the table
where their folders have results. Bad input (missing, empty or malformed sweep file, unknown
keys, a bad run config) exits 2 with one line before any run starts; SIGINT/SIGTERM stops the
current run (and its workers) and exits 130/143; a kill -9 of the sweep kills the current run's
launcher, which takes its workers with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from hsdp.bench.plan import NOCOMM, SweepPlan, plan_sweep
from hsdp.bench.plot import plot_runs, require_matplotlib
from hsdp.bench.records import RunRecord
from hsdp.bench.report import sweep_table
from hsdp.bench.spec import REPO
from hsdp.config.schema import ConfigError
from hsdp.run.stop import Interrupted, StopSignals
from hsdp.run.zygote import die_with_parent

STOP_WAIT_S = 30.0  # a run's launcher stops its workers within seconds; then it is killed


def run_one(base: str, overrides: list[str], stop: StopSignals) -> int:
    """One run as `python <checkout>/train.py` in the current directory; its return code.

    On SIGINT/SIGTERM the run gets the same signal (its launcher stops its workers), and is
    killed if it has not exited after STOP_WAIT_S; then Interrupted propagates.
    """
    cmd = [sys.executable, str(REPO / "train.py"), "--config", base]
    for o in overrides:
        cmd += ["--set", o]
    print("+", " ".join(cmd), flush=True)
    sweep = os.getpid()
    proc = subprocess.Popen(cmd, preexec_fn=lambda: die_with_parent(sweep))  # a kill -9 of the sweep ends the run
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


def exit_reason(rc: int) -> str:
    """Why a run's train.py failed, from its return code."""
    if rc < 0:
        return f"train.py was killed by signal {-rc}"
    return f"train.py exited with code {rc} (its output is above)"


def read_record(run_dir: Path) -> tuple[Optional[RunRecord], str]:
    """The run's record, or None and why not (no summary.json, or an unreadable one)."""
    try:
        record = RunRecord.read(run_dir)
    except (OSError, ValueError) as e:
        return None, f"unreadable {run_dir / 'summary.json'} ({str(e).splitlines()[0]})"
    return record, "" if record else f"no summary.json in {run_dir}"


def asked_for(plan: SweepPlan, only: set[str]) -> list[str]:
    """The runs the command was asked for: `--only`'s (a twin follows its run), else every run."""
    return [run for run in plan.overrides if not only or run.removesuffix(NOCOMM) in only]


def run_sweep(path: str, extra_set: list[str], only: set[str], plot: bool, no_run: bool, resume: bool = False) -> int:
    """The sweep command: plan, run, table, plots. 0 when every run asked for has a summary, 1 if not (one line
    per failure on stderr), 2 on bad input."""
    if plot:
        try:
            require_matplotlib()
        except ImportError:
            print("--plot: needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
            return 2
    try:
        plan = plan_sweep(path, extra_set, only, no_run, resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    records: dict[str, Optional[RunRecord]] = {}  # None: the run failed or left no summary.json
    why: dict[str, str] = {}  # run → why it has no record
    run = None
    try:
        with StopSignals() as stop:
            stop.arm()
            for run, overrides in plan.overrides.items():
                rc = run_one(plan.spec["base"], overrides, stop) if run in plan.to_run else 0
                run_dir = plan.configs[run].run_dir.resolve()
                records[run], why[run] = read_record(run_dir) if rc == 0 else (None, exit_reason(rc))
                if rc == 0 and why[run] and run in plan.to_run:
                    why[run] = f"train.py exited 0 but left {why[run]}"
    except Interrupted as e:
        print(f"interrupted by {e}: stopped run {plan.name}-{run}", file=sys.stderr)
        return e.exit_code
    md = sweep_table(plan.spec, records)
    out = plan.table_path
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md + "\n")
    print(md)
    if plot:
        dirs = {run: plan.configs[run].run_dir.resolve() for run in plan.spec["runs"]}
        for png in plot_runs(dirs, out.parent, plan.name, title=f"{plan.name} ({Path(plan.spec['base']).name})"):
            print(f"wrote {png}")
    asked = asked_for(plan, only)
    failed = [run for run in asked if records[run] is None]
    missing = [run for run in records if records[run] is None and run not in asked]
    if missing:
        print(f"note: no results yet for {', '.join(missing)} (not asked for; shown as –)", file=sys.stderr)
    for run in failed:
        what = "failed" if run in plan.to_run else "has no results"
        print(f"sweep: run {plan.name}-{run} {what}: {why[run]}", file=sys.stderr)
    return 1 if failed else 0
