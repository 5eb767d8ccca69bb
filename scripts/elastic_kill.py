"""What a replica failure costs an elastic run: the same run with and without a kill -9 of one replica.

    python scripts/elastic_kill.py [--config configs/tiny.yaml] [--kill-step 40] [--replica 1]
                                   [--out runs/elastic-kill] [--set key=value ...]

Runs train.py twice with elastic.enabled=true: once undisturbed, once with every process of `--replica`
killed (SIGKILL, by the pids in replicas.json) when its metrics reach `--kill-step`. Prints one markdown
table: wall time, the killed replica's restarts and heals, the survivors' lost wall-clock, dropped syncs,
the quorum sizes the survivors saw, and whether the replicas' final params are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsdp.run.metrics import last_record  # noqa: E402  (after the path: run from anywhere)

DEFAULTS = [
    "elastic.enabled=true",
    "sync.warmup_steps=0",
    "sync.every=8",
    "sync.method=diloco",
    "run.checkpoint_every=0",  # configs/tiny.yaml keeps one every 100 steps; the timing runs save none
    "run.steps=120",
    "run.eval_every=0",
    "run.log_every=1",
    "run.save_model=true",
    "run.overwrite=true",
    "wandb.mode=disabled",
]


def last_step(path: Path) -> int:
    """The step of a metrics file's last whole record (-1: none yet)."""
    return int((last_record(path) or {}).get("step", -1))


def run(config: str, run_dir: Path, overrides: list[str], kill: tuple[int, int] | None) -> float:
    """One train.py run (killing replica kill[0] at step kill[1]); returns its wall time."""
    cmd = [sys.executable, str(REPO / "train.py"), "--config", config]
    for o in [*DEFAULTS, *overrides, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]:
        cmd += ["--set", o]
    t0 = time.monotonic()
    env = {**os.environ, "HSDP_NO_BAR": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill is not None:
        replica, step = kill
        while last_step(run_dir / f"metrics.replica{replica}.jsonl") < step:
            if proc.poll() is not None:
                sys.exit(f"the run ended before replica {replica} reached step {step}:\n{proc.stderr.read()[-2000:]}")
            time.sleep(0.05)
        for pid in json.loads((run_dir / "replicas.json").read_text())[str(replica)]["pids"]:
            os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"train.py failed ({proc.returncode}):\n{err[-2000:]}")
    return time.monotonic() - t0


def report(run_dir: Path, wall: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    replicas = json.loads((run_dir / "replicas.json").read_text())
    params = [torch.load(run_dir / f"model.replica{m}.pt") for m in range(len(replicas))]
    equal = all(torch.equal(p[k], params[0][k]) for p in params[1:] for k in params[0])
    seen = [r["replicas"] for r in map(json.loads, (run_dir / "metrics.replica0.jsonl").read_text().splitlines())]
    quorum = [q for i, q in enumerate(seen) if i == 0 or q != seen[i - 1]]
    return {
        "wall": wall,
        "restarts": sum(r["restarts"] for r in replicas.values()),
        "heals": summary["heals"],
        "lost": summary["survivor_lost_s"],
        "dropped": sum(summary["dropped_syncs"].values()),
        "quorum": "→".join(map(str, quorum)),
        "equal": equal,
        "loss": summary["final_loss"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    p.add_argument("--kill-step", type=int, default=40)
    p.add_argument("--replica", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("runs/elastic-kill"))
    p.add_argument("--set", action="append", default=[], help="extra train.py override (repeatable)")
    args = p.parse_args()
    rows = {}
    for name, kill in (("no failure", None), (f"replica {args.replica} killed", (args.replica, args.kill_step))):
        run_dir = args.out / name.replace(" ", "-")
        rows[name] = report(run_dir, run(args.config, run_dir, args.set, kill))
    base = rows["no failure"]["wall"]
    print(
        "| run | wall time | ÷ no failure | restarts | heals | survivors lost | dropped syncs | quorum sizes "
        "(replica 0) | replicas bitwise equal | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['wall']:.1f} s | {r['wall'] / base:.2f}× | {r['restarts']} | {r['heals']} | "
            f"{r['lost']:.2f} s | {r['dropped']} | {r['quorum']} | {'yes' if r['equal'] else 'NO'} | {r['loss']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
