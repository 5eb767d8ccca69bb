"""Kernels vs torch references (Triton interpreter on CPU), references vs naive loops.

TRITON_INTERPRET=1 is set before triton/kernels are imported, because @triton.jit
decides compiled-vs-interpreted when a kernel is defined. If another test module
imports triton first, the triton-side tests fail with an error that says so; set
TRITON_INTERPRET=1 in the environment (or in tests/conftest.py) then.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from decimal import ROUND_HALF_UP, Decimal  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kernels  # noqa: E402
from kernels import backend  # noqa: E402
from kernels.pack import pack_shards_ref, unpack_full_ref  # noqa: E402
from kernels.quant import quantize_int8_ref  # noqa: E402
from kernels.reduce import pack_grads_ref  # noqa: E402

# numpy warns when the interpreter casts values past fp16's range to inf (the intended result)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHARDS = [1, 2, 4, 3]
DT_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.fixture(autouse=True)
def _restore_backend():
    old = backend.get_backend()
    yield
    backend.set_backend(old)


def on(name: str, fn, *args, **kwargs):
    """Run fn under kernel backend `name`."""
    backend.set_backend(name)
    try:
        return fn(*args, **kwargs)
    finally:
        backend.set_backend("auto")


# ----------------------------------------------------------------------------- units


def shard_numel(shape: tuple, S: int) -> int:
    """Dim-0 shard size: ceil(d0/S) rows of prod(rest); a 0-dim param counts as d0 = 1."""
    d0 = shape[0] if shape else 1
    rest = math.prod(shape[1:])
    return -(-d0 // S) * rest


def _many_shapes(k: int = 120, seed: int = 0) -> list:
    rng = random.Random(seed)
    shapes = []
    for _ in range(k):
        if rng.random() < 0.4:
            shapes.append((rng.randint(1, 40),))
        else:
            shapes.append((rng.randint(1, 9), rng.randint(1, 6)))
    return shapes


UNITS = {
    # zero-size, one element, 0-dim, d0 < S, d0 not divisible by S, sizes not a multiple of the block
    "mixed": [(7,), (0,), (1,), (5, 3), (2, 4), (), (4099,), (3, 0), (1, 7), (2049, 2)],
    "many": _many_shapes(),
}
LARGE = [(1024, 1024)]  # 1M elements: kept to a few cases, the interpreter is slow


def make_grads(shapes, dtype, seed, none_at=()):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    for i in none_at:
        grads[i] = None
    return grads


# ----------------------------------------------------------------------------- naive formulations


def naive_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 round-to-nearest-even with numpy integer ops (finite inputs)."""
    b = x.numpy().view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return torch.from_numpy(r.view(np.int16).copy()).view(torch.bfloat16)


def naive_unpack(gathered, sizes):
    S = gathered.shape[0]
    out = torch.empty(gathered.numel(), dtype=gathered.dtype)
    off = 0
    for sn in sizes:
        for r in range(S):
            for j in range(sn):
                out[S * off + r * sn + j] = gathered[r, off + j]
        off += sn
    return out


def naive_pack_grads(grads, sizes, out, scale, accumulate):
    S, N = out.shape
    res = np.zeros((S, N), dtype=np.float32)
    off = 0
    for g, sn in zip(grads, sizes):
        flat = np.zeros(0, np.float32) if g is None else g.float().flatten().numpy()
        for r in range(S):
            for j in range(sn):
                k = r * sn + j
                res[r, off + j] = (flat[k] if k < flat.size else np.float32(0)) * np.float32(scale)
        off += sn
    res = torch.from_numpy(res)
    if accumulate:
        res = res + out.float()
    return res.to(out.dtype)


