"""The 2-D `sync × shard` DeviceMesh and its two process groups (docs/design.md §1).

Rank r = sync_rank · shard + shard_rank: the shard dimension is innermost, so a
shard group is a block of neighbouring ranks (one node, fast links) and a sync
group joins the ranks with the same shard_rank across replicas.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hsdp.comm.groups import Comm
from hsdp.comm.transport import GroupTransport, Transport


@dataclass
class Mesh:
    device_mesh: DeviceMesh
    device: torch.device
    rank: int
    world: int
    shard_rank: int
    sync_rank: int
    shard_size: int
    sync_size: int
    comm: Comm
    # The replicas' collectives, built with the mesh: the c10d sync group, or an elastic replica's torchft
    # group (hsdp/sync/elastic/transport.py).
    sync_transport: Transport


def build_mesh(sync: int, shard: int, device: torch.device, timeout_s: Optional[float] = None) -> Mesh:
    """Build the mesh on an initialised default process group of sync·shard ranks; `timeout_s` bounds
    every wait on one of its collectives (mesh.timeout_s)."""
    dm = _device_mesh(sync, shard, device, timeout_s)
    rank = dist.get_rank()
    comm = Comm({"shard": dm.get_group("shard"), "sync": dm.get_group("sync"), "world": dist.group.WORLD}, timeout_s)
    return Mesh(
        device_mesh=dm,
        device=device,
        rank=rank,
        world=dist.get_world_size(),
        shard_rank=rank % shard,
        sync_rank=rank // shard,
        shard_size=shard,
        sync_size=sync,
        comm=comm,
        sync_transport=GroupTransport(comm),
    )


def build_elastic_mesh(
    replica: int,
    replicas: int,
    shard: int,
    device: torch.device,
    timeout_s: float,
    transport: Callable[[Comm, int], Transport],
) -> Mesh:
    """An elastic replica's mesh: its own world of `shard` ranks is the shard group (and "world"); the sync
    group is `transport(comm, shard_rank)` (torchft's), so the c10d "sync" group is this rank alone. Ranks
    and sizes are those of the whole run (rank = replica · shard + shard_rank), so data streams match."""
    dm = _device_mesh(1, shard, device, timeout_s)
    shard_rank = dist.get_rank()
    comm = Comm({"shard": dm.get_group("shard"), "sync": dm.get_group("sync"), "world": dist.group.WORLD}, timeout_s)
    return Mesh(
        device_mesh=dm,
        device=device,
        rank=replica * shard + shard_rank,
        world=replicas * shard,
        shard_rank=shard_rank,
        sync_rank=replica,
        shard_size=shard,
        sync_size=replicas,
        comm=comm,
        sync_transport=transport(comm, shard_rank),
    )


def _device_mesh(sync: int, shard: int, device: torch.device, timeout_s: Optional[float]) -> DeviceMesh:
    """The sync × shard DeviceMesh, its two groups created with the run's timeout.

    init_device_mesh would create them with torch's default timeout (30 min for gloo), not the
    default group's, so a rank that stops answering would hold its peers for half an hour.
    """
    if timeout_s is None:
        return init_device_mesh(device.type, (sync, shard), mesh_dim_names=("sync", "shard"))
    timeout = datetime.timedelta(seconds=timeout_s)
    layout = torch.arange(sync * shard).view(sync, shard)
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    # new_group is collective over the world: every rank creates every group, in the same order.
    for name, groups in (("sync", layout.t().tolist()), ("shard", layout.tolist())):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[name] = group
    return DeviceMesh.from_group(
        [mine["sync"], mine["shard"]], device.type, mesh=layout, mesh_dim_names=("sync", "shard")
    )
