"""Benchmark every kernel at the size of one real unit: `python -m kernels.bench`.

The `7b` unit is one transformer block of a 7B model (d=4096, ffn=11008,
~202M params) sharded over S=8; `small` is d=1024, ffn=2816. Prints a markdown
table: time, achieved GB/s (bytes read + written / time), % of the device's
measured copy bandwidth (`dst.copy_(src)`), and on CUDA the speedup of the
Triton kernel over the torch reference. Without a GPU only the torch
references are timed.

The SparseLoCo payload kernels (quantize_int2, dequantize_int2, pack_idx,
unpack_idx, decode_topk_int2) run on the values a top-k of SPARSE_K of every
SPARSE_CHUNK selects, which is ~1.6% of a unit: by default those of the --size
unit, what one launch handles in a step of that model; `--values 7b` (or any
unit, or a count such as 4000000) sets it apart from --size, e.g. the 7b count
on a CPU box, or a larger one to see the kernels past their launch latency.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from kernels import backend, registry
from kernels.bitpack import index_bits, pack_bits, unpack_bits
from kernels.outer import compute_delta, outer_step
from kernels.pack import pack_shards, unpack_full
from kernels.quant import dequantize_mean, quantize_int8
from kernels.quant2 import dequantize_int2_mean, quantize_int2
from kernels.quant4 import dequantize_int4_mean, quantize_int4
from kernels.reduce import accumulate_grad_shards, pack_grads
from kernels.sparse_decode import decode_topk_int2_add
from kernels.topk import topk_error_feedback, topk_index_dtype, topk_numel

UNITS = {"small": (1024, 2816), "7b": (4096, 11008)}  # (d_model, d_ffn) of one transformer block
KERNELS = registry.bench_names()  # the kernels this times, in the table's order (kernels/registry.py)
S = 8  # shard-group size (one node)
M = 4  # sync-group size for the dequantize rows
QBLOCK = 256  # int8 and int4 quantization block
TOPK_CHUNK, TOPK_K = 1024, 10  # top-k: 10 of every 1024 elements (~1% density)
SPARSE_CHUNK, SPARSE_K = 4096, 64  # SparseLoCo: 64 of every 4096, int2 values in blocks of 64, 12-bit indices


def block_shapes(d: int, ffn: int) -> list[tuple[int, ...]]:
    """Params of one llama-style block: q, k, v, o, w1, w3, w2, two norms."""
    return [(d, d)] * 4 + [(ffn, d), (ffn, d), (d, ffn), (d,), (d,)]


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Time of fn in ms: do_bench's median on CUDA; on CPU the best of a perf_counter loop
    (CPU boxes are often shared, and the minimum is the least noisy estimate)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()  # warm up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (len(times) < 50 and time.perf_counter() - start < 1.0):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of dst.copy_(src) for a large fp32 buffer (bytes read + written)."""
    n = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * n * 4 / ms / 1e6