def naive_quantize(x: torch.Tensor, block: int):
    xs = x.numpy()
    n = xs.size
    nb = -(-n // block)
    q = np.zeros(n, np.int8)
    scales = np.zeros(nb, np.float32)
    for b in range(nb):
        chunk = xs[b * block : (b + 1) * block]
        s = np.float32(np.abs(chunk).max()) / np.float32(127)
        scales[b] = s
        for j, v in enumerate(chunk):
            if s == 0:
                continue
            y = np.float32(v) / s  # fp32 division, exact as Decimal
            r = int(Decimal(float(y)).quantize(Decimal(1), rounding=ROUND_HALF_UP))  # half away from zero
            q[b * block + j] = max(-127, min(127, r))
    return torch.from_numpy(q), torch.from_numpy(scales)


def naive_dequantize_mean(q, scales, block):
    M, n = q.shape
    acc = np.zeros(n, np.float32)
    for m in range(M):
        s = np.repeat(scales[m].numpy(), block)[:n]
        acc = acc + q[m].numpy().astype(np.float32) * s
    return torch.from_numpy(acc / np.float32(M))


# ----------------------------------------------------------------------------- backend


def test_backend_selection(monkeypatch):
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="expected one of"):
        backend.set_backend("cuda")
    backend.set_backend("auto")
    assert backend.get_backend() == "auto" and not backend.use_triton(x)  # CPU tensor -> reference
    backend.set_backend("torch")
    assert not backend.use_triton(x)
    backend.set_backend("triton")
    assert backend.use_triton(x)  # interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.use_triton(x)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.pack_shards(x, torch.empty(3))


def test_import_without_triton_or_cuda():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # make `import triton` fail
        "import torch, kernels\n"
        "from kernels import backend\n"
        "assert not backend.HAVE_TRITON and not torch.cuda.is_initialized()\n"
        "x = torch.randn(10); o = torch.empty(10, dtype=torch.bfloat16)\n"
        "kernels.pack_shards(x, o); assert torch.equal(o, x.bfloat16())\n"
        "backend.set_backend('triton')\n"
        "try:\n    kernels.pack_shards(x, o)\nexcept RuntimeError as e:\n    assert 'triton' in str(e)\n"
        "else:\n    raise AssertionError('expected RuntimeError')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------- pack_shards


