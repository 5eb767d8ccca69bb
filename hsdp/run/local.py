"""The local strategy: one world of `cfg.world_size` ranks on this machine; the first rank to fail ends all.

A world of 1 runs in this process; a larger one runs on a pool of forked workers (hsdp/run/pool.py; gloo on
CPU, nccl on CUDA). The strategy reads the pool's events and, at the first failure, stops the others and
raises `WorkerError` carrying the root cause: the rank whose error is its own, not a peer's "connection
closed" (`root_cause`); a rank stopped past mesh.timeout_s, or one a timed-out peer waited on, is named as
the one that stopped answering. A hung collective fails after `mesh.timeout_s`.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Optional, Protocol

from hsdp.config.schema import Config
from hsdp.run.guard import ONE_LINE_ERRORS
from hsdp.run.pool import Exit, Pool, WorkerError, start_zygote
from hsdp.run.rank import Worker, forked_ranks, host_rendezvous_store, run_rank
from hsdp.run.stop import Interrupted, StopSignals

# What a rank raises when a peer died or went quiet: a symptom of another rank's failure, not a cause.
PEER_LOSS_SYMPTOMS = (
    "Connection closed by peer",  # gloo, the peer's sockets closed as it exited
    "Connection reset by peer",
    "remote worker crashing",  # torch's hint on a gloo peer loss
    "Broken pipe",
    "CollectiveTimeout",  # ours
    "Timed out waiting",  # gloo's
)


class Events(Protocol):
    """The part of a `Pool` that reading its events takes (tests script one)."""

    def running(self) -> list[int]: ...

    def poll(self, timeout: Optional[float]) -> list[Exit]: ...

    def stopped(self) -> list[int]: ...


def launch_local(cfg: Config, worker: Worker, stop: StopSignals) -> None:
    """Run `worker(cfg)` on every rank of the local world. Raises WorkerError naming the failing rank, or
    Interrupted (after stopping the workers) on SIGINT/SIGTERM."""
    if cfg.world_size == 1:
        return run_in_process(cfg, worker, stop)
    return run_forked(cfg, worker, stop)


def run_in_process(cfg: Config, worker: Worker, stop: StopSignals) -> None:
    """A world of 1, in this process: handed the store (no env flag left behind), its failure reported as a
    forked rank's would be (one line for a one-line error)."""
    store = host_rendezvous_store(cfg.mesh.timeout_s)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    stop.arm()
    try:
        run_rank(cfg, worker, 0, 1, 0, 1, store=store)
    except KeyboardInterrupt:  # SIGINT with our handler not installed (not the main thread)
        raise Interrupted(signal.SIGINT) from None
    except Exception as e:
        raise WorkerError(failure_message(Exit(0, 1, traceback.format_exc()))) from e


def run_forked(cfg: Config, worker: Worker, stop: StopSignals) -> None:
    """The world's ranks on a pool of forked workers, watched until all finish or the first fails."""
    store = host_rendezvous_store(cfg.mesh.timeout_s)  # bound before any rank starts
    with Pool(start_zygote(worker, cfg.compile.enabled), stall_after_s=cfg.mesh.timeout_s) as pool:
        with stop.guarding(pool):  # the others after a failure; none after a clean run
            pool.start(forked_ranks(cfg, worker, store.port, cfg.world_size))
            stop.arm()
            failed, silent = watch(pool)
    if failed is not None:
        raise WorkerError(failure_message(failed, silent))


def watch(pool: Events) -> tuple[Optional[Exit], list[int]]:
    """Read the pool's events until every worker finished or one failed (ended non-zero, or stalled). Returns
    the failure to report (None: all finished) and, when it was a rank timing out in a collective, the ranks
    that stopped answering."""
    while pool.running():
        failures = [e for e in pool.poll(1.0) if e.code != 0]
        if failures:
            failed = root_cause(pool, failures)
            return failed, [] if failed.stalled else not_answering(pool, failed)
    return None, []


def is_symptom(ended: Exit) -> bool:
    """True if `ended` failed because a peer failed first (its error is about the lost peer)."""
    return ended.code is not None and ended.code > 0 and any(s in ended.traceback for s in PEER_LOSS_SYMPTOMS)


def root_cause(pool: Events, failed: list[Exit], grace_s: float = 5.0) -> Exit:
    """The failure to report out of the ranks `failed` that just ended non-zero (or stalled): the first whose
    error is its own; if all are peer-loss symptoms, one that ends within `grace_s` with an error of its own
    (the rank that raised tears its sockets down as it exits, so its peers' "connection closed" can reach the
    launcher before its own exit does on a busy machine); else the first."""
    deadline = time.monotonic() + grace_s
    ended = list(failed)
    while (cause := next((e for e in ended if not is_symptom(e)), None)) is None:
        left = deadline - time.monotonic()
        if not pool.running() or left <= 0:
            return failed[0]
        ended = [e for e in pool.poll(min(left, 0.2)) if e.code != 0]
    return cause


def not_answering(pool: Events, failed: Exit, grace_s: float = 3.0) -> list[int]:
    """After a rank timed out in a collective: the ranks that are stopped, or that do not also fail within
    `grace_s` (their peers time out too), i.e. the ones that stopped answering."""
    if "CollectiveTimeout" not in failed.traceback and "Timed out waiting" not in failed.traceback:  # ours, gloo's
        return []
    deadline = time.monotonic() + grace_s
    while pool.running() and (left := deadline - time.monotonic()) > 0:
        stopped = pool.stopped()
        if stopped:
            return stopped
        pool.poll(min(left, 0.2))
    return pool.running()


def failure_message(ended: Exit, silent: Sequence[int] = ()) -> str:
    """WorkerError's message for a worker that did not exit cleanly; its last line is the error itself."""
    rank = f"rank {ended.index}"
    if ended.stalled:
        return f"{rank} stopped answering: {ended.traceback}"
    if silent:
        last = ended.traceback.rstrip().splitlines()[-1].split(": ", 1)[-1]
        names = ", ".join(str(i) for i in silent)
        return f"rank{'s' if len(silent) > 1 else ''} {names} stopped answering; {rank} waited for it: {last}"
    if ended.code is None:
        return f"{rank} ended with an unknown status ({ended.traceback})"
    if ended.traceback:
        last = ended.traceback.rstrip().splitlines()[-1]
        if last.split(":", 1)[0] in ONE_LINE_ERRORS:  # the message says it all (e.g. Diverged)
            return f"{rank}: {last.split(': ', 1)[-1]}"
        return f"{rank} failed:\n{ended.traceback.rstrip()}"
    if ended.code < 0:
        return f"{rank} was killed by {signal.Signals(-ended.code).name}"
    return f"{rank} exited with code {ended.code}"
