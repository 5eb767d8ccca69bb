"""The inner optimizer (AdamW, SGD, or Muon + AdamW on held shards) and the LR schedule."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from hsdp.config.schema import OptimConfig
from hsdp.models.gpt import no_decay
from hsdp.models.muon import NS_COEFFICIENTS, NS_EPS, MuonAdamW, RowSharding, is_muon_matrix


def build_optimizer(
    named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig, sharding: Optional[RowSharding] = None
) -> torch.optim.Optimizer:
    """AdamW (or SGD) with no weight decay on biases, norms and embeddings; with `optim.name: muon`, Muon for
    the blocks' matrices (hsdp/models/muon.py) and that AdamW for the rest.

    `named_params` use the model's own names, so the same grouping applies to
    held shards (hsdp), DTensor shards (fsdp2) and full params (ddp). `sharding` says how Muon's matrices are
    split over ranks (None: every param is whole).
    """
    if sharding is None:
        sharding = RowSharding({n: p.shape for n, p in named_params})
    muon = [p for n, p in named_params if cfg.name == "muon" and is_muon_matrix(n, len(sharding.full_shapes[n]))]
    taken = set(muon)
    rest_params = [(n, p) for n, p in named_params if p not in taken]
    decay = [p for n, p in rest_params if not no_decay(n, p.dim())]
    rest = [p for n, p in rest_params if no_decay(n, p.dim())]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    for g in groups:
        g["lr"] = cfg.lr
    muon_group = {
        "params": muon,
        "lr": cfg.muon_lr,
        "lr_scale": cfg.muon_lr / cfg.lr,  # the schedule scales both groups by one factor (set_lr)
        "weight_decay": cfg.weight_decay,
        "momentum": cfg.muon_momentum,
        "nesterov": cfg.muon_nesterov,
        "ns_steps": cfg.muon_ns_steps,
        "ns_coefficients": NS_COEFFICIENTS,
        "ns_eps": NS_EPS,
        "adjust_lr_fn": cfg.muon_adjust_lr,
    }
    names = {p: n for n, p in named_params}
    betas = (cfg.beta1, cfg.beta2)
    return MuonAdamW(groups, [muon_group], sharding, names, betas=betas, eps=cfg.eps, exchange=cfg.muon_exchange)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr` over `lr_warmup` steps, then cosine decay reaching `min_lr` at the last step."""
    if step < cfg.lr_warmup:
        return cfg.lr * (step + 1) / cfg.lr_warmup
    span = max(1, total_steps - 1 - cfg.lr_warmup)
    progress = min(1.0, (step - cfg.lr_warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's LR `lr` (optim.lr's scale); a Muon group gets it × optim.muon_lr / optim.lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
