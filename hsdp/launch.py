"""Start the workers: torchrun's environment, or `sync·shard` local processes.

Under torchrun (RANK/WORLD_SIZE set) this process is one worker. Otherwise a
world of 1 runs in-process and a larger world is spawned locally (gloo on CPU,
nccl on CUDA). A crash on any rank terminates every rank (torch.multiprocessing
does that on the first failure) and `launch` raises `WorkerError` carrying that
rank's traceback; a hung collective fails after `mesh.timeout_s`.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hsdp.config import Config, ConfigError, validate

Worker = Callable[[Config], None]


class WorkerError(RuntimeError):
    """A worker rank failed; the message holds that rank's error."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(cfg: Config, device: torch.device) -> str:
    if cfg.mesh.backend != "auto":
        return cfg.mesh.backend
    return "nccl" if device.type == "cuda" else "gloo"


def _init_and_run(cfg: Config, worker: Worker, rank: int, world: int, local_rank: int, local_world: int) -> None:
    # Share the CPU among local ranks; oversubscription makes gloo runs crawl.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    device = pick_device(local_rank)
    timeout = datetime.timedelta(seconds=cfg.mesh.timeout_s)
    dist.init_process_group(backend_for(cfg, device), rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    try:
        worker(cfg)
    finally:
        shutdown_process_group()


def shutdown_process_group() -> None:
    """Destroy the process groups and free them now, while the interpreter is fully alive.

    Our mesh objects keep the groups referenced (the engine and its units form a
    reference cycle), so without the collect they would be freed in the
    interpreter's final GC. A gloo worker thread that then drops a Work created in
    backward (it holds a Python object from the autograd TLS) needs the GIL, finds
    the interpreter finalizing and aborts the process ("terminate called without
    an active exception").
    """
    dist.destroy_process_group()
    gc.collect()


def _spawned(local_rank: int, cfg: Config, worker: Worker, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world))
    _init_and_run(cfg, worker, local_rank, world, local_rank, world)


def launch(cfg: Config, worker: Worker) -> None:
    """Run `worker(cfg)` on every rank of the mesh; raise WorkerError if any rank fails."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        world = int(os.environ["WORLD_SIZE"])
        validate(cfg, world_size=world)
        _init_and_run(cfg, worker, int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
                      int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        return
    world = cfg.world_size
    if torch.cuda.is_available() and world > torch.cuda.device_count() and cfg.mesh.backend != "gloo":
        raise ConfigError(f"mesh: sync×shard = {world} ranks but only {torch.cuda.device_count()} GPUs here; "
                          "use torchrun across nodes or mesh.backend=gloo")
    port = _free_port()
    if world == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            _init_and_run(cfg, worker, 0, 1, 0, 1)
        except Exception as e:  # same report as a spawned rank's failure
            raise WorkerError(f"rank 0 failed:\n{traceback.format_exc()}") from e
        return
    try:
        mp.start_processes(_spawned, args=(cfg, worker, port, world), nprocs=world, join=True,
                           start_method="spawn")
    except mp.ProcessRaisedException as e:
        raise WorkerError(f"rank {e.error_index} failed:{str(e).split('following error:', 1)[-1]}") from None
    except mp.ProcessExitedException as e:
        raise WorkerError(f"rank {e.error_index} exited with code {e.exit_code}") from None
