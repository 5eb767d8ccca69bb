"""Running the slow-link benchmark: per rate one network, its probe, its runs; slowlink.json/.md after every run.

For each rate a SlowLink (hsdp.bench.netns: one namespace per replica, tc-shaped veths) is
built, a probe (hsdp.bench.probe) times an all_reduce across it, and every run at that rate
is a multi-node torchrun Job (hsdp.bench.job) bounded by `timeout_s`; the veths' tx bytes are
read before and after each run (`link_bytes` ≈ M·S·sync_bytes plus TCP/IP headers). The
network is removed after its runs, on an error, and on SIGINT / SIGTERM / SIGHUP (the
processes in the namespaces are stopped first).

Spec file (all keys but `runs` optional; the command line's flags override it):

    base: configs/tiny.yaml
    set: [wandb.mode=disabled, run.log_every=1, run.eval_every=16]
    rates: [1000mbit, 100mbit, 20mbit]      # or unshaped
    delay_ms: 0
    target: hsdp
    timeout_s: 900                           # per run
    probe_s: 2                               # probe size in seconds at the rate
    pin_cores: false                         # true: replica m's processes on core m (one machine each)
    runs:
      hsdp: []                               # at every rate
      diloco-h32-int8: [sync.warmup_steps=0, sync.every=32, sync.method=diloco, sync.quantize=int8]
      int8-delay-unshaped: {set: [sync.delay=1, ...], rates: [unshaped]}   # only at these rates
      elastic-cut: {set: [elastic.enabled=true, ...], partition: 1@0.3:20}   # replica 1's link down 20 s
      elastic-slow: {set: [elastic.enabled=true, ...], slow: "1:3"}         # replica 1's node 3x slower
      (and `kill: 1@0.3`: replica 1's node SIGKILLed; hsdp/bench/elastic.py, hsdp/bench/faults.py)
      elastic-chaos: {set: [elastic.enabled=true, ...], chaos: "7:30"}   # seeded faults (hsdp/bench/chaos.py)

Outputs: run folders `<run.out_dir>/<name>-<run>-<rate>/` (train.py's usual config.yaml,
metrics.jsonl, summary.json), node logs in `<out>/logs/`, and in `<out>` (default
`<run.out_dir>/<name>`): `slowlink.json` (per run: median and mean step time, train and wall
time, final val loss, sync and link bytes, rate, time to the target val loss
(hsdp.bench.analysis); the probes; the crossover rates), `slowlink.md` (the tables, also
printed) and with `--plot` the PNGs of hsdp.bench.plot for each rate. slowlink.json/.md are
rewritten after every run, so an interrupted benchmark keeps what it measured; `--only
run,run` re-runs those runs and keeps the other entries of the earlier slowlink.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator

from hsdp.bench.analysis import Key, crossovers, evaluate_results
from hsdp.bench.chaos import ChaosJob, after_chaos
from hsdp.bench.elastic import ElasticJob
from hsdp.bench.job import TIMED_OUT, Job
from hsdp.bench.netns import MissingRequirement, SlowLink, SlowLinkError, cleanup_stale, missing_requirements
from hsdp.bench.plan import LinkOptions, LinkPlan, make_plan, overrides, plan_items, run_name
from hsdp.bench.plot import plot_rates, require_matplotlib
from hsdp.bench.probe import ProbeResult, run_probe
from hsdp.bench.records import LinkRun, Measured
from hsdp.bench.report import link_tables, secs
from hsdp.bench.spec import REPO, parse_only
from hsdp.config.schema import ConfigError
from hsdp.run.preflight import load_checked_config
from hsdp.run.stop import Interrupted, StopSignals

BASE_PORT = 29400


@contextlib.contextmanager
def hangup_stops_too() -> Iterator[None]:
    """While active, SIGHUP (the terminal went away) stops the benchmark as SIGTERM does.

    Enter it inside `StopSignals`: SIGHUP gets the handler StopSignals installed for SIGTERM.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGHUP, signal.getsignal(signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, previous)


