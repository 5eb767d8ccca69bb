"""The compiled path's gloo workaround (hsdp/compile/gloo.py): the functional collectives' CPU kernels
issue the eager engine's c10d calls, with the same results and the work waited by `wait_tensor`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import hold_rendezvous, join_rendezvous

pytestmark = pytest.mark.timeout(120)
C = torch.ops._c10d_functional


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    join_rendezvous(port, rank, 2)
    name = dist.group.WORLD.group_name
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank
    g = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1)
    # torch's own kernels first (the reference), then the routed ones, on the same inputs
    native = [
        C.wait_tensor(C.all_gather_into_tensor(x, 2, name)),
        C.wait_tensor(C.reduce_scatter_tensor(g, "sum", 2, name)),
    ]

    import hsdp.compile.gloo as route

    calls = []
    gather, scatter = route._all_gather_single, route._reduce_scatter_single
    route._all_gather_single = lambda *a, **k: (calls.append("all_gather"), gather(*a, **k))[1]
    route._reduce_scatter_single = lambda *a, **k: (calls.append("reduce_scatter"), scatter(*a, **k))[1]
    route.route_functional_collectives_to_c10d()
    route.route_functional_collectives_to_c10d()  # a second call changes nothing
    # two in flight at once, waited in the other order: each output is found in the work registry
    a, b = C.all_gather_into_tensor(x, 2, name), C.reduce_scatter_tensor(g, "sum", 2, name)
    rs, ag = C.wait_tensor(b), C.wait_tensor(a)
    routed = [ag, rs]
    assert calls == ["all_gather", "reduce_scatter"], calls
    for want, got in zip(native, routed):
        assert torch.equal(want, got), (want, got)
    assert torch.equal(routed[0], torch.cat([torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(3, 2) + 10]))
    assert torch.equal(routed[1], (torch.arange(8.0).reshape(4, 2) * 3)[2 * rank : 2 * rank + 2])
    dist.destroy_process_group()


def test_routed_functional_collectives_equal_torchs_kernels() -> None:
    store = hold_rendezvous()  # listening before the ranks start: no port to lose to another process
    mp.start_processes(_worker, args=(store.port,), nprocs=2, join=True, start_method="spawn")
