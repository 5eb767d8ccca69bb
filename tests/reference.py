"""An independent single-process reference: plain torch training on the concatenated batch.

No torch.distributed, no hsdp engine: just the model, AdamW/SGD with the same
param groups (optim.name=muon: torch.optim.Muon for the blocks' matrices and
torch.optim.AdamW for the rest, torch's own classes), the same LR schedule and
the same global batches (the data module's contract: the concatenation of all
ranks' batches is the batch of one process with batch_size·world).
"""

from __future__ import annotations

import dataclasses

import torch

from hsdp.config.schema import Config
from hsdp.data.tokens import Data
from hsdp.models.gpt import build_model, loss_fn, no_decay
from hsdp.models.optim import build_optimizer, lr_at
from hsdp.run.preflight import load_checked_config


def reference_config(overrides: list[str], world: int) -> Config:
    cfg = load_checked_config(None, overrides)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, batch_size=cfg.data.batch_size * world),
        mesh=dataclasses.replace(cfg.mesh, sync=1, shard=1),
    )
    return cfg


def torch_optimizers(model: torch.nn.Module, cfg: Config) -> list[torch.optim.Optimizer]:
    """The run's inner optimizer(s) from torch alone: for optim.name=muon, torch.optim.Muon over every 2-D weight
    of the blocks' attention and MLP and torch.optim.AdamW (decay / no-decay groups) over the rest."""
    o = cfg.optim
    if o.name != "muon":
        return [build_optimizer(list(model.named_parameters()), o)]
    blocks = {f"units.{i}." for i in range(1, cfg.model.n_layer + 1)}
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() == 2 and n[: n.index(".", 6) + 1] in blocks]
    rest = [(n, p) for n, p in named if not any(p is m for m in matrices)]
    muon = torch.optim.Muon(
        matrices,
        lr=o.muon_lr,
        weight_decay=o.weight_decay,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
        adjust_lr_fn=o.muon_adjust_lr,
    )
    groups = [
        {"params": [p for n, p in rest if not no_decay(n, p.dim())], "weight_decay": o.weight_decay},
        {"params": [p for n, p in rest if no_decay(n, p.dim())], "weight_decay": 0.0},
    ]
    return [muon, torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)]


def set_torch_lr(optimizers: list[torch.optim.Optimizer], cfg: Config, step: int) -> None:
    """The schedule's LR at `step`; torch's Muon at optim.muon_lr scaled by the same factor."""
    lr = lr_at(step, cfg.optim, cfg.run.steps)
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr * cfg.optim.muon_lr / cfg.optim.lr if isinstance(opt, torch.optim.Muon) else lr


def reference_run(overrides: list[str], world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses and final params of single-process training on the global batch."""
    torch.set_num_threads(1)
    cfg = reference_config(overrides, world)
    model = build_model(cfg.model, cfg.run.seed)
    opts = torch_optimizers(model, cfg)
    data = Data(cfg, 0, 1)
    losses = []
    for step in range(cfg.run.steps):
        set_torch_lr(opts, cfg, step)
        total = 0.0
        for micro in range(cfg.optim.grad_accum):
            x, y = data.train_batch(step, micro)
            loss = loss_fn(model(x), y) / cfg.optim.grad_accum
            loss.backward()
            total += loss.item()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
