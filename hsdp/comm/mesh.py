"""The `sync × [replicate ×] shard` DeviceMesh and its process groups (docs/design.md §4).

Rank r = (sync_rank · replicate + replicate_rank) · shard + shard_rank: the shard
dimension is innermost, so a shard group is a block of neighbouring ranks (one
node, fast links); a replicate group joins the shard groups of one site (fast
links, grads averaged every step); a sync group joins the ranks at the same
(replicate_rank, shard_rank) across sites (the slow links). With replicate = 1
(the default) the mesh is the two-level `sync × shard` one and has no replicate
group.
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
from hsdp.comm.site import SiteTransport
from hsdp.comm.transport import GroupTransport, Transport


@dataclass
class Mesh:
    device_mesh: DeviceMesh
    device: torch.device
    rank: int
    world: int
    shard_rank: int
    sync_rank: int  # the site (the replica, on a two-level mesh)
    shard_size: int
    sync_size: int  # sites
    comm: Comm
    # The replicas' collectives, built with the mesh: the c10d sync group (sliced across the site's
    # replicate group when replicate > 1), or an elastic replica's torchft group (hsdp/sync/elastic/transport.py).
    sync_transport: Transport
    replicate_rank: int = 0  # this rank's replica inside its site
    replicate_size: int = 1  # replicas inside a site (mesh.replicate)

    @property
    def data_rank(self) -> int:
        """This rank's shard group among all sites × in-site replicas: site s, replica r is s·R + r."""
        return self.sync_rank * self.replicate_size + self.replicate_rank


def build_mesh(
    sync: int, shard: int, device: torch.device, timeout_s: Optional[float] = None, replicate: int = 1
) -> Mesh:
    """Build the mesh on an initialised default process group of sync·replicate·shard ranks; `timeout_s`
    bounds every wait on one of its collectives (mesh.timeout_s)."""
    dm = _device_mesh(sync, replicate, shard, device, timeout_s)
    rank = dist.get_rank()
    groups = {name: dm.get_group(name) for name in dm.mesh_dim_names or ()}
    comm = Comm({**groups, "world": dist.group.WORLD}, timeout_s)
    transport: Transport = GroupTransport(comm) if replicate == 1 else SiteTransport(GroupTransport(comm), comm)
    return Mesh(
        device_mesh=dm,
        device=device,
        rank=rank,
        world=dist.get_world_size(),
        shard_rank=rank % shard,
        sync_rank=rank // (shard * replicate),
        shard_size=shard,
        sync_size=sync,
        comm=comm,
        sync_transport=transport,
        replicate_rank=rank // shard % replicate,
        replicate_size=replicate,
    )


def build_elastic_mesh(
    replica: int,
    replicas: int,
    shard: int,
    device: torch.device,
    timeout_s: float,
    transport: Callable[[Comm, int], Transport],
    replicate: int = 1,
) -> Mesh:
    """An elastic replica's mesh (a site's, with `replicate` > 1): its own world of replicate·shard ranks holds
    its shard (and replicate) groups and is "world"; the sync group is `transport(comm, site_rank)` (torchft's,
    sliced across the site by `SiteTransport`), so the c10d "sync" group is this rank alone. Ranks and sizes
    are those of the whole run (rank = (replica · R + replicate_rank) · S + shard_rank), so data streams match."""
    dm = _device_mesh(1, replicate, shard, device, timeout_s)
    site_rank = dist.get_rank()
    groups = {name: dm.get_group(name) for name in dm.mesh_dim_names or ()}
    comm = Comm({**groups, "world": dist.group.WORLD}, timeout_s)
    between_sites = transport(comm, site_rank)
    return Mesh(
        device_mesh=dm,
        device=device,
        rank=replica * replicate * shard + site_rank,
        world=replicas * replicate * shard,
        shard_rank=site_rank % shard,
        sync_rank=replica,
        shard_size=shard,
        sync_size=replicas,
        comm=comm,
        sync_transport=between_sites if replicate == 1 else SiteTransport(between_sites, comm),
        replicate_rank=site_rank // shard,
        replicate_size=replicate,
    )


def _device_mesh(sync: int, replicate: int, shard: int, device: torch.device, timeout_s: Optional[float]) -> DeviceMesh:
    """The sync × shard DeviceMesh (sync × replicate × shard when replicate > 1), its groups created with
    the run's timeout.

    init_device_mesh would create them with torch's default timeout (30 min for gloo), not the
    default group's, so a rank that stops answering would hold its peers for half an hour.
    """
    shape, names = ((sync, shard), ("sync", "shard")) if replicate == 1 else ((sync, replicate, shard), MESH_DIMS)
    if timeout_s is None:
        return init_device_mesh(device.type, shape, mesh_dim_names=names)
    timeout = datetime.timedelta(seconds=timeout_s)
    layout = torch.arange(sync * replicate * shard).view(*shape)
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    # new_group is collective over the world: every rank creates every group, in the same order.
    for dim, name in enumerate(names):
        for ranks in layout.movedim(dim, -1).reshape(-1, shape[dim]).tolist():  # the groups along `dim`
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[name] = group
    return DeviceMesh.from_group([mine[n] for n in names], device.type, mesh=layout, mesh_dim_names=names)


MESH_DIMS = ("sync", "replicate", "shard")
