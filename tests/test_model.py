"""Model: shapes, parameter count, units, init, causality, weight-decay groups, LR schedule, a short training run."""

from __future__ import annotations

import math

import pytest
import torch

from hsdp.config.schema import Config, ModelConfig, OptimConfig
from hsdp.data.tokens import Data
from hsdp.models.gpt import Block, Embedding, Head, build_model, loss_fn, no_decay
from hsdp.models.optim import build_optimizer, lr_at, set_lr

torch.set_num_threads(1)

SMALL = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def tokens(B: int, T: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def expected_param_count(c: ModelConfig) -> int:
    V, T, D, L = c.vocab_size, c.seq_len, c.d_model, c.n_layer
    b = 1 if c.bias else 0
    ln = D + b * D
    block = 2 * ln + (3 * D * D + b * 3 * D) + (D * D + b * D) + (4 * D * D + b * 4 * D) + (4 * D * D + b * D)
    return V * D + T * D + L * block + ln + V * D


# ------------------------------------------------------------------ shapes and size
@pytest.mark.parametrize("T", [16, 5])
def test_output_shape(T):
    model = build_model(SMALL, seed=0)
    logits = model(tokens(3, T, SMALL.vocab_size))
    assert logits.shape == (3, T, SMALL.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128),  # tiny.yaml
        ModelConfig(vocab_size=50, seq_len=7, n_layer=3, n_head=3, d_model=24, bias=False),
    ],
    ids=["small", "tiny-yaml", "no-bias"],
)
def test_parameter_count_matches_formula(cfg):
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == expected_param_count(cfg)


def test_tiny_yaml_model_is_about_0_8M_params():
    n = expected_param_count(ModelConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128))
    assert n == 4 * (4 * 128 + 12 * 128 * 128 + 9 * 128) + 256 * 128 * 2 + 128 * 128 + 2 * 128
    assert 0.8e6 < n < 0.9e6


# ------------------------------------------------------------------ units
def test_units_are_embedding_blocks_head():
    model = build_model(SMALL, seed=0)
    units = list(model.units)
    assert len(units) == SMALL.n_layer + 2
    assert isinstance(units[0], Embedding) and isinstance(units[-1], Head)
    assert all(isinstance(u, Block) for u in units[1:-1])
    # every parameter belongs to exactly one unit
    unit_params = [p for u in units for p in u.parameters()]
    assert len(unit_params) == len(list(model.parameters()))
    assert {id(p) for p in unit_params} == {id(p) for p in model.parameters()}


def test_running_units_in_order_equals_forward():
    model = build_model(SMALL, seed=1)
    idx = tokens(2, 12, SMALL.vocab_size, seed=1)
    x = idx
    for unit in model.units:
        x = unit(x)
    full = model(idx)
    assert torch.equal(x, full)
    # skipping a block changes the result (the comparison can fail)
    y = idx
    for unit in [model.units[0], *model.units[2:]]:
        y = unit(y)
    assert not torch.allclose(y, full)


# ------------------------------------------------------------------ init
def test_same_seed_same_params_different_seed_different():
    a, b, c = build_model(SMALL, 7), build_model(SMALL, 7), build_model(SMALL, 8)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert pa.keys() == pb.keys() == pc.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    random_params = [n for n, p in pa.items() if p.dim() >= 2]
    assert random_params and all(not torch.equal(pa[n], pc[n]) for n in random_params)


def test_init_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expect = torch.rand(4)
    torch.manual_seed(123)
    build_model(SMALL, 0)
    assert torch.equal(torch.rand(4), expect)


def test_init_values():
    cfg = ModelConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=64)
    model = build_model(cfg, seed=0)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif ".ln" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("proj.weight") else 0.02
            assert abs(p.std().item() - std) < 0.15 * std, f"{name}: std {p.std().item():.4g} != {std:.4g}"
            assert abs(p.mean().item()) < 0.2 * std, name


# ------------------------------------------------------------------ causality
def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(SMALL, seed=0).eval()
    T = SMALL.seq_len
    idx = tokens(2, T, SMALL.vocab_size, seed=3)
    base = model(idx)
    for t in (0, 5, T - 2):
        changed = idx.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1 + torch.arange(T - t - 1)) % SMALL.vocab_size
        out = model(changed)
        assert torch.allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6), f"position <= {t} saw the future"
        assert not torch.allclose(out[:, t + 1], base[:, t + 1]), "changed token had no effect"


def test_past_tokens_do_change_later_logits():
    model = build_model(SMALL, seed=0).eval()
    idx = tokens(1, 10, SMALL.vocab_size, seed=4)
    changed = idx.clone()
    changed[0, 0] = (changed[0, 0] + 1) % SMALL.vocab_size
    a, b = model(idx), model(changed)
    assert not torch.allclose(a[0, 9], b[0, 9])  # attention reaches back


# ------------------------------------------------------------------ loss
def test_loss_fn_matches_cross_entropy_and_uniform_init():
    logits = torch.zeros(2, 3, 10)
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert loss_fn(logits, targets).item() == pytest.approx(math.log(10))
    model = build_model(ModelConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32), seed=0)
    idx = tokens(4, 32, 256)
    assert loss_fn(model(idx), idx).item() == pytest.approx(math.log(256), abs=0.1)


