"""How long a killed replica takes to train again, by phase: the tiny elastic job with one kill, N times.

    python scripts/restart_phases.py [--reps 3] [--kill 1@2:before_quorum:die | --kill-step 1@45]
                                     [--out runs/restart-phases] [--set key=value ...]

Runs train.py on configs/tiny.yaml as an elastic run of 3 replicas of 1 rank (DiLoCo every 20 steps, no warmup,
100 steps) where `--kill` (an elastic.faults `die`: the replica SIGKILLs itself there, at a sync) kills a replica
once, or `--kill-step R@S` SIGKILLs replica R's processes from here once its metrics reach step S (anywhere in a
period; this script's clock is then the kill's mark). The restarted life's summary (summary.replica<m>.json)
holds its marks (hsdp/core/timeline.py): from the kill through the launcher's restart, the fork, its world, its
manager, the model, its first quorum and its heal to its first trained step. Prints each repetition's phases and
the median over the repetitions, as a markdown table, with the load average before each repetition (a shared
box's timings are noisy: say how loaded it was).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdp.core.timeline import ORDER, phases  # noqa: E402  (after the path: run from anywhere)
from hsdp.faults.spec import parse_faults  # noqa: E402
from hsdp.run.metrics import last_record  # noqa: E402

DEFAULTS = [
    "elastic.enabled=true",
    "mesh.sync=3",
    "mesh.shard=1",
    "sync.warmup_steps=0",
    "sync.every=20",
    "run.steps=100",
    "run.checkpoint_every=0",
    "run.eval_every=0",
    "run.eval_batches=1",
    "run.log_every=1",
    "run.overwrite=true",
    "wandb.mode=disabled",
]


def last_step(path: Path) -> int:
    """The step of a metrics file's last whole record (-1: none yet)."""
    return int((last_record(path) or {}).get("step", -1))


def kill_at(proc: subprocess.Popen, run_dir: Path, replica: int, step: int, timeout_s: float) -> float:
    """SIGKILL every process of `replica` once its metrics reach `step`; the kill's time.time()."""
    deadline = time.monotonic() + timeout_s
    while last_step(run_dir / f"metrics.replica{replica}.jsonl") < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the run ended (or hung) before replica {replica} reached step {step}")
        time.sleep(0.02)
    pids = json.loads((run_dir / "replicas.json").read_text())[str(replica)]["pids"]
    killed = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return killed


def one_run(config: str, run_dir: Path, kill: str, at_step: str, overrides: list[str], timeout_s: float) -> dict:
    """One train.py run with `kill` (a die fault) or a kill from here at `at_step` (R@S); the restarted replica's
    summary, its marks led by the kill's, with the load average before the run."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config]
    where = [f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
    faults = [] if at_step else [f"elastic.faults={kill}"]
    for o in [*DEFAULTS, *overrides, *faults, *where]:
        cmd += ["--set", o]
    load = os.getloadavg()[0]
    env = {**os.environ, "HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    killed = None
    if at_step:
        replica, step = (int(x) for x in at_step.split("@"))
        killed = kill_at(proc, run_dir, replica, step, timeout_s)
    else:
        who = parse_faults(kill, 3)[0].at.replica
        if who is None:
            sys.exit(f"--kill {kill}: a replica's fault, not the lighthouse's")
        replica = who
    try:
        _, err = proc.communicate(timeout=timeout_s)  # the hang guard
    except subprocess.TimeoutExpired:
        proc.kill()
        sys.exit("train.py hung")
    if proc.returncode != 0:
        sys.exit(f"train.py failed ({proc.returncode}):\n{err[-3000:]}")
    summary = json.loads((run_dir / f"summary.replica{replica}.json").read_text())
    if killed is not None:  # killed from outside: this script's clock has the kill, the launcher's detection follows
        summary["start_marks"] = [["killed", killed], *summary["start_marks"]]
        summary["start_s"] = summary["start_marks"][-1][1] - killed
    return {**summary, "load": load}


def table(runs: list[dict]) -> str:
    """Each phase's seconds per repetition and their median (phases named by the mark that ends them)."""
    per_run = [phases([(n, t) for n, t in r["start_marks"]]) for r in runs]
    names = [n for n in ORDER if any(n in p for p in per_run)]
    head = "| phase (ends at) | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |"
    lines = [head, "|---" * (len(runs) + 2) + "|"]
    for n in names:
        values = [p.get(n) for p in per_run]
        known = [v for v in values if v is not None]
        cells = " | ".join("–" if v is None else f"{v:.3f}" for v in values)
        lines.append(f"| {n} | {cells} | {statistics.median(known):.3f} |")
    totals = [r["start_s"] for r in runs]
    lines.append(
        f"| **kill → trained** | {' | '.join(f'{t:.3f}' for t in totals)} | **{statistics.median(totals):.3f}** |"
    )
    loads = " | ".join(f"{r['load']:.2f}" for r in runs)
    lines.append(f"| load (1 min) before | {loads} | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kill", default="1@2:before_quorum:die", help="the elastic.faults that kills a replica")
    p.add_argument("--kill-step", default="", metavar="R@S", help="instead: SIGKILL replica R from here at its step S")
    p.add_argument("--out", type=Path, default=Path("runs/restart-phases"))
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--set", action="append", default=[], help="extra train.py override (repeatable)")
    args = p.parse_args()
    runs = []
    for i in range(args.reps):
        run = one_run(args.config, args.out / f"rep{i}", args.kill, args.kill_step, args.set, args.timeout)
        print(f"rep {i + 1}: kill → trained {run['start_s']:.3f} s (load {run['load']:.2f})", file=sys.stderr)
        runs.append(run)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
