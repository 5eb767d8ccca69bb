"""Plan a run before paying for it: step time, compute utilisation and bytes at given link rates.

    python -m hsdp.plan CONFIG [--set k=v ...] --inter RATE[,RATE...] [--latency MS] [--intra RATE]
                        [--calibrate RUN_DIR] [--json] [--plot OUT.png]
                        [--params N] [--replicas M] [--shard S] [--gpu NAME] [--mfu F] [--flops F] [--tokens T]
                        [--speeds F0,F1,... [--bound S] [--window S]]

Compute comes from a fake-backend run of the config (`--calibrate RUN_DIR`, else a few fake steps
measured now) or, with `--gpu`/`--flops`, from FLOPs (hsdp.plan.project); communication from the
engine's byte counts (hsdp.plan.workload) on the step model of hsdp.plan.model. The shard group's
collectives, which a fake-backend run leaves out, are timed on this machine's mesh
(hsdp.plan.collectives) when compute is measured here and `--intra` is not given. Bad input exits 2
with one line, before any work. `--speeds` (each replica's step time as a multiple of the compute) adds the
steady round of uneven replicas under lockstep, the straggler bound and paced rounds (hsdp.plan.uneven).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from typing import Optional

from hsdp.bench.spec import parse_rate, rate_number
from hsdp.config.loader import load_config
from hsdp.config.schema import Config, ConfigError
from hsdp.plan.calibrate import SKIP, measure_fake_run, read_fake_run
from hsdp.plan.collectives import measure_shard_collectives
from hsdp.plan.goodput import OneLineParser, check_plot_path
from hsdp.plan.model import FRAMING, Compute, Link, MeasuredIntra, Prediction, predict
from hsdp.plan.project import failure_cost, gpu_peak_flops, projected_compute
from hsdp.plan.report import plot_utilization, rate_label, table
from hsdp.plan.uneven import UnevenRound, uneven_rounds, uneven_table
from hsdp.plan.workload import Workload, build_workload

SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str, flag: str) -> float:
    """'10B' → 1e10, '124M', '2e12', '1.5T'; ConfigError naming the flag otherwise."""
    t = str(text).strip().lower()
    scale = SUFFIXES.get(t[-1:], 1.0)
    try:
        value = float(t[:-1] if t[-1:] in SUFFIXES else t) * scale
    except ValueError:
        raise ConfigError(f"{flag}: expected a number such as 10B, 124M or 2e12, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag}: expected a positive, finite number, got {text!r}")
    return value


def parse_whole(text: str, flag: str) -> int:
    """A count that must be at least 1 once rounded down (parameters, tokens)."""
    value = parse_count(text, flag)
    if value < 1:
        raise ConfigError(f"{flag}: expected at least 1, got {text!r}")
    return int(value)


def parse_rates(text: str, flag: str) -> list[float]:
    rates = []
    for part in filter(None, text.split(",")):
        number = rate_number(part)
        if number is not None and not (number[0] > 0 and math.isfinite(number[0])):
            raise ConfigError(f"{flag}: a rate must be above 0 and finite, got {part!r}")
        try:
            label, bps = parse_rate(part)
        except ConfigError:
            raise ConfigError(f"{flag}: expected rates such as 20mbit, 10gbit or 500kbit, got {part!r}") from None
        if bps is None:
            raise ConfigError(f"{flag}: a plan needs a finite rate, got {part!r}")
        rates.append(float(bps))
    if not rates:
        raise ConfigError(f"{flag}: expected at least one rate")
    return rates


class PlanParser(OneLineParser):
    """argparse's usage errors as one line, exit 2, like every other bad input of the command; it also keeps
    the flags that take a value (`value_flags`), which attach_negative_values needs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, name="plan", **kwargs)
        self.value_flags: set[str] = set()

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.nargs != 0:
            self.value_flags.update(action.option_strings)
        return action


# a value that starts like a negative number: `--inter -10gbit`, `--latency -inf` (argparse takes it for a flag)
NEGATIVE = re.compile(r"-(\d|\.\d|inf|nan)", re.IGNORECASE)