SPECIAL = torch.tensor(
    [
        0.0,
        -0.0,
        1.0,
        -1.0,
        float("inf"),
        -float("inf"),
        3.4e38,
        -3.4e38,
        65504.0,
        65520.0,
        1e-40,
        -1e-45,
        1.17e-38,
        6e-8,
        1.00390625,
        1.01171875,
        1.0 + 2**-8,
        1.0 + 3 * 2**-9,
    ]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("n", [0, 1, 4095, 4097, 3 * 4096 + 5])
def test_pack_shards(dtype, n):
    held = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100
    held[: min(n, SPECIAL.numel())] = SPECIAL[: min(n, SPECIAL.numel())]  # infs, subnormals, rounding ties
    outs = {b: torch.full((n,), 7.0, dtype=dtype) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.pack_shards, held, o)
    assert torch.equal(
        outs["triton"].view(torch.int16 if dtype != torch.float32 else torch.int32),
        outs["torch"].view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_pack_shards_large():
    held = torch.randn(1 << 20)
    outs = {b: torch.empty(1 << 20, dtype=torch.bfloat16) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.pack_shards, held, o)
    assert torch.equal(outs["triton"], outs["torch"])


def test_pack_shards_ref_vs_naive():
    held = torch.cat([SPECIAL, torch.randn(5000) * 1e3, torch.randn(5000) * 1e-39])
    out = torch.empty(held.numel(), dtype=torch.bfloat16)
    pack_shards_ref(held, out)
    assert torch.equal(out.view(torch.int16), naive_bf16(held).view(torch.int16))
    nan = torch.empty(3, dtype=torch.bfloat16)
    on("triton", kernels.pack_shards, torch.tensor([float("nan"), -float("nan"), 1.0]), nan)
    assert nan[:2].isnan().all() and nan[2] == 1


# ----------------------------------------------------------------------------- unpack_full


def _unpack_case(shapes, S, dtype, seed=0):
    sizes = [shard_numel(s, S) for s in shapes]
    gathered = (torch.randn(S, sum(sizes), generator=torch.Generator().manual_seed(seed)) * 10).to(dtype)
    return gathered, sizes


def _unpack_both(gathered, sizes):
    outs = {}
    for b in ("torch", "triton"):
        outs[b] = torch.full((gathered.numel(),), -1.0, dtype=gathered.dtype)
        on(b, kernels.unpack_full, gathered, sizes, outs[b])
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("S", SHARDS)
@pytest.mark.parametrize("unit", list(UNITS))
def test_unpack_full(unit, S, dtype):
    gathered, sizes = _unpack_case(UNITS[unit], S, dtype)
    outs = _unpack_both(gathered, sizes)
    assert torch.equal(outs["triton"], outs["torch"])


@pytest.mark.parametrize("S", [2, 3])
def test_unpack_full_large(S):
    gathered, sizes = _unpack_case(LARGE + [(5,)], S, torch.bfloat16)
    outs = _unpack_both(gathered, sizes)
    assert torch.equal(outs["triton"], outs["torch"])


@pytest.mark.parametrize("S", SHARDS)
def test_unpack_full_ref_vs_naive(S):
    gathered, sizes = _unpack_case(UNITS["mixed"][:-1] + UNITS["many"][:20], S, torch.float32)
    out = torch.empty(gathered.numel())
    unpack_full_ref(gathered, sizes, out)
    assert torch.equal(out, naive_unpack(gathered, sizes))


def test_unpack_full_restores_params():
    # the full buffer, viewed per param and cropped to the param's numel, is the param itself
    S = 3
    shapes = UNITS["mixed"]
    params = make_grads(shapes, torch.float32, seed=5)
    sizes = [shard_numel(s, S) for s in shapes]
    gathered = torch.empty(S, sum(sizes))
    kernels.pack_grads(params, sizes, gathered, 1.0)  # the same dim-0 shard layout
    full = torch.empty(gathered.numel())
    on("triton", kernels.unpack_full, gathered, sizes, full)
    off = 0
    for p, sn in zip(params, sizes):
        assert torch.equal(full[S * off : S * off + p.numel()].view(p.shape), p)
        off += sn


# ----------------------------------------------------------------------------- pack_grads


def _pack_grads_both(grads, sizes, S, out_dtype, scale, accumulate, seed=1):
    init = torch.randn(S, sum(sizes), generator=torch.Generator().manual_seed(seed)).to(out_dtype)
    outs = {}
    for b in ("torch", "triton"):
        outs[b] = init.clone()
        on(b, kernels.pack_grads, grads, sizes, outs[b], scale, accumulate)
    return init, outs


@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("S", SHARDS)
def test_pack_grads_mixed_unit(S, grad_dtype, out_dtype, accumulate):
    shapes = UNITS["mixed"]
    sizes = [shard_numel(s, S) for s in shapes]
    grads = make_grads(shapes, grad_dtype, seed=S, none_at=(4,))
    _, outs = _pack_grads_both(grads, sizes, S, out_dtype, 1.0 / (3 * S), accumulate)
    # one fp32 multiply (and add) then one cast on both sides: bit-exact
    assert torch.equal(outs["triton"], outs["torch"])


@pytest.mark.parametrize(
    "S,grad_dtype,out_dtype,accumulate",
    [
        (4, torch.bfloat16, torch.float32, False),
        (3, torch.float32, torch.bfloat16, True),
        (2, torch.float16, torch.float16, False),
    ],
)
def test_pack_grads_many_params(S, grad_dtype, out_dtype, accumulate):
    shapes = UNITS["many"]
    sizes = [shard_numel(s, S) for s in shapes]
    grads = make_grads(shapes, grad_dtype, seed=7, none_at=(3, 50))
    _, outs = _pack_grads_both(grads, sizes, S, out_dtype, 0.125, accumulate)
    assert torch.equal(outs["triton"], outs["torch"])


def test_pack_grads_large():
    S = 4
    shapes = LARGE + [(3,), (6, 2)]
    sizes = [shard_numel(s, S) for s in shapes]
    grads = make_grads(shapes, torch.bfloat16, seed=3)
    _, outs = _pack_grads_both(grads, sizes, S, torch.bfloat16, 0.25, False)
    assert torch.equal(outs["triton"], outs["torch"])


def test_pack_grads_mixed_dtypes_and_all_none():
    S = 3
    shapes = [(5, 2), (4,), (7,)]
    sizes = [shard_numel(s, S) for s in shapes]
    grads = [torch.randn(5, 2).bfloat16(), torch.randn(4).half(), torch.randn(7)]
    _, outs = _pack_grads_both(grads, sizes, S, torch.float32, 0.5, True)
    assert torch.equal(outs["triton"], outs["torch"])
    init, outs = _pack_grads_both([None] * 3, sizes, S, torch.bfloat16, 0.5, True)
    assert torch.equal(outs["triton"], init) and torch.equal(outs["torch"], init)
    _, outs = _pack_grads_both([None] * 3, sizes, S, torch.bfloat16, 0.5, False)
    assert not outs["triton"].any() and not outs["torch"].any()


@pytest.mark.parametrize("accumulate", [False, True], ids=["set", "acc"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("S", [1, 3, 4])
def test_pack_grads_ref_vs_naive(S, grad_dtype, out_dtype, accumulate):
    shapes = UNITS["mixed"][:-1] + UNITS["many"][:10]
    sizes = [shard_numel(s, S) for s in shapes]
    grads = make_grads(shapes, grad_dtype, seed=11, none_at=(2,))
    out = torch.randn(S, sum(sizes), generator=torch.Generator().manual_seed(2)).to(out_dtype)
    expect = naive_pack_grads(grads, sizes, out, 0.3, accumulate)
    pack_grads_ref(grads, sizes, out, 0.3, accumulate)
    assert torch.equal(out, expect)


def test_pack_grads_ref_matches_padded_chunks():
    # an independent view of the layout: rank r's slice = chunk r of the zero-padded dim 0
    S = 3
    grads = [torch.randn(7, 2), torch.randn(2, 3), torch.randn(1)]
    sizes = [shard_numel(tuple(g.shape), S) for g in grads]
    out = torch.empty(S, sum(sizes))
    pack_grads_ref(grads, sizes, out, 1.0)
    expect = []
    for g in grads:
        rows = -(-g.shape[0] // S)
        padded = torch.zeros(rows * S, *g.shape[1:])
        padded[: g.shape[0]] = g
        expect.append(padded.view(S, -1))
    assert torch.equal(out, torch.cat(expect, dim=1))


# ----------------------------------------------------------------------------- accumulate_grad_shards


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS.get)
@pytest.mark.parametrize("n", [0, 1, 4097, 12289])
def test_accumulate_grad_shards(dtype, n):
    g = torch.Generator().manual_seed(n)
    reduced = torch.randn(n, generator=g).to(dtype)
    init = torch.randn(n, generator=g)
    outs = {}
    for b in ("torch", "triton"):
        outs[b] = init.clone()
        on(b, kernels.accumulate_grad_shards, reduced, outs[b], 1.0 / 12)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-6, atol=0)
    assert torch.equal(outs["triton"], outs["torch"])  # same op order, no FMA: exact in practice
    expect = init.numpy() + reduced.float().numpy() * np.float32(1.0 / 12)
    assert torch.equal(outs["torch"], torch.from_numpy(expect))


# ----------------------------------------------------------------------------- outer step


def test_compute_delta():
    g = torch.Generator().manual_seed(0)
    gp, held = torch.randn(10007, generator=g), torch.randn(10007, generator=g)
    outs = {b: torch.empty(10007) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.compute_delta, gp, held, o)
    assert torch.equal(outs["triton"], outs["torch"])
    assert torch.equal(outs["torch"], torch.from_numpy(gp.numpy() - held.numpy()))


def naive_outer(held, gp, mom, delta, lr, mu, nesterov, first):
    f = np.float32
    d, b, g = delta.numpy(), mom.numpy(), gp.numpy()
    b = d.copy() if first else f(mu) * b + d
    step = d + f(mu) * b if nesterov else b
    g = g - f(lr) * step
    return [torch.from_numpy(x.astype(np.float32)) for x in (g, g, b)]


@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("n", [1, 10007])
def test_outer_step(n, nesterov, first):
    g = torch.Generator().manual_seed(n)
    held, gp, mom = (torch.randn(n, generator=g) for _ in range(3))
    delta = torch.randn(n, generator=g) * 1e-2
    res = {}
    for b in ("torch", "triton"):
        t = [held.clone(), gp.clone(), mom.clone()]
        on(b, kernels.outer_step, *t, delta, 0.7, 0.9, nesterov, first)
        res[b] = t
    for a, c, e in zip(res["triton"], res["torch"], naive_outer(held, gp, mom, delta, 0.7, 0.9, nesterov, first)):
        assert torch.equal(a, c)
        assert torch.equal(c, e)
    assert torch.equal(res["torch"][0], res["torch"][1])  # held = global


def test_outer_step_matches_torch_sgd():
    # several outer steps == torch.optim.SGD(nesterov) with grad = averaged delta
    g = torch.Generator().manual_seed(1)
    n = 513
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    opt = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    gp, held, mom, delta = p.detach().clone(), p.detach().clone(), torch.zeros(n), torch.empty(n)
    for step in range(4):
        replicas = [held + torch.randn(n, generator=g) * 0.01 for _ in range(3)]
        avg = torch.stack(replicas).mean(0)
        kernels.compute_delta(gp, avg, delta)
        p.grad = delta.clone()
        opt.step()
        on("triton", kernels.outer_step, held, gp, mom, delta, 0.7, 0.9, True, step == 0)
        torch.testing.assert_close(gp, p.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(held, gp)


# ----------------------------------------------------------------------------- int8 quantization


def _quant_input(n, block, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    if n >= 2 * block:
        x[block : 2 * block] = 0.0  # an all-zero block: scale 0, q 0
    if n >= 4:
        # exact .5 ties after scaling: absmax 127 makes the scale exactly 1
        x[:4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    return x


@pytest.mark.parametrize("block", [1, 7, 64, 256, 1000, 16384])
@pytest.mark.parametrize("n", [0, 1, 999, 4097])
def test_quantize_int8(n, block):
    x = _quant_input(n, block, seed=n + block)
    q_ref, s_ref = on("torch", kernels.quantize_int8, x, block)
    q_tri, s_tri = on("triton", kernels.quantize_int8, x, block)
    assert q_ref.dtype == torch.int8 and q_ref.shape == (n,) and s_ref.shape == (-(-n // block),)
    assert torch.equal(q_tri, q_ref) and torch.equal(s_tri, s_ref)


def test_quantize_int8_ties_round_away_from_zero():
    x = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -126.5, 0.49999997])
    for b in ("torch", "triton"):
        q, s = on(b, kernels.quantize_int8, x, 8)
        assert s.item() == 1.0
        assert q.tolist() == [127, 3, -3, 1, -1, 2, -127, 0]


@pytest.mark.parametrize("block,n", [(7, 100), (64, 300), (256, 256)])
def test_quantize_int8_ref_vs_naive(n, block):
    x = _quant_input(n, block, seed=3)
    q, s = quantize_int8_ref(x, block)
    q_n, s_n = naive_quantize(x, block)
    assert torch.equal(s, s_n) and torch.equal(q, q_n)


def test_quantize_int8_large():
    x = torch.randn(1 << 20)
    q_ref, s_ref = on("torch", kernels.quantize_int8, x, 256)
    q_tri, s_tri = on("triton", kernels.quantize_int8, x, 256)
    assert torch.equal(q_tri, q_ref) and torch.equal(s_tri, s_ref)


def _dequant_case(M, n, block, seed):
    g = torch.Generator().manual_seed(seed)
    pairs = [quantize_int8_ref(torch.randn(n, generator=g), block) for _ in range(M)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


@pytest.mark.parametrize("block", [1, 7, 256])
@pytest.mark.parametrize("n", [1, 999, 4097])
@pytest.mark.parametrize("M", [1, 3, 4])
def test_dequantize_mean(M, n, block):
    q, s = _dequant_case(M, n, block, seed=M * n + block)
    outs = {b: torch.empty(n) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.dequantize_mean, q, s, block, o)
    assert torch.equal(outs["triton"], outs["torch"])
    assert torch.equal(outs["torch"], naive_dequantize_mean(q, s, block))


# ----------------------------------------------------------------------------- property tests


@settings(max_examples=15, deadline=None)
@given(
    sizes_by_param=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    S=st.sampled_from(SHARDS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_unpack(sizes_by_param, S, dtype, seed):
    gathered = torch.randn(S, sum(sizes_by_param), generator=torch.Generator().manual_seed(seed)).to(dtype)
    outs = _unpack_both(gathered, sizes_by_param)
    assert torch.equal(outs["triton"], outs["torch"])


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), min_size=1, max_size=10),
    S=st.sampled_from(SHARDS),
    grad_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    scale=st.floats(-4, 4, allow_nan=False, width=32),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_pack_grads(shapes, S, grad_dtype, out_dtype, scale, accumulate, seed):
    sizes = [shard_numel(s, S) for s in shapes]
    grads = make_grads(shapes, grad_dtype, seed)
    _, outs = _pack_grads_both(grads, sizes, S, out_dtype, scale, accumulate, seed=seed)
    assert torch.equal(outs["triton"], outs["torch"])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 3000), block=st.integers(1, 600), spread=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16))
def test_property_quant_roundtrip(n, block, spread, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * spread
    q, s = on("triton", kernels.quantize_int8, x, block)
    q_ref, s_ref = quantize_int8_ref(x, block)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    out = torch.empty(n)
    on("triton", kernels.dequantize_mean, q[None], s[None], block, out)
    # each element is within half a quantization step (plus fp32 slack) of x
    step = s.repeat_interleave(block)[:n]
    assert bool(((out - x).abs() <= step * 0.5001 + 1e-30).all())


# ----------------------------------------------------------------------------- validation, custom ops


def test_validation_errors():
    with pytest.raises(ValueError, match="held has dtype"):
        kernels.pack_shards(torch.zeros(4, dtype=torch.float16), torch.zeros(4))
    with pytest.raises(ValueError, match="out has shape"):
        kernels.pack_shards(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="shard_sizes sum to 5"):
        kernels.unpack_full(torch.zeros(2, 4), [2, 3], torch.zeros(8))
    with pytest.raises(ValueError, match="out has dtype"):
        kernels.unpack_full(torch.zeros(2, 4), [4], torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.unpack_full(torch.zeros(4, 2).t(), [4], torch.zeros(8))
    with pytest.raises(ValueError, match=r"shard_sizes\[0\] = 4"):
        kernels.pack_grads([torch.zeros(5, 2)], [4], torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match="2 grads but 1"):
        kernels.pack_grads([None, None], [4], torch.zeros(2, 4), 1.0)
    with pytest.raises(ValueError, match="grad_shard has dtype"):
        kernels.accumulate_grad_shards(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), 1.0)
    with pytest.raises(ValueError, match="momentum has shape"):
        kernels.outer_step(torch.zeros(4), torch.zeros(4), torch.zeros(5), torch.zeros(4), 0.7, 0.9, True, False)
    with pytest.raises(ValueError, match="block must be"):
        kernels.quantize_int8(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="block must be"):
        kernels.quantize_int8(torch.zeros(4), 1 << 20)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 2\), expected \(2, 1\)"):
        kernels.dequantize_mean(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2, 2), 4, torch.zeros(4))


def test_no_grad_on_parameters():
    p = torch.nn.Parameter(torch.randn(8))
    gp, mom, delta = torch.randn(8), torch.zeros(8), torch.randn(8)
    kernels.outer_step(p, gp, mom, delta, 0.7, 0.9, True, True)  # in place on a leaf that requires grad
    assert torch.equal(p.detach(), gp)


OP_ARGS = {
    "pack_shards": lambda: (torch.randn(14), torch.empty(14, dtype=torch.bfloat16)),
    "unpack_full": lambda: (torch.randn(2, 14), [9, 3, 2], torch.empty(28)),
    "pack_grads": lambda: ([torch.randn(5, 3), None, torch.randn(4)], [9, 3, 2], torch.empty(2, 14), 0.5, True),
    "accumulate_grad_shards": lambda: (torch.randn(14).bfloat16(), torch.randn(14), 0.5),
    "compute_delta": lambda: (torch.randn(14), torch.randn(14), torch.empty(14)),
    "outer_step": lambda: (torch.randn(14), torch.randn(14), torch.randn(14), torch.randn(14), 0.7, 0.9, True, False),
    "quantize_int8": lambda: (torch.randn(14), 4),
    "dequantize_mean": lambda: (
        torch.randint(-127, 128, (3, 14), dtype=torch.int8),
        torch.rand(3, 4),
        4,
        torch.empty(14),
    ),
}


@pytest.mark.parametrize("name", list(OP_ARGS))
def test_custom_op_opcheck(name):
    # schema, fake (meta) implementation, and mutation declarations are consistent
    torch.library.opcheck(getattr(torch.ops.hsdp_kernels, name).default, OP_ARGS[name]())


def test_compile_sees_one_op_per_call():
    nodes = []

    def capture(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def step(held, out, gathered, full, x):
        kernels.pack_shards(held, out)
        kernels.unpack_full(gathered, [3, 4], full)
        q, s = kernels.quantize_int8(x, 4)
        return q.float().sum() + s.sum()

    args = (torch.randn(7), torch.empty(7, dtype=torch.bfloat16), torch.randn(2, 7), torch.empty(14), torch.randn(9))
    torch._dynamo.reset()
    res = torch.compile(step, backend=capture, fullgraph=True)(*args)
    ops = [n for n in nodes if n.startswith("hsdp_kernels.")]
    assert ops == [
        "hsdp_kernels.pack_shards.default",
        "hsdp_kernels.unpack_full.default",
        "hsdp_kernels.quantize_int8.default",
    ]
    assert torch.equal(args[1], args[0].bfloat16())
    q, s = quantize_int8_ref(args[4], 4)
    assert res == q.float().sum() + s.sum()


# ----------------------------------------------------------------------------- GPU code generation (no GPU needed)

_F32X = {"num_warps": 8, "enable_fp_fusion": False}
GPU_CASES = {  # name -> (module, kernel, signature, constexprs, options), as the dispatchers launch them
    "pack_shards_bf16": (
        "kernels.pack",
        "_pack_shards_kernel",
        {"src_ptr": "*fp32", "dst_ptr": "*bf16", "n": "i32"},
        {"BLOCK": 4096},
        {"num_warps": 8},
    ),
    "unpack_full": (
        "kernels.pack",
        "_unpack_full_kernel",
        {"src_ptr": "*bf16", "dst_ptr": "*bf16", "items_ptr": "*i64", "N": "i32", "S": "i32"},
        {"BLOCK": 2048, "ALIGN": 16},
        {"num_warps": 4},
    ),
    "pack_grads_acc": (
        "kernels.reduce",
        "_pack_grads_kernel",
        {
            "grads_ptr": "*i64",
            "out_ptr": "*bf16",
            "items_ptr": "*i64",
            "g0_ptr": "*bf16",
            "n_params": "i32",
            "N": "i32",
            "scale": "fp32",
        },
        {"BLOCK": 2048, "ALIGN": 16, "NUMEL_ALIGN": 16, "PTR_ALIGN": 16, "ACCUMULATE": True},
        {"num_warps": 4, "enable_fp_fusion": False},
    ),
    "accumulate": (
        "kernels.reduce",
        "_accumulate_kernel",
        {"reduced_ptr": "*bf16", "shard_ptr": "*fp32", "n": "i32", "scale": "fp32"},
        {"BLOCK": 4096},
        _F32X,
    ),
    "compute_delta": (
        "kernels.outer",
        "_delta_kernel",
        {"global_ptr": "*fp32", "held_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
        {"BLOCK": 4096},
        {"num_warps": 8},
    ),
    "outer_step": (
        "kernels.outer",
        "_outer_step_kernel",
        {
            "held_ptr": "*fp32",
            "global_ptr": "*fp32",
            "mom_ptr": "*fp32",
            "delta_ptr": "*fp32",
            "n": "i32",
            "lr": "fp32",
            "mu": "fp32",
        },
        {"NESTEROV": True, "FIRST": False, "BLOCK": 4096},
        _F32X,
    ),
    "quantize": (
        "kernels.quant",
        "_quantize_kernel",
        {"x_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "n": "i32", "nb": "i32", "block": "i32"},
        {"ROWS": 16, "COLS": 256},
        _F32X,
    ),
    "quantize_max_block": (
        "kernels.quant",
        "_quantize_kernel",
        {"x_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "n": "i32", "nb": "i32", "block": "i32"},
        {"ROWS": 1, "COLS": 16384},
        _F32X,
    ),
    "dequantize": (
        "kernels.quant",
        "_dequantize_mean_kernel",
        {
            "q_ptr": "*i8",
            "scale_ptr": "*fp32",
            "out_ptr": "*fp32",
            "n": "i32",
            "nb": "i32",
            "block": "i32",
            "M": "i32",
            "M_f": "fp32",
        },
        {"BLOCK": 4096},
        _F32X,
    ),
}


@pytest.fixture(scope="module")
def sm90_facts():
    """Every GPU_CASES kernel compiled for sm_90 once (tests/test_kernel_harness.py: no GPU needed)."""
    from tests.test_kernel_harness import sm90_facts_of

    return sm90_facts_of(GPU_CASES)


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_kernels_compile_for_cuda(sm90_facts, case):
    # Lowering errors the interpreter cannot show, and the exactness contract on the
    # GPU: no fused multiply-adds, only correctly rounded fp32 division.
    facts = sm90_facts[case]
    assert "error" not in facts, facts.get("error")
    assert not facts["fma"] and not facts["approx_div"]
    assert facts["div_rn"] == (case.startswith(("quantize", "dequantize")))


def test_arithmetic_kernels_launch_without_fma(monkeypatch):
    # the bit-exactness above needs FMA contraction off on the GPU too (the interpreter never fuses)
    from kernels import outer, pack, quant, reduce

    seen = {}
    for mod in (outer, pack, quant, reduce):
        real = mod.launch

        def spy(kernel, grid, *args, _real=real, **meta):
            seen[kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)] = meta.get("enable_fp_fusion", True)
            return _real(kernel, grid, *args, **meta)

        monkeypatch.setattr(mod, "launch", spy)
    backend.set_backend("triton")
    for name, make in OP_ARGS.items():
        getattr(kernels, name)(*make())
    assert seen == {
        "_pack_shards_kernel": True,
        "_unpack_full_kernel": True,
        "_delta_kernel": True,  # copies/one op: no FMA
        "_pack_grads_kernel": False,
        "_accumulate_kernel": False,
        "_outer_step_kernel": False,
        "_quantize_kernel": False,
        "_dequantize_mean_kernel": False,
    }


# ----------------------------------------------------------------------------- in a compiled graph


def test_graph_ops_run_the_kernels_inside_a_compiled_graph(monkeypatch) -> None:
    """cast_shard / scale_grad / scaled_grad_shard stay one call each in inductor's generated code; at run
    time kernels.backend picks: 'triton' launches the kernels (3 launches), 'torch' none; bitwise equal."""
    from torch._inductor.graph import GraphLowering

    import kernels.pack
    import kernels.reduce
    from kernels.pack import cast_shard
    from kernels.reduce import scale_grad, scaled_grad_shard

    launches = []

    def counting(launch):
        def wrapper(kernel, *args, **kwargs):
            launches.append(kernel)
            return launch(kernel, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels.pack, "launch", counting(kernels.pack.launch))
    monkeypatch.setattr(kernels.reduce, "launch", counting(kernels.reduce.launch))

    def step(held: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = cast_shard(held, torch.bfloat16)  # the all-gather input
        rs_in = scale_grad(grad * packed.float(), torch.bfloat16, 0.25)  # the reduce-scatter input
        return packed, rs_in, scaled_grad_shard(rs_in, 0.5)  # the grad shard

    code: list[str] = []
    monkeypatch.setattr(GraphLowering, "save_output_code", code.append)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    held, grad = torch.randn(5000, generator=g), torch.randn(5000, generator=g) * 1e3
    results = {}
    for name in ["torch", "triton"]:
        backend.set_backend(name)
        launches.clear()
        results[name] = compiled(held, grad)
        assert len(launches) == (3 if name == "triton" else 0), name
    assert len(code) == 1
    for op in ["cast_shard", "scale_grad", "scaled_grad_shard"]:
        assert f"torch.ops.hsdp_kernels.{op}.default(" in code[0], op
    for a, b in zip(results["torch"], results["triton"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    packed, rs_in, shard = results["torch"]
    assert torch.equal(packed, held.bfloat16())
    assert torch.equal(shard, rs_in.float() * 0.5)
