"""Newton–Schulz (torch.optim.Muon's, bf16) timed at a config's Muon matrix shapes: what one optimizer step adds.

    python scripts/muon_ns_bench.py [--config configs/gpu-124m.yaml] [--device cuda] [--reps 20]

Per distinct matrix shape of the config's blocks (hsdp/models/muon.py `is_muon_matrix`): the median time of one
orthogonalization (5 iterations, torch's coefficients), its FLOPs (hsdp/plan/workload.py's count) and achieved
TFLOP/s; then the whole model's matrices once (what one rank runs per step with mesh.shard = 1; with the owner
exchange each of S ranks runs about 1/S of it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp.config.loader import load_config  # noqa: E402
from hsdp.models.gpt import GPT  # noqa: E402
from hsdp.models.muon import NS_COEFFICIENTS, NS_EPS, is_muon_matrix  # noqa: E402
from hsdp.torch_compat import muon_orthogonalize  # noqa: E402


def ns_flops(shape: tuple[int, int], steps: int = 5) -> int:
    p, q = min(shape), max(shape)
    return steps * (4 * p * p * q + 2 * p**3)


def time_one(shape: tuple[int, int], device: torch.device, reps: int) -> float:
    x = torch.randn(*shape, device=device)
    times = []
    for i in range(reps + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        muon_orthogonalize(x, NS_COEFFICIENTS, 5, NS_EPS)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # warm-up: kernels chosen, caches filled
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--config", default="configs/gpu-124m.yaml")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--reps", type=int, default=20)
    a.add_argument("--set", action="append", default=[])
    args = a.parse_args()
    cfg = load_config(args.config, [*args.set, "model.vocab_size=32768"] if "gpu-124m" in args.config else args.set)
    with torch.device("meta"):
        model = GPT(cfg.model)
    shapes = Counter(tuple(p.shape) for n, p in model.named_parameters() if is_muon_matrix(n, p.dim()))
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.config}: {sum(shapes.values())} Muon matrices, bf16 Newton–Schulz (5 steps) on {name}")
    print("| shape | count | ms each | GFLOP each | TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    total = 0.0
    for shape, count in sorted(shapes.items()):
        s = time_one(shape, device, args.reps)
        total += s * count
        flops = ns_flops(shape)
        print(f"| {shape[0]}×{shape[1]} | {count} | {s * 1e3:.3f} | {flops / 1e9:.3g} | {flops / s / 1e12:.2f} |")
    print(f"all matrices once (one rank, shard 1): {total * 1e3:.1f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
