"""Reproducer candidate for the compiled path's heap-corruption abort, without torch.compile.

    python scripts/repro_gloo_abort.py [--iters N] [--gather functional|c10d|routed]

What the compiled step does at run time, eagerly: a 2x2 mesh of gloo ranks (shard pairs {0,1},{2,3},
sync pairs {0,2},{1,3}), each iteration issuing the step's functional collectives
(`torch.ops._c10d_functional`: two prefetched all-gathers on the shard group, a reduce-scatter on
the shard group, an in-place all-reduce of its output on the sync group) with several in flight at
once and waited out of order, while the main thread computes. A gloo worker thread's malloc abort
(`malloc(): unaligned tcache chunk detected`, `double free or corruption`) or a wrong sum is the
failure; the exit code is then non-zero. Sizes are the tiny model's (units of 32,896 and 196,864
floats per rank). `--gather c10d` issues the all-gathers through `dist.all_gather_into_tensor(...,
async_op=True)` instead (gloo's `_allgather_base`, not the coalesced all-gather the functional op
uses), everything else unchanged: the comparison that tells whether that path is the culprit.
`--gather routed` keeps the functional calls but installs the project's workaround first
(`hsdp.compile.gloo.route_functional_collectives_to_c10d`: their CPU kernels issue the c10d calls).
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


class _C10dGather:
    """A c10d all-gather with the functional op's calling shape: start returns a handle, wait its output."""

    def __init__(self, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.out = torch.empty(2 * inp.numel(), dtype=inp.dtype)
        self.work = dist.all_gather_into_tensor(self.out, inp, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out


def worker(rank: int, world: int, port: int, iters: int, gather: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sync_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    shard, sync = shard_groups[rank // 2], sync_groups[rank % 2]
    if gather == "routed":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from hsdp.compile.gloo import route_functional_collectives_to_c10d

        route_functional_collectives_to_c10d()
    sname, yname = shard.group_name, sync.group_name
    held = [torch.full((n,), float(rank + 1)) for n in SIZES]
    x = torch.randn(256, 256)

    def start_gather(t: torch.Tensor):
        return _C10dGather(t, shard) if gather == "c10d" else C.all_gather_into_tensor(t, 2, sname)

    def wait_gather(h) -> torch.Tensor:
        return h.wait() if gather == "c10d" else C.wait_tensor(h)

    for it in range(iters):
        # forward: prefetch two gathers ahead, wait each before "using" it
        gathers = [start_gather(held[0]), start_gather(held[1])]
        for u in range(len(SIZES)):
            if u + 2 < len(SIZES):
                gathers.append(start_gather(held[u + 2]))
            full = wait_gather(gathers[u])
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
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--gather", choices=["functional", "c10d", "routed"], default="functional")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 4, port, args.iters, args.gather)) for r in range(4)]
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
