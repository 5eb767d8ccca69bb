"""The compression kernels (int4 quantization, chunked top-k with error feedback): kernels vs torch
references bit for bit (Triton interpreter on CPU), references vs plain numpy/python loops, round-trip
properties, input validation, custom-op registration and sm_90 code generation.

TRITON_INTERPRET=1 is set before triton/kernels are imported (see tests/test_kernels.py).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from decimal import ROUND_HALF_UP, Decimal  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kernels  # noqa: E402
from kernels import backend  # noqa: E402
from kernels.quant4 import MAX_BLOCK, quantize_int4_ref  # noqa: E402
from kernels.topk import MAX_CHUNK, topk_error_feedback_ref, topk_select_ref  # noqa: E402
from tests.test_kernel_harness import _restore_backend, assert_exact_codegen, on, sm90_facts_of  # noqa: E402, F401


def both(fn, *args):
    """(result, tensor args after the call) under the torch reference, then under the Triton kernel."""
    res = {}
    for b in ("torch", "triton"):
        cloned = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        res[b] = (on(b, fn, *cloned), [a for a in cloned if isinstance(a, torch.Tensor)])
    return res["torch"], res["triton"]


# ----------------------------------------------------------------------------- naive implementations


def naive_quantize_int4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs = x.numpy()
    n = xs.size
    nb = -(-n // block)
    nibbles = [0] * (n + (n & 1))
    scales = np.zeros(nb, np.float32)
    for b in range(nb):
        chunk = xs[b * block : (b + 1) * block]
        s = np.float32(np.abs(chunk).max()) / np.float32(7)
        scales[b] = s
        for j, v in enumerate(chunk):
            r = 0
            if s != 0:
                y = np.float32(v) / s  # fp32 division, exact as Decimal
                r = int(Decimal(float(y)).quantize(Decimal(1), rounding=ROUND_HALF_UP))  # half away from zero
            nibbles[b * block + j] = max(-7, min(7, r)) + 8
    packed = [nibbles[2 * i] | (nibbles[2 * i + 1] << 4) for i in range(len(nibbles) // 2)]
    return torch.tensor(packed, dtype=torch.uint8), torch.from_numpy(scales)


def naive_dequantize_int4_mean(packed: torch.Tensor, scales: torch.Tensor, block: int, n: int) -> torch.Tensor:
    M = packed.shape[0]
    acc = np.zeros(n, np.float32)
    for m in range(M):
        q = np.array([((int(packed[m, e // 2]) >> (4 * (e % 2))) & 15) - 8 for e in range(n)], np.float32)
        acc = acc + q * np.repeat(scales[m].numpy(), block)[:n]
    return torch.from_numpy(acc / np.float32(M))


def naive_topk(acc: torch.Tensor, chunk: int, k: int) -> tuple[list[int], list[float]]:
    a = acc.tolist()
    idx, vals = [], []
    for start in range(0, len(a), chunk):
        part = a[start : start + chunk]
        best = sorted(sorted(range(len(part)), key=lambda i: (-abs(part[i]), i))[:k])
        idx += best
        vals += [part[i] for i in best]
    return idx, vals


# ----------------------------------------------------------------------------- int4 quantization


def _quant_input(n: int, block: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    if n >= 2 * block:
        x[block : 2 * block] = 0.0  # an all-zero block: scale 0, nibble 8
    if n >= 4:
        x[:4] = torch.tensor([7.0, 2.5, -3.5, 0.5])  # exact .5 ties when the first block's scale is 1
    return x


@pytest.mark.parametrize("block", [2, 8, 64, 1000, MAX_BLOCK])
@pytest.mark.parametrize("n", [1, 2, 7, 999, 4097])
def test_quantize_int4(n, block):
    x = _quant_input(n, block, seed=n + block)
    p_ref, s_ref = on("torch", kernels.quantize_int4, x, block)
    p_tri, s_tri = on("triton", kernels.quantize_int4, x, block)
    assert p_ref.dtype == torch.uint8 and p_ref.shape == ((n + 1) // 2,) and s_ref.shape == (-(-n // block),)
    assert torch.equal(p_tri, p_ref) and torch.equal(s_tri, s_ref)


def test_quantize_int4_nibbles_and_ties():
    # absmax 7 makes the scale exactly 1: exact .5 ties round away from zero
    x = torch.tensor([7.0, 2.5, -2.5, 0.5, -0.5, 1.5, -6.5, 0.49999997, -7.0])
    for b in ("torch", "triton"):
        p, s = on(b, kernels.quantize_int4, x, 10)
        assert s.tolist() == [1.0]
        # q = [7, 3, -3, 1, -1, 2, -7, 0, -7] -> nibbles q + 8, low first; odd n: last high nibble 0
        assert p.tolist() == [15 | 11 << 4, 5 | 9 << 4, 7 | 10 << 4, 1 | 8 << 4, 1]
        z, sz = on(b, kernels.quantize_int4, torch.zeros(5), 4)
        assert z.tolist() == [0x88, 0x88, 0x08] and sz.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("block,n", [(2, 9), (8, 100), (64, 301), (256, 256)])
def test_quantize_int4_ref_vs_naive(n, block):
    x = _quant_input(n, block, seed=5)
    p, s = quantize_int4_ref(x, block)
    p_n, s_n = naive_quantize_int4(x, block)
    assert torch.equal(s, s_n) and torch.equal(p, p_n)


@pytest.mark.parametrize("block", [2, 6, 256])
@pytest.mark.parametrize("n", [1, 7, 999])
@pytest.mark.parametrize("M", [1, 3])
def test_dequantize_int4_mean(M, n, block):
    g = torch.Generator().manual_seed(M * n + block)
    pairs = [quantize_int4_ref(torch.randn(n, generator=g) * (m + 1), block) for m in range(M)]
    p, s = torch.stack([q for q, _ in pairs]), torch.stack([sc for _, sc in pairs])
    outs = {b: torch.full((n,), float("nan")) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.dequantize_int4_mean, p, s, block, o)
    assert torch.equal(outs["triton"], outs["torch"])
    assert torch.equal(outs["torch"], naive_dequantize_int4_mean(p, s, block, n))


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 2000),
    half_block=st.integers(1, 300),
    spread=st.floats(1e-6, 1e6),
    seed=st.integers(0, 2**16),
)
def test_property_int4_roundtrip(n, half_block, spread, seed):
    block = 2 * half_block
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * spread
    p, s = on("triton", kernels.quantize_int4, x, block)
    p_ref, s_ref = quantize_int4_ref(x, block)
    assert torch.equal(p, p_ref) and torch.equal(s, s_ref)
    nib = torch.stack((p & 15, p >> 4), dim=1).view(-1)
    assert bool((nib[:n] >= 1).all()) and (n % 2 == 0 or nib[n] == 0)
    out, out_ref = torch.empty(n), torch.empty(n)
    on("triton", kernels.dequantize_int4, p, s, block, out)
    on("torch", kernels.dequantize_int4, p, s, block, out_ref)
    assert torch.equal(out, out_ref)
    q = nib[:n].float() - 8
    step = s.repeat_interleave(block)[:n]
    assert torch.equal(out, q * step)  # one replica: exactly q * scale
    assert bool(((out - x).abs() <= step * 0.5001 + 1e-30).all())  # within half a step (+ fp32 slack)


# ----------------------------------------------------------------------------- top-k + error feedback


def test_index_dtype_and_numel():
    dt = kernels.topk_index_dtype
    assert (dt(1), dt(256), dt(257), dt(MAX_CHUNK), dt(32768), dt(32769)) == (
        torch.uint8,
        torch.uint8,
        torch.int16,
        torch.int16,
        torch.int16,
        torch.int32,
    )
    nm = kernels.topk_numel
    assert (nm(0, 4, 2), nm(10, 4, 2), nm(10, 4, 3), nm(12, 4, 3), nm(3, 64, 10)) == (0, 6, 8, 9, 3)


def test_empty_inputs():
    for b in ("torch", "triton"):
        backend.set_backend(b)
        e = torch.empty(0)
        for idx, vals in (kernels.topk_select(e, 4, 2), kernels.topk_error_feedback(e, torch.empty(0), 4, 2)):
            assert idx.shape == vals.shape == (0,) and idx.dtype == torch.uint8
        p, s = kernels.quantize_int4(e, 4)
        assert p.shape == s.shape == (0,)
        kernels.dequantize_int4_mean(torch.empty(2, 0, dtype=torch.uint8), torch.empty(2, 0), 4, e)
        kernels.scatter_add_chunks(torch.empty(0, dtype=torch.uint8), torch.empty(0), 4, 2, e)


def _topk_input(n: int, seed: int, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(n, generator=g)
    err = torch.randn(n, generator=g) * 0.1
    if ties:
        # many equal magnitudes of both signs (err 0 keeps them exact), an all-zero stretch, -0.0 and 0.0
        r = torch.randint(-3, 4, (n,), generator=g).float()
        sel = torch.rand(n, generator=g) < 0.5
        delta = torch.where(sel, r, delta)
        err = torch.where(sel, 0.0, err)
        z = slice(n // 3, n // 3 + min(40, n // 4))
        delta[z], err[z] = 0.0, 0.0
        if n >= 2:
            delta[n // 3], delta[n - 1], err[n - 1] = -0.0, -0.0, -0.0
    return delta, err


TOPK_CASES = [  # (n, chunk, k)
    (1, 1, 1),
    (10, 4, 2),  # last chunk of 2 == k
    (10, 4, 3),  # last chunk of 2 < k: k_last = 2
    (50, 64, 60),  # one short chunk, k > n
    (600, 300, 300),  # k == chunk: everything selected
    (1000, 256, 3),  # uint8 idx
    (1000, 257, 5),  # int16 idx
    (2000, 1024, 10),
    (9000, MAX_CHUNK, 81),
]


@pytest.mark.parametrize("n,chunk,k", TOPK_CASES)
def test_topk_error_feedback(n, chunk, k):
    delta, err = _topk_input(n, seed=n + chunk + k)
    ((i_ref, v_ref), (_, e_ref)), ((i_tri, v_tri), (_, e_tri)) = both(kernels.topk_error_feedback, delta, err, chunk, k)
    total = kernels.topk_numel(n, chunk, k)
    assert i_ref.dtype == kernels.topk_index_dtype(chunk) and i_ref.shape == v_ref.shape == (total,)
    assert torch.equal(i_tri, i_ref) and torch.equal(v_tri, v_ref) and torch.equal(e_tri, e_ref)
    # signed zeros too: compare bits
    assert torch.equal(v_tri.view(torch.int32), v_ref.view(torch.int32))
    assert torch.equal(e_tri.view(torch.int32), e_ref.view(torch.int32))


@pytest.mark.parametrize("n,chunk,k", TOPK_CASES)
def test_topk_select(n, chunk, k):
    acc, _ = _topk_input(n, seed=n * 7 + k)
    (r_ref, a_ref), (r_tri, a_tri) = both(kernels.topk_select, acc, chunk, k)
    assert torch.equal(a_ref[0], acc) and torch.equal(a_tri[0], acc)  # acc untouched
    assert torch.equal(r_tri[0], r_ref[0]) and torch.equal(r_tri[1], r_ref[1])


@pytest.mark.parametrize("n,chunk,k", [(10, 4, 3), (97, 16, 5), (300, 256, 7), (300, 257, 9), (40, 8, 8)])
def test_topk_ref_vs_naive(n, chunk, k):
    delta, err = _topk_input(n, seed=11)
    acc = delta + err
    idx, vals = topk_select_ref(acc, chunk, k)
    n_idx, n_vals = naive_topk(acc, chunk, k)
    assert idx.tolist() == n_idx and vals.tolist() == n_vals
    e = err.clone()
    idx2, vals2 = topk_error_feedback_ref(delta, e, chunk, k)
    assert torch.equal(idx2, idx) and torch.equal(vals2, vals)
    expect = acc.clone()
    for j, i in enumerate(n_idx):
        expect[(j // k) * chunk + i] = 0.0
    assert torch.equal(e, expect)


def test_topk_tie_rule():
    acc = torch.tensor([1.0, -2.0, 2.0, -0.0, 2.0, 0.0, 0.0, -1.0, 3.0])
    for b in ("torch", "triton"):
        idx, vals = on(b, kernels.topk_select, acc, 4, 2)
        # chunks [1, -2, 2, -0] -> |2| twice: 1, 2; [2, 0, 0, -1] -> 0, 3; [3] -> 0
        assert idx.tolist() == [1, 2, 0, 3, 0] and vals.tolist() == [-2.0, 2.0, 2.0, -1.0, 3.0]
        idx, _ = on(b, kernels.topk_select, torch.zeros(6), 6, 4)  # all zero: lowest indices
        assert idx.tolist() == [0, 1, 2, 3]


@settings(max_examples=12, deadline=None)
@given(
    n_chunks=st.integers(1, 5),
    chunk=st.integers(1, 600),
    last=st.floats(0.0, 1.0),
    kfrac=st.floats(0.0, 1.0),
    scale=st.sampled_from([1.0, 0.25, -3.0]),
    seed=st.integers(0, 2**16),
)
def test_property_topk_ef_roundtrip(n_chunks, chunk, last, kfrac, scale, seed):
    # few chunks: the interpreter runs one program per chunk, slowly
    n = (n_chunks - 1) * chunk + max(1, round(last * chunk))
    k = max(1, min(chunk, round(kfrac * chunk)))
    delta, err = _topk_input(n, seed, ties=seed % 2 == 0)
    acc = delta + err
    ((i_ref, v_ref), (_, e_ref)), ((i_tri, v_tri), (_, e_tri)) = both(kernels.topk_error_feedback, delta, err, chunk, k)
    assert torch.equal(i_tri, i_ref) and torch.equal(v_tri, v_ref) and torch.equal(e_tri, e_ref)
    # decode: scatter(vals) + err_new == delta + err exactly, on both backends
    for b in ("torch", "triton"):
        out = e_ref.clone()
        on(b, kernels.scatter_add_chunks, i_ref, v_ref, chunk, k, out)
        assert torch.equal(out, acc)
    # a scaled decode agrees bit for bit too
    outs = {b: torch.randn(n, generator=torch.Generator().manual_seed(seed)) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.scatter_add_chunks, i_ref, v_ref, chunk, k, o, scale)
    assert torch.equal(outs["torch"], outs["triton"])


def test_scatter_add_mean_of_replicas():
    n, chunk, k, M = 700, 128, 9, 3
    payloads = [kernels.topk_select(_topk_input(n, seed=m, ties=False)[0], chunk, k) for m in range(M)]
    outs = {b: torch.zeros(n) for b in ("torch", "triton")}
    for b, o in outs.items():
        for idx, vals in payloads:  # m = 0..M-1 in order, then / M
            on(b, kernels.scatter_add_chunks, idx, vals, chunk, k, o)
        o.div_(M)
    expect = np.zeros(n, np.float32)
    for idx, vals in payloads:
        for j, (i, v) in enumerate(zip(idx.tolist(), vals.tolist())):
            expect[(j // k) * chunk + i] += np.float32(v)
    assert torch.equal(outs["torch"], outs["triton"])
    assert torch.equal(outs["torch"], torch.from_numpy(expect / np.float32(M)))


# ----------------------------------------------------------------------------- validation, custom ops


def test_validation_errors():
    x = torch.zeros(8)
    for bad in (0, 1, 3, MAX_BLOCK + 2, 2.0, True):
        with pytest.raises(ValueError, match="block must be an even int"):
            kernels.quantize_int4(x, bad)
    with pytest.raises(ValueError, match="x has dtype"):
        kernels.quantize_int4(x.double(), 4)
    p = torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block must be an even int"):
        kernels.dequantize_int4_mean(p, torch.zeros(2, 2), 5, torch.zeros(8))
    with pytest.raises(ValueError, match=r"packed must be \[M >= 1, ceil\(n/2\) = 5\]"):
        kernels.dequantize_int4_mean(p, torch.zeros(2, 3), 4, torch.zeros(9))
    with pytest.raises(ValueError, match="packed has dtype"):
        kernels.dequantize_int4_mean(p.to(torch.int8), torch.zeros(2, 2), 4, x)
    with pytest.raises(ValueError, match=r"scales has shape \(2, 1\), expected \(2, 2\)"):
        kernels.dequantize_int4_mean(p, torch.zeros(2, 1), 4, x)
    with pytest.raises(ValueError, match="packed must be a 1-D"):
        kernels.dequantize_int4(p, torch.zeros(2), 4, x)
    for chunk in (0, MAX_CHUNK + 1, 4.0):
        with pytest.raises(ValueError, match="chunk must be an int"):
            kernels.topk_select(x, chunk, 1)
    for k in (0, 5, None):
        with pytest.raises(ValueError, match=r"k must be an int in \[1, chunk = 4\]"):
            kernels.topk_error_feedback(x, torch.zeros(8), 4, k)
    with pytest.raises(ValueError, match="err has shape"):
        kernels.topk_error_feedback(x, torch.zeros(9), 4, 2)
    with pytest.raises(ValueError, match="acc has dtype"):
        kernels.topk_select(x.bfloat16(), 4, 2)
    with pytest.raises(ValueError, match="idx has dtype"):
        kernels.scatter_add_chunks(torch.zeros(4, dtype=torch.int16), torch.zeros(4), 4, 2, x)
    with pytest.raises(ValueError, match=r"vals has shape \(5,\), expected \(4,\)"):
        kernels.scatter_add_chunks(torch.zeros(4, dtype=torch.uint8), torch.zeros(5), 4, 2, x)


OP_ARGS = {
    "quantize_int4": lambda: (torch.randn(15), 4),
    "dequantize_int4_mean": lambda: (
        torch.randint(0, 256, (3, 8), dtype=torch.uint8),
        torch.rand(3, 4),
        4,
        torch.empty(15),
    ),
    "topk_select": lambda: (torch.randn(21), 8, 3),
    "topk_error_feedback": lambda: (torch.randn(21), torch.randn(21), 8, 3),
    "scatter_add_chunks": lambda: (
        torch.tensor([0, 5, 1, 0], dtype=torch.uint8),  # chunks of 8 and 2
        torch.randn(4),
        8,
        2,
        torch.randn(10),
        0.5,
    ),
}


@pytest.mark.parametrize("name", list(OP_ARGS))
def test_custom_op_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.hsdp_kernels, name).default, OP_ARGS[name]())


def test_compile_sees_one_op_per_call():
    nodes = []

    def capture(gm, example_inputs):
        nodes.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def step(delta, err, out):
        idx, vals = kernels.topk_error_feedback(delta, err, 8, 2)
        kernels.scatter_add_chunks(idx, vals, 8, 2, out)
        p, s = kernels.quantize_int4(vals, 2)
        return p.sum() + s.sum()

    torch._dynamo.reset()
    delta, err, out = torch.randn(20), torch.zeros(20), torch.zeros(20)
    torch.compile(step, backend=capture, fullgraph=True)(delta, err, out)
    ops = [n for n in nodes if n.startswith("hsdp_kernels.")]
    assert ops == [f"hsdp_kernels.{o}.default" for o in ("topk_error_feedback", "scatter_add_chunks", "quantize_int4")]
    assert torch.equal(out + err, delta)


def test_kernels_launch_without_fma(monkeypatch):
    from kernels import _util, topk

    seen = {}
    for mod in (_util, topk):  # quant4's kernels launch through kernels/_util.py's packed-codec helpers
        real = mod.launch

        def spy(kernel, grid, *args, _real=real, **meta):
            seen[kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)] = meta.get("enable_fp_fusion", True)
            return _real(kernel, grid, *args, **meta)

        monkeypatch.setattr(mod, "launch", spy)
    backend.set_backend("triton")
    for name, make in OP_ARGS.items():
        getattr(kernels, name)(*make())
    assert seen == dict.fromkeys(
        ("_quantize4_kernel", "_dequantize4_mean_kernel", "_topk_kernel", "_scatter_add_kernel"), False
    )


# ----------------------------------------------------------------------------- GPU code generation (no GPU needed)

_F32X4 = {"num_warps": 4, "enable_fp_fusion": False}
_Q4_SIG = {
    "x_ptr": "*fp32",
    "p_ptr": "*u8",
    "scale_ptr": "*fp32",
    "n": "i32",
    "nbytes": "i32",
    "block": "i32",
    "half": "i32",
}
_DQ4_SIG = {
    "p_ptr": "*u8",
    "scale_ptr": "*fp32",
    "out_ptr": "*fp32",
    "n": "i32",
    "nbytes": "i32",
    "nb": "i32",
    "block": "i32",
    "half": "i32",
    "M": "i32",
    "inv_m": "fp32",
    "M_f": "fp32",
}
GPU_CASES = {  # name -> (module, kernel, signature, constexprs, options), as the dispatchers launch them
    "quantize4": ("kernels.quant4", "_quantize4_kernel", _Q4_SIG, {"ROWS": 8, "BP": 256, "DENSE": True}, _F32X4),
    "quantize4_odd_block": (
        "kernels.quant4",
        "_quantize4_kernel",
        _Q4_SIG,
        {"ROWS": 2, "BP": 1024, "DENSE": False},
        _F32X4,
    ),
    "quantize4_max_block": (
        "kernels.quant4",
        "_quantize4_kernel",
        _Q4_SIG,
        {"ROWS": 1, "BP": MAX_BLOCK, "DENSE": True},
        _F32X4,
    ),
    "dequantize4": (
        "kernels.quant4",
        "_dequantize4_mean_kernel",
        _DQ4_SIG,
        {"EXACT_INV": False, "ROWS": 16, "BP": 128},
        _F32X4,
    ),
    "dequantize4_pow2_m": (  # M a power of two: a multiplication by 1/M, no division
        "kernels.quant4",
        "_dequantize4_mean_kernel",
        _DQ4_SIG,
        {"EXACT_INV": True, "ROWS": 16, "BP": 128},
        _F32X4,
    ),
    **{
        f"topk_{cp}_{ty}_arity{arity}": (
            "kernels.topk",
            "_topk_kernel",
            {
                "delta_ptr": "*fp32",
                "err_ptr": "*fp32",
                "idx_ptr": f"*{ty}",
                "val_ptr": "*fp32",
                "n": "i32",
                "chunk": "i32",
                "k": "i32",
            },
            {
                "HAS_ERR": True,
                "ROWS": max(1, 1024 // cp),
                "CP": cp,
                "ARITY": arity,
            },
            {"num_warps": max(1, cp // 1024), "enable_fp_fusion": False},
        )
        for cp, ty, arity in ((256, "u8", 2), (1024, "i16", 2), (1024, "i16", 4), (MAX_CHUNK, "i16", 2))
    },
    "scatter_add": (
        "kernels.topk",
        "_scatter_add_kernel",
        {
            "idx_ptr": "*i16",
            "val_ptr": "*fp32",
            "out_ptr": "*fp32",
            "total": "i32",
            "n": "i32",
            "chunk": "i32",
            "k": "i32",
            "scale": "fp32",
        },
        {"BLOCK": 2048},
        {"num_warps": 4, "enable_fp_fusion": False},
    ),
}


@pytest.fixture(scope="module")
def sm90_facts():
    return sm90_facts_of(GPU_CASES)


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_kernels_compile_for_cuda(sm90_facts, case):
    # division only where the arithmetic divides: int4's scale and q (quantize), a mean over M = 3 (dequantize)
    assert_exact_codegen(sm90_facts[case], div_rn=case.startswith("quantize4") or case == "dequantize4")


@pytest.mark.parametrize("M", [1, 2, 3, 4, 6])
def test_mean_multiplies_only_for_a_power_of_two(monkeypatch, M):
    """dequantize_int4_mean multiplies by 1/M (EXACT_INV) only where that is the correctly rounded x / M."""
    from kernels import _util

    seen = []
    real = _util.launch
    monkeypatch.setattr(
        _util, "launch", lambda kernel, grid, *a, **meta: seen.append(meta) or real(kernel, grid, *a, **meta)
    )
    p, s = torch.randint(0, 256, (M, 4), dtype=torch.uint8), torch.rand(M, 2)
    outs = {b: torch.empty(8) for b in ("torch", "triton")}
    for b, o in outs.items():
        on(b, kernels.dequantize_int4_mean, p, s, 4, o)
    assert torch.equal(outs["torch"], outs["triton"])
    assert [m["EXACT_INV"] for m in seen] == [M in (1, 2, 4)]


def test_quantize_int4_near_half_steps():
    """Values at, and a few ulps or 2**-17 to 2**-15 from, the half-steps (scale 1: absmax 7 in every block):
    the kernel's multiply-by-1/scale path must give up to the dividing one exactly where it could round
    differently, and agree with the reference everywhere."""
    half = torch.arange(-7, 8, dtype=torch.float32) + 0.5
    eps = torch.tensor([0.0, 2.0**-22, 2.0**-20, 2.0**-17, 2.0**-16, 2.0**-15])
    vals = torch.cat([half[:, None] + eps, half[:, None] - eps], dim=1).reshape(-1).clamp(-7, 7)
    x = vals.repeat(4)[:1024].clone()
    x[::256] = 7.0  # each block's absmax: scale = 7 / 7 = 1
    x2 = torch.randn(1024) * 0.01
    x2[:256] = x[:256]  # one block of near-ties among random blocks: only its tile takes the dividing path
    for data in (x, x2, x * 3.0**-20, x * 1e-39):  # scaled: scale 3**-20 (inexact), subnormal
        p_ref, s_ref = on("torch", kernels.quantize_int4, data, 256)
        p_tri, s_tri = on("triton", kernels.quantize_int4, data, 256)
        assert torch.equal(p_tri, p_ref) and torch.equal(s_tri, s_ref)


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_quantize_int4_whole_tiles_and_alignment(offset):
    """Whole tiles of a power-of-two block read as int64 value pairs (x 8-byte aligned), else value by value (a
    view 4 bytes in); both, and the partial last tile, as the reference."""
    base = _quant_input(3 * 4096 + 2 + 300, 64, seed=offset)
    x = base[offset : offset + 3 * 4096 + 300]  # a contiguous view: 8-byte aligned for offsets 0 and 2
    for block in (64, 256, 96):
        p_ref, s_ref = on("torch", kernels.quantize_int4, x, block)
        p_tri, s_tri = on("triton", kernels.quantize_int4, x, block)
        assert torch.equal(p_tri, p_ref) and torch.equal(s_tri, s_ref), block
