"""Value checks of a config on its own: choices, ranges and rules that tie fields together.

Pure: no torch, no files. What needs the machine (devices, data, the output
folder, the engine's capabilities) is `hsdp/run/preflight.py`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from hsdp.config.schema import CHOICES, Config, ConfigError, OptimConfig
from hsdp.faults.spec import FaultSpecError, parse_faults

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
    "mesh.replicate",
    "mesh.shard",
    "optim.grad_accum",
    "optim.muon_ns_steps",
    "sync.every",
    "sync.fragments",
    "sync.quant_block",
    "sync.topk_chunk",
    "run.keep_checkpoints",
    "elastic.min_replicas",
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
    "sync.outer_momentum_warmup",
    "sync.outer_lr_warmup",
    "sync.outer_lr_rounds",
    "sync.outer_min_lr",
    "compile.prefetch",
    "compile.bucket_mb",
    "elastic.max_restarts",
    "elastic.restart_delay_s",
    "elastic.round_timeout_s",
    "sync.every_s",
    "run.slow_from",
    "run.slow_for_s",
]
POSITIVE = [
    "optim.lr",
    "optim.eps",
    "optim.muon_lr",
    "mesh.timeout_s",
    "sync.outer_lr",
    "elastic.timeout_s",
    "elastic.heartbeat_timeout_s",
    "elastic.partition_timeout_s",
]


def _get(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config) -> None:
    """Range, choice and cross-field checks of the values alone (ConfigError, one line, on the first)."""
    for key, choices in CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}: expected one of {' | '.join(choices)}, got {_get(cfg, key)!r}")
    for key in AT_LEAST_ONE:
        v = _get(cfg, key)
        if v is not None and v < 1:  # None: only model.vocab_size, resolved by preflight (check_vocab_source)
            raise ConfigError(f"{key}: expected an integer >= 1, got {v!r}")
    check_vocab_source(cfg)
    check_arch(cfg)
    for key in NON_NEGATIVE:
        v = _get(cfg, key)
        if v is not None and v < 0:
            raise ConfigError(f"{key}: expected a value >= 0, got {v!r}")
    for key in POSITIVE:
        v = _get(cfg, key)
        if v is not None and v <= 0:
            raise ConfigError(f"{key}: expected a value > 0, got {v!r}")
    check_run_name(cfg.run.name)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < 2:
        raise ConfigError(f"model.vocab_size: expected at least 2 tokens, got {cfg.model.vocab_size}")
    if cfg.model.d_model % cfg.model.n_head:
        raise ConfigError(
            f"model.n_head: expected a divisor of model.d_model={cfg.model.d_model}, got {cfg.model.n_head}"
        )
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr: expected a value <= optim.lr={cfg.optim.lr}, got {cfg.optim.min_lr}")
    check_muon_keys(cfg)
    if not 0 <= cfg.optim.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum: expected a value in [0, 1), got {cfg.optim.muon_momentum}")
    if cfg.optim.muon_ns_steps >= 100:
        raise ConfigError(f"optim.muon_ns_steps: expected fewer than 100 iterations, got {cfg.optim.muon_ns_steps}")
    if not 0 <= cfg.optim.beta1 < 1 or not 0 <= cfg.optim.beta2 < 1:
        raise ConfigError(f"optim.beta1/beta2: expected values in [0, 1), got {cfg.optim.beta1}, {cfg.optim.beta2}")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction: expected a value in (0, 1), got {cfg.data.val_fraction}")
    vocab = cfg.model.vocab_size  # not None for stdlib and text data: check_vocab_source
    if cfg.data.source == "synthetic" or cfg.data.source == "stdlib":
        if cfg.data.source == "stdlib" and vocab is not None and vocab < 256:
            raise ConfigError(f"model.vocab_size: expected >= 256 for byte-level data, got {vocab}")
    elif cfg.data.source == "text" and vocab is not None and vocab < 256:
        raise ConfigError(f"model.vocab_size: expected >= 256 for byte-level data, got {vocab}")
    s = cfg.sync
    if s.fragments > 1 and s.every % s.fragments:
        raise ConfigError(f"sync.fragments: expected a divisor of sync.every={s.every}, got {s.fragments}")
    units = cfg.model.n_layer + 2  # hsdp/models/gpt.py: embedding, one unit per block, head
    if s.fragments > units:
        raise ConfigError(
            f"sync.fragments: expected at most the model's {units} units (model.n_layer + 2: "
            f"embedding, blocks, head), got {s.fragments}"
        )
    if s.delay >= s.every and s.delay > 0:
        raise ConfigError(f"sync.delay: expected a value < sync.every={s.every}, got {s.delay}")
    if not 0 <= s.topk <= 1:
        raise ConfigError(f"sync.topk: expected a density in [0, 1] (0 = off), got {s.topk}")
    if s.quantize == "int4" and s.quant_block % 2:
        raise ConfigError(
            f"sync.quant_block: int4 packs two values per byte, so expected an even block, got {s.quant_block}"
        )
    if s.quantize == "int2" and s.quant_block % 4:
        raise ConfigError(
            f"sync.quant_block: int2 packs four values per byte, so expected a multiple of 4, got {s.quant_block}"
        )
    if s.error_feedback and s.quantize == "none" and s.topk == 0:
        raise ConfigError("sync.error_feedback: only for a lossy codec (sync.quantize int8/int4/int2 or sync.topk > 0)")
    if not 0 <= s.error_feedback_decay <= 1:
        raise ConfigError(f"sync.error_feedback_decay: expected a value in [0, 1], got {s.error_feedback_decay}")
    if s.error_feedback_decay != 1 and not s.error_feedback:
        raise ConfigError(
            f"sync.error_feedback_decay: only used with sync.error_feedback=true, got {s.error_feedback_decay}"
        )
    if s.topk_mean != "all" and s.topk == 0:
        raise ConfigError(f"sync.topk_mean: only used by top-k (sync.topk > 0), got {s.topk_mean!r}")
    if not 0 <= s.alpha <= 1:
        raise ConfigError(f"sync.alpha: expected a value in [0, 1], got {s.alpha}")
    if s.alpha > 0 and s.delay == 0 and s.schedule != "torchft":
        raise ConfigError(
            f"sync.alpha: with sync.schedule=hsdp only used by an overlapped sync (sync.delay >= 1), got alpha "
            f"{s.alpha} with delay 0 (sync.schedule=torchft mixes α at every sync)"
        )
    check_outer_options(cfg)
    check_paced(cfg)
    saves = {"run.checkpoint_every": cfg.run.checkpoint_every, "run.save_model": cfg.run.save_model}
    saves["run.resume"] = cfg.run.resume not in ("auto", "never")
    if cfg.mesh.backend == "fake" and any(saves.values()):
        what = next(k for k, v in saves.items() if v)
        raise ConfigError(
            f"{what}: mesh.backend=fake moves no data between ranks (timing only), so saved or loaded state "
            "would be wrong; turn it off or use a real backend"
        )
    if s.outer_momentum is not None and s.outer_momentum >= 1:
        raise ConfigError(f"sync.outer_momentum: expected a value in [0, 1), got {s.outer_momentum}")
    if cfg.sync.method == "average" and (cfg.sync.outer_lr is not None or cfg.sync.outer_momentum is not None):
        raise ConfigError("sync.outer_lr/outer_momentum: only used by sync.method=diloco, got method average")
    if not cfg.run.slowdown >= 1:  # also refuses nan
        raise ConfigError(f"run.slowdown: expected a factor >= 1 (1 = full speed), got {cfg.run.slowdown!r}")
    if not -1 <= cfg.run.slow_replica < cfg.mesh.sync:
        raise ConfigError(
            f"run.slow_replica: expected -1 (every rank) or a replica 0..{cfg.mesh.sync - 1}, "
            f"got {cfg.run.slow_replica}"
        )
    if cfg.elastic.round_timeout_s > 0 and not cfg.elastic.enabled:
        raise ConfigError(
            f"elastic.round_timeout_s: bounds an elastic run's sync rounds, so needs elastic.enabled=true, "
            f"got {cfg.elastic.round_timeout_s}"
        )
    if cfg.elastic.faults and not cfg.elastic.enabled:
        faults = cfg.elastic.faults
        raise ConfigError(f"elastic.faults: faults of an elastic run, so needs elastic.enabled=true ({faults!r})")
    if cfg.elastic.enabled:
        check_elastic(cfg)


def check_outer_options(cfg: Config) -> None:
    """sync.schedule, sync.eager and the per-round outer lr / momentum (docs/design.md §8.9–§8.11)."""
    s = cfg.sync
    if s.schedule == "torchft" and s.delay >= s.every // s.fragments:
        raise ConfigError(
            f"sync.delay: sync.schedule=torchft takes a fragment's Δ τ steps before its slot, so expected a value "
            f"< sync.every / sync.fragments = {s.every // s.fragments} (torchft's fragment_sync_delay), got {s.delay}"
        )
    if s.eager and s.delay == 0:
        raise ConfigError("sync.eager: stands in for a mean still in flight, so needs sync.delay >= 1, got delay 0")
    if s.eager and s.alpha > 0:
        raise ConfigError(
            f"sync.eager: keeps the local steps whole (θ_m ← θ_m + θ_g − θ̂_m), so takes no sync.alpha, got {s.alpha}"
        )
    if s.eager and cfg.elastic.enabled:
        raise ConfigError("sync.eager: not in an elastic run (a dropped round would leave the eager step applied)")
    set_keys = [
        k
        for k, on in (
            ("outer_momentum_warmup", s.outer_momentum_warmup > 0),
            ("outer_lr_warmup", s.outer_lr_warmup > 0),
            ("outer_lr_schedule", s.outer_lr_schedule != "constant"),
            ("outer_lr_rounds", s.outer_lr_rounds > 0),
            ("outer_min_lr", s.outer_min_lr > 0),
        )
        if on
    ]
    if set_keys and s.method == "average":
        raise ConfigError(f"sync.{set_keys[0]}: only used by sync.method=diloco, got method average")
    decays = s.outer_lr_schedule != "constant"
    if not decays and (s.outer_lr_rounds or s.outer_min_lr):
        key = "outer_lr_rounds" if s.outer_lr_rounds else "outer_min_lr"
        raise ConfigError(f"sync.{key}: only used by sync.outer_lr_schedule cosine or linear, got constant")
    if decays and s.outer_lr_rounds < s.outer_lr_warmup + 2:
        per_fragment = 0 if s.warmup_steps is None else max(0, cfg.run.steps - s.warmup_steps) // s.every
        raise ConfigError(
            f"sync.outer_lr_rounds: the round at which the {s.outer_lr_schedule} decay ends, so expected at least "
            f"sync.outer_lr_warmup + 2 = {s.outer_lr_warmup + 2} (this run has {per_fragment} per fragment), "
            f"got {s.outer_lr_rounds}"
        )
    outer_lr = 0.7 if s.outer_lr is None else s.outer_lr
    if decays and s.outer_min_lr > outer_lr:
        raise ConfigError(f"sync.outer_min_lr: expected a value <= the outer lr {outer_lr}, got {s.outer_min_lr}")


def check_paced(cfg: Config) -> None:
    """sync.every_s (rounds paced by wall time) and sync.weighting (docs/design.md §8.12)."""
    s = cfg.sync
    if s.every_s > 0 and s.warmup_steps is None:
        raise ConfigError(
            f"sync.every_s: paces the param-sync rounds, so needs sync.warmup_steps set (null is exact HSDP, no "
            f"rounds), got every_s {s.every_s}"
        )
    if s.every_s > 0 and cfg.elastic.round_timeout_s > 0:
        raise ConfigError(
            f"sync.every_s: paced rounds already bound every replica's period; drop elastic.round_timeout_s "
            f"(got {cfg.elastic.round_timeout_s})"
        )


def check_elastic(cfg: Config) -> None:
    """What an elastic run (replicas on torchft, docs/design.md §9) supports (the engine: check_engine_config)."""
    e, s = cfg.elastic, cfg.sync
    if cfg.mesh.sync < 2:
        raise ConfigError(f"elastic.enabled: needs at least 2 replicas (mesh.sync), got {cfg.mesh.sync}")
    if s.delay >= s.every // s.fragments:
        raise ConfigError(
            f"sync.delay: an elastic run has one sync in flight at a time, so expected a value < sync.every / "
            f"sync.fragments = {s.every // s.fragments}, got {s.delay}"
        )
    if e.min_replicas > cfg.mesh.sync:
        raise ConfigError(f"elastic.min_replicas: expected at most mesh.sync={cfg.mesh.sync}, got {e.min_replicas}")
    if cfg.mesh.backend == "fake":
        raise ConfigError("elastic.enabled: mesh.backend=fake moves no data; an elastic run needs a real backend")
    if cfg.run.resume not in ("auto", "never"):
        raise ConfigError(
            "run.resume: an elastic run's replicas resume together, each from its own checkpoint, so it takes "
            f"auto or never (auto: each replica's own newest), got {cfg.run.resume!r}"
        )
    if e.lighthouse:
        check_lighthouse(e.lighthouse)
    try:  # the one fault grammar (hsdp/faults/spec.py): its one line already names elastic.faults
        parse_faults(e.faults, cfg.mesh.sync, cfg.mesh.replicate * cfg.mesh.shard, what="elastic.faults")
    except FaultSpecError as err:
        raise ConfigError(str(err)) from None


def check_lighthouse(url: str) -> None:
    """elastic.lighthouse is http(s)://HOST:PORT: a malformed one is refused here, before anything is written,
    instead of failing every replica's start until elastic.max_restarts is spent."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number in 0..65535
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port or parts.path not in ("", "/"):
        raise ConfigError(f"elastic.lighthouse: expected http://HOST:PORT (e.g. http://node0:29510), got {url!r}")


