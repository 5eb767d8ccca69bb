"""The SparseLoCo codec's kernels (kernels/quant2.py: int2 values; kernels/bitpack.py: packed indices): Triton
(interpreter on CPU) vs torch reference bit for bit, the references vs plain python loops written from
docs/design.md §8.5, input validation, and sm_90 code generation without FMA. Sizes are small: the
interpreter is slow.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.bitpack import index_bits, pack_bits, pack_bits_ref, packed_nbytes, unpack_bits  # noqa: E402
from kernels.quant2 import dequantize_int2, dequantize_int2_mean, quantize_int2, quantize_int2_ref  # noqa: E402
from kernels.sparse_decode import decode_topk_int2_add  # noqa: E402
from kernels.topk import scatter_add_chunks, topk_numel, topk_select  # noqa: E402
from tests.test_kernel_harness import _restore_backend, assert_exact_codegen, on, sm90_facts_of  # noqa: E402, F401


def _values(n: int, seed: int) -> torch.Tensor:
    """Random values with exact ties: repeats, negations, ±0 and a block of one magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[3::7] = -x[1::7][: x[3::7].numel()]
    x[5::11], x[6::13] = 0.0, -0.0
    x[: min(n, 8)] = 0.25 * torch.tensor([1, -1, 1, 1, -1, 1, -1, -1])[: min(n, 8)]
    return x


# ----------------------------------------------------------------------------- int2


