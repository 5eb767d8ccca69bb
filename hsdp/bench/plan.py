"""What to run: each run's `--set` overrides and validated config, for a sweep and for the slow-link benchmark.

Every run's config is loaded (and so validated) before the first run starts, so a bad
override is a ConfigError (exit 2) and not a failure an hour in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hsdp.bench.faults import chaos_of, flag_fault
from hsdp.bench.netns import MAX_REPLICAS
from hsdp.bench.spec import REPO, LinkRunSpec, SweepSpec, load_link_spec, load_sweep, parse_rate, parse_runs_arg
from hsdp.config.schema import Config, ConfigError
from hsdp.faults.chaos import Chaos
from hsdp.faults.spec import Fault
from hsdp.run.preflight import load_checked_config
from hsdp.run.rundir import has_checkpoint

NOCOMM = "-nocomm"  # suffix of a sweep run's no-communication twin (nocomm: true)

# ------------------------------------------------------------------ sweeps


@dataclass
class SweepPlan:
    name: str  # the sweep file's stem: run folders are <name>-<run>
    spec: SweepSpec
    overrides: dict[str, list[str]]  # every run, twins included, in run order → its overrides
    to_run: list[str]  # the runs to (re)run; the others' outputs are reused
    configs: dict[str, Config]  # every run's resolved config

    @property
    def table_path(self) -> Path:
        """`<out_dir>/<name>.md`, in the first run's out_dir."""
        first = next(iter(self.configs.values()))
        return Path(first.run.out_dir).expanduser().resolve() / f"{self.name}.md"


