"""The decoder-only transformer used by experiments, split into units the sharding engine wraps.

Units (docs/design.md §6): the embedding, each transformer block, and final norm + head.
`GPT.units` is an `nn.ModuleList` of exactly those; `GPT.forward` runs them in
order, so any engine that wraps each unit sees the same computation.

`model.arch` picks the units: `gpt` (pre-LayerNorm, learned positions, GELU MLP)
or `llama` (pre-RMSNorm, rotary positions, SwiGLU MLP, no biases). Both are
`GPT` (the class every engine, checkpoint and export builds), with the same
parameter naming conventions (`.ln*` norms, `proj` residual outputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from hsdp.config.schema import Config, ModelConfig
from hsdp.torch_compat import uninitialized_embedding


class Embedding(nn.Module):
    """Token + learned position embedding: idx [B, T] → x [B, T, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vocab_size is not None  # resolved before a model is built (resolve_vocab_size)
        self.wte = uninitialized_embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = uninitialized_embedding(cfg.seq_len, cfg.d_model)

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
    """Pre-norm transformer block: LayerNorm, attention, GELU MLP (gpt) or RMSNorm, rotary attention, SwiGLU (llama)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        llama = cfg.arch == "llama"
        self.ln1 = norm_layer(cfg)
        self.attn = RotaryAttention(cfg) if llama else Attention(cfg)
        self.ln2 = norm_layer(cfg)
        self.mlp = SwiGLU(cfg) if llama else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final norm + untied LM head: x [B, T, D] → logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = norm_layer(cfg)
        assert cfg.vocab_size is not None  # resolved before a model is built (resolve_vocab_size)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def norm_layer(cfg: ModelConfig) -> nn.Module:
    """The arch's normalisation: LayerNorm (gpt) or RMSNorm (llama, no bias)."""
    return RMSNorm(cfg.d_model) if cfg.arch == "llama" else nn.LayerNorm(cfg.d_model, bias=cfg.bias)


# ---------------------------------------------------------------- the llama units
ROPE_THETA = 10000.0  # rotary base (Llama 1/2)
NORM_EPS = 1e-5
FFN_MULTIPLE = 32  # SwiGLU hidden width is rounded up to a multiple of this


class RMSNorm(nn.Module):
    """x / rms(x) · weight, normalised in fp32 (or wider) whatever the compute dtype (as Llama's reference does)."""

    def __init__(self, d: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.to(at_least_fp32(x)), (x.shape[-1],), eps=self.eps).type_as(x) * self.weight


def at_least_fp32(x: torch.Tensor) -> torch.dtype:
    """The dtype norms and rotations are computed in: fp32 for bf16/fp16/fp32 inputs, float64 stays."""
    return torch.promote_types(x.dtype, torch.float32)


def apply_rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, Dh]: each pair (x_i, x_{i+Dh/2}) at position t is rotated
    by t·θ^(-2i/Dh). Computed from the positions each call (no buffers: the engines shard parameters only)."""
    T, half, dtype = x.shape[-2], x.shape[-1] // 2, at_least_fp32(x)
    inv_freq = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = torch.outer(torch.arange(T, device=x.device, dtype=dtype), inv_freq)  # [T, Dh/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def ffn_hidden(d_model: int) -> int:
    """SwiGLU width: 2/3 of the GPT MLP's 4·d (so both MLPs hold about 8·d² weights), rounded up."""
    return FFN_MULTIPLE * -(-(8 * d_model // 3) // FFN_MULTIPLE)


class TokenEmbedding(nn.Module):
    """Token embedding only (positions are rotary, inside attention): idx [B, T] → x [B, T, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vocab_size is not None  # resolved before a model is built (resolve_vocab_size)
        self.wte = uninitialized_embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)


class RotaryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_head)
        y = F.scaled_dot_product_attention(apply_rotary(q), apply_rotary(k), v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class SwiGLU(nn.Module):
    """proj(silu(gate(x)) · up(x)); gate and up are one matrix `fc` (one matmul, one held param)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 2 * hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


ARCHS: dict[str, tuple[type[nn.Module], type[nn.Module], type[nn.Module]]] = {
    "gpt": (Embedding, Block, Head),
    "llama": (TokenEmbedding, Block, Head),
}  # model.arch → (embedding, block, head) unit classes


# ---------------------------------------------------------------- the model
class GPT(nn.Module):
    """The units of `cfg.arch` in order: embedding, n_layer blocks, final norm + head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        embedding, block, head = ARCHS[cfg.arch]
        self.units = nn.ModuleList([embedding(cfg), *[block(cfg) for _ in range(cfg.n_layer)], head(cfg)])

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward), the PaLM/nanoGPT estimate: 6 per weight that multiplies
        an activation (every matrix but the embedding tables, whose lookup is no matmul) plus
        12·n_layer·seq_len·d_model for attention's scores and weighted values (the full T×T, as is customary)."""
        c = self.cfg
        matmul = sum(p.numel() for n, p in self.named_parameters() if p.dim() == 2 and not n.startswith("units.0."))
        return 6 * matmul + 12 * c.n_layer * c.seq_len * c.d_model

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


# ---------------------------------------------------------------- throughput against the hardware
# Dense bf16/fp16 tensor-core peak TFLOP/s per GPU, from NVIDIA's datasheets; the first name that occurs in
# torch.cuda.get_device_name() wins, so specific names come first. A GPU not listed gets no MFU.
PEAK_TFLOPS_16BIT: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": 989.4,
    "A100": 312.0,
}


def peak_flops(device: torch.device, param_dtype: str) -> float | None:
    """One device's peak FLOP/s for the compute dtype, or None (CPU, fp32 compute, or a GPU not in the table)."""
    if device.type != "cuda" or param_dtype not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for gpu, tf in PEAK_TFLOPS_16BIT.items() if gpu in name), None)


def throughput(
    cfg: Config, tokens_per_s: float | None, device: torch.device, wall_tokens_per_s: float | None = None
) -> dict[str, float | None]:
    """summary.json's model FLOPs per token and, where the peak and the rate are known, MFU: achieved
    FLOP/s over the peak of all `cfg.world_size` devices (one rank per GPU). `mfu` is of `tokens_per_s`
    (the steady rate, hsdp.run.metrics.run_rates), `wall_mfu` of `wall_tokens_per_s` (the whole run's)."""
    with torch.device("meta"):
        per_token = GPT(cfg.model).flops_per_token()
    peak = peak_flops(device, cfg.precision.param_dtype)

    def mfu(rate: float | None) -> float | None:
        return round(per_token * rate / (peak * cfg.world_size), 4) if peak and rate else None

    return {"flops_per_token": per_token, "mfu": mfu(tokens_per_s), "wall_mfu": mfu(wall_tokens_per_s)}
