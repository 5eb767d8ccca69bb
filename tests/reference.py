"""An independent single-process reference: plain torch training on the concatenated batch.

No torch.distributed, no hsdp engine: just the model, AdamW/SGD with the same
param groups, the same LR schedule and the same global batches (the data
module's contract: the concatenation of all ranks' batches is the batch of one
process with batch_size·world).
"""

from __future__ import annotations

import dataclasses

import torch

from hsdp.config.schema import Config
from hsdp.data.tokens import Data
from hsdp.models.gpt import build_model, loss_fn
from hsdp.models.optim import build_optimizer, lr_at, set_lr
from hsdp.run.preflight import load_checked_config


def reference_config(overrides: list[str], world: int) -> Config:
    cfg = load_checked_config(None, overrides)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * world),
        mesh=dataclasses.replace(cfg.mesh, sync=1, shard=1),
    )
    return cfg


def reference_run(overrides: list[str], world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and final params of single-process training on the global batch."""
    torch.set_num_threads(1)
    cfg = reference_config(overrides, world)
    model = build_model(cfg.model, cfg.run.seed)
    opt = build_optimizer(list(model.named_parameters()), cfg.optim)
    data = Data(cfg, 0, 1)
    losses = []
    for step in range(cfg.run.steps):
        set_lr(opt, lr_at(step, cfg.optim, cfg.run.steps))
        total = 0.0
        for micro in range(cfg.optim.grad_accum):
            x, y = data.train_batch(step, micro)
            loss = loss_fn(model(x), y) / cfg.optim.grad_accum
            loss.backward()
            total += loss.item()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