def read_previous(plan: LinkPlan) -> tuple[dict[Key, Measured], dict[str, ProbeResult]]:
    """What an earlier slowlink.json in `plan.out` measured: per (run, rate), and the probes by rate."""
    try:
        report = json.loads((plan.out / "slowlink.json").read_text())
    except (OSError, ValueError):
        return {}, {}
    runs = {(r["run"], r["rate"]): Measured.from_json(r) for r in report.get("runs", []) if "run" in r and "rate" in r}
    return runs, {p["rate"]: ProbeResult.from_json(p) for p in report.get("probes", []) if "rate" in p}


def link_run(plan: LinkPlan, run: str, label: str, measured: Measured) -> LinkRun:
    """A run's entry: its rate, folder and what was measured around it, with its record read from the folder."""
    bps = dict(plan.rates)[label]
    return LinkRun.read(run, label, bps, plan.delay_ms, plan.out_dir / run_name(plan, run, label), measured)


def write_report(plan: LinkPlan, results: dict[Key, LinkRun], probes: dict[str, ProbeResult]) -> str:
    """slowlink.json and slowlink.md from what is known so far (written after every run); returns the tables."""
    runs = [results[k] for k in plan_items(plan) if k in results]
    probe_list = [probes[label] for label, _ in plan.rates if label in probes]
    assessed = evaluate_results(plan, runs)
    cross = crossovers(plan, runs, assessed)
    md = link_tables(plan, runs, assessed, probe_list, cross)
    report = {
        "name": plan.name,
        "base": plan.base,
        "set": plan.shared,
        "mesh": list(plan.mesh),
        "delay_ms": plan.delay_ms,
        "pin_cores": plan.pin_cores,
        "target_run": plan.target,
        "runs": [{**r.to_json(), **(assessed[(r.run, r.rate)].to_json() if r.ok else {})} for r in runs],
        "probes": [p.to_json() for p in probe_list],
        "crossover": {run: dataclasses.asdict(c) for run, c in cross.items()},
    }
    (plan.out / "slowlink.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (plan.out / "slowlink.md").write_text(md + "\n")
    return md


def make_job(plan: LinkPlan, run: str, label: str, link: SlowLink, args: list[str], port: int, rdzv_s: int) -> Job:
    """The run's job across `link`: one torchrun world over all nodes, or an elastic run's replicas."""
    S, name, logs = plan.mesh[1], f"{run}-{label}", plan.out / "logs"
    cfg = load_checked_config(plan.base, overrides(plan, run, label))
    slow = plan.slows.get(run)
    if not cfg.elastic.enabled:
        return Job(link, S, args, port, logs, name, rdzv_s, slow=slow)
    kill, cut, chaos = plan.kills.get(run), plan.partitions.get(run), plan.chaoses.get(run)
    if chaos is not None:  # the schedule is drawn over the run's time bound (hsdp.bench.chaos)
        return ChaosJob(
            link, S, args, port, logs, name, rdzv_s, slow=slow, cfg=cfg, chaos=chaos, horizon_s=plan.timeout_s
        )
    return ElasticJob(link, S, args, port, logs, name, rdzv_s, slow=slow, cfg=cfg, kill=kill, partition=cut)


def run_at_rate(
    plan: LinkPlan,
    label: str,
    link: SlowLink,
    runs: list[str],
    results: dict[Key, LinkRun],
    probes: dict[str, ProbeResult],
    port: int,
    opts: LinkOptions,
) -> int:
    """The probe and the runs of one rate across its network (the report rewritten after each); the last port used."""
    S = plan.mesh[1]
    logs = plan.out / "logs"
    print(f"[slowlink] {label}: namespaces {', '.join(link.namespaces)}; {link.qdiscs() or 'no qdisc'}", flush=True)
    if not opts.no_probe:
        port += 1
        p = probes[label] = run_probe(link, S, plan.probe_s, opts.probe_reps, port, logs, label)
        print(
            f"[slowlink] probe {label}: {p.tensor_bytes / 2**20:.1f} MiB all_reduce in "
            f"{p.sync_s_median:.3f} s (expected {secs(p.expected_s)}), shard group {secs(p.shard_s_median)}",
            flush=True,
        )
    for run in runs:
        port += 1
        args = [str(REPO / "train.py"), "--config", plan.base]
        for o in overrides(plan, run, label):
            args += ["--set", o]
        print(f"[slowlink] {run} @ {label}: {' '.join(args[3:])}", flush=True)
        before = link.tx_bytes()
        t0 = time.perf_counter()
        job = make_job(plan, run, label, link, args, port, opts.rdzv_timeout_s)
        job.start()
        rc = job.wait(plan.timeout_s)
        faults = job.faults()
        if isinstance(job, ChaosJob) or (isinstance(job, ElasticJob) and (job.kill or job.partition)):
            faults["after"] = after_chaos(job, plan.mesh[0])  # what the faults left behind: the run's state, checked
        measured = Measured(time.perf_counter() - t0, rc, sum(link.tx_bytes()) - sum(before), faults or None)
        if rc != 0:
            why = "timed out" if rc == TIMED_OUT else f"exit {rc}"
            print(f"[slowlink] {run} @ {label} {why}; logs:\n{job.log_tail()}", file=sys.stderr, flush=True)
        results[(run, label)] = link_run(plan, run, label, measured)
        write_report(plan, results, probes)  # an interrupted benchmark keeps what it measured
    return port


def execute(
    plan: LinkPlan, todo: set[Key], stop: StopSignals, opts: LinkOptions
) -> tuple[dict[Key, LinkRun], dict[str, ProbeResult]]:
    """Run the (run, rate) pairs in `todo`, one network per rate; the others come from earlier outputs."""
    measured, probes = read_previous(plan)
    results = {
        (run, label): link_run(plan, run, label, measured.get((run, label), Measured()))
        for run, label in plan_items(plan)
        if (run, label) not in todo
    }
    port = BASE_PORT
    for label, bps in plan.rates:
        runs = [run for run, lab in plan_items(plan) if lab == label and (run, lab) in todo]
        if not runs:
            continue
        link = None
        try:
            # an elastic run's lighthouse gets a host (a namespace and link) of its own on the network
            lighthouse = any(run in plan.elastic for run in runs)
            link = SlowLink(plan.mesh[0], bps, plan.delay_ms, pin_cores=plan.pin_cores, lighthouse=lighthouse)
            link.up()  # after the assignment: a failure half-way is still torn down below
            port = run_at_rate(plan, label, link, runs, results, probes, port, opts)
        finally:
            if link is not None:
                stop.disarm()  # a signal during the teardown is only noted: the network must go
                left = link.down()
                if left:
                    print(f"[slowlink] could not remove: {', '.join(left)}", file=sys.stderr)
        stop.arm()  # and raised here, once the network is gone
    return results, probes


def run_benchmark(opts: LinkOptions) -> int:
    """The slow-link command. 0 when every run finished, 1 if one did not, 2 on bad input or a missing requirement."""
    why = missing_requirements()
    if why and not opts.no_run:
        print(why, file=sys.stderr)
        return 2
    if opts.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespaces{': ' + ', '.join(removed) if removed else ''}")
        return 0
    try:
        plan = make_plan(opts)
        only = parse_only(opts.only)
        if only - set(plan.runs):
            raise ConfigError(f"--only: unknown runs {sorted(only - set(plan.runs))}")
        if opts.plot:
            require_matplotlib()  # fail now, not after an hour of runs
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("slowlink: --plot needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
        return 2
    todo = set() if opts.no_run else {(run, label) for run, label in plan_items(plan) if not only or run in only}
    plan.out.mkdir(parents=True, exist_ok=True)
    with StopSignals() as stop, hangup_stops_too():
        try:
            stop.arm()
            results, probes = execute(plan, todo, stop, opts)
        except Interrupted as e:
            report = plan.out / "slowlink.json"
            kept = f" (results so far in {report})" if report.is_file() else ""
            print(f"interrupted by {e}: stopped the runs and removed the namespaces{kept}", file=sys.stderr)
            return e.exit_code
        except SlowLinkError as e:
            print(f"slowlink: {e}", file=sys.stderr)
            return 2 if isinstance(e, MissingRequirement) else 1
    print(write_report(plan, results, probes))
    if opts.plot:
        for path in plot_rates(plan, [results[k] for k in plan_items(plan) if k in results]):
            print(f"wrote {path}")
    return 0 if all(r.ok for r in results.values()) else 1
