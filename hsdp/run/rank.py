"""A rank's life: join its world, run the worker, leave.

Every way a rank runs goes through `run_rank`: in the launcher's own process (a world of 1), forked by the
zygote (`run_forked_rank`, whose targets `forked_ranks` builds for a pool), or as torchrun's worker. A
local world meets at a rendezvous store the launcher hosts (`host_rendezvous_store`).
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from hsdp.config.schema import Config
from hsdp.core import timeline
from hsdp.sync.seam import ReplicaSeat
from hsdp.torch_compat import register_fake_backend

# worker(cfg); an elastic replica's worker(cfg, seat), its ReplicaSeat (which replica, which start of it)
Worker = Callable[..., None]


def worker_env() -> dict[str, str]:
    """What an elastic worker's environment adds: torchft's Rust side logs every quorum at info otherwise."""
    return {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}


def host_rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a local world, served by the launcher on a port the OS picks.

    The launcher binds it before any worker starts; forked workers connect as clients
    (`TORCHELASTIC_USE_AGENT_STORE` in their environment, as under torchrun's agent) and a rank
    run in the launcher's own process is handed it (no flag left in the launcher's environment,
    where later jobs it starts would inherit it). Choosing a free port and letting rank 0 bind it
    later raced with other jobs on the machine (EADDRINUSE at start-up)."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


def pick_device(local_rank: int) -> torch.device:
    """This rank's GPU (ranks share GPUs round-robin when a gloo world is larger), else the CPU."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(cfg: Config, device: torch.device) -> str:
    if cfg.mesh.backend != "auto":
        return cfg.mesh.backend
    return "nccl" if device.type == "cuda" else "gloo"


def threads_per_rank(local_world: int) -> int:
    """OMP_NUM_THREADS if set (torchrun and the slow-link launcher set it per node), else the cores / local ranks.

    Sharing the CPU matters: oversubscribed gloo ranks mostly wait for each other.
    """
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return max(1, (os.cpu_count() or 1) // local_world)


def run_rank(
    cfg: Config,
    worker: Worker,
    rank: int,
    world: int,
    local_rank: int,
    local_world: int,
    store: Optional[dist.Store] = None,
    seat: Optional[ReplicaSeat] = None,
) -> None:
    """Join the world (through `store` if given, else the environment's rendezvous), run the worker (an
    elastic replica's is handed its `seat`), leave."""
    torch.set_num_threads(threads_per_rank(local_world))
    device = pick_device(local_rank)
    timeout = datetime.timedelta(seconds=cfg.mesh.timeout_s)
    if cfg.mesh.backend == "fake":  # older torch registers the fake backend only when this module is imported
        register_fake_backend()
    dist.init_process_group(
        backend_for(cfg, device),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        store=store,
    )
    timeline.mark("world")
    try:
        if seat is None:
            worker(cfg)
        else:
            worker(cfg, seat)
    finally:
        shutdown_process_group()


def shutdown_process_group() -> None:
    """Destroy the process groups and free them now, while the interpreter is fully alive.

    Our mesh objects keep the groups referenced and sit in reference cycles, so
    without the collect they would be freed in the interpreter's final GC. Units no
    longer point at the engine, but each holds the engine's backward callback (a
    bound method), so engine ↔ units is still a cycle; a check after a 1×2 run found
    the engine, its 4 units, Comm and Mesh among ~550 objects of cyclic garbage.
    A gloo worker thread that then drops a Work created in backward (it holds a
    Python object from the autograd TLS) needs the GIL, finds the interpreter
    finalizing and aborts the process ("terminate called without an active
    exception").
    """
    dist.destroy_process_group()
    gc.collect()


def run_torchrun_rank(cfg: Config, worker: Worker, seat: Optional[ReplicaSeat]) -> None:
    """This process as torchrun's worker: its rank and world from the environment torchrun set."""
    timeline.begin("started", seat.marks if seat is not None else ())  # torchrun's agent started this process
    world = int(os.environ["WORLD_SIZE"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    run_rank(cfg, worker, rank, world, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)), seat=seat)


def run_forked_rank(
    rank: int,
    cfg: Config,
    worker: Worker,
    port: int,
    world: int,
    local_rank: Optional[int] = None,
    local_world: Optional[int] = None,
    seat: Optional[ReplicaSeat] = None,
) -> None:
    """A local worker, forked by the zygote (which already gave it the launcher's environment and stdio).

    An elastic replica's worker is rank `rank` of its replica's own world of `world` ranks; `local_rank`
    and `local_world` then number it among all the launcher's workers, and `seat` says which replica
    and which start of it (hsdp/run/replicas.py)."""
    timeline.begin("forked", seat.marks if seat is not None else ())  # a restart's: the launcher's marks first
    local_rank = rank if local_rank is None else local_rank
    local_world = world if local_world is None else local_world
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher hosts the store (host_rendezvous_store)
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world),
        **(worker_env() if seat is not None else {}),
    )
    run_rank(cfg, worker, rank, world, local_rank, local_world, seat=seat)


def forked_ranks(
    cfg: Config,
    worker: Worker,
    port: int,
    world: int,
    first_local: int = 0,
    local_world: Optional[int] = None,
    seat: Optional[ReplicaSeat] = None,
) -> list[tuple[Callable, tuple]]:
    """A pool's targets for the `world` ranks meeting at `port`: the local world, or an elastic replica's
    (numbered among the launcher's workers from `first_local`, of `local_world`, and handed its `seat`)."""
    local_world = world if local_world is None else local_world
    return [(run_forked_rank, (r, cfg, worker, port, world, first_local + r, local_world, seat)) for r in range(world)]
