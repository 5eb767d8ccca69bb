"""Muon's cost per step against AdamW's on a shard group: optimizer time and the extra shard-group bytes.

    python scripts/muon_cost.py [--config configs/tiny.yaml] [--shard 4] [--reps 20] [--set key=value ...]

Spawns `--shard` gloo ranks (one shard group, one replica), builds the hsdp engine of the config, runs one
forward/backward so every held param has a grad, then times `optimizer.step()` (the grads kept, the params
restored between reps so every rep steps from the same point) for AdamW, Muon with the owner exchange (one rank
per matrix runs Newton–Schulz; hsdp/models/muon.py) and Muon with the gather exchange (every rank runs every
matrix). Prints one markdown row per optimizer: median step ms (the slowest rank's), shard-group bytes one
rank sends per step in the optimizer, and the planner's figures for the same config (hsdp/plan/workload.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsdp.comm.mesh import build_mesh  # noqa: E402
from hsdp.config.loader import load_config  # noqa: E402
from hsdp.data.tokens import Data  # noqa: E402
from hsdp.engines.hsdp import HSDPEngine  # noqa: E402
from hsdp.models.optim import build_optimizer  # noqa: E402
from hsdp.plan.workload import build_workload  # noqa: E402

VARIANTS = {
    "adamw": ["optim.name=adamw"],
    "muon owner": ["optim.name=muon"],
    "muon gather": ["optim.name=muon", "optim.muon_exchange=gather"],
}


def worker(rank: int, world: int, port: int, config: str, overrides: list[str], reps: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for name, extra in VARIANTS.items():
        cfg = load_config(config, [*overrides, *extra, "mesh.sync=1", f"mesh.shard={world}"])
        mesh = build_mesh(1, world, torch.device("cpu"), 300)
        engine = HSDPEngine.from_config(cfg, mesh)
        optimizer = build_optimizer(engine.named_parameters(), cfg.optim, engine.row_sharding())
        x, y = Data(cfg, rank, world).train_batch(0, 0)
        engine.forward_backward([(x, y)])
        start = [b.clone() for b in engine.held_buffers()]
        optimizer.step()  # the state's first creation is not what is timed
        before = mesh.comm.group_bytes("shard")
        times = []
        for _ in range(reps):
            for b, s in zip(engine.held_buffers(), start):
                b.copy_(s)
            dist.barrier()
            t0 = time.perf_counter()
            optimizer.step()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took))
        step_bytes = (mesh.comm.group_bytes("shard") - before) // reps
        w = build_workload(cfg)
        modelled = sum(m.nbytes for m in w.muon_messages())
        rows.append((name, statistics.median(times) * 1e3, step_bytes, modelled, w.muon_flops_per_step() / 1e9))
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--shard", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    out = f"/tmp/muon_cost.{os.getpid()}"
    port = 29500 + os.getpid() % 1000
    mp.spawn(worker, args=(a.shard, port, a.config, a.set, a.reps, out), nprocs=a.shard)
    rows = eval(Path(out).read_text())  # noqa: S307 - our own repr of a list of tuples
    Path(out).unlink()
    cfg = load_config(a.config, a.set)
    m = cfg.model
    print(f"{a.config} {' '.join(a.set)}: d_model {m.d_model}, {m.n_layer} layers, 1×{a.shard}, gloo, {a.reps} reps")
    print("| optimizer | step ms (slowest rank) | shard bytes/step/rank | planner bytes | planner NS GFLOP |")
    print("|---|---:|---:|---:|---:|")
    for name, ms, nbytes, modelled, gflop in rows:
        print(f"| {name} | {ms:.1f} | {nbytes:,} | {modelled:,} | {gflop:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
