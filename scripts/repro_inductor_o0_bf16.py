"""Reproducer of an inductor/ATen bug, with plain torch: a bf16 layer-norm backward compiled for the CPU reads
uninitialized memory when inductor's C++ is built at -O0.

    python scripts/repro_inductor_o0_bf16.py

On an AVX-512 CPU inductor fuses the backward below into one C++ kernel that writes its bf16 input grad through
a scratch buffer with `store(tmpbuf.data(), 64)`, on a bf16 vector of 32 lanes. A count other than the lane
count takes ATen's masked store (`vec512_bfloat16.h`: `__mmask32 mask = (1ULL << count) - 1`), and a shift by
64 is undefined. g++ at -O3 folds the mask to all ones (right); at -O0 the CPU shifts by 64 mod 64, the mask is
0, nothing is stored, and the grad is whatever the stack held (NaN here). The project's bf16 step-scope graph on
a shard group of 2 has this kernel (docs/results/suite.md). Each level runs in a fresh interpreter with a fresh
inductor cache; the script prints both and exits 1 if the default build differs from eager.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch


def ln_backward_packed(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, flat: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ln_f's backward as the step graph has it: its weight and bias read from a gathered flat buffer (two
    ranks' shards), their grads packed into a flat buffer for the reduce-scatter."""
    weight, bias = flat[:, :16].reshape(32), flat[:, 16:32].reshape(32)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy, x, [32], mean, rstd, weight, bias, [True, True, True])
    return dx, torch.cat([dw.view(2, 16), db.view(2, 16), torch.zeros(2, 4096, dtype=torch.bfloat16)], 1)


def compare() -> bool:
    """Eager vs compiled on seeded inputs; prints the input grad's difference, True if they agree."""
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    args = (
        torch.randn(2, 16, 32).to(bf16),
        torch.randn(2, 16, 32).to(bf16),
        (torch.randn(2, 16, 1) * 0.1).to(bf16),
        (torch.rand(2, 16, 1) + 0.5).to(bf16),
        torch.randn(2, 4128).to(bf16),
    )
    eager, compiled = ln_backward_packed(*args)[0], torch.compile(ln_backward_packed)(*args)[0]
    nan = bool(compiled.isnan().any())
    diff = (compiled.float() - eager.float()).abs().max().item()
    print(f"  input grad: NaN {nan}, max |compiled - eager| {diff:.3g}")
    return not nan and diff == 0.0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return 0 if compare() else 1
    codes = {}
    for label, debug in (("-O3 (inductor's default)", "0"), ("-O0 (TORCHINDUCTOR_DEBUG_COMPILE=1)", "1")):
        print(label)
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_DEBUG_COMPILE": debug}
            codes[debug] = subprocess.run([sys.executable, __file__, "--child"], env=env, timeout=600).returncode
    print("bug reproduced: -O0 differs from eager" if codes["1"] else "not reproduced: -O0 agrees with eager")
    return codes["0"]


if __name__ == "__main__":
    sys.exit(main())
