"""Run configuration: typed dataclasses, YAML loading, `--set` overrides, validation.

Every user error (unknown key, wrong type, out-of-range value, missing file,
inconsistent mesh) raises `ConfigError` with one line naming the key and what
was expected; `train.py` turns it into exit code 2 before any worker starts.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


@dataclass
class RunConfig:
    name: str = "tiny"
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 200
    log_every: int = 10
    eval_every: int = 50  # 0 = only at the end
    eval_batches: int = 4
    save_model: bool = False  # write model.replica{m}.pt (full params) at the end
    overwrite: bool = False  # replace an existing run folder of the same name (otherwise refuse)
    checkpoint_every: int = 0  # steps between checkpoints (0 = off)
    resume: str = "auto"  # auto (latest checkpoint in the run folder, if any) | never | a checkpoint path
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones deleted after a new one is complete)


@dataclass
class ModelConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    bias: bool = True


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text | tokens | synthetic
    path: str = ""  # text: file or glob; tokens: train .bin (val.bin beside it, if present)
    batch_size: int = 8  # sequences per rank per micro-step
    val_fraction: float = 0.1  # text/tokens without a val file: share held out


@dataclass
class MeshConfig:
    sync: int = 1  # replicas (slow links)
    shard: int = 1  # FSDP group size (fast links)
    engine: str = "hsdp"  # hsdp | fsdp2 | ddp
    backend: str = "auto"  # auto (nccl on CUDA, else gloo) | gloo | nccl | fake (no communication, timing only)
    timeout_s: float = 300.0  # process-group timeout: a hung collective fails after this
    prefetch: bool = True  # overlap the next unit's gather with this unit's compute


@dataclass
class PrecisionConfig:
    param_dtype: str = "fp32"  # dtype of gathered full params (compute)
    reduce_dtype: str = "fp32"  # dtype of gradient reduce-scatter / all-reduce


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup: int = 20  # linear LR warmup steps (not the sync warmup)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    grad_clip: float = 1.0  # 0 disables clipping
    grad_accum: int = 1


@dataclass
class SyncConfig:
    warmup_steps: Optional[int] = None  # None: every step syncs grads (exact HSDP)
    every: int = 1  # H: param sync period after warmup
    method: str = "average"  # average | diloco
    outer_lr: Optional[float] = None  # None: 1.0 for average, 0.7 for diloco
    outer_momentum: Optional[float] = None  # None: 0.0 for average, 0.9 for diloco
    nesterov: bool = True
    fragments: int = 1  # P: streaming fragments
    quantize: str = "none"  # none | int8
    quant_block: int = 256  # elements per int8 scale
    delay: int = 0  # τ: local steps a param sync's reduction overlaps before it lands (0 = blocking sync)
    alpha: float = 0.0  # α: when a delayed sync lands, θ_m ← α·θ_m + (1 − α)·θ_g (needs delay ≥ 1)


@dataclass
class CompileConfig:
    enabled: bool = False  # hsdp: fwd+bwd as torch.compile graphs, collectives inside; fsdp2: compiled per block
    passes: str = "ours"  # hsdp: who schedules the graph's collectives (ours: prefetch + late waits; inductor's; none)
    prefetch: int = 1  # passes=ours: all-gathers start this many units ahead of their use
    bucket_mb: float = 0.0  # hsdp: neighbouring units share one all-gather/reduce-scatter up to this size (0 = off)


@dataclass
class KernelsConfig:
    backend: str = "auto"  # auto (Triton on CUDA, torch on CPU) | triton | torch


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "hsdp"
    entity: Optional[str] = None


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @property
    def world_size(self) -> int:
        return self.mesh.sync * self.mesh.shard

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir).expanduser() / self.run.name


# ---------------------------------------------------------------- validation rules
DTYPES = ("fp32", "bf16", "fp16")
CHOICES: dict[str, tuple[str, ...]] = {
    "data.source": ("stdlib", "text", "tokens", "synthetic"),
    "mesh.engine": ("hsdp", "fsdp2", "ddp"),
    "mesh.backend": ("auto", "gloo", "nccl", "fake"),
    "precision.param_dtype": DTYPES,
    "precision.reduce_dtype": DTYPES,
    "optim.name": ("adamw", "sgd"),
    "sync.method": ("average", "diloco"),
    "sync.quantize": ("none", "int8"),
    "compile.passes": ("ours", "inductor", "none"),
    "kernels.backend": ("auto", "triton", "torch"),
    "wandb.mode": ("offline", "online", "disabled"),
}
# Range rules by key: integers >= 1, values >= 0 (null allowed where the field is optional), values > 0.
AT_LEAST_ONE = [
    "run.steps",
    "run.log_every",
    "run.eval_batches",
    "model.vocab_size",
    "model.seq_len",
    "model.n_layer",
    "model.n_head",
    "model.d_model",
    "data.batch_size",
    "mesh.sync",
    "mesh.shard",
    "optim.grad_accum",
    "sync.every",
    "sync.fragments",
    "sync.quant_block",
    "run.keep_checkpoints",
]
NON_NEGATIVE = [
    "run.eval_every",
    "optim.lr_warmup",
    "optim.weight_decay",
    "optim.momentum",
    "optim.grad_clip",
    "optim.min_lr",
    "sync.warmup_steps",
    "sync.outer_momentum",
    "run.checkpoint_every",
    "sync.delay",
    "compile.prefetch",
    "compile.bucket_mb",
]
POSITIVE = ["optim.lr", "optim.eps", "mesh.timeout_s", "sync.outer_lr"]


def _type_name(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args:
        return f"{args[0].__name__} or null"
    return tp.__name__


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to the field's annotated type, or raise ConfigError."""
    optional = type(None) in typing.get_args(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    expected = f"expected {_type_name(tp)}{' or null' if optional and 'null' not in _type_name(tp) else ''}"
    bad = ConfigError(f"{key}: {expected}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            number = float(value) if isinstance(value, (int, float, str)) else None
        except ValueError:
            number = None
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite float, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)  # --set text arrives verbatim, so "2024-01-01" or "010" stay as typed
        raise bad
    raise bad


def _section_fields(section_obj: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section_obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(section_obj)}


def _set_value(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    sections = [f.name for f in dataclasses.fields(cfg)]
    if len(parts) != 2:
        raise ConfigError(f"{key}: expected a key of the form section.key (sections: {', '.join(sections)})")
    section, name = parts
    if section not in sections:
        raise ConfigError(f"{key}: unknown section {section!r} (expected one of: {', '.join(sections)})")
    obj = getattr(cfg, section)
    fields_ = _section_fields(obj)
    if name not in fields_:
        raise ConfigError(f"{key}: unknown key in section {section!r} (expected one of: {', '.join(fields_)})")
    setattr(obj, name, _coerce(key, value, fields_[name]))


def _apply_mapping(cfg: Config, data: Any, origin: str) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of sections, got {type(data).__name__}")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a mapping of keys, got {values!r}")
        for name, value in values.items():
            _set_value(cfg, f"{section}.{name}", value)


def parse_override(text: str) -> tuple[str, str]:
    """`section.key=value` → (key, raw text); the field's type decides how the text is read."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), raw


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (plain YAML silently keeps the last)."""

    def compose_document(self) -> yaml.Node:
        self._root = super().compose_document()
        return self._root

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:` merges may be overridden by explicit keys, as YAML intends
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                where = ".".join(map(str, [*(_key_path(self._root, node) or []), key]))
                raise _DuplicateKey(
                    f"duplicate key {where} at {_position(key_node.start_mark)} "
                    f"(first at {_position(seen[key].start_mark)})"
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep)


class _DuplicateKey(Exception):
    """A YAML mapping repeats a key (raised by the strict loader, turned into a ConfigError)."""


def _position(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _key_path(root: yaml.Node, target: yaml.Node) -> Optional[list[str]]:
    """Keys leading from the document root to the mapping node `target` (for error messages)."""
    if root is target:
        return []
    if isinstance(root, yaml.MappingNode):
        children = [(k.value, v) for k, v in root.value]
    elif isinstance(root, yaml.SequenceNode):
        children = [(str(i), v) for i, v in enumerate(root.value)]
    else:
        return None
    for name, child in children:
        below = _key_path(child, target)
        if below is not None:
            return [name, *below]
    return None


def read_yaml(path: str, key: str = "--config", expected: str = "a mapping of sections") -> Any:
    """Parse a YAML file strictly; ConfigError (naming `key`, the file, line and column) on any problem.

    An empty file (or one holding only comments) is an error: it is almost always a mistake.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}: file not found: {path}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {path} ({e})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"{key}: {path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{_position(mark)}: " if mark else ""
        what = f"{e.problem or 'syntax error'}{f' ({e.context})' if e.context else ''}"
        raise ConfigError(f"{key}: {path} is not valid YAML ({where}{' '.join(what.split())})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: {path} is not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        raise ConfigError(f"{key}: {path} is empty (expected {expected})")
    return data


def load_config(path: Optional[str], overrides: list[str] = ()) -> Config:
    """Defaults ← YAML file ← `--set` overrides, then validate."""
    cfg = Config()
    if path is not None:
        _apply_mapping(cfg, read_yaml(path), str(path))
    for text in overrides:
        key, value = parse_override(text)
        _set_value(cfg, key, value)
    validate(cfg)
    return cfg


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Range, choice and cross-field checks, then the machine, the output folder and the data.

    `world_size` is the torchrun world, if any. Everything that can be known before a
    worker starts is checked here, so that bad input exits 2 before anything is written.
    """
    for key, choices in CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}: expected one of {' | '.join(choices)}, got {_get(cfg, key)!r}")
    for key in AT_LEAST_ONE:
        if _get(cfg, key) < 1:
            raise ConfigError(f"{key}: expected an integer >= 1, got {_get(cfg, key)!r}")
    for key in NON_NEGATIVE:
        v = _get(cfg, key)
        if v is not None and v < 0:
            raise ConfigError(f"{key}: expected a value >= 0, got {v!r}")
    for key in POSITIVE:
        v = _get(cfg, key)
        if v is not None and v <= 0:
            raise ConfigError(f"{key}: expected a value > 0, got {v!r}")
    check_run_name(cfg.run.name)
    if cfg.model.vocab_size < 2:
        raise ConfigError(f"model.vocab_size: expected at least 2 tokens, got {cfg.model.vocab_size}")
    if cfg.model.d_model % cfg.model.n_head:
        raise ConfigError(
            f"model.n_head: expected a divisor of model.d_model={cfg.model.d_model}, got {cfg.model.n_head}"
        )
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr: expected a value <= optim.lr={cfg.optim.lr}, got {cfg.optim.min_lr}")
    if not 0 <= cfg.optim.beta1 < 1 or not 0 <= cfg.optim.beta2 < 1:
        raise ConfigError(f"optim.beta1/beta2: expected values in [0, 1), got {cfg.optim.beta1}, {cfg.optim.beta2}")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction: expected a value in (0, 1), got {cfg.data.val_fraction}")
    if cfg.data.source == "synthetic" or cfg.data.source == "stdlib":
        if cfg.data.source == "stdlib" and cfg.model.vocab_size < 256:
            raise ConfigError(f"model.vocab_size: expected >= 256 for byte-level data, got {cfg.model.vocab_size}")
    elif cfg.data.source == "text":
        if cfg.model.vocab_size < 256:
            raise ConfigError(f"model.vocab_size: expected >= 256 for byte-level data, got {cfg.model.vocab_size}")
        if not cfg.data.path or not any(os.path.isfile(p) for p in glob.glob(os.path.expanduser(cfg.data.path))):
            raise ConfigError(f"data.path: expected a text file or glob that matches files, got {cfg.data.path!r}")
    elif cfg.data.source == "tokens":
        if not cfg.data.path or not Path(cfg.data.path).expanduser().is_file():
            raise ConfigError(f"data.path: expected an existing uint16 .bin token file, got {cfg.data.path!r}")
    s = cfg.sync
    if s.fragments > 1 and s.every % s.fragments:
        raise ConfigError(f"sync.fragments: expected a divisor of sync.every={s.every}, got {s.fragments}")
    units = cfg.model.n_layer + 2  # hsdp/model.py: embedding, one unit per block, head
    if s.fragments > units:
        raise ConfigError(
            f"sync.fragments: expected at most the model's {units} units (model.n_layer + 2: "
            f"embedding, blocks, head), got {s.fragments}"
        )
    from kernels.quant import MAX_BLOCK  # lazy: kernels import torch

    if s.quant_block > MAX_BLOCK:  # one block is one register-tile row of the kernel
        raise ConfigError(f"sync.quant_block: expected at most {MAX_BLOCK}, got {s.quant_block}")
    if s.delay >= s.every and s.delay > 0:
        raise ConfigError(f"sync.delay: expected a value < sync.every={s.every}, got {s.delay}")
    if not 0 <= s.alpha <= 1:
        raise ConfigError(f"sync.alpha: expected a value in [0, 1], got {s.alpha}")
    if s.alpha > 0 and s.delay == 0:
        raise ConfigError(
            f"sync.alpha: only used by an overlapped sync (sync.delay >= 1), got alpha {s.alpha} with delay 0"
        )
    saves = {"run.checkpoint_every": cfg.run.checkpoint_every, "run.save_model": cfg.run.save_model}
    saves["run.resume"] = cfg.run.resume not in ("auto", "never")
    if cfg.mesh.backend == "fake" and any(saves.values()):
        what = next(k for k, v in saves.items() if v)
        raise ConfigError(
            f"{what}: mesh.backend=fake moves no data between ranks (timing only), so saved or loaded state "
            "would be wrong; turn it off or use a real backend"
        )
    if cfg.compile.enabled and cfg.mesh.engine == "ddp":
        raise ConfigError("compile.enabled: the compiled path exists for mesh.engine hsdp and fsdp2, got ddp")
    if s.outer_momentum is not None and s.outer_momentum >= 1:
        raise ConfigError(f"sync.outer_momentum: expected a value in [0, 1), got {s.outer_momentum}")
    periodic = s.warmup_steps is not None and s.warmup_steps < cfg.run.steps
    if periodic and cfg.mesh.engine != "hsdp":
        raise ConfigError(
            f"mesh.engine: periodic sync (sync.warmup_steps < run.steps) needs engine hsdp, got {cfg.mesh.engine!r}"
        )
    if cfg.kernels.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch  # only here: config parsing stays light otherwise

        if not torch.cuda.is_available():
            raise ConfigError(
                "kernels.backend: triton needs a CUDA GPU (or TRITON_INTERPRET=1 to interpret "
                "the kernels on CPU); use auto or torch here"
            )
    if cfg.sync.method == "average" and (cfg.sync.outer_lr is not None or cfg.sync.outer_momentum is not None):
        raise ConfigError("sync.outer_lr/outer_momentum: only used by sync.method=diloco, got method average")
    if cfg.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"wandb.mode: {cfg.wandb.mode} needs the wandb package (pip install wandb); or set wandb.mode=disabled"
        )
    if world_size is not None:
        check_world_size(cfg, world_size)
    check_mesh_fits(cfg)
    from hsdp.data import check_data  # lazy: data imports torch
    from hsdp.rundir import check_output_dir  # lazy: rundir imports this module

    check_output_dir(cfg)
    check_data(cfg)


def check_run_name(name: str) -> None:
    """run.name is one folder name inside run.out_dir: not empty, `.`, `..`, nor a path."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ConfigError(f"run.name: expected a folder name (not empty, '.', '..', no '/'), got {name!r}")


def check_world_size(cfg: Config, world_size: int) -> None:
    """The mesh must match the world torchrun launched."""
    if world_size != cfg.world_size:
        raise ConfigError(
            f"mesh: sync×shard = {cfg.mesh.sync}×{cfg.mesh.shard} = {cfg.world_size} does not match "
            f"the launched world size {world_size}"
        )


def check_mesh_fits(cfg: Config) -> None:
    """nccl needs CUDA; a locally spawned world must fit this machine (torchrun worlds are its business).

    Local cap: one rank per GPU with nccl (the default on CUDA), else 4 ranks per CPU core
    (beyond that gloo ranks mostly wait for each other, and memory runs out first).
    """
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.mesh.backend != "nccl" and (torchrun or cfg.world_size == 1):
        return
    import torch  # lazy: only a multi-rank or nccl config needs to know the machine

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.mesh.backend == "nccl" and not gpus:
        raise ConfigError("mesh.backend: nccl needs CUDA GPUs and none are available here; use auto or gloo")
    if torchrun:
        return
    mesh = f"mesh.sync×mesh.shard = {cfg.mesh.sync}×{cfg.mesh.shard} = {cfg.world_size} local ranks"
    if gpus and cfg.mesh.backend != "gloo":
        if cfg.world_size > gpus:
            raise ConfigError(
                f"{mesh}, but this machine has {gpus} GPUs; use torchrun across nodes or mesh.backend=gloo"
            )
        return
    cap = (os.cpu_count() or 1) * 4
    if cfg.world_size > cap:
        raise ConfigError(
            f"{mesh}, but this machine runs at most {cap} (4 per CPU core); "
            "use a smaller mesh or torchrun across machines"
        )


def outer_hyperparams(s: SyncConfig) -> tuple[float, float]:
    """(outer lr η, outer momentum μ) with the method's defaults (docs/design.md §2.4)."""
    if s.method == "average":
        return (1.0 if s.outer_lr is None else s.outer_lr, 0.0 if s.outer_momentum is None else s.outer_momentum)
    return (0.7 if s.outer_lr is None else s.outer_lr, 0.9 if s.outer_momentum is None else s.outer_momentum)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def from_dict(data: dict[str, Any]) -> Config:
    cfg = Config()
    _apply_mapping(cfg, data, "config")
    return cfg


__all__ = [
    "Config",
    "ConfigError",
    "load_config",
    "validate",
    "save_config",
    "from_dict",
    "to_dict",
    "outer_hyperparams",
    "parse_override",
    "read_yaml",
    "check_world_size",
    "check_mesh_fits",
]