def unit_numel(size: str) -> int:
    """N: the length of one rank's shard of the unit (every param's dim 0 split over S)."""
    return sum(-(-s[0] // S) * (s[1] if len(s) > 1 else 1) for s in block_shapes(*UNITS[size]))


def sparse_length(values: str) -> int:
    """The dense length whose SparseLoCo top-k the payload kernels decode: a unit's N for a unit name; for a
    count c, whole chunks enough for c selected values (ValueError otherwise)."""
    if values in UNITS:
        return unit_numel(values)
    try:
        count = int(values)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--values: expected a unit ({', '.join(sorted(UNITS))}) or a count >= 1, got {values!r}")
    return -(-count // SPARSE_K) * SPARSE_CHUNK


def cases(
    size: str, device: torch.device, values: str | None = None
) -> dict[str, tuple[str, int, Callable[[], object]]]:
    """kernel name (each of KERNELS) -> (size label, bytes moved, call); the payload kernels at `values`
    (default: `size`)."""
    shapes = block_shapes(*UNITS[size])
    sizes = [-(-s[0] // S) * (s[1] if len(s) > 1 else 1) for s in shapes]
    N = sum(sizes)
    Ns = sparse_length(values or size)  # the dense length behind the SparseLoCo payload
    numel = sum(torch.Size(s).numel() for s in shapes)
    nb = -(-N // QBLOCK)
    bf16, f32 = torch.bfloat16, torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = f32) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    label = f"N={N / 1e6:.1f}M"
    held, shard_bf16, full = randn(N), torch.empty(N, dtype=bf16, device=device), randn(N)
    gathered, unpacked = randn(S, N, dtype=bf16), torch.empty(S * N, dtype=bf16, device=device)
    grads = [randn(*s, dtype=bf16) for s in shapes]
    rs_in = torch.empty(S, N, dtype=f32, device=device)
    mom, delta, out = randn(N), randn(N) * 1e-3, torch.empty(N, device=device)
    q = torch.randint(-127, 128, (M, N), dtype=torch.int8, device=device, generator=g)
    scales = torch.rand(M, nb, device=device, generator=g)
    packed4 = torch.randint(0, 256, (M, (N + 1) // 2), dtype=torch.uint8, device=device, generator=g)
    err = randn(N) * 1e-3
    n_sel = topk_numel(N, TOPK_CHUNK, TOPK_K)
    c2 = topk_numel(Ns, SPARSE_CHUNK, SPARSE_K)  # SparseLoCo's selected values of one unit
    bits = index_bits(SPARSE_CHUNK)
    sel_vals = randn(c2)
    sel_idx = torch.randint(0, SPARSE_CHUNK, (c2,), dtype=torch.int16, device=device, generator=g)
    packed2 = torch.randint(0, 256, (M, (c2 + 3) // 4), dtype=torch.uint8, device=device, generator=g)
    table2 = torch.rand(M, 2 * -(-c2 // SPARSE_K), device=device, generator=g)
    packed_idx = pack_bits(sel_idx, bits)
    idx_out = torch.empty(c2, dtype=torch.int16, device=device)
    out2 = torch.empty(c2, device=device)
    # one replica's SparseLoCo payload of the unit: valid, ascending indices within each chunk
    sel_pos = torch.arange(c2, device=device) % SPARSE_K * (SPARSE_CHUNK // SPARSE_K)
    last = Ns - (-(-Ns // SPARSE_CHUNK) - 1) * SPARSE_CHUNK  # a short last chunk: keep its indices inside it
    sel_pos[c2 - min(SPARSE_K, last) :] = torch.arange(min(SPARSE_K, last), device=device)
    payload = (pack_bits(sel_pos.to(torch.int16), bits), packed2[0], table2[0])
    acc, senders = torch.zeros(Ns, device=device), torch.zeros(Ns, device=device)
    sparse = f"{c2 / 1e6:.2f}M values" + ("" if Ns == N else f" (of N={Ns / 1e6:.1f}M)")
    idx_bytes = topk_index_dtype(TOPK_CHUNK).itemsize
    return {
        "pack": (f"{label} fp32→bf16", N * (4 + 2), lambda: pack_shards(held, shard_bf16)),
        "unpack": (f"S={S}, {label} bf16", 2 * S * N * 2, lambda: unpack_full(gathered, sizes, unpacked)),
        "pack_grads": (
            f"{len(shapes)} grads bf16→fp32, S={S}",
            numel * 2 + S * N * 4,
            lambda: pack_grads(grads, sizes, rs_in, 1.0 / S),
        ),
        "accumulate": (f"{label} fp32", 3 * N * 4, lambda: accumulate_grad_shards(held, full, 1.0 / S)),
        "delta": (f"{label}", 3 * N * 4, lambda: compute_delta(full, held, out)),
        "outer": (
            f"{label} nesterov",
            6 * N * 4,
            lambda: outer_step(held, full, mom, delta, 0.7, 0.9, True, False),
        ),
        "quantize": (f"{label}, block {QBLOCK}", N * 4 + N + nb * 4, lambda: quantize_int8(held, QBLOCK)),
        "dequantize": (
            f"M={M}, {label}",
            M * (N + nb * 4) + N * 4,
            lambda: dequantize_mean(q, scales, QBLOCK, out),
        ),
        "quantize_int4": (
            f"{label}, block {QBLOCK}",
            N * 4 + (N + 1) // 2 + nb * 4,
            lambda: quantize_int4(held, QBLOCK),
        ),
        "dequantize_int4": (
            f"M={M}, {label}",
            M * ((N + 1) // 2 + nb * 4) + N * 4,
            lambda: dequantize_int4_mean(packed4, scales, QBLOCK, out),
        ),
        "topk_ef": (  # reads delta and err, writes err, idx and vals
            f"{label}, {TOPK_K} of {TOPK_CHUNK}",
            3 * N * 4 + n_sel * (idx_bytes + 4),
            lambda: topk_error_feedback(delta, err, TOPK_CHUNK, TOPK_K),
        ),
        "quantize_int2": (
            f"{sparse}, block {SPARSE_K}",
            c2 * 4 + (c2 + 3) // 4 + 8 * -(-c2 // SPARSE_K),
            lambda: quantize_int2(sel_vals, SPARSE_K),
        ),
        "dequantize_int2": (
            f"M={M}, {sparse}",
            M * ((c2 + 3) // 4 + 8 * -(-c2 // SPARSE_K)) + c2 * 4,
            lambda: dequantize_int2_mean(packed2, table2, SPARSE_K, out2),
        ),
        "pack_idx": (
            f"{sparse}, {bits}-bit indices",
            c2 * 2 + packed_idx.numel(),
            lambda: pack_bits(sel_idx, bits),
        ),
        "unpack_idx": (
            f"{sparse}, {bits}-bit indices",
            c2 * 2 + packed_idx.numel(),
            lambda: unpack_bits(packed_idx, bits, idx_out),
        ),
        "decode_topk_int2": (  # reads the payload, reads + writes the sum and the senders at c2 positions
            f"{sparse}, chosen",
            packed_idx.numel() + (c2 + 3) // 4 + table2.shape[1] * 4 + 4 * c2 * 4,
            lambda: decode_topk_int2_add(*payload, bits, SPARSE_CHUNK, SPARSE_K, SPARSE_K, acc, senders),
        ),
    }


def parse_device(text: str | None) -> torch.device:
    """--device: cpu, cuda or cuda:N that exists here (default: cuda if available); ValueError otherwise."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device: {text} asked for, but no CUDA GPU is available here; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device: {text} asked for, but there are {torch.cuda.device_count()} GPUs")
    elif device.type != "cpu":
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {text!r}")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(UNITS), help="unit size (default: 7b on CUDA, small on CPU)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument(
        "--values",
        help="the payload kernels' size: a unit (the values its SparseLoCo top-k selects) or a count of values "
        "(default: the --size unit)",
    )
    args = parser.parse_args(argv)
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in names if k not in KERNELS]
    try:
        if unknown or not names:
            raise ValueError(f"--kernels: unknown kernels {unknown}; choose from {','.join(KERNELS)}")
        device = parse_device(args.device)
        if args.values is not None:
            sparse_length(args.values)
    except ValueError as e:  # one line and exit 2, like train.py's config errors
        print(f"bench: {e}", file=sys.stderr)
        return 2
    size = args.size or ("7b" if device.type == "cuda" else "small")
    gpu = device.type == "cuda" and backend.HAVE_TRITON

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    copy_bw = copy_bandwidth(device)
    d, ffn = UNITS[size]
    threads = "" if device.type == "cuda" else f", {torch.get_num_threads()} threads"
    print(f"device: {name}{threads}; copy bandwidth {copy_bw:.0f} GB/s; torch {torch.__version__}")
    print(f"unit: one transformer block, d={d}, ffn={ffn}, S={S}")
    if not gpu:
        print("Triton kernels need a GPU: timing the torch references only.")
    print()
    print("| kernel | size | time (ms) | GB/s | % of copy | torch ref (ms) | speedup |")
    print("|---|---|---:|---:|---:|---:|---:|")
    table = cases(size, device, args.values)
    for k in names:
        label, nbytes, fn = table[k]
        backend.set_backend("torch")
        ref_ms = time_ms(fn, device)
        if gpu:
            backend.set_backend("triton")
            ms = time_ms(fn, device)
            speedup = f"{ref_ms / ms:.2f}x"
        else:
            ms, speedup = ref_ms, "–"
        gbs = nbytes / ms / 1e6
        print(f"| {k} | {label} | {ms:.3f} | {gbs:.0f} | {100 * gbs / copy_bw:.0f}% | {ref_ms:.3f} | {speedup} |")
    backend.set_backend("auto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
