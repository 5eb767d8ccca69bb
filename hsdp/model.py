"""The GPT used by experiments, split into units the sharding engine wraps.

Units (docs/design.md §1): the embedding, each transformer block, and final norm + head.
`GPT.units` is an `nn.ModuleList` of exactly those; `GPT.forward` runs them in
order, so any engine that wraps each unit sees the same computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from hsdp.config.schema import ModelConfig


class Embedding(nn.Module):
    """Token + learned position embedding: idx [B, T] → x [B, T, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm + untied LM head: x [B, T, D] → logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.units = nn.ModuleList([Embedding(cfg), *[Block(cfg) for _ in range(cfg.n_layer)], Head(cfg)])

    def reset_parameters(self, generator: torch.Generator) -> None:
        for i, unit in enumerate(self.units):
            init_unit(i, unit, self.cfg, generator)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for unit in self.units:
            x = unit(x)
        return x


@torch.no_grad()
def init_unit(index: int, unit: nn.Module, cfg: ModelConfig, generator: torch.Generator) -> None:
    """GPT-2 init of one unit: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer).

    Units must be initialised in order with one generator: then unit-by-unit
    init (see `unit_initializer`) gives exactly the weights of `build_model`.
    """
    for name, p in unit.named_parameters(prefix=f"units.{index}"):
        if name.endswith("bias"):
            p.zero_()
        elif ".ln" in name:
            p.fill_(1.0)
        elif name.endswith("proj.weight"):
            p.normal_(0.0, 0.02 / math.sqrt(2 * cfg.n_layer), generator=generator)
        else:
            p.normal_(0.0, 0.02, generator=generator)


def build_model(cfg: ModelConfig, seed: int, materialize: bool = True) -> GPT:
    """Deterministic init: the same seed gives the same weights on every rank.

    `materialize=False` builds on the meta device (no memory); pair it with
    `unit_initializer` to create and initialise one unit at a time.
    """
    if not materialize:
        with torch.device("meta"):
            return GPT(cfg)
    with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
        model = GPT(cfg)
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model


def unit_initializer(cfg: ModelConfig, seed: int) -> Callable[[int, nn.Module], None]:
    """fn(index, unit) that materialises a meta unit on CPU with `build_model`'s weights (call in order)."""
    generator = torch.Generator().manual_seed(seed)

    def materialize(index: int, unit: nn.Module) -> None:
        unit.to_empty(device="cpu")
        init_unit(index, unit, cfg, generator)

    return materialize


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def no_decay(name: str, ndim: int) -> bool:
    """Biases, norms and embeddings get no weight decay."""
    return ndim < 2 or ".ln" in name or ".wte." in name or ".wpe." in name or name.startswith("units.0.")
