"""Start the workers: torchrun's environment, or local processes under one of two strategies.

Under torchrun (RANK/WORLD_SIZE set) this process is one worker (hsdp/run/rank.py); torchrun's agent owns
the workers' lifetime and signals. Otherwise the launch picks a strategy over one pool of local workers
(hsdp/run/pool.py, forked by a zygote that has already imported torch and the worker's module):

- local (hsdp/run/local.py): one world of `mesh.sync × mesh.replicate × mesh.shard` ranks (a world of 1
  in-process); the first rank to fail ends all, and `WorkerError` carries the root cause;
- elastic (hsdp/run/replicas.py; `elastic.enabled`): torchft's lighthouse, then one world per replica,
  each restarted alone when it fails.

Either way SIGINT/SIGTERM stops every local worker and `launch` raises `Interrupted` (exit code 130 / 143;
hsdp/run/stop.py). Each strategy reads the pool's events and decides; nothing below calls back up here.
"""

from __future__ import annotations

import os
from typing import Optional

from hsdp.config.schema import Config
from hsdp.run.local import launch_local
from hsdp.run.pool import WorkerError
from hsdp.run.rank import Worker, run_torchrun_rank
from hsdp.run.replicas import enter_torchrun_replica, launch_elastic
from hsdp.run.stop import Interrupted, StopSignals
from hsdp.sync.seam import ReplicaSeat

# The launcher's names its callers import (train.py, hsdp.plan): the exceptions a launch ends with live
# with the strategies that raise them.
__all__ = ["Interrupted", "WorkerError", "launch", "torchrun_seat", "under_torchrun"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_seat(cfg: Config) -> Optional[ReplicaSeat]:
    """Under torchrun, an elastic run's agent is one replica: its seat (which replica, which start of it,
    the lighthouse; ConfigError if elastic.replica or elastic.lighthouse is wrong). None otherwise: the
    local elastic launcher gives each replica's workers theirs."""
    return enter_torchrun_replica(cfg) if cfg.elastic.enabled and under_torchrun() else None


def launch(cfg: Config, worker: Worker, seat: Optional[ReplicaSeat] = None) -> None:
    """Run `worker(cfg)` on every rank of the mesh (`worker(cfg, seat)` for an elastic replica's ranks: the
    local elastic launcher's seats, or under torchrun the agent's `seat`).

    Raises WorkerError if any rank fails, Interrupted (after stopping the workers)
    on SIGINT/SIGTERM. The mesh is assumed checked (`load_checked_config`, the torchrun world included).
    """
    if under_torchrun():  # one worker; under an elastic run, one replica per agent
        return run_torchrun_rank(cfg, worker, seat)
    with StopSignals() as stop:
        if cfg.elastic.enabled:
            return launch_elastic(cfg, worker, stop)
        return launch_local(cfg, worker, stop)
