"""Reproducer candidate for the compiled path's heap-corruption abort, without torch.compile.

    python scripts/repro_gloo_abort.py [--iters N] [--world 4]

What the compiled step does at run time, eagerly: a 2x2 mesh of gloo ranks (shard pairs {0,1},{2,3},
sync pairs {0,2},{1,3}), each iteration issuing the step's functional collectives
(`torch.ops._c10d_functional`: two prefetched all-gathers on the shard group, a reduce-scatter on
the shard group, an in-place all-reduce of its output on the sync group) with several in flight at
once and waited out of order, while the main thread computes. A gloo worker thread's malloc abort
(`malloc(): unaligned tcache chunk detected`, `double free or corruption`) or a wrong sum is the
failure; the exit code is then non-zero. Sizes are the tiny model's (units of 32,896 and 196,864
floats per rank).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

C = torch.ops._c10d_functional
SIZES = [32896, 196864, 196864, 196864, 196864, 32896]  # the tiny model's units, per rank


def worker(rank: int, world: int, port: int, iters: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sync_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, sync = shard_groups[rank // 2], sync_groups[rank % 2]
    sname, yname = shard.group_name, sync.group_name
    held = [torch.full((n,), float(rank + 1)) for n in SIZES]
    x = torch.randn(256, 256)
    for it in range(iters):
        # forward: prefetch two gathers ahead, wait each before "using" it
        gathers = [C.all_gather_into_tensor(held[0], 2, sname), C.all_gather_into_tensor(held[1], 2, sname)]
        for u in range(len(SIZES)):
            if u + 2 < len(SIZES):
                gathers.append(C.all_gather_into_tensor(held[u + 2], 2, sname))
            full = C.wait_tensor(gathers[u])
            x = torch.tanh(x @ x.t() * 1e-3) + full[:1].sum() * 0  # compute while the next gathers run
        # backward: reduce-scatter each unit's full grad, all-reduce the result on the sync group, waits late
        pending = []
        for u in reversed(range(len(SIZES))):
            g = torch.full((2 * SIZES[u],), 1.0)
            rs = C.reduce_scatter_tensor(g, "sum", 2, sname)
            if pending:
                prev = pending.pop()
                C.wait_tensor(prev)
                C.all_reduce_(prev, "sum", yname)
                pending.insert(0, prev)
            pending.append(rs)
            x = torch.tanh(x @ x.t() * 1e-3)
        for t in pending:
            C.wait_tensor(t)
        # each reduce-scatter output is 2.0 per element; the all-reduced ones 4.0
        got = sorted({float(t[0]) for t in pending})
        if not set(got) <= {2.0, 4.0}:
            raise SystemExit(f"rank {rank} iteration {it}: wrong sums {got}")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 4, port, args.iters)) for r in range(4)]
    for proc in procs:
        proc.start()
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode)
    print(f"exit codes {codes}")
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
