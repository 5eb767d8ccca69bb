"""The run configuration's schema: typed dataclasses, one per section, and their choices.

This module only describes a config; `loader.py` reads one (YAML, `--set`),
`validate.py` checks its values against each other, `hsdp/run/preflight.py` checks it
against the machine (devices, data files, output folder). Every user error is a
`ConfigError` with one line naming the key; `train.py` turns it into exit 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


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
    checkpoint_async: bool = True  # write checkpoints on a background thread while training goes on
    slowdown: float = 1.0  # fault injection: each trained step sleeps (slowdown - 1) x min(it, recent median) (>= 1)
    slow_replica: int = -1  # run.slowdown on this replica's ranks only (-1: every rank)
    slow_from: float = 0.0  # run.slowdown from this step on (a fraction of run.steps when < 1)
    slow_for_s: float = 0.0  # ... for this many seconds, then full speed again (0: to the end)


@dataclass
class ModelConfig:
    vocab_size: Optional[int] = 256  # null: the size of the tokenizer.json beside data.path (tokens)
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    bias: bool = True  # llama: false unless set (hsdp.config.loader)
    arch: str = "gpt"  # gpt (LayerNorm, learned positions, GELU) | llama (RMSNorm, rotary, SwiGLU, no biases)
    init_from: str = ""  # start from these weights: an HF folder or a plain export (.pt, .safetensors); "" = seeded


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text | tokens | synthetic
    path: str = ""  # text: file or glob; tokens: a prepared folder, a train .bin or a glob of llm.c shards
    batch_size: int = 8  # sequences per rank per micro-step
    val_fraction: float = 0.1  # text/tokens without a val file: share held out


@dataclass
class MeshConfig:
    sync: int = 1  # sites: replicas joined by slow links, synced per the sync section
    replicate: int = 1  # replicas inside a site (fast links), averaging grads every step (design §4.1)
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
    name: str = "adamw"  # adamw | sgd | muon (Muon for the blocks' matrices, AdamW for the rest)
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
    muon_lr: float = 0.02  # muon: the Muon group's peak LR (the schedule scales it as it scales optim.lr)
    muon_momentum: float = 0.95  # muon: the momentum of its matrices' update
    muon_nesterov: bool = True  # muon: Nesterov momentum (torch.optim.Muon's nesterov)
    muon_ns_steps: int = 5  # muon: Newton–Schulz iterations
    muon_adjust_lr: str = "original"  # muon: its per-shape LR scaling (torch.optim.Muon's adjust_lr_fn)
    muon_exchange: str = "owner"  # muon: one rank per matrix runs Newton–Schulz (owner) or every rank all (gather)


@dataclass
class SyncConfig:
    warmup_steps: Optional[int] = None  # None: every step syncs grads (exact HSDP)
    every: int = 1  # H: param sync period after warmup
    method: str = "average"  # average | diloco
    outer_lr: Optional[float] = None  # None: 1.0 for average, 0.7 for diloco
    outer_momentum: Optional[float] = None  # None: 0.0 for average, 0.9 for diloco
    nesterov: bool = True
    fragments: int = 1  # P: streaming fragments
    quantize: str = "none"  # none | int8 | int4 | int2
    quant_block: int = 256  # elements per int8/int4 scale or int2 table (even for int4, a multiple of 4 for int2)
    topk: float = 0.0  # density in (0, 1]: send the largest-|x| ⌈topk·topk_chunk⌉ of each chunk (0 = off)
    topk_chunk: int = 1024  # elements per top-k chunk (indices are sent within the chunk)
    error_feedback: bool = False  # lossy codecs: each replica keeps what it did not send and adds it next time
    error_feedback_decay: float = 1.0  # β in [0, 1]: e ← β·e + Δ before compressing (1 = plain error feedback)
    topk_mean: str = "all"  # top-k: each coordinate ÷ M (all) or ÷ the replicas that sent it (chosen)
    delay: int = 0  # τ: local steps a param sync's reduction overlaps before it lands (0 = blocking sync)
    alpha: float = 0.0  # α: when a sync lands, θ_m ← α·θ_m + (1 − α)·θ_g (hsdp: needs delay ≥ 1; torchft: any delay)
    # when a fragment's Δ is taken: hsdp (at its slot, landing τ steps later) | torchft (τ steps before, landing at it)
    schedule: str = "hsdp"
    eager: bool = False  # eager updates (delay ≥ 1, alpha 0): each replica's own Δ_m stands in for the mean in flight
    outer_momentum_warmup: int = 0  # rounds over which the outer momentum ramps from 0 to its value (0 = off)
    outer_lr_schedule: str = "constant"  # constant | cosine | linear: the outer lr per round, after its warmup
    outer_lr_warmup: int = 0  # rounds over which the outer lr ramps up linearly to its value (0 = off)
    outer_lr_rounds: int = 0  # cosine / linear: the round (counted from 1) at which the outer lr reaches outer_min_lr
    outer_min_lr: float = 0.0  # cosine / linear: the outer lr at the end of its decay
    # paced rounds (s): each replica trains the steps of a period that fit this window, at most `every` (0 = off)
    every_s: float = 0.0
    weighting: str = "auto"  # the outer mean: tokens (each Δ by its trained tokens) | equal | auto (tokens if paced)


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile: hsdp as compile.scope says; fsdp2: each block (its collectives eager)
    passes: str = "ours"  # scope=step: who schedules the collectives (ours: prefetch + late waits; inductor; none)
    prefetch: int = 1  # scope=step, passes=ours: all-gathers start this many units ahead of their use
    bucket_mb: float = 0.0  # scope=step: neighbouring units share an all-gather/reduce-scatter up to this size (0: off)
    regional: bool = True  # scope=step: identical blocks compile once (a nested compile region), not once per layer
    # hsdp: blocks (each block compiled, collectives eager: FSDP2's compile cost) | step (one graph per step with
    # the collectives inside, scheduled by compile.passes: 1.7-2.8x the compile, a second graph with a warmup)
    scope: str = "blocks"


@dataclass
class KernelsConfig:
    backend: str = "auto"  # auto (Triton on CUDA, torch on CPU) | triton | torch


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "hsdp"
    entity: Optional[str] = None


@dataclass
class ElasticConfig:
    enabled: bool = False  # replicas on torchft: one that dies is restarted and heals from a live one; others go on
    lighthouse: str = ""  # torchft lighthouse address (http://host:port); empty: the launcher starts one
    min_replicas: int = 1  # a sync commits only with at least this many replicas in its quorum
    max_restarts: int = 3  # per replica: restarts after a failure before it is given up
    restart_delay_s: float = 0.0  # wait before restarting a failed replica (0: at once; max_restarts ends a crash loop)
    replica: int = -1  # under torchrun: this machine's replica (0..mesh.sync-1); the local launcher numbers them
    timeout_s: float = 10.0  # a sync's collectives and quorum requests give up on a silent peer after this
    heartbeat_timeout_s: float = 1.0  # the lighthouse drops a replica whose manager went silent (dead) after this
    partition_timeout_s: float = 120.0  # no quorum this long (cut off, lighthouse lost): the replica fails
    round_timeout_s: float = 0.0  # straggler bound (s): rounds count who is in within it; slower ones cut (0 = off)
    # what a replica healing at a param sync fetches from a live peer: full (its whole state, params mid-period and
    # inner optimizer: a clone of the peer) | global (θ_g and the outer state only: the period goes on from θ_g
    # with the replica's own inner optimizer, a fresh one after a restart; 2-3× fewer bytes over a slow link)
    heal: str = "full"
    # deterministic faults at named points (tests, benchmarks): "1@3:before_quorum:die,..." (hsdp/faults/spec.py)
    faults: str = ""


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
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    @property
    def world_size(self) -> int:
        return self.mesh.sync * self.mesh.replicate * self.mesh.shard

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir).expanduser() / self.run.name


# ---------------------------------------------------------------- validation rules
DTYPES = ("fp32", "bf16", "fp16")
CHOICES: dict[str, tuple[str, ...]] = {
    "model.arch": ("gpt", "llama"),
    "data.source": ("stdlib", "text", "tokens", "synthetic"),
    "mesh.engine": ("hsdp", "fsdp2", "ddp"),
    "mesh.backend": ("auto", "gloo", "nccl", "fake"),
    "elastic.heal": ("full", "global"),
    "precision.param_dtype": DTYPES,
    "precision.reduce_dtype": DTYPES,
    "optim.name": ("adamw", "sgd", "muon"),
    "optim.muon_adjust_lr": ("original", "match_rms_adamw"),
    "optim.muon_exchange": ("owner", "gather"),
    "sync.method": ("average", "diloco"),
    "sync.quantize": ("none", "int8", "int4", "int2"),
    "sync.topk_mean": ("all", "chosen"),
    "sync.schedule": ("hsdp", "torchft"),
    "sync.weighting": ("auto", "tokens", "equal"),
    "sync.outer_lr_schedule": ("constant", "cosine", "linear"),
    "compile.passes": ("ours", "inductor", "none"),
    "compile.scope": ("step", "blocks"),
    "kernels.backend": ("auto", "triton", "torch"),
    "wandb.mode": ("offline", "online", "disabled"),
}


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