def with_nocomm_twins(runs: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each run followed by its `<run>-nocomm` twin: the same overrides plus mesh.backend=fake."""
    out = {}
    for run, extra in runs.items():
        out[run] = extra
        out[run + NOCOMM] = [*extra, "mesh.backend=fake"]
    return out


def plan_sweep(path: str, extra_set: list[str], only: set[str], no_run: bool, resume: bool = False) -> SweepPlan:
    """The sweep file's runs (and twins) with their overrides; `only` (a twin follows its run) or none re-run.

    Re-run runs get `run.overwrite=true`; every run gets its `run.out_dir` made absolute (relative
    out_dirs mean "from where the sweep was started"). `resume` continues an interrupted sweep: a
    run with a summary.json is finished and kept, one with a checkpoint resumes from it
    (`run.resume=auto`), the others start over.
    """
    spec = load_sweep(path)
    name = Path(path).stem
    shared = [*spec["set"], *extra_set]
    if only - set(spec["runs"]):
        raise ConfigError(
            f"--only: unknown runs {sorted(only - set(spec['runs']))} (expected: {', '.join(spec['runs'])})"
        )
    all_runs = with_nocomm_twins(spec["runs"]) if spec["nocomm"] else spec["runs"]
    overrides = {run: [*shared, *extra, f"run.name={name}-{run}"] for run, extra in all_runs.items()}
    to_run = [] if no_run else [run for run in overrides if not only or run.removesuffix(NOCOMM) in only]
    if resume:
        dirs = {run: load_checked_config(spec["base"], o).run_dir for run, o in overrides.items()}
        to_run = [run for run in to_run if not (dirs[run] / "summary.json").is_file()]
    for run in to_run:  # a sweep re-runs its runs: replace their previous outputs (or continue them)
        overrides[run].append("run.resume=auto" if resume and has_checkpoint(dirs[run]) else "run.overwrite=true")
    # validate (and check against this machine) all before running any
    configs = {run: load_checked_config(spec["base"], o) for run, o in overrides.items()}
    for run, cfg in configs.items():
        overrides[run].append(f"run.out_dir={Path(cfg.run.out_dir).expanduser().resolve()}")
    return SweepPlan(name=name, spec=spec, overrides=overrides, to_run=to_run, configs=configs)


# ------------------------------------------------------------------ the slow-link benchmark


@dataclass
class LinkOptions:
    """The slow-link command line (see `python -m hsdp.slowlink --help`)."""

    spec: Optional[str] = None
    rate: Optional[str] = None
    delay_ms: Optional[float] = None
    config: Optional[str] = None
    shared: list[str] = field(default_factory=list)  # --set
    runs: Optional[list[str]] = None
    only: str = ""
    target: Optional[str] = None
    name: Optional[str] = None
    out: Optional[str] = None
    timeout_s: Optional[float] = None
    rdzv_timeout_s: int = 120
    probe_s: Optional[float] = None
    probe_reps: int = 3
    no_probe: bool = False
    # Fault flags reach the runs that name that fault (`kill:` ... in the spec: the flag's value replaces
    # theirs); where no run names it, every run it applies to but the target (`flag_runs`). Each compiles to a
    # Fault of hsdp/faults/spec.py (hsdp/bench/faults.py)
    kill: Optional[str] = None  # REPLICA@STEP (elastic runs)
    partition: Optional[str] = None  # REPLICA@AT:SECONDS (elastic runs)
    slow: Optional[str] = None  # REPLICA:FACTOR[@AT[:SECONDS]] (any run)
    chaos: Optional[str] = None  # SEED:MTBF_S (elastic runs)
    pin_cores: bool = False  # node m's processes on CPU core m (the spec's `pin_cores: true` too)
    plot: bool = False
    no_run: bool = False
    cleanup: bool = False


@dataclass
class LinkPlan:
    name: str
    base: str
    shared: list[str]
    rates: list[tuple[str, Optional[int]]]  # every network, in the order they are built
    default_rates: list[str]  # the rates of a run without its own `rates`
    delay_ms: float
    target: str
    timeout_s: float
    probe_s: float
    runs: dict[str, LinkRunSpec]
    out: Path
    out_dir: Path  # run.out_dir (absolute)
    # (M, ranks per node) of the base config with the shared overrides: a node is a replica (its S shard
    # ranks) or, on a three-level mesh, a site (its R·S ranks: docs/design.md §4.1)
    mesh: tuple[int, int] = (0, 0)
    pin_cores: bool = False  # node m's processes on CPU core m (hsdp.bench.netns.SlowLink.exec_prefix)
    kills: dict[str, Fault] = field(default_factory=dict)  # elastic runs whose node is killed (R@STEP:kill)
    partitions: dict[str, Fault] = field(default_factory=dict)  # elastic runs whose replica is cut off
    slows: dict[str, Fault] = field(default_factory=dict)  # runs with a slow replica (R@AT:slow=F[xS])
    chaoses: dict[str, Chaos] = field(default_factory=dict)  # elastic runs under a seeded fault schedule
    elastic: set[str] = field(default_factory=set)  # the elastic runs (their networks get a lighthouse host)


def make_plan(opts: LinkOptions) -> LinkPlan:
    """The spec file and the flags (which override it) → the networks and runs; every run's config validated."""
    spec = load_link_spec(opts.spec) if opts.spec else None
    runs = parse_runs_arg(opts.runs) if opts.runs else spec.runs if spec else {}
    if not runs:
        raise ConfigError("--runs: no runs (give --runs NAME=overrides ... or a spec file)")
    base = opts.config or (spec and spec.base) or str(REPO / "configs" / "tiny.yaml")
    rate_text = opts.rate.split(",") if opts.rate else (spec.rates if spec else [])
    if not rate_text:
        raise ConfigError("--rate: no rate (e.g. --rate 20mbit, or rates: in the spec)")
    rates = [parse_rate(r) for r in rate_text]
    plan_rates = list(dict.fromkeys(rates))  # the rates every run without its own `rates` runs at
    if not opts.rate:  # a run's own rates may add networks (e.g. unshaped for one run only)
        for entry in runs.values():
            plan_rates += [r for r in map(parse_rate, entry.rates or []) if r not in plan_rates]
    else:  # --rate restricts every run to those rates
        runs = {
            run: entry._replace(
                rates=None if entry.rates is None else [r for r in entry.rates if parse_rate(r) in rates]
            )
            for run, entry in runs.items()
        }
    target = opts.target or (spec and spec.target) or next(iter(runs))
    if target not in runs:
        raise ConfigError(f"--target: {target!r} is not a run (runs: {', '.join(runs)})")
    name = opts.name or (Path(opts.spec).stem if opts.spec else "slowlink")
    shared = [*(spec.shared if spec else []), *opts.shared]
    cfg = load_checked_config(base, shared)
    out_dir = Path(cfg.run.out_dir).expanduser().resolve()
    spec_delay = spec.delay_ms if spec and spec.delay_ms is not None else 0
    spec_timeout = spec.timeout_s if spec and spec.timeout_s is not None else 1200
    spec_probe = spec.probe_s if spec and spec.probe_s is not None else 2.0
    plan = LinkPlan(
        name=name,
        base=base,
        shared=shared,
        rates=plan_rates,
        default_rates=[r[0] for r in rates],
        delay_ms=opts.delay_ms if opts.delay_ms is not None else float(spec_delay),
        pin_cores=opts.pin_cores or bool(spec and spec.pin_cores),
        target=target,
        timeout_s=opts.timeout_s or float(spec_timeout),
        probe_s=opts.probe_s if opts.probe_s is not None else float(spec_probe),
        runs=runs,
        out=Path(opts.out).expanduser().resolve() if opts.out else out_dir / name,
        out_dir=out_dir,
        mesh=node_mesh(cfg),
    )
    if plan.delay_ms < 0:
        raise ConfigError(f"--delay-ms: expected >= 0, got {plan.delay_ms}")
    cores = len(os.sched_getaffinity(0))
    if plan.pin_cores and plan.mesh[0] > cores:
        raise ConfigError(f"--pin-cores: {plan.mesh[0]} nodes need a CPU core each, this process may use {cores}")
    configs = {(run, label): load_checked_config(base, overrides(plan, run, label)) for run, label in plan_items(plan)}
    elastic = plan.elastic = {run for (run, _), c in configs.items() if c.elastic.enabled}
    flagged = {
        kind: flag_runs(runs, kind, target, elastic if kind != "slow" else set(runs), chaos_too=kind == "slow")
        for kind in ("kill", "partition", "slow", "chaos")
        if getattr(opts, kind)
    }

    def fault(run: str, kind: str) -> tuple[Optional[str], str]:
        """The run's fault of `kind` (the flag's value where the flag reaches it, else the spec's) and its key."""
        if run in flagged.get(kind, ()):
            return getattr(opts, kind), f"--{kind}"
        return getattr(runs[run], kind), f"runs.{run}.{kind}"

    for (run, label), c in configs.items():  # validate every run's config before building anything
        for kind, faults in (("kill", plan.kills), ("partition", plan.partitions), ("slow", plan.slows)):
            text, what = fault(run, kind)
            if text:
                faults[run] = flag_fault(kind, text, c, what)
        if run in plan.slows:  # the node's config with it, checked now (run.slowdown's rules, hsdp/config/validate.py)
            load_checked_config(base, [*overrides(plan, run, label), *plan.slows[run].overrides()])
        chaos, what = fault(run, "chaos")
        if chaos:
            plan.chaoses[run] = chaos_of(chaos, c, what)
            if run in plan.kills or run in plan.partitions:
                raise ConfigError(f"runs.{run}: chaos draws its own kills and partitions; drop kill/partition")
        if node_mesh(c) != plan.mesh:
            raise ConfigError(
                f"runs.{run}: {node_mesh(c)[0]} nodes of {node_mesh(c)[1]} ranks differ from the base's "
                f"{plan.mesh[0]} of {plan.mesh[1]} (one network per rate)"
            )
    if opts.kill and not plan.kills:
        raise ConfigError("--kill: no run is elastic (elastic.enabled=true); a kill would end every replica")
    if opts.partition and not plan.partitions:
        raise ConfigError("--partition: no run is elastic (elastic.enabled=true); a cut would end every replica")
    if opts.chaos and not plan.chaoses:
        raise ConfigError("--chaos: no run is elastic (elastic.enabled=true); a fault would end every replica")
    if not 2 <= plan.mesh[0] <= MAX_REPLICAS:
        raise ConfigError(f"mesh.sync: slowlink needs 2..{MAX_REPLICAS} replicas, got {plan.mesh[0]}")
    return plan


def flag_runs(runs: dict[str, LinkRunSpec], kind: str, target: str, fit: set[str], chaos_too: bool) -> list[str]:
    """The runs a fault flag of `kind` (kill, partition, slow, chaos) reaches: those whose spec names that fault
    (the flag replaces their value: `--chaos 3:8` makes a spec's chaos run denser), else every run in `fit` (the
    runs it applies to) but the target, which the others are measured against and must stay calm; the target
    only when it is the one run the flag fits. A kill or a partition does not reach a chaos run (it draws its
    own; `chaos_too`: the kind may)."""
    named = [run for run, entry in runs.items() if getattr(entry, kind)]
    if named:
        return named
    fits = [run for run in runs if run in fit and (chaos_too or kind == "chaos" or not runs[run].chaos)]
    others = [run for run in fits if run != target]
    return others or fits


def node_mesh(cfg: Config) -> tuple[int, int]:
    """(nodes, ranks per node): one node (network namespace) per replica, or per site of R·S ranks."""
    return cfg.mesh.sync, cfg.mesh.replicate * cfg.mesh.shard


def plan_items(plan: LinkPlan) -> list[tuple[str, str]]:
    """(run, rate label) in the order they run: rate by rate, runs in spec order."""
    items = []
    for label, _ in plan.rates:
        for run, entry in plan.runs.items():
            labels = plan.default_rates if entry.rates is None else [parse_rate(r)[0] for r in entry.rates]
            if label in labels:
                items.append((run, label))
    return items


def run_name(plan: LinkPlan, run: str, label: str) -> str:
    """The run folder's name: `<name>-<run>-<rate>`."""
    return f"{plan.name}-{run}-{label}"


def overrides(plan: LinkPlan, run: str, label: str) -> list[str]:
    """A run's `--set` list at one rate: shared, its own, then where it writes (a fresh folder every time)."""
    return [
        *plan.shared,
        *plan.runs[run].overrides,
        f"run.name={run_name(plan, run, label)}",
        "run.overwrite=true",
        "run.resume=never",
        f"run.out_dir={plan.out_dir}",
    ]
