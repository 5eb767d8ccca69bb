"""Goodput under faults in the planner: what a fault of each kind costs a run of N replicas, and so the share
of replica-seconds that is useful work, from 2 to 1,024 replicas (docs/design.md §15.1).

    python -m hsdp.plan.goodput [--replicas 2,4,...,1024] [--mtbf-h 1,6,24] [--step-s 0.5 --every 32 --round-s 10]
                                [--heal-s 60] [--detect-s 1] [--checkpoint-every-s 1800 --save-s 2]
                                [--validate SLOWLINK.json] [--plot OUT.png] [--json]

Faults arrive on each replica at rate 1/MTBF (the group: N/MTBF), of the chaos benchmark's replica kinds
(hsdp/bench/chaos.py: kill, stop, partition, slow; equal shares, its mean spells), and on the one
lighthouse at 1/MTBF. A fault costs replica-seconds; with L = fault rate × mean cost ÷ N
(lost per useful replica-second) goodput = (1 − the share of time training waits for checkpoint saves) ÷
(1 + L), and the time to a target is the calm run's ÷ goodput. Per fault (P: one sync period, H steps
and the round; w: elastic.heartbeat_timeout_s, the failure detection; v: what a restarted lighthouse costs a replica
before its next quorum, its replicas' heartbeats reaching it (torchft heartbeats every 0.1 s); h: a
replacement's heal; s: the fault's spell; f = 3: a slow spell's factor):

    kind         lockstep (one job)        elastic (step-counted rounds)        paced (sync.every_s)
    kill         N·(R + C/2)               h + P/2 + (N−1)·w                    h + P/2 + (N−1)·w
    stop         N·s                       N·min(s, w) + [s > w]·(s − w + h)    s (+ h if s > w)
    partition    N·(R + C/2)               s + P/2 + h + (N−1)·w                s + P/2 + h + (N−1)·w
    slow         N·s·(1 − 1/f)             N·s·(1 − 1/f)                         s·(1 − 1/f)
    lighthouse   0 (none)                  N·(v + s·min(1, s/P))                N·(v + s·min(1, s/P))

Lockstep is one synchronous job: a lost node or link ends it, and all N restart (R, defaulting to h) from
the last checkpoint (half an interval C of work redone on average). In step-counted rounds every replica
waits at the round for a stopped or slowed one (N times the spell); paced rounds go on without it. A kill
or a cut loses the replica's unmerged half period and its heal; the survivors lose the detection at their
next round. After a lighthouse restart every replica waits for the others' heartbeats to reach it before
its next quorum, and those whose round falls in the outage wait for it.

The floor: what a fault costs on hardware of its own even if recovery cost nothing (no detection, no
restart, no heal, no wait at a round: `spell_cost`): a kill loses its unmerged half period P/2, a stop its
spell s, a slow spell s·(1 − 1/f); a partition and a lighthouse outage lose nothing (a cut replica could
train on and merge later). No recovery can beat 1 − those costs ÷ the run's replica-seconds.

`--validate` reads a slow-link report (slowlink.json with chaos runs and their calm target run) and
predicts each chaos run's goodput from the faults it actually had (kinds, spells, the heal times it
measured) and the calm run's period, in the mode its rounds ran (paced where the report sets sync.every_s): the
model's per-fault costs against the measured goodput, beside that schedule's floor. Measured by wall time (the calm
run's ÷ the chaos run's) where rounds are step-counted, since every replica waits for the slowest; by tokens trained
(the chaos run's ÷ the calm run's) where they are paced, since a paced run takes its time whatever the faults.
Bad input (a flag's value, a report that is missing, not JSON or not a slow-link report) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, Optional

from hsdp.config.schema import ConfigError

KINDS = ("kill", "stop", "partition", "slow", "lighthouse")
MEAN_SPELL_S = {"kill": 0.0, "stop": 7.0, "partition": 12.5, "slow": 20.0, "lighthouse": 4.0}  # chaos.py's ranges
SLOW_FACTOR = 3.0
MODES = ("lockstep", "elastic", "paced")


@dataclass(frozen=True)
class Cluster:
    """What the goodput model needs to know of a run (seconds throughout)."""

    replicas: int
    period_s: float  # one sync period: H steps and the round
    heal_s: float  # a replacement's time from the fault to contributing again (start, join, fetch)
    detect_s: float  # elastic.heartbeat_timeout_s: failure detection
    checkpoint_every_s: float = math.inf  # C
    save_s: float = 0.0  # what training waits for per save (synchronous: the whole write)
    restart_s: Optional[float] = None  # R: a lockstep job's relaunch (default: heal_s)
    lighthouse_wait_s: float = 0.2  # v: a restarted lighthouse hearing every replica's heartbeat


def fault_cost(kind: str, spell_s: float, mode: str, c: Cluster) -> float:
    """Replica-seconds one fault of `kind` with spell `spell_s` costs a run in `mode` (the module's table; "floor":
    its `spell_cost`, what no recovery can win back)."""
    if mode == "floor":
        return spell_cost(kind, spell_s, c)
    n, p, w, h = c.replicas, c.period_s, c.detect_s, c.heal_s
    r = c.heal_s if c.restart_s is None else c.restart_s
    redo = r + (c.checkpoint_every_s / 2 if math.isfinite(c.checkpoint_every_s) else 0.0)
    if kind in ("kill", "partition"):
        if mode == "lockstep":
            return n * redo
        return (spell_s if kind == "partition" else 0.0) + p / 2 + h + (n - 1) * w
    if kind == "stop":
        beyond = spell_s > w  # out of the quorum after the heartbeat timeout: healed when back
        if mode == "lockstep":
            return n * spell_s
        if mode == "paced":
            return spell_s + (h if beyond else 0.0)
        return n * min(spell_s, w) + ((spell_s - w + h) if beyond else 0.0)
    if kind == "slow":
        lost = spell_s * (1 - 1 / SLOW_FACTOR)
        return lost if mode == "paced" else n * lost
    if kind == "lighthouse":
        return 0.0 if mode == "lockstep" else n * (c.lighthouse_wait_s + spell_s * min(1.0, spell_s / p))
    raise ValueError(f"unknown fault kind {kind!r}")


def spell_cost(kind: str, spell_s: float, c: Cluster) -> float:
    """Replica-seconds a fault of `kind` takes from replicas of their own even with a recovery that costs
    nothing (the module's floor): only what the fault itself stops from being trained or merged."""
    if kind == "kill":
        return c.period_s / 2  # the work since the last round dies with the process
    if kind == "stop":
        return spell_s
    if kind == "slow":
        return spell_s * (1 - 1 / SLOW_FACTOR)
    if kind in ("partition", "lighthouse"):
        return 0.0
    raise ValueError(f"unknown fault kind {kind!r}")


def goodput(c: Cluster, mtbf_s: float, mode: str, mix: Optional[dict[str, float]] = None) -> float:
    """Useful ÷ total replica-seconds with faults at 1/`mtbf_s` per replica of the replica kinds in `mix`
    (equal shares by default, with chaos.py's mean spells) and at 1/`mtbf_s` on the lighthouse, less the
    share spent waiting for checkpoint saves."""
    on_replicas = [k for k in KINDS if k != "lighthouse"]
    shares = mix or {k: 1 / len(on_replicas) for k in on_replicas}
    per_fault = sum(share * fault_cost(k, MEAN_SPELL_S[k], mode, c) for k, share in shares.items())
    # replica-seconds lost per useful replica-second: (N / mtbf) replica faults per second × cost ÷ N
    # replicas, and the one lighthouse's faults at 1 / mtbf (one more machine); the lost time is added to the
    # run (more faults fall into it), so goodput is 1 / (1 + that), not 1 − that
    lighthouse = fault_cost("lighthouse", MEAN_SPELL_S["lighthouse"], mode, c) / c.replicas
    lost = (per_fault + lighthouse) / mtbf_s
    saving = c.save_s / c.checkpoint_every_s if math.isfinite(c.checkpoint_every_s) else 0.0
    return (1.0 - saving) / (1.0 + lost)


def predict_run(faults: list[dict[str, Any]], wall_s: float, c: Cluster, mode: str = "elastic") -> float:
    """The goodput the model gives a run of `wall_s` seconds that had exactly these `faults` (slowlink.json's
    chaos list: kind, seconds; each spell cut at the run's end): 1 − their summed cost ÷ (N · the run's
    replica-seconds). `mode` "floor": their `spell_cost`s, what no recovery can win back."""
    cost = 0.0
    for f in faults:
        if f.get("applied_s") is None:
            continue
        spell = min(float(f["seconds"]), max(0.0, wall_s - float(f["applied_s"])))  # what fell inside the run
        cost += fault_cost(f["kind"], spell, mode, c)
    return max(0.0, 1.0 - cost / (c.replicas * wall_s))


# ------------------------------------------------------------------ validation against measured chaos runs
def validate(report_path: Path, detect_s: float) -> list[dict[str, Any]]:
    """Each chaos run of a slowlink.json against the model: its measured wall-time goodput (the calm target
    run's wall time ÷ its own) and the model's, from its own faults, the calm run's period and the heal
    times its kills measured (from the kill to the replacement's first logged step)."""
    report = read_report(report_path)
    try:
        return _compare(report, detect_s)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:  # a report of another shape
        raise ConfigError(f"--validate: {report_path}: not a slow-link report ({type(e).__name__}: {e})") from None


def read_report(path: Path) -> dict[str, Any]:
    """A slow-link report (slowlink.json); ConfigError (one line) for a missing or unreadable file, text that is
    not JSON, or JSON without a `runs` list."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"--validate: {path} does not exist (a slowlink.json of python -m hsdp.slowlink)") from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"--validate: cannot read {path} ({why})") from None
    try:
        report = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--validate: {path} is not JSON ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise ConfigError(
            f"--validate: {path} is not a slow-link report (no `runs` list; expected the slowlink.json "
            "that python -m hsdp.slowlink writes)"
        )
    return report


def _compare(report: dict[str, Any], detect_s: float) -> list[dict[str, Any]]:
    """`validate`'s rows from a report that has a `runs` list."""
    runs = report["runs"]
    calm = {r["rate"]: r for r in runs if r["run"] == report["target_run"] and r.get("wall_time_s")}
    out = []
    for r in runs:
        chaos = (r.get("faults") or {}).get("chaos")
        base = calm.get(r["rate"])
        if not chaos or base is None or not r.get("wall_time_s"):
            continue
        faults = r["faults"]["faults"]
        heals = [f["over_s"] - f["applied_s"] for f in faults if f["kind"] == "kill" and f.get("over_s") is not None]
        every = _every(report, r["run"])
        period = base["mean_step_s"] * every
        c = Cluster(report["mesh"][0], period, _mean(heals, 30.0), detect_s)
        mode = "paced" if _setting(report, "sync.every_s", 0.0) > 0 else "elastic"  # rounds by wall time or steps
        # What the faults cost: step-counted rounds wait for the slowest replica, so the run takes longer (wall
        # time); paced rounds take their time whatever the faults, so the cost is the tokens not trained.
        by = "tokens" if mode == "paced" else "wall"
        measured = r["tokens"] / base["tokens"] if by == "tokens" else base["wall_time_s"] / r["wall_time_s"]
        predicted = predict_run(faults, r["wall_time_s"], c, mode)
        out.append(
            {
                "run": r["run"],
                "rate": r["rate"],
                "replicas": c.replicas,
                "mode": mode,
                "measured_by": by,
                "faults": len([f for f in faults if f.get("applied_s") is not None]),
                "period_s": round(period, 3),
                "heal_s": round(c.heal_s, 2),
                "measured": round(measured, 3),
                "predicted": round(predicted, 3),
                "error": round(predicted / measured - 1, 3),
                # the best any recovery could do on replicas of their own, on this schedule and the calm time
                "floor": round(predict_run(faults, base["wall_time_s"], c, "floor"), 3),
            }
        )
    return out


def _every(report: dict[str, Any], run: str) -> int:
    """sync.every of a run, from the report's shared overrides (the last one set wins)."""
    return int(_setting(report, "sync.every", 1))


def _setting(report: dict[str, Any], key: str, default: float) -> float:
    """A numeric config key from the report's shared overrides (the last one set wins), else `default`."""
    value = default
    for o in report.get("set", []):
        if o.startswith(f"{key}="):
            value = float(o.split("=", 1)[1])
    return value


def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default


# ------------------------------------------------------------------ the command
def table(c: Cluster, replicas: list[int], mtbfs_h: list[float]) -> str:
    lines = [
        "| replicas | MTBF per replica | " + " | ".join(f"goodput ({m})" for m in MODES) + " |",
        "|---:|---:|" + "---:|" * len(MODES),
    ]
    for m_h in mtbfs_h:
        for n in replicas:
            cells = [f"{goodput(replace(c, replicas=n), m_h * 3600, mode):.3f}" for mode in MODES]
            lines.append(f"| {n} | {m_h:g} h | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(c: Cluster, replicas: list[int], mtbfs_h: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"lockstep": ":", "elastic": "-", "paced": "--"}
    for i, m_h in enumerate(mtbfs_h):
        for mode in MODES:
            ys = [goodput(replace(c, replicas=n), m_h * 3600, mode) for n in replicas]
            ax.plot(replicas, ys, styles[mode], color=f"C{i}", label=f"{mode}, MTBF {m_h:g} h")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas")
    ax.set_ylabel("goodput (useful ÷ total replica-seconds)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"period {c.period_s:g} s, heal {c.heal_s:g} s, detection {c.detect_s:g} s")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_list(text: str, flag: str, kind: type) -> list:
    """'1,6,24' → [1.0, 6.0, 24.0]: positive, finite numbers, or ConfigError naming `flag`."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ConfigError(f"{flag}: expected positive numbers, got {text!r}")
    return values


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as one line ("`name`: the error (see --help)") and exit 2, like every other bad
    input of the planner's commands (hsdp.plan, hsdp.plan.goodput, hsdp.plan.validate)."""

    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name

    def error(self, message: str) -> NoReturn:
        print(f"{self.name}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def check_args(a: argparse.Namespace) -> tuple[Cluster, list[int], list[float]]:
    """The cluster, replica counts and MTBFs the flags give; ConfigError naming the first bad flag."""
    replicas = parse_list(a.replicas, "--replicas", float)
    if any(n != int(n) for n in replicas):
        raise ConfigError(f"--replicas: expected whole numbers, got {a.replicas!r}")
    mtbfs = parse_list(a.mtbf_h, "--mtbf-h", float)
    for flag, v in [("--step-s", a.step_s), ("--every", a.every), ("--heal-s", a.heal_s), ("--detect-s", a.detect_s)]:
        if not (v > 0 and math.isfinite(v)):
            raise ConfigError(f"{flag}: expected a positive number, got {v:g}")
    for flag, v in [("--round-s", a.round_s), ("--save-s", a.save_s)]:
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"{flag}: expected seconds >= 0, got {v:g}")
    if not a.checkpoint_every_s > 0:  # inf: no checkpoints
        raise ConfigError(f"--checkpoint-every-s: expected seconds > 0 (inf: none), got {a.checkpoint_every_s:g}")
    if a.plot:
        check_plot_path(a.plot)
    c = Cluster(2, a.step_s * a.every + a.round_s, a.heal_s, a.detect_s, a.checkpoint_every_s, a.save_s)
    return c, [int(n) for n in replicas], mtbfs


KERNEL_FS = (Path("/proc"), Path("/sys"))  # writable to root, but no place for a PNG


def check_plot_path(path: str) -> None:
    """--plot's file must go into an existing, writable folder, and matplotlib must be there: checked before any
    work (hsdp.plan's --plot too), so a bad path is one line, not a traceback after the work."""
    folder = Path(path).expanduser().absolute().parent
    if not folder.is_dir():
        raise ConfigError(f"--plot: {folder} is not a folder")
    kernel = any(folder == k or k in folder.parents for k in KERNEL_FS)
    if kernel or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--plot: cannot write into {folder}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install -e '.[plot]')") from None


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"plan.goodput: {e}", file=sys.stderr)
        return 2


def _main(argv: Optional[list[str]]) -> int:
    p = OneLineParser(prog="python -m hsdp.plan.goodput", description=__doc__.splitlines()[0], name="plan.goodput")
    p.add_argument("--replicas", default="2,4,8,16,32,64,128,256,512,1024")
    p.add_argument("--mtbf-h", default="1,6,24", help="each replica's mean time between faults (hours)")
    p.add_argument("--step-s", type=float, default=0.5, help="one training step (s)")
    p.add_argument("--every", type=int, default=32, help="sync.every: steps per period")
    p.add_argument("--round-s", type=float, default=10.0, help="a round's exposed sync time (s)")
    p.add_argument("--heal-s", type=float, default=60.0, help="a replacement's restart, join and state fetch (s)")
    p.add_argument("--detect-s", type=float, default=1.0, help="elastic.heartbeat_timeout_s: failure detection (s)")
    p.add_argument("--checkpoint-every-s", type=float, default=1800.0)
    p.add_argument("--save-s", type=float, default=2.0, help="what training waits for per save (async: the copy)")
    p.add_argument("--validate", metavar="SLOWLINK.json", help="compare with the chaos runs of a slow-link report")
    p.add_argument("--plot", metavar="OUT.png")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    c, replicas, mtbfs = check_args(a)
    if a.validate:
        rows = validate(Path(a.validate).expanduser(), a.detect_s)
        if not rows:
            raise ConfigError(
                f"--validate: {a.validate} has no chaos run with a calm target run at its rate (nothing to compare)"
            )
        if a.json:
            print(json.dumps(rows, indent=1))
        else:
            print(
                "| run | rate | replicas | rounds | faults | period | heal | measured goodput | measured by | model "
                "| error | floor |"
            )
            print("|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
            for r in rows:
                print(
                    f"| {r['run']} | {r['rate']} | {r['replicas']} | {r['mode']} | {r['faults']} "
                    f"| {r['period_s']:.1f} s | {r['heal_s']:.1f} s | {r['measured']:.3f} | {r['measured_by']} "
                    f"| {r['predicted']:.3f} "
                    f"| {r['error']:+.1%} | {r['floor']:.3f} |"
                )
        return 0
    if a.json:
        rows = [
            {"replicas": n, "mtbf_h": m, **{mode: goodput(replace(c, replicas=n), m * 3600, mode) for mode in MODES}}
            for m in mtbfs
            for n in replicas
        ]
        print(json.dumps(rows, indent=1))
    else:
        print(table(c, replicas, mtbfs))
    if a.plot:
        plot(c, replicas, mtbfs, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
