"""`mesh.engine` → engine class, and the checks that ask an engine class what it supports.

The only place that maps engine names to code: config validation, checkpoints
and export ask the class this returns, never compare names.
"""

from __future__ import annotations

from hsdp.comm.mesh import Mesh
from hsdp.config.schema import CHOICES, Config, ConfigError
from hsdp.engines.base import Engine
from hsdp.engines.baselines import DDPEngine, FSDP2Engine
from hsdp.engines.compiled import CompiledHSDPEngine
from hsdp.engines.hsdp import HSDPEngine

ENGINES: dict[str, type[Engine]] = {cls.name: cls for cls in (HSDPEngine, FSDP2Engine, DDPEngine)}
# An engine whose compiled path is another class; the others compile themselves (fsdp2: per block).
COMPILED: dict[str, type[Engine]] = {HSDPEngine.name: CompiledHSDPEngine}
assert tuple(ENGINES) == CHOICES["mesh.engine"], "the config's engine choices and the registry disagree"


def saved_engine_class(name: str) -> type[Engine]:
    """The class that wrote a checkpoint whose meta.json names engine `name`."""
    return ENGINES[name]


def engine_class(cfg: Config) -> type[Engine]:
    """The class that runs `cfg` (the compiled variant when compile.enabled asks for it)."""
    name = cfg.mesh.engine
    return COMPILED.get(name, ENGINES[name]) if cfg.compile.enabled else ENGINES[name]


def check_engine_config(cfg: Config) -> None:
    """ConfigError (one line) unless the engine supports what `cfg` asks of it."""
    cls = ENGINES[cfg.mesh.engine]
    if cfg.compile.enabled and not cls.supports_compile:
        able = " and ".join(n for n, c in ENGINES.items() if c.supports_compile)
        raise ConfigError(f"compile.enabled: the compiled path exists for mesh.engine {able}, got {cls.name}")
    s = cfg.sync
    if cfg.elastic.enabled and not cls.supports_periodic_sync:  # elastic replicas run the periodic sync policy
        able = " or ".join(n for n, c in ENGINES.items() if c.supports_periodic_sync)
        raise ConfigError(f"elastic.enabled: elastic replicas need mesh.engine {able}, got {cls.name!r}")
    if s.warmup_steps is not None and s.warmup_steps < cfg.run.steps and not cls.supports_periodic_sync:
        able = " or ".join(n for n, c in ENGINES.items() if c.supports_periodic_sync)
        raise ConfigError(
            f"mesh.engine: periodic sync (sync.warmup_steps < run.steps) needs engine {able}, got {cls.name!r}"
        )


def build_engine(cfg: Config, mesh: Mesh) -> Engine:
    """The model, wrapped by the engine the config asks for (eager or compiled), ready to train."""
    return engine_class(cfg).from_config(cfg, mesh)
