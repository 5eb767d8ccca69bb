"""The slow-link benchmark's injected faults besides a node kill: a partition and a slow replica.

Partition   `--partition REPLICA@AT:SECONDS` (or a run's `partition:`): replica REPLICA's link goes down
            once its metrics log step AT (a fraction of run.steps when < 1) and comes back SECONDS later;
            every process lives (hsdp.bench.elastic.ElasticJob cuts it, hsdp.bench.netns.SlowLink.cut)
Slow        `--slow REPLICA:FACTOR[@AT[:SECONDS]]` (or a run's `slow:`): that replica's node trains FACTOR×
            slower (`--set run.slowdown=FACTOR` on its command line only: each step sleeps (FACTOR − 1)× its
            time or the rank's recent median step, the smaller); with @AT from step AT (a fraction of run.steps
            when < 1), for SECONDS (a spell) or to the end
"""

from __future__ import annotations

from dataclasses import dataclass

from hsdp.config.schema import Config, ConfigError


def require_elastic(cfg: Config, what: str, fault: str, loss: str) -> None:
    """ConfigError naming `what` unless the run is elastic: without torchft, `fault` ends every replica."""
    if not cfg.elastic.enabled:
        raise ConfigError(f"{what}: {fault} needs an elastic run (elastic.enabled=true); without it {loss}")


@dataclass(frozen=True)
class Partition:
    """Replica `replica`'s link is down from when its metrics log step `step`, for `seconds`."""

    replica: int
    step: int
    seconds: float

    @classmethod
    def parse(cls, text: str, cfg: Config, what: str) -> Partition:
        """'R@AT:SECONDS' (AT a step, or a fraction of run.steps when < 1) for a run of this config, or ConfigError."""
        usage = f"{what}: expected REPLICA@AT:SECONDS (e.g. 1@0.3:20), got {text!r}"
        replica, sep, rest = str(text).partition("@")
        at, sep2, seconds = rest.partition(":")
        try:
            m, a, s = int(replica), float(at), float(seconds)
        except ValueError:
            raise ConfigError(usage) from None
        if not sep or not sep2 or a < 0 or not s > 0:
            raise ConfigError(usage)
        require_elastic(cfg, what, "a partition", "one cut ends all")
        if not 1 <= m < cfg.mesh.sync:
            raise ConfigError(
                f"{what}: replica {m} is not one of 1..{cfg.mesh.sync - 1} "
                "(node 0 runs the lighthouse and is the replica the benchmark measures)"
            )
        step = int(a * cfg.run.steps) if a < 1 else int(a)
        if step >= cfg.run.steps:
            raise ConfigError(f"{what}: step {step} is not before run.steps={cfg.run.steps}")
        return cls(m, step, s)

    def to_json(self) -> dict:
        return {"replica": self.replica, "step": self.step, "seconds": self.seconds}


@dataclass(frozen=True)
class Slow:
    """Replica `replica`'s node trains `factor`× slower (run.slowdown on its command line): from step `at`
    (a fraction of run.steps when < 1) for `seconds` (0: to the end)."""

    replica: int
    factor: float
    at: float = 0.0
    seconds: float = 0.0

    @classmethod
    def parse(cls, text: str, mesh_sync: int, what: str) -> Slow:
        """'R:FACTOR[@AT[:SECONDS]]' (FACTOR ≥ 1) for a run of `mesh_sync` replicas, or ConfigError."""
        usage = f"{what}: expected REPLICA:FACTOR[@AT[:SECONDS]] with FACTOR >= 1 (e.g. 1:3, 1:2@0.3:60), got {text!r}"
        head, _, spell = str(text).partition("@")
        replica, sep, factor = head.partition(":")
        at, _, seconds = spell.partition(":")
        try:
            m, f = int(replica), float(factor)
            a, s = float(at or 0), float(seconds or 0)
        except ValueError:
            raise ConfigError(usage) from None
        if not sep or not f >= 1 or a < 0 or s < 0:
            raise ConfigError(usage)
        if not 0 <= m < mesh_sync:
            raise ConfigError(f"{what}: replica {m} is not one of 0..{mesh_sync - 1}")
        return cls(m, f, a, s)

    def overrides(self) -> list[str]:
        return [f"run.slowdown={self.factor:g}", f"run.slow_from={self.at:g}", f"run.slow_for_s={self.seconds:g}"]

    def to_json(self) -> dict:
        return {"replica": self.replica, "factor": self.factor, "at": self.at, "seconds": self.seconds}
