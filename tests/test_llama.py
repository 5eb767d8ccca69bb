"""model.arch=llama: the block against an independent float64 reference, and every engine against a single
process and against each other (as tests/test_engine.py does for the GPT), checkpoint and export included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError, ModelConfig
from hsdp.export import export
from hsdp.models.gpt import GPT, Block, build_model, ffn_hidden
from tests.helpers import SMALL, STEP_SCOPE, RunResult, max_param_rel_err, run_train
from tests.reference import reference_run

STEPS = 12
# SMALL (vocab 257, seq_len 17, d_model 36: dims that do not divide 4) with an even head dim for rotary.
LLAMA = SMALL + ["model.arch=llama", "model.n_head=3", f"run.steps={STEPS}"]
CFG = ModelConfig(vocab_size=50, seq_len=11, n_layer=2, n_head=3, d_model=24, bias=False, arch="llama")


# ----------------------------------------------------------------- the block, independently
def reference_block(x: torch.Tensor, w: dict[str, torch.Tensor], n_head: int) -> torch.Tensor:
    """Llama's block written out: RMSNorm, rotary as a complex rotation, explicit causal softmax, SwiGLU."""

    def rms(v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * g

    def rotate(v: torch.Tensor) -> torch.Tensor:  # v [B, H, T, Dh]: pairs (i, i + Dh/2) as complex numbers
        half = v.shape[-1] // 2
        z = torch.complex(v[..., :half], v[..., half:])
        angle = torch.arange(v.shape[2], dtype=v.dtype)[:, None] * 10000.0 ** (
            -torch.arange(half, dtype=v.dtype) / half
        )
        z = z * torch.polar(torch.ones_like(angle), angle)
        return torch.cat([z.real, z.imag], -1)

    B, T, D = x.shape
    q, k, v = (rms(x, w["ln1.weight"]) @ w["attn.qkv.weight"].T).reshape(B, T, 3, n_head, D // n_head).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(D // n_head)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D)
    x = x + att @ w["attn.proj.weight"].T
    h = rms(x, w["ln2.weight"])
    gate, up = (h @ w["mlp.fc.weight"].T).chunk(2, -1)
    return x + (gate * torch.sigmoid(gate) * up) @ w["mlp.proj.weight"].T


def test_block_equals_independent_reference() -> None:
    torch.manual_seed(0)
    block = Block(CFG).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, CFG.seq_len, CFG.d_model, dtype=torch.float64)
    weights = {n: p.detach() for n, p in block.named_parameters()}
    assert set(weights) == {"ln1.weight", "attn.qkv.weight", "attn.proj.weight", "ln2.weight", "mlp.fc.weight",
                            "mlp.proj.weight"}  # no biases  # fmt: skip
    assert torch.allclose(block(x), reference_block(x, weights, CFG.n_head), rtol=1e-10, atol=1e-10)


def test_positions_enter_only_through_rotary_and_causally() -> None:
    """No position table; a later token never changes earlier logits; an earlier one changes later ones."""
    model = build_model(CFG, seed=1)
    assert not any("wpe" in n for n, _ in model.named_parameters())
    idx = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[0, 5] = (changed[0, 5] + 1) % CFG.vocab_size
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :5], b[:, :5]) and not torch.allclose(a[:, 5:], b[:, 5:])


def test_flops_per_token_by_hand() -> None:
    """6 per matmul weight (no embedding table) + 12·L·T·d, counted here from the dims."""
    d, V, L, T = 24, 50, 2, 11
    h = ffn_hidden(d)
    assert h % 32 == 0 and h >= 8 * d // 3
    llama = 6 * (L * (3 * d * d + d * d + 2 * d * h + h * d) + d * V) + 12 * L * T * d
    assert GPT(CFG).flops_per_token() == llama
    gpt = ModelConfig(vocab_size=V, seq_len=T, n_layer=L, n_head=3, d_model=d, bias=True)
    assert GPT(gpt).flops_per_token() == 6 * (L * 12 * d * d + d * V) + 12 * L * T * d


def test_config_refuses_biases_and_odd_head_dims() -> None:
    base = ["data.source=synthetic", "model.arch=llama"]
    with pytest.raises(ConfigError, match="model.bias"):
        load_config(None, [*base, "model.bias=true"])  # asked for explicitly; unset, llama takes false
    with pytest.raises(ConfigError, match="even"):
        load_config(None, [*base, "model.bias=false", "model.d_model=36", "model.n_head=4"])
    assert load_config(None, [*base, "model.bias=false"]).model.arch == "llama"


# ----------------------------------------------------------------- every engine
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    tmp = tmp_path_factory.mktemp("llama")
    mesh = {"1x2": ["mesh.sync=1", "mesh.shard=2"], "2x2": ["mesh.sync=2", "mesh.shard=2"]}
    mesh["1x4"] = ["mesh.sync=1", "mesh.shard=4"]
    # 2x2 saves a checkpoint at its end (the export test's); it is checked against the single process all the same
    ckpt = {"2x2": [f"run.checkpoint_every={STEPS}"]}
    out = {name: run_train(tmp, name, LLAMA + m + ckpt.get(name, [])) for name, m in mesh.items()}
    for engine in ("fsdp2", "ddp"):
        out[engine] = run_train(tmp, engine, LLAMA + mesh["2x2"] + [f"mesh.engine={engine}"])
    # the step scope in the traced order (passes=none); the passes keep numerics (test_compile)
    compiled = [*STEP_SCOPE, "compile.passes=none"]
    out["compiled"] = run_train(tmp, "compiled", LLAMA + mesh["1x2"] + compiled, timeout=600)
    return out


def _rel(a: list[float], b: list[float]) -> float:
    return float(np.max(np.abs(np.array(a) - np.array(b)) / np.abs(np.array(b))))


@pytest.mark.parametrize("mesh", ["1x2", "2x2", "1x4"])
def test_equals_single_process(runs: dict[str, RunResult], mesh: str) -> None:
    sync, shard = (int(n) for n in mesh.split("x"))
    overrides = LLAMA + [f"mesh.sync={sync}", f"mesh.shard={shard}"]
    ref_losses, ref_params = reference_run(overrides, sync * shard)
    run = runs[mesh]
    assert len(run.losses) == STEPS and _rel(run.losses, ref_losses) < 1e-5
    for m in range(sync):
        assert max_param_rel_err(run.params(m), ref_params) < 1e-5
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it trained


@pytest.mark.parametrize("other", ["fsdp2", "ddp", "compiled"])
def test_other_engines_equal_hsdp(runs: dict[str, RunResult], other: str) -> None:
    ours = runs["1x2" if other == "compiled" else "2x2"]
    assert _rel(runs[other].losses, ours.losses) < 1e-5
    assert max_param_rel_err(runs[other].params(0), ours.params(0)) < 1e-5


def test_checkpoint_exports_the_trained_model(runs: dict[str, RunResult]) -> None:
    run = runs["2x2"]
    checkpoint = next((run.run_dir / "checkpoints").glob("step_*"))
    state, _ = export(checkpoint)
    assert max_param_rel_err(state, run.params(0)) == 0.0
    model = GPT(load_config(None, LLAMA).model)
    model.load_state_dict(state)  # the names and shapes of the llama GPT


def test_summary_reports_model_flops(runs: dict[str, RunResult]) -> None:
    summary = runs["2x2"].summary
    assert summary["flops_per_token"] == GPT(load_config(None, LLAMA).model).flops_per_token()
    assert summary["mfu"] is None  # CPU: no peak to compare against
