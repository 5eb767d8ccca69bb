"""Checks of a config against the machine, run before any worker starts or any file is written.

Devices (CUDA for nccl / Triton), the local world's size, optional packages
(wandb), the engine's capabilities, the output folder and the data files.
Here, above the engines, and not in `hsdp.config` (which parses and validates
values only, without torch): these checks ask the data module, the engine
registry, the codec and the run folder, so a config read does not pull in the
engine stack (docs/design.md §0). `load_checked_config` is what a command calls.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import Config, ConfigError
from hsdp.data.tokens import check_data, resolve_vocab_size, token_files
from hsdp.engines.registry import check_engine_config
from hsdp.models.init_from import read_init_from
from hsdp.models.optim import lr_at
from hsdp.run.replicas import check_lighthouse_reachable
from hsdp.run.rundir import check_output_dir
from hsdp.sync.codec import check_codec

if TYPE_CHECKING:  # the checkpoint stack is heavy: imported where it is used
    from hsdp.run.checkpoint import ResumePlan


def load_checked_config(path: Optional[str], overrides: Sequence[str] = (), world_size: Optional[int] = None) -> Config:
    """`load_config` (defaults ← YAML ← `--set`, validated), then `preflight` (the machine, data, engine, folder).

    `world_size`: the torchrun world, if any (checked against the mesh). ConfigError on the first problem.
    """
    cfg = load_config(path, overrides)
    preflight(cfg, world_size)
    return cfg


def preflight(cfg: Config, world_size: Optional[int] = None) -> None:
    """Everything about `cfg` that depends on this machine, the engine or the disk (ConfigError on the first).

    `world_size` is the torchrun world, if any. Run after `validate` and before any worker
    starts or any file is written, so that bad input exits 2 with nothing changed.
    """
    check_engine_config(cfg)
    check_codec(cfg.sync)
    check_data_paths(cfg)
    resolve_vocab_size(cfg)  # model.vocab_size null → tokenizer.json's size, before anything reads it
    check_init_from(cfg)
    if cfg.kernels.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        if not torch.cuda.is_available():
            raise ConfigError(
                "kernels.backend: triton needs a CUDA GPU (or TRITON_INTERPRET=1 to interpret "
                "the kernels on CPU); use auto or torch here"
            )
    if cfg.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"wandb.mode: {cfg.wandb.mode} needs the wandb package (pip install wandb); or set wandb.mode=disabled"
        )
    if world_size is not None:
        check_world_size(cfg, world_size)
    check_mesh_fits(cfg)
    if cfg.elastic.enabled:
        check_lighthouse_reachable(cfg)  # before the run folder: an unreachable one must leave nothing behind
    check_output_dir(cfg)
    check_data(cfg)


def check_data_paths(cfg: Config) -> None:
    """The data files the config names exist (their contents are `check_data`'s)."""
    d = cfg.data
    if d.source == "text" and (not d.path or not any(os.path.isfile(p) for p in glob.glob(os.path.expanduser(d.path)))):
        raise ConfigError(f"data.path: expected a text file or glob that matches files, got {d.path!r}")
    if d.source == "tokens":
        token_files(d.path)  # one file or a glob of shards that matches files


def check_init_from(cfg: Config) -> None:
    """model.init_from (if set) holds exactly this model's tensors: arch, vocab, widths, depth, finite.

    The path is made absolute, so every worker (and config.yaml) names the same file whatever its cwd."""
    if not cfg.model.init_from:
        return
    cfg.model.init_from = str(Path(cfg.model.init_from).expanduser().absolute())
    read_init_from(cfg.model)  # read once here to check; each rank reads it again to build its params


def check_world_size(cfg: Config, world_size: int) -> None:
    """The mesh must match the world torchrun launched (an elastic replica's world: one replica, mesh.shard)."""
    site = cfg.mesh.replicate * cfg.mesh.shard
    if cfg.elastic.enabled and world_size != site:
        raise ConfigError(
            f"mesh.shard: an elastic run's torchrun world is one replica (site) of mesh.replicate×mesh.shard="
            f"{site} ranks, got a world of {world_size}"
        )
    if not cfg.elastic.enabled and world_size != cfg.world_size:
        raise ConfigError(
            f"mesh: sync×replicate×shard = {cfg.mesh.sync}×{cfg.mesh.replicate}×{cfg.mesh.shard} = "
            f"{cfg.world_size} does not match the launched world size {world_size}"
        )


def check_mesh_fits(cfg: Config) -> None:
    """nccl needs CUDA; a locally spawned world must fit this machine (torchrun worlds are its business).

    Local cap: one rank per GPU with nccl (the default on CUDA), else 4 ranks per CPU core
    (beyond that gloo ranks mostly wait for each other, and memory runs out first).
    """
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.mesh.backend != "nccl" and (torchrun or cfg.world_size == 1):
        return
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


def config_notes(cfg: Config) -> list[str]:
    """One warning line per knob `cfg` sets that the run will not use (printed before the run starts).

    The sync codec (`sync.quantize`, `sync.topk`, `sync.error_feedback`) compresses the periodic param
    sync's Δ only; grad-sync steps average full-precision grads. With every step a grad-sync step
    (`sync.warmup_steps` null, or at least `run.steps`: exact HSDP, and always on fsdp2/ddp, which have
    no periodic sync) the codec never runs, whatever the engine.
    """
    s = cfg.sync
    every_step_syncs_grads = s.warmup_steps is None or s.warmup_steps >= cfg.run.steps
    if not every_step_syncs_grads:
        return []
    knobs = [f"sync.quantize={s.quantize}"] if s.quantize != "none" else []
    knobs += [f"sync.topk={s.topk:g}"] if s.topk else []
    knobs += ["sync.error_feedback=true"] if s.error_feedback else []
    if not knobs:
        return []
    why = "null" if s.warmup_steps is None else f"{s.warmup_steps} >= run.steps={cfg.run.steps}"
    return [
        f"warning: {', '.join(knobs)} ignored: every step syncs full-precision grads (sync.warmup_steps={why}, "
        f"mesh.engine={cfg.mesh.engine}); the sync codec compresses only the periodic param sync"
    ]


def resume_schedule_note(cfg: Config, resume_from: Optional[Path]) -> Optional[str]:
    """One note line when a resumed run's `run.steps` differs from its checkpoint's: the cosine LR schedule
    stretches to the new length, so the LR at the resume step jumps (old schedule's LR vs the new one's)."""
    if resume_from is None:
        return None
    from hsdp.run.checkpoint import read_meta, read_saved_config  # lazy: the checkpoint stack is heavy

    saved = read_saved_config(resume_from)
    old, new = saved.run.steps, cfg.run.steps
    if old == new:
        return None
    step = read_meta(resume_from)["step"] + 1
    was, now = lr_at(step, saved.optim, old), lr_at(step, cfg.optim, new)
    return (
        f"note: run.steps {old} -> {new} on resume: the LR schedule now spans {new} steps, so the LR at the "
        f"resume step {step} is {now:.3g} (it was {was:.3g} under run.steps={old})"
    )


def resume_line(plan: ResumePlan) -> Optional[str]:
    """The line that says a run goes on from a checkpoint: "resuming from step N (<its folder>)", N the last step
    the checkpoint holds (training goes on at N + 1); None for a fresh start. An elastic run's replicas each
    resume from their own newest checkpoint: the line names the newest (launch's note says who heals)."""
    if plan.path is None or plan.step is None:
        return None
    return f"resuming from step {plan.step} ({plan.path})"
