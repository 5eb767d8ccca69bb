"""Every Triton kernel compiled for real on a CUDA GPU against its torch reference (skipped without CUDA).

Two comparisons per kernel, on the same inputs (generated on the CPU from one seed, then copied):

* vs the reference run on the CPU: bit for bit, every kernel. This is the kernels' exactness contract
  (each output element is one fixed sequence of fp32 operations, each correctly rounded: FMA contraction
  off, tl.div_rn for division, RNE casts by hand in kernels/_triton_helpers.py, integer work for codes,
  bit packing and top-k), which the CPU suite checks in the Triton interpreter; here it is the code
  ptxas really produced.
* vs the same reference run on the GPU (what `kernels.backend=torch` computes there): bit for bit, except
  where the reference divides a CUDA tensor by a Python number. torch computes that as a multiplication
  by the rounded reciprocal (aten's div_true_kernel_cuda for a CPU scalar divisor), not a correctly
  rounded division: fl(x·fl(1/d)) is within (2u + u²)|x/d| of x/d and the kernel's fl(x/d) within u
  (u = 2^-24), so the two differ by at most (3u + u²)|x/d| < 2^-22·|result|. That bounds the int8/int4
  scales (absmax / qmax) and the means of M = 3 replicas (sum / M; M a power of two is exact). A scale
  that far off moves y = x/scale by at most ~4u·qmax + 2u·qmax (the two divisions' own roundings), so a
  quantized code can differ by one step, and only where y lies that close to a rounding boundary: a
  fraction ~2·6u·qmax ≈ 1e-4 of the values for int8 (qmax 127), ~5e-6 for int4; the bound allows 1e-3.

Fast: ~1M elements per kernel (tails included), about a second of GPU work plus Triton's compiles.

    TRITON_INTERPRET=0 python -m pytest -q tests/test_cuda_parity.py

tests/conftest.py sets TRITON_INTERPRET=1 when it is unset (the CPU suite runs the interpreter); where the
kernels were defined for the interpreter, the measurements run in a child process without it. With
$HSDP_PARITY_JSON set, the table of measurements is written there (scripts/gpu_check.sh reads it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import registry

REPO = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

U = 2.0**-24  # fp32's unit roundoff
SCALAR_DIV_REL = 2.0**-22  # > (3u + u²): torch's x·fl(1/d) on CUDA vs the kernel's correctly rounded x/d
CODE_FRACTION = 1e-3  # quantized codes allowed one step apart (of the values), vs the CUDA reference
N = 1_000_003  # elements per kernel: odd, so every kernel has a partial last block/chunk/byte
M = 3  # replicas of the dequantize means: not a power of two, so the mean divides
S = 8  # shards


# --------------------------------------------------------------------------- outputs and how they compare


@dataclass(frozen=True)
class Out:
    """One output of a kernel and its bound vs the reference on the GPU (vs the CPU one: always bitwise).

    kind: "exact"  bit for bit on the GPU too;
          "rel"    floats, |a − b| ≤ SCALAR_DIV_REL·|b| (a division by a Python number in the reference);
          "codes"  integer codes, |a − b| ≤ 1 in at most CODE_FRACTION of them (an int8 quantization);
          "int4"   packed int4 nibbles, compared as codes (two a byte)."""

    name: str
    kind: str = "exact"


@dataclass(frozen=True)
class Case:
    make: Callable[[torch.Generator], dict[str, Any]]  # the inputs, on the CPU
    run: Callable[[dict[str, Any]], tuple[torch.Tensor, ...]]  # the kernel call: its outputs
    outs: tuple[Out, ...]


def _randn(g: torch.Generator, n: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=g) * scale


def _then(_: object, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The outputs of a kernel that writes into its arguments (its own return value, None, dropped)."""
    return outs


