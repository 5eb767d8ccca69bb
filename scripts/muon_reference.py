"""Muon on the sharded meshes against torch's own optimizers: the worst relative loss difference per mesh.

    python scripts/muon_reference.py [--steps 16] [--out /tmp/muon-reference]

Trains tests/test_muon.py's small model with optim.name=muon on 1×1, 2×2, 1×4, 4×1 (exact HSDP), on ddp 2×1 and
on fsdp2 2×2 and 1×4 (torch's math on DTensors), each against tests/reference.py's one process of
torch.optim.Muon + torch.optim.AdamW on the concatenated batch; prints a markdown row per mesh: the worst
per-step relative loss difference and the step it is at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.exactness import losses  # noqa: E402
from tests.helpers import run_train  # noqa: E402
from tests.reference import reference_run  # noqa: E402
from tests.test_muon import COMMON  # noqa: E402

MESHES = [
    (1, 1, "hsdp"),
    (2, 2, "hsdp"),
    (1, 4, "hsdp"),
    (4, 1, "hsdp"),
    (2, 1, "ddp"),
    (2, 2, "fsdp2"),
    (1, 4, "fsdp2"),
]


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--steps", type=int, default=16)
    a.add_argument("--out", default="/tmp/muon-reference")
    args = a.parse_args()
    out = Path(args.out)
    print(f"Muon vs torch.optim.Muon + AdamW, {args.steps} steps (tests/test_muon.py's model)")
    print("| mesh | engine | worst relative loss difference | at step | final loss |")
    print("|---|---|---:|---:|---:|")
    for sync, shard, engine in MESHES:
        overrides = [*COMMON, f"run.steps={args.steps}"]
        mesh = [f"mesh.sync={sync}", f"mesh.shard={shard}", f"mesh.engine={engine}"]
        run = run_train(out, f"{engine}-{sync}x{shard}", [*overrides, *mesh, "run.overwrite=true"], timeout=900)
        ref, _ = reference_run([*overrides, "mesh.sync=1", "mesh.shard=1"], sync * shard)
        gaps = [abs(x - y) / abs(y) for x, y in zip(losses(run), ref)]
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        print(f"| {sync}×{shard} | {engine} | {gaps[worst]:.2e} | {worst} | {losses(run)[-1]:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
