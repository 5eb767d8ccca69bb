"""`mesh.engine` → engine class, and the checks that ask an engine class what it supports.

The only place that maps engine names to code: config validation, checkpoints
and export ask the class this returns, never compare names.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from hsdp.comm.mesh import Mesh
from hsdp.config.schema import CHOICES, CompileConfig, Config, ConfigError
from hsdp.engines.base import Engine


class _Engines(Mapping[str, type[Engine]]):
    """name → engine class, each class's module imported when that engine is first asked for: the baselines
    pull in FSDP2 and DCP's state-dict helpers, the compiled engine inductor (0.7 CPU s of every fresh
    `import train` on a 2-core box, for engines that a run does not use)."""

    def __init__(self, where: dict[str, str]) -> None:
        self._where = where  # name → "module:Class"

    def __getitem__(self, name: str) -> type[Engine]:
        module, cls = self._where[name].split(":")
        return getattr(importlib.import_module(module), cls)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def modules(self) -> list[str]:
        """The modules that hold these engines' classes."""
        return sorted({where.split(":")[0] for where in self._where.values()})


ENGINES = _Engines(
    {
        "hsdp": "hsdp.engines.hsdp:HSDPEngine",
        "fsdp2": "hsdp.engines.baselines:FSDP2Engine",
        "ddp": "hsdp.engines.baselines:DDPEngine",
    }
)
# An engine whose compiled path is another class, per compile.scope; the others compile themselves (fsdp2:
# per block, whatever the scope).
COMPILED = {
    "step": _Engines({"hsdp": "hsdp.engines.compiled:CompiledHSDPEngine"}),
    "blocks": _Engines({"hsdp": "hsdp.engines.blocks:BlockCompiledHSDPEngine"}),
}
assert tuple(ENGINES) == CHOICES["mesh.engine"], "the config's engine choices and the registry disagree"


def engine_modules(compiled: bool) -> list[str]:
    """What a launcher's zygote imports before it forks workers, so that they share it instead of each
    importing its engine: every eager engine's module (a warm zygote serves launches of any engine), and
    both compiled engines' (every compile.scope) for a compiled run."""
    return ENGINES.modules() + ([m for scope in COMPILED.values() for m in scope.modules()] if compiled else [])


def saved_engine_class(name: str) -> type[Engine]:
    """The class that wrote a checkpoint whose meta.json names engine `name`."""
    return ENGINES[name]


def engine_class(cfg: Config) -> type[Engine]:
    """The class that runs `cfg` (the compiled variant when compile.enabled asks for it)."""
    name = cfg.mesh.engine
    return COMPILED[cfg.compile.scope].get(name, ENGINES[name]) if cfg.compile.enabled else ENGINES[name]


def check_engine_config(cfg: Config) -> None:
    """ConfigError (one line) unless the engine supports what `cfg` asks of it."""
    cls = ENGINES[cfg.mesh.engine]
    if cfg.compile.enabled and not cls.supports_compile:
        able = " and ".join(n for n, c in ENGINES.items() if c.supports_compile)
        raise ConfigError(f"compile.enabled: the compiled path exists for mesh.engine {able}, got {cls.name}")
    check_compile_scope(cfg)
    s = cfg.sync
    if cfg.mesh.replicate > 1 and not cls.supports_replicate:
        able = " or ".join(n for n, c in ENGINES.items() if c.supports_replicate)
        raise ConfigError(
            f"mesh.replicate: the {cls.name} baseline has one level of replicas, so expected 1 (its HSDP step "
            f"over {cfg.mesh.sync * cfg.mesh.replicate} replicas is mesh.sync={cfg.mesh.sync * cfg.mesh.replicate}, "
            f"mesh.replicate=1; sites need mesh.engine {able}), got {cfg.mesh.replicate}"
        )
    if cfg.elastic.enabled and not cls.supports_periodic_sync:  # elastic replicas run the periodic sync policy
        able = " or ".join(n for n, c in ENGINES.items() if c.supports_periodic_sync)
        raise ConfigError(f"elastic.enabled: elastic replicas need mesh.engine {able}, got {cls.name!r}")
    if s.warmup_steps is not None and s.warmup_steps < cfg.run.steps and not cls.supports_periodic_sync:
        able = " or ".join(n for n, c in ENGINES.items() if c.supports_periodic_sync)
        raise ConfigError(
            f"mesh.engine: periodic sync (sync.warmup_steps < run.steps) needs engine {able}, got {cls.name!r}"
        )


def check_compile_scope(cfg: Config) -> None:
    """compile.scope=blocks runs the collectives eagerly, so the step graph's options would do nothing there:
    a value other than their default is refused rather than ignored (fsdp2 compiles per block whatever the
    scope, and takes none of them)."""
    c = cfg.compile
    if not (c.enabled and c.scope == "blocks" and cfg.mesh.engine in COMPILED["blocks"]):
        return
    default = CompileConfig()
    for key in ("passes", "prefetch", "bucket_mb", "regional"):
        if getattr(c, key) != getattr(default, key):
            raise ConfigError(
                f"compile.{key}: shapes the step graph: set compile.scope=step to use it (compile.scope=blocks, the "
                f"default, compiles the blocks alone with the collectives eager; mesh.prefetch prefetches there), "
                f"got {getattr(c, key)!r}"
            )


def build_engine(cfg: Config, mesh: Mesh) -> Engine:
    """The model, wrapped by the engine the config asks for (eager or compiled), ready to train."""
    return engine_class(cfg).from_config(cfg, mesh)