SHAPES = [(1024, 1024)] * 4 + [(2816, 1024), (2816, 1024), (1024, 2816), (1024,), (1024,)]  # a small block
SIZES = [-(-s[0] // S) * (s[1] if len(s) > 1 else 1) for s in SHAPES]  # each param's dim-0 shard
TOPK = (1024, 10)  # chunk, k of the top-k error feedback
SPARSE = (4096, 64, 64, 12)  # SparseLoCo: chunk, k, int2 block, index bits


def _cases() -> dict[str, Case]:
    """kernel name -> its case, for every kernel of kernels/registry.py in its order (CASE_NAMES)."""
    import kernels
    from kernels.bitpack import pack_bits, unpack_bits
    from kernels.pack import cast_shard
    from kernels.quant2 import dequantize_int2_mean, quantize_int2
    from kernels.reduce import scale_grad, scaled_grad_shard
    from kernels.sparse_decode import decode_topk_int2_add

    chunk2, k2, block2, bits = SPARSE
    n_sel = kernels.topk_numel(N, chunk2, k2)  # SparseLoCo's selected values of N

    def grads(g: torch.Generator) -> list[torch.Tensor]:
        return [torch.randn(*s, generator=g).to(torch.bfloat16) for s in SHAPES]

    def payload(g: torch.Generator) -> dict[str, Any]:
        """One replica's valid SparseLoCo payload of N: k distinct positions per chunk, ascending."""
        pos = torch.stack([torch.randperm(chunk2, generator=g)[:k2].sort().values for _ in range(-(-N // chunk2))])
        last = N - (-(-N // chunk2) - 1) * chunk2
        assert last >= k2
        pos[-1] = torch.arange(k2) * (last // k2)  # inside the short last chunk
        return {
            "idx": pos.reshape(-1)[:n_sel].to(torch.int16),
            "packed": torch.randint(0, 256, ((n_sel + 3) // 4,), dtype=torch.uint8, generator=g),
            "table": torch.rand(2 * -(-n_sel // block2), generator=g),
            "acc": _randn(g, N),
            "senders": torch.randint(0, M, (N,), generator=g).float(),
        }

    def decode(i: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        packed_idx = pack_bits(i["idx"], bits)  # the same kernel on both sides (checked on its own below)
        decode_topk_int2_add(packed_idx, i["packed"], i["table"], bits, chunk2, k2, block2, i["acc"], i["senders"])
        return i["acc"], i["senders"]

    return {
        "pack": Case(
            lambda g: {"held": _randn(g, N), "out": torch.empty(N, dtype=torch.bfloat16)},
            lambda i: _then(kernels.pack_shards(i["held"], i["out"]), i["out"]),
            (Out("out"),),
        ),
        "unpack": Case(
            lambda g: {"gathered": _randn(g, S * sum(SIZES)).view(S, -1).bfloat16()},
            lambda i: _unpack(kernels.unpack_full, i),
            (Out("out"),),
        ),
        "pack_grads": Case(
            lambda g: {"grads": grads(g), "out": _randn(g, S * sum(SIZES)).view(S, -1)},
            lambda i: _then(kernels.pack_grads(i["grads"], SIZES, i["out"], 1.0 / S, True), i["out"]),
            (Out("out"),),
        ),
        "accumulate": Case(
            lambda g: {"reduced": _randn(g, N).bfloat16(), "shard": _randn(g, N)},
            lambda i: _then(kernels.accumulate_grad_shards(i["reduced"], i["shard"], 1.0 / S), i["shard"]),
            (Out("grad_shard"),),
        ),
        "delta": Case(
            lambda g: {"glob": _randn(g, N), "held": _randn(g, N), "out": torch.empty(N)},
            lambda i: _then(kernels.compute_delta(i["glob"], i["held"], i["out"]), i["out"]),
            (Out("out"),),
        ),
        "outer": Case(
            lambda g: {"held": _randn(g, N), "glob": _randn(g, N), "mom": _randn(g, N), "delta": _randn(g, N, 1e-3)},
            lambda i: _then(
                kernels.outer_step(i["held"], i["glob"], i["mom"], i["delta"], 0.7, 0.9, True, False),
                i["held"],
                i["glob"],
                i["mom"],
            ),
            (Out("held"), Out("global"), Out("momentum")),
        ),
        "quantize": Case(
            lambda g: {"x": _randn(g, N, 1e-2)},
            lambda i: kernels.quantize_int8(i["x"], 256),
            (Out("q", "codes"), Out("scales", "rel")),
        ),
        "dequantize": Case(
            lambda g: {
                "q": torch.randint(-127, 128, (M, N), dtype=torch.int8, generator=g),
                "scales": torch.rand(M, -(-N // 256), generator=g) * 1e-3,
                "out": torch.empty(N),
            },
            lambda i: _then(kernels.dequantize_mean(i["q"], i["scales"], 256, i["out"]), i["out"]),
            (Out("out", "rel"),),
        ),
        "quantize_int4": Case(
            lambda g: {"x": _randn(g, N, 1e-2)},
            lambda i: kernels.quantize_int4(i["x"], 256),
            (Out("packed", "int4"), Out("scales", "rel")),
        ),
        "dequantize_int4": Case(
            lambda g: {
                "packed": torch.randint(0, 256, (M, (N + 1) // 2), dtype=torch.uint8, generator=g),
                "scales": torch.rand(M, -(-N // 256), generator=g) * 1e-3,
                "out": torch.empty(N),
            },
            lambda i: _then(kernels.dequantize_int4_mean(i["packed"], i["scales"], 256, i["out"]), i["out"]),
            (Out("out", "rel"),),
        ),
        "topk_ef": Case(
            lambda g: {"delta": _randn(g, N, 1e-3), "err": _randn(g, N, 1e-3)},
            lambda i: (*kernels.topk_error_feedback(i["delta"], i["err"], *TOPK), i["err"]),
            (Out("idx"), Out("vals"), Out("err")),
        ),
        "topk_select": Case(
            lambda g: {"acc": _randn(g, N)},
            lambda i: kernels.topk_select(i["acc"], chunk2, k2),
            (Out("idx"), Out("vals")),
        ),
        "scatter_add": Case(
            lambda g: {**payload(g), "vals": _randn(g, n_sel)},
            lambda i: _then(kernels.scatter_add_chunks(i["idx"], i["vals"], chunk2, k2, i["acc"], 1.0 / M), i["acc"]),
            (Out("out"),),
        ),
        "quantize_int2": Case(
            lambda g: {"x": _randn(g, n_sel, 1e-3)},
            lambda i: quantize_int2(i["x"], block2),
            (Out("packed"), Out("table")),
        ),
        "dequantize_int2": Case(
            lambda g: {
                "packed": torch.randint(0, 256, (M, (n_sel + 3) // 4), dtype=torch.uint8, generator=g),
                "table": torch.rand(M, 2 * -(-n_sel // block2), generator=g),
                "out": torch.empty(n_sel),
            },
            lambda i: _then(dequantize_int2_mean(i["packed"], i["table"], block2, i["out"]), i["out"]),
            (Out("out", "rel"),),
        ),
        "pack_idx": Case(
            lambda g: {"v": torch.randint(0, chunk2, (n_sel,), dtype=torch.int16, generator=g)},
            lambda i: (pack_bits(i["v"], bits),),
            (Out("packed"),),
        ),
        "unpack_idx": Case(
            lambda g: {
                "packed": torch.randint(0, 256, (-(-n_sel * bits // 8),), dtype=torch.uint8, generator=g),
                "out": torch.empty(n_sel, dtype=torch.int16),
            },
            lambda i: _then(unpack_bits(i["packed"], bits, i["out"]), i["out"]),
            (Out("out"),),
        ),
        "decode_topk_int2": Case(payload, decode, (Out("out"), Out("senders"))),
        "cast_shard": Case(
            lambda g: {"held": _randn(g, N)},
            lambda i: (cast_shard(i["held"], torch.bfloat16),),
            (Out("out"),),
        ),
        "scale_grad": Case(
            lambda g: {"grad": _randn(g, N).bfloat16()},
            lambda i: (scale_grad(i["grad"], torch.float32, 0.25),),
            (Out("out"),),
        ),
        "scaled_grad_shard": Case(
            lambda g: {"reduced": _randn(g, N).bfloat16()},
            lambda i: (scaled_grad_shard(i["reduced"], 1.0 / S),),
            (Out("out"),),
        ),
    }


def _unpack(unpack_full: Callable[..., None], i: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    gathered = i["gathered"]
    out = torch.empty(gathered.numel(), dtype=gathered.dtype, device=gathered.device)
    unpack_full(gathered, SIZES, out)
    return (out,)


# --------------------------------------------------------------------------- measuring


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor as integers of its bit pattern (floats) or itself (ints), on the CPU."""
    t = t.detach().cpu().contiguous()
    views = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.view(views[t.dtype]) if t.dtype in views else t


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / |b| over the elements (0/0 → 0, x/0 → inf), in fp64."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    diff = (a - b).abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / b.abs())
    return float(rel.max()) if rel.numel() else 0.0


def _codes(t: torch.Tensor, kind: str) -> torch.Tensor:
    t = t.detach().cpu()
    if kind == "int4":
        t = torch.stack((t & 15, t >> 4), dim=-1).reshape(-1)  # nibbles, low first
    return t.to(torch.int64)


def compare(a: torch.Tensor, b: torch.Tensor, kind: str) -> dict[str, Any]:
    """a (the kernel's) vs b (a reference's): bitwise equality and the measure `kind`'s bound is on."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    row: dict[str, Any] = {"equal": bool(torch.equal(_bits(a), _bits(b)))}
    if kind in ("codes", "int4"):
        d = (_codes(a, kind) - _codes(b, kind)).abs()
        row["max_code_diff"] = int(d.max()) if d.numel() else 0
        row["code_fraction"] = float((d != 0).double().mean()) if d.numel() else 0.0
    elif a.dtype.is_floating_point:
        row["max_rel"] = _max_rel(a, b)
    return row


def within(row: dict[str, Any], kind: str) -> bool:
    """Whether a vs-the-GPU-reference row is inside `kind`'s bound (see Out)."""
    if row["equal"]:
        return True
    if kind == "rel":
        return row["max_rel"] <= SCALAR_DIV_REL
    if kind in ("codes", "int4"):
        return row["max_code_diff"] <= 1 and row["code_fraction"] <= CODE_FRACTION
    return False


def _on(device: str, backend_name: str, case: Case, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    from kernels import backend

    def moved(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device, copy=True)
        if isinstance(v, list):
            return [moved(x) for x in v]
        return v

    backend.set_backend(backend_name)
    try:
        outs = case.run({k: moved(v) for k, v in inputs.items()})
        if device == "cuda":
            torch.cuda.synchronize()
        return tuple(o.cpu() for o in outs)
    finally:
        backend.set_backend("auto")


def kernels_compiled() -> bool:
    """Whether this process's kernels were defined for the GPU compiler (not the Triton interpreter)."""
    from kernels import backend
    from kernels.pack import _pack_shards_kernel

    if not backend.HAVE_TRITON:
        return False
    import triton

    return isinstance(_pack_shards_kernel, triton.runtime.JITFunction) and not backend.interpreting()


def bound_text(outs: tuple[Out, ...]) -> str:
    words = {"exact": "bitwise", "rel": "rel ≤ 2^-22", "codes": "codes ±1 in ≤ 1e-3", "int4": "codes ±1 in ≤ 1e-3"}
    return ", ".join(f"{o.name}: {words[o.kind]}" for o in outs)


def measure() -> dict[str, Any]:
    """Every case: the kernel on the GPU vs the reference on the CPU and on the GPU (see the module doc)."""
    import triton

    assert kernels_compiled(), "the kernels are defined for the Triton interpreter: unset TRITON_INTERPRET"
    table: dict[str, Any] = {}
    for name, case in _cases().items():
        inputs = case.make(torch.Generator().manual_seed(0))
        got = _on("cuda", "triton", case, inputs)
        refs = {"cpu": _on("cpu", "torch", case, inputs), "cuda": _on("cuda", "torch", case, inputs)}
        rows: dict[str, Any] = {"cpu": [], "cuda": []}
        ok = True
        for j, out in enumerate(case.outs):
            for where, ref in refs.items():
                row = {"output": out.name, **compare(got[j], ref[j], out.kind)}
                rows[where].append(row)
                ok &= row["equal"] if where == "cpu" else within(row, out.kind)
        table[name] = {"elements": int(got[0].numel()), "bound": bound_text(case.outs), **rows, "ok": ok}
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kernels": table,
    }


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    if kernels_compiled():
        result = measure()
    else:  # the kernels of this process run in the interpreter: measure in a fresh one that compiles them
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_cuda_parity"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.environ.get("HSDP_PARITY_JSON"):
        Path(os.environ["HSDP_PARITY_JSON"]).write_text(json.dumps(result, indent=1) + "\n")
    return result


CASE_NAMES = list(registry.names())  # every kernel, a case of _cases() each (tests/test_kernel_registry.py)


@needs_cuda
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_is_bitwise_the_cpu_reference(measured: dict[str, Any], name: str) -> None:
    rows = measured["kernels"][name]["cpu"]
    assert all(r["equal"] for r in rows), rows


@needs_cuda
@pytest.mark.parametrize("name", CASE_NAMES)
def test_kernel_is_within_its_bound_of_the_gpu_reference(measured: dict[str, Any], name: str) -> None:
    kinds = {o.name: o.kind for o in _cases()[name].outs}
    rows = measured["kernels"][name]["cuda"]
    assert all(within(r, kinds[r["output"]]) for r in rows), (measured["kernels"][name]["bound"], rows)


# ------------------------------------------------------------------- on any machine: the cases and the bounds


def test_torch_cuda_scalar_division_is_within_the_rel_bound() -> None:
    """The `rel` bound: x·fl(1/d), as torch divides a CUDA tensor by a Python number, vs the correctly
    rounded x/d, both fp32 (computed here on the CPU, whose fp32 multiply and divide round the same)."""
    x = torch.randn(2**18, generator=torch.Generator().manual_seed(0)) * 1e3
    for d in (3.0, 127.0, 7.0, 5.0):
        recip = torch.tensor(1.0) / d  # fp32, correctly rounded, as the CUDA kernel computes opmath(1) / d
        a, b = x * recip, x / d
        row = compare(a, b, "rel")
        assert not row["equal"]  # it does differ, by ulps
        assert row["max_rel"] <= SCALAR_DIV_REL and within(row, "rel"), (d, row)
        assert row["max_rel"] <= 3 * U + U * U


def test_a_scale_an_ulp_off_moves_few_int8_codes_by_one_step() -> None:
    """The `codes` bound: quantize block-scaled values with scale = absmax/127 and with absmax·fl(1/127) (the
    CUDA reference's): some scales differ by an ulp, and the codes by at most one step, rarely."""
    x = torch.randn(4096 * 256, generator=torch.Generator().manual_seed(1)).view(-1, 256)
    absmax = x.abs().amax(dim=1, keepdim=True)

    def codes(scale: torch.Tensor) -> torch.Tensor:  # round half away from zero, clamped, as quantize_int8
        y = x / scale
        a = y.abs()
        r = a.floor()
        r += (a - r) >= 0.5
        return r.clamp(max=127).copysign(y).to(torch.int8).view(-1)

    exact, recip = absmax / 127.0, absmax * (torch.tensor(1.0) / 127.0)
    scales = compare(recip, exact, "rel")
    assert not scales["equal"] and within(scales, "rel"), scales
    row = compare(codes(recip), codes(exact), "codes")
    assert row["max_code_diff"] <= 1 and row["code_fraction"] <= CODE_FRACTION / 10 and within(row, "codes"), row


def test_compare_reads_bit_patterns_and_nibbles() -> None:
    z = torch.zeros(4)
    assert not compare(z, -z, "exact")["equal"]  # +0.0 and -0.0 are different bits
    packed = torch.tensor([0x21, 0x87], dtype=torch.uint8)  # nibbles 1, 2, 7, 8 (low first)
    other = torch.tensor([0x22, 0x87], dtype=torch.uint8)  # the second code one step up
    row = compare(packed, other, "int4")
    assert row == {"equal": False, "max_code_diff": 1, "code_fraction": 0.25}
    assert not within(row, "int4")  # a quarter of the codes: far over the fraction the bound allows


if __name__ == "__main__":  # the fixture's child process: the measurements as one JSON line
    print(json.dumps(measure()))
