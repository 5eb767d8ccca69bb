"""The inner optimizer (AdamW or SGD on held shards) and the LR schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from hsdp.config.schema import OptimConfig
from hsdp.models.gpt import no_decay


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (or SGD) with no weight decay on biases, norms and embeddings.

    `named_params` use the model's own names, so the same grouping applies to
    held shards (hsdp), DTensor shards (fsdp2) and full params (ddp).
    """
    decay = [p for n, p in named_params if not no_decay(n, p.dim())]
    rest = [p for n, p in named_params if no_decay(n, p.dim())]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr` over `lr_warmup` steps, then cosine decay reaching `min_lr` at the last step."""
    if step < cfg.lr_warmup:
        return cfg.lr * (step + 1) / cfg.lr_warmup
    span = max(1, total_steps - 1 - cfg.lr_warmup)
    progress = min(1.0, (step - cfg.lr_warmup) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