# ------------------------------------------------------------------ weight decay groups
def test_no_decay_classification():
    model = build_model(SMALL, seed=0)
    decay, rest = set(), set()
    for name, p in model.named_parameters():
        (rest if no_decay(name, p.dim()) else decay).add(name)
    L = SMALL.n_layer
    linear = {
        f"units.{i}.{m}.weight" for i in range(1, L + 1) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    } | {f"units.{L + 1}.lm_head.weight"}
    assert decay == linear
    assert {
        "units.0.wte.weight",
        "units.0.wpe.weight",
        f"units.{L + 1}.ln_f.weight",
        f"units.{L + 1}.ln_f.bias",
        "units.1.ln1.weight",
        "units.1.ln2.bias",
        "units.1.attn.qkv.bias",
        "units.2.mlp.proj.bias",
    } <= rest
    assert decay | rest == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize(
    "name, ndim, expected",
    [
        ("units.0.wte.weight", 2, True),
        ("units.0.wpe.weight", 2, True),
        ("units.3.ln_f.weight", 1, True),
        ("units.1.ln1.weight", 1, True),
        ("units.1.attn.qkv.bias", 1, True),
        ("units.1.attn.qkv.weight", 2, False),
        ("units.2.mlp.fc.weight", 2, False),
        ("units.2.mlp.proj.weight", 2, False),
        ("units.3.lm_head.weight", 2, False),
        ("module.units.0.wte.weight", 2, True),  # DDP-style prefix
        ("module.units.1.attn.proj.weight", 2, False),
    ],
)
def test_no_decay_names(name, ndim, expected):
    assert no_decay(name, ndim) is expected


def test_build_optimizer_groups():
    model = build_model(SMALL, seed=0)
    named = list(model.named_parameters())
    cfg = OptimConfig(weight_decay=0.25, lr=1e-3)
    opt = build_optimizer(named, cfg)
    assert isinstance(opt, torch.optim.AdamW)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.25 for p in g["params"]}
    zero = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decay == {id(p) for n, p in named if p.dim() == 2 and ".wte." not in n and ".wpe." not in n}
    assert decay | zero == {id(p) for _, p in named} and not decay & zero
    sgd = build_optimizer(named, OptimConfig(name="sgd", momentum=0.9, lr=0.1))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt.param_groups)


# ------------------------------------------------------------------ LR schedule
OPT = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup=10)
TOTAL = 100


def test_lr_warmup_is_linear_from_lr_over_warmup_to_peak():
    assert lr_at(0, OPT, TOTAL) == pytest.approx(OPT.lr / OPT.lr_warmup)
    for s in range(OPT.lr_warmup):
        assert lr_at(s, OPT, TOTAL) == pytest.approx(OPT.lr * (s + 1) / OPT.lr_warmup)
    assert lr_at(OPT.lr_warmup - 1, OPT, TOTAL) == pytest.approx(OPT.lr)  # peak at the end of warmup
    assert max(lr_at(s, OPT, TOTAL) for s in range(TOTAL)) == pytest.approx(OPT.lr)


def test_lr_decays_monotonically_to_at_least_min_lr():
    lrs = [lr_at(s, OPT, TOTAL) for s in range(OPT.lr_warmup, TOTAL)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:])), "not monotone after warmup"
    assert lrs[0] > lrs[-1]
    assert all(v >= OPT.min_lr - 1e-15 for v in lrs)
    # cosine shape: half-way through the decay the lr is half-way between lr and min_lr
    mid = OPT.lr_warmup + (TOTAL - OPT.lr_warmup) // 2
    assert lr_at(mid, OPT, TOTAL) == pytest.approx((OPT.lr + OPT.min_lr) / 2, rel=0.05)


def test_lr_without_warmup_starts_at_peak():
    cfg = OptimConfig(lr=2e-3, min_lr=0.0, lr_warmup=0)
    assert lr_at(0, cfg, 50) == pytest.approx(2e-3)
    assert lr_at(49, cfg, 50) < 2e-3 * 0.01


@pytest.mark.parametrize("total, warmup", [(100, 10), (20, 0), (600, 30)])
def test_lr_reaches_min_lr_at_the_last_step(total, warmup):
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup=warmup)
    assert lr_at(total - 1, cfg, total) == pytest.approx(cfg.min_lr, rel=1e-6)


# ------------------------------------------------------------------ training
def test_short_training_run_reduces_loss():
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=2, d_model=64)
    cfg.data.batch_size = 8
    cfg.optim = OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup=5)
    steps = 40
    data = Data(cfg, 0, 1)
    model = build_model(cfg.model, cfg.run.seed)
    opt = build_optimizer(list(model.named_parameters()), cfg.optim)
    losses = []
    for step in range(steps):
        set_lr(opt, lr_at(step, cfg.optim, steps))
        x, y = data.train_batch(step, 0)
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    initial, final = losses[0], sum(losses[-5:]) / 5
    assert initial == pytest.approx(math.log(256), abs=0.15)
    assert final < initial - 0.5, f"loss {initial:.3f} -> {final:.3f}"
    with torch.no_grad():
        val = sum(loss_fn(model(x), y).item() for x, y in (data.val_batch(i) for i in range(2))) / 2
    assert val < initial - 0.5, f"val loss {val:.3f}"


def test_unit_by_unit_init_equals_build_model():
    """The engine's meta-device path (one unit materialised at a time) gives build_model's exact weights."""
    from hsdp.models.gpt import unit_initializer

    cfg = ModelConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, d_model=32)
    full = build_model(cfg, seed=7)
    meta = build_model(cfg, seed=7, materialize=False)
    assert all(p.is_meta for p in meta.parameters())
    init = unit_initializer(cfg, seed=7)
    for i, unit in enumerate(meta.units):
        init(i, unit)
    for (name, a), (_, b) in zip(full.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