def naive_int2(x: torch.Tensor, block: int) -> tuple[list[int], list[float]]:
    """(codes, table) by python loops over fp32 numbers (each operation rounded to fp32 as the design says)."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    xs = [float(v) for v in x]
    codes, table = [], []
    for s in range(0, len(xs), block):
        blk = xs[s : s + block]
        mags = [abs(v) for v in blk]
        lo, hi = min(mags), max(mags)
        d = f32(f32(hi - lo) * 0.5)
        t = f32(lo + d)
        table += [f32(lo + f32(d * 0.5)), f32(lo + f32(d * 1.5))]
        codes += [(1 if abs(v) >= t else 0) | (2 if v < 0 else 0) for v in blk]
    return codes, table


def _codes(packed: torch.Tensor, n: int) -> list[int]:
    return [(int(packed[i // 4]) >> (2 * (i % 4))) & 3 for i in range(n)]


@pytest.mark.parametrize(("n", "block"), [(1, 4), (7, 4), (67, 8), (301, 64), (1000, 1000)])
def test_quantize_int2_kernel_equals_reference_equals_loops(n: int, block: int):
    x = _values(n, n + block)
    p_ref, t_ref = on("torch", quantize_int2, x, block)
    p_tri, t_tri = on("triton", quantize_int2, x, block)
    assert torch.equal(p_ref, p_tri) and torch.equal(t_ref, t_tri)
    codes, table = naive_int2(x, block)
    assert _codes(p_ref, n) == codes and t_ref.tolist() == table
    assert p_ref.numel() == -(-n // 4) and t_ref.numel() == 2 * -(-n // block)
    if n % 4:  # the last byte's unused high bits are zero
        assert int(p_ref[-1]) >> (2 * (n % 4)) == 0


def test_int2_levels_by_hand():
    x = torch.tensor([1.0, -2.0, 3.0, -5.0, 4.0, 4.0, -4.0, 4.0])
    packed, table = quantize_int2_ref(x, 4)
    assert table.tolist() == [2.0, 4.0, 4.0, 4.0]  # lo 1, hi 5: d 2, t 3; then one magnitude: d 0
    assert _codes(packed, 8) == [0, 2, 1, 3, 1, 1, 3, 1]  # |3| = t takes level1
    out = torch.empty(8)
    dequantize_int2(packed, table, 4, out)
    assert out.tolist() == [2.0, -2.0, 4.0, -4.0, 4.0, 4.0, -4.0, 4.0]


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize(("n", "block"), [(5, 4), (301, 64)])
def test_dequantize_int2_mean(M: int, n: int, block: int):
    parts = [quantize_int2_ref(_values(n, 10 * m + n), block) for m in range(M)]
    packed = torch.stack([p for p, _ in parts])
    table = torch.stack([t for _, t in parts])
    outs = {}
    for b in ("torch", "triton"):
        outs[b] = torch.empty(n)
        on(b, dequantize_int2_mean, packed, table, block, outs[b])
    assert torch.equal(outs["torch"], outs["triton"])
    want = torch.zeros(n)
    for p, t in parts:  # each replica decoded by lookup, summed in order, ÷ M
        codes = _codes(p, n)
        want += torch.tensor([(-1 if c & 2 else 1) * float(t[2 * (i // block) + (c & 1)]) for i, c in enumerate(codes)])
    assert torch.equal(outs["torch"], want / M)


# ----------------------------------------------------------------------------- packed indices


def naive_pack(v: list[int], bits: int) -> list[int]:
    stream = [(x >> b) & 1 for x in v for b in range(bits)]
    stream += [0] * (-len(stream) % 8)
    return [sum(stream[8 * i + j] << j for j in range(8)) for i in range(len(stream) // 8)]


@pytest.mark.parametrize("bits", [0, 1, 3, 7, 8, 12, 13, 16])
@pytest.mark.parametrize("count", [0, 1, 5, 67])
def test_pack_unpack_kernel_equals_reference_equals_loops(bits: int, count: int):
    g = torch.Generator().manual_seed(bits * 100 + count)
    v = torch.randint(0, 1 << bits, (count,), generator=g, dtype=torch.int32)
    if count:
        v[0] = (1 << bits) - 1  # all ones: every bit of an entry lands
    ref = on("torch", pack_bits, v, bits)
    tri = on("triton", pack_bits, v, bits)
    assert torch.equal(ref, tri) and ref.numel() == packed_nbytes(count, bits)
    assert ref.tolist() == naive_pack(v.tolist(), bits)
    for dtype in (torch.int32, torch.int16 if bits < 16 else torch.int32, torch.uint8 if bits <= 8 else torch.int32):
        for b in ("torch", "triton"):
            out = torch.full((count,), 99, dtype=dtype)
            on(b, unpack_bits, ref, bits, out)
            assert out.tolist() == v.tolist(), (b, dtype)


# ----------------------------------------------------------------------------- fused decode


@pytest.mark.parametrize(("n", "chunk", "k", "block"), [(37, 8, 3, 4), (300, 64, 5, 8), (1000, 256, 9, 12)])
def test_fused_decode_equals_the_three_kernels(n: int, chunk: int, k: int, block: int):
    """decode_topk_int2_add (Triton and reference) == unpack_bits + dequantize_int2 + scatter_add_chunks, for
    two replicas in order, with the senders count; short last chunks (37 % 8, 300 % 64, 1000 % 256)."""
    bits = index_bits(chunk)
    base = _values(n, 1)
    want, want_s = base.clone(), torch.zeros(n)
    got = {b: (base.clone(), torch.zeros(n)) for b in ("torch", "triton")}
    for m in range(2):
        idx, vals = topk_select(_values(n, 7 + m), chunk, k)
        packed_vals, table = quantize_int2_ref(vals, block)
        packed_idx = pack_bits_ref(idx, bits)
        for b, (out, senders) in got.items():
            on(b, decode_topk_int2_add, packed_idx, packed_vals, table, bits, chunk, k, block, out, senders)
        back, dec = torch.empty_like(idx), torch.empty(vals.numel())
        unpack_bits(packed_idx, bits, back)
        dequantize_int2(packed_vals, table, block, dec)
        scatter_add_chunks(back, dec, chunk, k, want)
        scatter_add_chunks(back, torch.ones_like(dec), chunk, k, want_s)
    assert vals.numel() == topk_numel(n, chunk, k)
    for b, (out, senders) in got.items():
        assert torch.equal(out, want) and torch.equal(senders, want_s), b
    assert int(want_s.max()) == 2  # some position was sent by both


def test_index_bits():
    assert [index_bits(c) for c in (1, 2, 3, 256, 257, 1024, 4096, 8192)] == [0, 1, 2, 8, 9, 10, 12, 13]
    assert packed_nbytes(128, 12) == 192 and packed_nbytes(431, 7) == 378


def test_validation_errors():
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_int2(torch.zeros(8), 6)
    with pytest.raises(ValueError, match="bits must be"):
        pack_bits(torch.zeros(4, dtype=torch.int32), 17)
    with pytest.raises(ValueError, match="dtype"):
        pack_bits(torch.zeros(4), 4)
    with pytest.raises(ValueError, match="packed has shape"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 12, torch.empty(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed must be"):
        dequantize_int2_mean(torch.zeros(1, 3, dtype=torch.uint8), torch.zeros(1, 2), 4, torch.empty(4))
    assert pack_bits_ref(torch.tensor([5, 0], dtype=torch.int32), 3).tolist() == [5]


def test_custom_ops_registered():
    for name in ("quantize_int2", "dequantize_int2_mean", "pack_bits", "unpack_bits", "decode_topk_int2_add"):
        assert hasattr(torch.ops.hsdp_kernels, name)


# ----------------------------------------------------------------------------- GPU code generation (no GPU needed)

_F32X4 = {"num_warps": 4, "enable_fp_fusion": False}
GPU_CASES = {
    "quantize2": (
        "kernels.quant2",
        "_quantize2_kernel",
        {
            "x_ptr": "*fp32",
            "p_ptr": "*u8",
            "table_ptr": "*fp32",
            "n": "i32",
            "nbytes": "i32",
            "block": "i32",
            "quarter": "i32",
        },
        {"ROWS": 32, "BP": 64, "DENSE": True},
        _F32X4,
    ),
    **{
        f"dequantize2{'_pow2_m' if exact else ''}": (
            "kernels.quant2",
            "_dequantize2_mean_kernel",
            {
                "p_ptr": "*u8",
                "table_ptr": "*fp32",
                "out_ptr": "*fp32",
                "n": "i32",
                "nbytes": "i32",
                "nt": "i32",
                "block": "i32",
                "quarter": "i32",
                "M": "i32",
                "inv_m": "fp32",
                "M_f": "fp32",
            },
            {"EXACT_INV": exact, "ROWS": 32, "BP": 16},
            _F32X4,
        )
        for exact in (False, True)
    },
    "pack12": (
        "kernels.bitpack",
        "_pack_kernel",
        {"v_ptr": "*i16", "p_ptr": "*u8", "count": "i32", "nbytes": "i32"},
        {"BITS": 12, "SPAN": 2, "BLOCK": 1024},
        {"num_warps": 4},
    ),
    "decode_add12": (
        "kernels.sparse_decode",
        "_decode_add_kernel",
        {
            "pi_ptr": "*u8",
            "pv_ptr": "*u8",
            "table_ptr": "*fp32",
            "out_ptr": "*fp32",
            "senders_ptr": "*fp32",
            "total": "i32",
            "n": "i32",
            "nbytes_idx": "i32",
            "chunk": "i32",
            "k": "i32",
            "block": "i32",
        },
        {"BITS": 12, "HAS_SENDERS": True, "BLOCK": 1024},
        {"num_warps": 4, "enable_fp_fusion": False},
    ),
    "unpack12": (
        "kernels.bitpack",
        "_unpack_kernel",
        {"p_ptr": "*u8", "out_ptr": "*i16", "count": "i32", "nbytes": "i32"},
        {"BITS": 12, "BLOCK": 1024},
        {"num_warps": 4},
    ),
}


@pytest.fixture(scope="module")
def sm90_facts():
    return sm90_facts_of(GPU_CASES)


@pytest.mark.parametrize("case", list(GPU_CASES))
def test_kernels_compile_for_cuda(sm90_facts, case):
    assert_exact_codegen(sm90_facts[case], div_rn=case == "dequantize2")  # a mean over M = 3 divides
