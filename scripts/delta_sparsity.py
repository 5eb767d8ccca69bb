"""How much of a DiLoCo pseudo-gradient top-k keeps, for AdamW against Muon as the inner optimizer.

    python scripts/delta_sparsity.py [--config configs/tiny.yaml] [--warm 48] [--period 16] [--chunk 4096] [--k 64]

One process trains the config's model `--warm` steps, snapshots θ, trains one period of `--period` steps and
prints, per inner optimizer, the share of |Δ|² (Δ = θ_before − θ_after, flat, in chunks of `--chunk` as
sync.topk_chunk cuts a shard) that the `--k` largest |Δ| of each chunk hold: SparseLoCo's top-k sends those
(k/chunk = sync.topk), for the blocks' matrices (Muon's) and for the rest (AdamW's in both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp.config.loader import load_config  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.data.tokens import Data  # noqa: E402
from hsdp.models.gpt import build_model, loss_fn  # noqa: E402
from hsdp.models.muon import is_muon_matrix  # noqa: E402
from hsdp.models.optim import build_optimizer, lr_at, set_lr  # noqa: E402


def topk_share(delta: torch.Tensor, chunk: int, k: int) -> float:
    """The share of |Δ|² in the k largest |Δ| of each full chunk."""
    d = delta[: delta.numel() // chunk * chunk].view(-1, chunk)
    return float((d.abs().topk(k, dim=1).values ** 2).sum() / (d**2).sum())


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Data, cfg: Config, steps: range) -> None:
    """Plain one-process steps of the run's schedule."""
    for step in steps:
        set_lr(opt, lr_at(step, cfg.optim, cfg.run.steps))
        x, y = data.train_batch(step, 0)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--config", default="configs/tiny.yaml")
    a.add_argument("--warm", type=int, default=48)
    a.add_argument("--period", type=int, default=16)
    a.add_argument("--chunk", type=int, default=4096)
    a.add_argument("--k", type=int, default=64)
    args = a.parse_args()
    torch.set_num_threads(1)
    print(f"share of |Δ|² in the top {args.k} of each {args.chunk} after {args.period} steps (from step {args.warm})")
    print("| inner optimizer | blocks' matrices | the rest |")
    print("|---|---:|---:|")
    for name in ("adamw", "muon"):
        cfg = load_config(args.config, [f"optim.name={name}", "mesh.sync=1", "mesh.shard=1"])
        model = build_model(cfg.model, cfg.run.seed)
        opt = build_optimizer(list(model.named_parameters()), cfg.optim)
        data = Data(cfg, 0, 1)

        train(model, opt, data, cfg, range(args.warm))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train(model, opt, data, cfg, range(args.warm, args.warm + args.period))
        deltas = {n: (before[n] - p.detach()).reshape(-1) for n, p in model.named_parameters()}
        mats = torch.cat([d for n, d in deltas.items() if is_muon_matrix(n, before[n].dim())])
        rest = torch.cat([d for n, d in deltas.items() if not is_muon_matrix(n, before[n].dim())])
        print(f"| {name} | {topk_share(mats, args.chunk, args.k):.3f} | {topk_share(rest, args.chunk, args.k):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