NAME_MAX = 255  # bytes in one file name on Linux and macOS file systems


def check_muon_keys(cfg: Config) -> None:
    """optim.muon_* set away from its default without optim.name=muon would do nothing: refused."""
    if cfg.optim.name == "muon":
        return
    default = OptimConfig()
    for key in ("muon_lr", "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr", "muon_exchange"):
        if getattr(cfg.optim, key) != getattr(default, key):
            raise ConfigError(f"optim.{key}: only used by optim.name=muon, got optim.name {cfg.optim.name}")


def check_run_name(name: str) -> None:
    """run.name is one folder name inside run.out_dir: not empty, `.`, `..`, nor a path."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ConfigError(f"run.name: expected a folder name (not empty, '.', '..', no '/'), got {name!r}")
    # The lock file beside the run folder (.<name>.lock, hsdp/run/lock.py) is the longest name a run creates.
    if len(f".{name}.lock".encode()) > NAME_MAX:
        raise ConfigError(
            f"run.name: {len(name.encode())} bytes is too long for a folder name (at most {NAME_MAX - 6})"
        )


def check_vocab_source(cfg: Config) -> None:
    """model.vocab_size null is left to a tokenizer.json beside tokens data; other sources need a size."""
    if cfg.model.vocab_size is None and cfg.data.source != "tokens":
        raise ConfigError(
            f"model.vocab_size: null (the tokenizer's size) needs data.source=tokens with a tokenizer.json beside "
            f"data.path, got data.source={cfg.data.source}"
        )


def check_arch(cfg: Config) -> None:
    """The llama block has no biases: refuse a config that asks for them rather than ignore it."""
    m = cfg.model
    if m.arch == "llama" and m.bias:
        raise ConfigError("model.bias: the llama arch has no biases (RMSNorm, bias-free linears); set model.bias=false")
    if m.arch == "llama" and m.d_model % m.n_head == 0 and (m.d_model // m.n_head) % 2:
        raise ConfigError(
            f"model.n_head: rotary positions rotate pairs, so d_model / n_head must be even, "
            f"got {m.d_model} / {m.n_head} = {m.d_model // m.n_head}"
        )
