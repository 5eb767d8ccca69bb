"""The slow-link benchmark's fault flags, each compiled to the one Fault (hsdp/faults/spec.py) and checked against the
run it goes to, before anything runs:

Kill        `--kill REPLICA@STEP` (or a run's `kill:`): REPLICA@STEP:kill, replica REPLICA's node SIGKILLed once its
            metrics log step STEP (a fraction of run.steps when < 1), a replacement started after
            elastic.restart_delay_s (hsdp.bench.elastic.ElasticJob)
Partition   `--partition REPLICA@AT:SECONDS` (or `partition:`): REPLICA@AT:partition=SECONDS, its link down once it logs
            step AT, back SECONDS later; every process lives (ElasticJob cuts it, hsdp.bench.netns.SlowLink.cut)
Slow        `--slow REPLICA:FACTOR[@AT[:SECONDS]]` (or `slow:`): REPLICA@AT:slow=FACTOR[xSECONDS], that replica's node
            trains FACTOR× slower (`Fault.overrides`: run.slowdown on its command line only, hsdp/faults/slowdown.py)
            from step AT (0 without it) for SECONDS (a spell) or to the end
Chaos       `--chaos SEED:MTBF_S` (or `chaos:`): the generator of hsdp/faults/chaos.py (hsdp.bench.chaos applies it)

The benchmark's own rules (not the grammar's): a kill or partition needs an elastic run and is placed at a step. It
may hit any replica, 0 included: the lighthouse runs on a host of its own, the run folder is prepared before any
replica starts, and the benchmark measures a replica that logged every step (hsdp/bench/records.py).
"""

from __future__ import annotations

from dataclasses import replace

from hsdp.config.schema import Config, ConfigError
from hsdp.faults.chaos import Chaos, parse_chaos
from hsdp.faults.spec import FLAGS, Fault, FaultSpecError, parse_flag

LOSS = {"kill": "one death ends all", "partition": "one cut ends all"}


def require_elastic(cfg: Config, what: str, fault: str, loss: str) -> None:
    """ConfigError naming `what` unless the run is elastic: without torchft, `fault` ends every replica."""
    if not cfg.elastic.enabled:
        raise ConfigError(f"{what}: {fault} needs an elastic run (elastic.enabled=true); without it {loss}")


def flag_fault(flag: str, text: str, cfg: Config, what: str) -> Fault:
    """A fault flag's value (`flag`: kill, partition, slow; `what`: the flag or the spec key it came from) as its
    Fault for a run of this config, a kill's or partition's step taken of run.steps; or ConfigError naming `what`."""
    try:
        fault = parse_flag(flag, text, what)
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None
    form, example = FLAGS[flag][1:]
    if fault.at.when != "step":  # the grammar's times are the chaos generator's
        raise ConfigError(f"{what}: the benchmark places a {flag} at a step ({form}, e.g. {example}), got {text!r}")
    m = fault.replica
    assert m is not None  # the lighthouse is placed at a time only
    if flag == "slow":
        if not m < cfg.mesh.sync:
            raise ConfigError(f"{what}: replica {m} is not one of 0..{cfg.mesh.sync - 1}")
        return fault
    require_elastic(cfg, what, f"a {flag}", LOSS[flag])
    if not m < cfg.mesh.sync:
        raise ConfigError(f"{what}: replica {m} is not one of 0..{cfg.mesh.sync - 1}")
    step = fault.at.step_of(cfg.run.steps)
    if step >= cfg.run.steps:
        raise ConfigError(f"{what}: step {step} is not before run.steps={cfg.run.steps}")
    return replace(fault, at=replace(fault.at, step=float(step)))


def chaos_of(text: str, cfg: Config, what: str) -> Chaos:
    """A chaos flag's value (SEED:MTBF_S) for an elastic run of at least 2 replicas, or ConfigError naming `what`."""
    try:
        chaos = parse_chaos(text, what)
    except FaultSpecError as e:
        raise ConfigError(str(e)) from None
    require_elastic(cfg, what, "chaos", "one fault ends all")
    if cfg.mesh.sync < 2:
        raise ConfigError(f"{what}: chaos needs mesh.sync >= 2 replicas, got {cfg.mesh.sync}")
    return chaos