def attach_negative_values(parser: PlanParser, argv: list[str]) -> list[str]:
    """`--flag -10gbit` → `--flag=-10gbit` for every flag that takes a value, so that a negative value reaches
    the checks (and is refused there, naming the flag) instead of argparse's "expected one argument"."""
    takes_value = parser.value_flags
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in takes_value and i + 1 < len(argv) and NEGATIVE.match(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def build_parser() -> PlanParser:
    p = PlanParser(prog="python -m hsdp.plan", description=__doc__.splitlines()[0])
    p.add_argument("config", help="the run's config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--inter", required=True, help="each replica's link, comma-separated rates: 20mbit,10gbit")
    p.add_argument("--latency", type=float, default=0.0, metavar="MS", help="one-way inter-link latency (ms)")
    p.add_argument(
        "--intra",
        metavar="RATE|free",
        help="the shard group's rate per rank, or free (default: its collectives timed on this machine's mesh "
        "when compute is measured here; free for --gpu/--flops)",
    )
    p.add_argument("--calibrate", metavar="RUN_DIR", help="a mesh.backend=fake run of the config")
    p.add_argument(
        "--compute-s",
        type=float,
        metavar="SECONDS",
        help="a compute-only step time measured elsewhere (e.g. a sweep's nocomm twin), instead of --calibrate",
    )
    p.add_argument("--calibrate-steps", type=int, default=16, help="fake steps measured when no RUN_DIR is given")
    p.add_argument("--overhead", type=float, default=FRAMING, help="wire bytes per payload byte (TCP/IP framing)")
    p.add_argument("--json", action="store_true", help="print JSON (one object, or a list for several rates)")
    p.add_argument("--plot", metavar="OUT.png", help="utilisation vs inter bandwidth, HSDP and the config's method")
    p.add_argument("--params", help="project to a model of this many parameters (scales the config's units)")
    p.add_argument("--replicas", type=int, help="mesh.sync of the projected cluster")
    p.add_argument("--shard", type=int, help="mesh.shard (GPUs per replica) of the projected cluster")
    p.add_argument("--gpu", help="GPU for the compute (hsdp.models.gpt's peak table): H100, H200, A100, ...")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of --gpu/--flops (default 0.4)")
    p.add_argument("--flops", help="peak FLOP/s per GPU, for a GPU not in the table (e.g. 989e12)")
    p.add_argument("--tokens", help="token budget (default: run.steps × tokens per step)")
    p.add_argument(
        "--speeds",
        metavar="F0,F1,...",
        help="each replica's step time as a multiple of the compute (e.g. 1,2: replica 1 2x slower): adds "
        "lockstep vs bound (elastic.round_timeout_s) vs paced (sync.every_s) rounds",
    )
    p.add_argument("--bound", type=float, help="with --speeds: the straggler bound (s; default the config's)")
    p.add_argument("--window", type=float, help="with --speeds: the paced window (s; default the config's every_s)")
    p.add_argument(
        "--for-utilization",
        metavar="U[,U...]",
        help="also print the inter bandwidth each compute utilisation needs (e.g. 0.5,0.9,0.95)",
    )
    return p


class Plan:
    """The checked inputs of one planning command."""

    def __init__(self, a: argparse.Namespace) -> None:
        for flag, n in (("--replicas", a.replicas), ("--shard", a.shard)):
            if n is not None and n < 1:
                what = "replica (mesh.sync)" if flag == "--replicas" else "GPU per replica (mesh.shard)"
                raise ConfigError(f"{flag}: expected at least 1 {what}, got {n}")
        self.rates = parse_rates(a.inter, "--inter")
        if not (a.latency >= 0 and math.isfinite(a.latency)):
            raise ConfigError(f"--latency: expected milliseconds >= 0, got {a.latency:g}")
        self.intra = parse_rates(a.intra, "--intra")[0] if a.intra and a.intra != "free" else None
        if not 0 < a.mfu <= 1:
            raise ConfigError(f"--mfu: expected a fraction in (0, 1], got {a.mfu:g}")
        if not (a.overhead >= 1 and math.isfinite(a.overhead)):
            raise ConfigError(f"--overhead: expected a factor >= 1, got {a.overhead:g}")
        if a.gpu is not None and not a.gpu.strip():
            raise ConfigError("--gpu: expected a GPU name such as H100")
        self.peak = parse_count(a.flops, "--flops") if a.flops else gpu_peak_flops(a.gpu) if a.gpu else None
        self.params = parse_whole(a.params, "--params") if a.params else None
        if self.params is not None and self.peak is None:
            raise ConfigError(
                "--params: a fake-backend calibration measures only the config's model; add --gpu or --flops"
            )
        given = [flag for flag, v in (("--calibrate", a.calibrate), ("--compute-s", a.compute_s)) if v is not None]
        given += ["--gpu/--flops"] if self.peak is not None else []
        if len(given) > 1:
            raise ConfigError(f"{given[0]}: give one source of compute, not {' and '.join(given)}")
        if not given and a.calibrate_steps <= SKIP:
            raise ConfigError(
                f"--calibrate-steps: the first {SKIP} steps are not timed; expected more, got {a.calibrate_steps}"
            )
        if a.compute_s is not None and not (a.compute_s > 0 and math.isfinite(a.compute_s)):
            raise ConfigError(f"--compute-s: expected seconds > 0, got {a.compute_s:g}")
        self.tokens = parse_whole(a.tokens, "--tokens") if a.tokens else None
        self.targets = parse_targets(a.for_utilization) if a.for_utilization else []
        self.speeds = parse_speeds(a.speeds) if a.speeds else []
        for flag, v in (("--bound", a.bound), ("--window", a.window)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ConfigError(f"{flag}: expected seconds > 0, got {v:g}")
            if v is not None and not self.speeds:
                raise ConfigError(f"{flag}: only used with --speeds")
        mesh = [f"mesh.sync={a.replicas}"] if a.replicas is not None else []
        mesh += [f"mesh.shard={a.shard}"] if a.shard is not None else []
        self.overrides = [*a.overrides, *mesh]
        self.cfg: Config = load_config(a.config, self.overrides)
        if self.speeds and len(self.speeds) != self.cfg.mesh.sync:
            raise ConfigError(
                f"--speeds: expected one factor per replica (mesh.sync={self.cfg.mesh.sync}), got {a.speeds!r}"
            )
        if self.speeds and self.cfg.sync.warmup_steps is None:
            raise ConfigError("--speeds: uneven replicas' rounds need periodic sync (sync.warmup_steps is null)")
        self.args = a
        self.compute: Optional[Compute] = None
        self.measured: Optional[MeasuredIntra] = None
        self.intra_used = ""  # which intra link the model uses: measured, rate or free (said in the output)
        if a.calibrate:  # read (and check) it now: a wrong folder is bad input, found before any work
            self.compute = read_fake_run(a.calibrate, self.cfg)
        elif a.compute_s is not None:
            self.compute = Compute(a.compute_s, 0.0, "--compute-s")

    def workload(self, cfg: Optional[Config] = None) -> Workload:
        return build_workload(cfg or self.cfg, self.params)

    def link(self, bps: float) -> Link:
        return Link(bps, self.args.latency / 1e3, self.intra, self.args.overhead, self.measured)

    def resolve_intra(self) -> str:
        """`--intra` if given; else the shard group's collectives timed on this machine's mesh when the compute
        is this machine's too (a fake-backend run leaves them out); else free. Which one, as a label."""
        if not self.intra_used:
            a = self.args
            if self.intra is not None:
                self.intra_used = f"rate: --intra {a.intra}"
            elif a.intra == "free" or self.peak is not None or self.cfg.mesh.shard == 1:
                why = "--intra free" if a.intra == "free" else "projection" if self.peak else "no shard group"
                self.intra_used = f"free ({why})"
            else:
                M, S = self.cfg.mesh.sync, self.cfg.mesh.shard
                print(f"[plan] timing the shard group's collectives on a {M}×{S} mesh", file=sys.stderr)
                self.measured = measured = measure_shard_collectives(self.cfg)
                assert measured is not None  # a shard group here (mesh.shard > 1)
                share = "; on the cores that compute: not overlapped" if measured.shares_compute else ""
                self.intra_used = f"measured: {measured.source}{share}"
        return self.intra_used

    def resolve_compute(self, w: Workload) -> Compute:
        if self.compute is None:
            if self.peak is not None:
                self.compute = projected_compute(w, self.peak, self.args.mfu)
            else:
                print(f"[plan] measuring {self.args.calibrate_steps} fake-backend steps of the config", file=sys.stderr)
                self.compute = measure_fake_run(self.args.config, self.overrides, self.args.calibrate_steps)
        return self.compute

    def predict(self, w: Workload, bps: float) -> Prediction:
        compute = self.resolve_compute(w)
        intra = self.resolve_intra()
        p = predict(w, self.link(bps), compute, self.cfg.run.steps, self.tokens)
        cost = failure_cost(w, self.link(bps), compute, self.cfg)
        alone = w.M == 1  # one replica: no survivors, no peer to heal from (failure_line)
        p.extra = {
            "intra": intra,
            "failure_survivor_lost_s": None if alone else cost.survivor_lost_s,
            "failure_heal_s": None if alone else cost.heal_s,
            "failure_heal_bytes_per_rank": None if alone else cost.heal_bytes_per_rank,
        }
        return p

    def latency_bound(self, w: Workload, p: Prediction) -> Optional[dict]:
        """Whether the link's latency, not its bandwidth, bounds the utilisation at p's rate: of the exposed
        communication per step, more is latency (p's step less the step with no latency) than bandwidth (the
        step with no latency less compute). With the utilisation at unlimited bandwidth (latency kept) and
        with no latency (rate kept), for the output; None without latency or when latency is not the bound."""
        if self.args.latency <= 0 or w.M == 1:
            return None
        steps, compute, link = self.cfg.run.steps, self.resolve_compute(w), self.link(p.rate_bps)
        no_latency = predict(w, dataclasses.replace(link, latency_s=0.0), compute, steps)
        latency_s = p.step_time_s - no_latency.step_time_s
        if not latency_s > no_latency.step_time_s - p.compute_s:
            return None
        ceiling = predict(w, dataclasses.replace(link, inter_bps=math.inf), compute, steps)
        return {
            "latency_s_per_step": latency_s,
            "utilization_unlimited_bandwidth": ceiling.compute_utilization,
            "utilization_no_latency": no_latency.compute_utilization,
        }


def parse_targets(text: str) -> list[float]:
    try:
        targets = [float(t) for t in text.split(",") if t]
    except ValueError:
        targets = []
    if not targets or not all(0 < t < 1 for t in targets):
        raise ConfigError(f"--for-utilization: expected fractions in (0, 1) such as 0.5,0.9, got {text!r}")
    return targets


def bandwidth_for(plan: Plan, w: Workload, target: float) -> Optional[float]:
    """The least inter rate (bits/s) at which the compute utilisation reaches `target` (bisection on a log
    scale between 1 kbit/s and 100 Pbit/s; utilisation grows with the rate), or None if it never does."""
    lo, hi = 1e3, 1e17
    if plan.predict(w, hi).compute_utilization < target:
        return None
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if plan.predict(w, mid).compute_utilization >= target else (mid, hi)
    return hi


def hsdp_twin(cfg: Config) -> Config:
    """The same config as exact HSDP (grads synced every step)."""
    return dataclasses.replace(cfg, sync=dataclasses.replace(cfg.sync, warmup_steps=None))


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(parser, sys.argv[1:] if argv is None else list(argv)))
    try:
        plan = Plan(args)
        if args.plot:
            check_plot_path(args.plot)  # its folder and matplotlib: fail now, not after the calibration
    except ConfigError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    w = plan.workload()
    try:
        predictions = [plan.predict(w, bps) for bps in plan.rates]
    except ConfigError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    compute = plan.resolve_compute(w)  # resolved by the predictions
    if compute.warning:
        print(f"plan: {compute.warning}", file=sys.stderr)
    bounds = {p.rate_bps: plan.latency_bound(w, p) for p in predictions}
    for p in predictions:
        p.extra["latency_bound"] = bounds[p.rate_bps] is not None
        p.extra.update(bounds[p.rate_bps] or {})
    if args.json:
        out = [p.to_json() for p in predictions]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print(f"compute: {compute.step_s:.4g} s/step + {compute.sync_s:.4g} s per param sync ({compute.source})")
        print(f"intra (shard group): {plan.intra_used}")
        mesh = f"{w.M}×{w.R}×{w.S}" if w.R > 1 else f"{w.M}×{w.S}"  # sites × in-site replicas × shards
        print(f"params {w.params:.4g}, units {len(w.units)}, mesh {mesh}, {w.tokens_per_step} tokens/step")
        if w.muon:  # optim.name=muon: what the optimizer step adds (docs/design.md §6.2)
            muon_bytes = sum(m.nbytes for m in w.muon_messages())
            print(
                f"muon: {len(w.muon)} matrices, {w.muon_exchange} exchange {muon_bytes:,} shard-group bytes/step per "
                f"rank, Newton–Schulz {w.muon_flops_per_step() / 1e9:.3g} GFLOP/step on the busiest rank"
            )
        print()
        print(table(predictions))
        notes = [latency_note(p, bound, args.latency) for p in predictions if (bound := bounds[p.rate_bps])]
        print("\n" + "\n".join(notes) if notes else "")
        print(failure_line(w, predictions[0]))
    if plan.speeds:
        rounds = uneven_prediction(plan, predictions[0])
        if args.json:
            print(json.dumps([r.to_json() for r in rounds], indent=2))
        else:
            print(f"\nuneven replicas at {rate_label(predictions[0].rate_bps)} (step time × {args.speeds}):\n")
            print(uneven_table(rounds))
    if plan.targets:
        print("\n| compute utilization | inter bandwidth needed |\n|---:|---:|")
        for target in plan.targets:
            bps = bandwidth_for(plan, w, target)
            print(f"| {100 * target:g}% | {rate_label(bps) if bps else 'never (latency or compute bound)'} |")
    if args.plot:
        twin = plan.workload(hsdp_twin(plan.cfg))
        curves = {"exact HSDP": lambda r: plan.predict(twin, r).compute_utilization}
        if plan.cfg.sync.warmup_steps is not None:
            curves[method_label(plan.cfg)] = lambda r: plan.predict(w, r).compute_utilization
        lo, hi = min(plan.rates) / 10, max(plan.rates) * 10
        plot_utilization(args.plot, curves, lo, hi)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def parse_speeds(text: str) -> list[float]:
    """'1,2' → [1.0, 2.0]; each factor ≥ 1 and finite, or ConfigError naming --speeds."""
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--speeds: expected factors such as 1,2, got {text!r}") from None
    if not speeds or not all(f >= 1 and math.isfinite(f) for f in speeds):
        raise ConfigError(f"--speeds: expected factors >= 1 (1: full speed), got {text!r}")
    return speeds


def uneven_prediction(plan: Plan, p: Prediction) -> list[UnevenRound]:
    """The steady round of uneven replicas at p's rate: each replica's step time is the compute × its factor,
    the round's sync time what the step model exposes per period (the period's steps less their compute)."""
    s = plan.cfg.sync
    step = plan.resolve_compute(plan.workload()).step_s
    period = p.period_step_time_s if p.period_step_time_s is not None else p.step_time_s
    sync_s = max(0.0, (period - step) * s.every)
    a = plan.args
    bound = a.bound if a.bound is not None else plan.cfg.elastic.round_timeout_s
    window = a.window if a.window is not None else s.every_s / s.fragments
    return uneven_rounds([step * f for f in plan.speeds], s.every, sync_s, bound, window)


def latency_note(p: Prediction, bound: dict, latency_ms: float) -> str:
    """One line: at this rate the link's latency, not its bandwidth, bounds the utilisation."""
    return (
        f"latency, not bandwidth, bounds the utilisation at {rate_label(p.rate_bps)}: "
        f"{bound['latency_s_per_step']:.3g} s of the {p.exposed_comm_s:.3g} s exposed per step is the "
        f"{latency_ms:g} ms latency of each ring hop; with unlimited bandwidth utilisation is still at most "
        f"{100 * bound['utilization_unlimited_bandwidth']:.1f}% ({100 * bound['utilization_no_latency']:.1f}% "
        "with no latency): fewer, larger syncs or a lower-latency link raise it, more bandwidth barely does"
    )


def failure_line(w: Workload, p: Prediction) -> str:
    """What a replica failure costs, in words that fit the mesh (one replica: no survivors, no peer)."""
    if w.M == 1:
        return (
            "replica failure: with one replica there are no survivors and no peer to heal from: the run stops "
            "and resumes from its last checkpoint (run.checkpoint_every), the steps since then lost"
        )
    return (
        f"replica failure at {rate_label(p.rate_bps)}: "
        f"{'the other replica loses' if w.M == 2 else f'the other {w.M - 1} replicas lose'} "
        f"~{p.extra['failure_survivor_lost_s']:.3g} s, "
        f"the restarted replica heals in ~{p.extra['failure_heal_s']:.3g} s "
        f"({p.extra['failure_heal_bytes_per_rank'] / 2**20:.4g} MiB per rank)"
    )


def method_label(cfg: Config) -> str:
    s = cfg.sync
    codec = s.quantize if s.topk == 0 else f"top-{s.topk:g}" + (f" {s.quantize}" if s.quantize != "none" else "")
    parts = [s.method, f"H={s.every}", codec if codec != "none" else "fp32"]
    parts += [f"P={s.fragments}"] if s.fragments > 1 else []
    parts += [f"τ={s.delay}"] if s.delay else []
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
