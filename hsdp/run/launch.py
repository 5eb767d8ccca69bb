"""Start the workers: torchrun's environment, or `sync·shard` local processes.

Under torchrun (RANK/WORLD_SIZE set) this process is one worker. Otherwise a
world of 1 runs in-process and a larger world runs as local processes (gloo on
CPU, nccl on CUDA), forked by this launcher's zygote, a process that has already
imported torch and the worker's module (`start_zygote`, hsdp.run.zygote). The
first rank to fail ends every rank and `launch` raises `WorkerError` carrying
that rank's traceback (the rank whose error is its own, not a peer's "connection
closed": `_root_cause`); a hung collective fails after `mesh.timeout_s`.

Stopping: SIGINT or SIGTERM to the launcher stops every local worker (SIGTERM,
then SIGKILL after `STOP_GRACE_S`) and `launch` raises `Interrupted`, whose
`exit_code` is 128 + the signal number (130 / 143). A SIGINT that the launcher
inherited as ignored (a background job of a script) stays ignored. Workers
ignore SIGINT themselves (a terminal's Ctrl-C reaches the whole process group,
and the launcher coordinates the stop) and die if the launcher dies without
cleaning up (`kill -9`): the zygote kills them and exits when the launcher's
ends of its socket and of the launch's lifeline pipe close, and a worker dies
with the zygote (PR_SET_PDEATHSIG on Linux, a parent-pid watchdog elsewhere).
"""

from __future__ import annotations

import datetime
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from hsdp.config.schema import Config, ConfigError
from hsdp.engines.registry import engine_modules
from hsdp.run.checkpoint import elastic_resume_note
from hsdp.run.guard import ONE_LINE_ERRORS
from hsdp.run.metrics import write_failure
from hsdp.run.replicas import (
    ElasticLaunch,
    check_lighthouse_reachable,
    enter_torchrun_replica,
    start_lighthouse,
    worker_env,
    write_summary,
)
from hsdp.run.zygote import Exit, Workers, Zygote
from hsdp.sync.seam import ReplicaSeat
from hsdp.torch_compat import RANK_LAZY_IMPORTS, register_fake_backend

# worker(cfg); an elastic replica's worker(cfg, seat), its ReplicaSeat (which replica, which start of it)
Worker = Callable[..., None]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 3.0  # seconds a worker gets to exit after SIGTERM before it is killed
KILL_WAIT_S = 10.0  # seconds to wait for the zygote to report SIGKILLed workers gone
_zygote: Optional[Zygote] = None  # start_zygote's


class WorkerError(RuntimeError):
    """A worker rank failed; the message holds that rank's error."""


class Interrupted(BaseException):
    """The launcher was asked to stop by a signal; its workers are gone when this is raised.

    A BaseException (like KeyboardInterrupt), so that `except Exception` in a worker
    running in-process does not swallow it.
    """

    def __init__(self, signum: int, workers: int = 0) -> None:
        self.signum = signum
        self.workers = workers
        super().__init__(f"{signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]  # signal.getsignal's


class StopSignals:
    """While active, SIGINT/SIGTERM in the main thread become `Interrupted` once armed.

    Before `arm()` a signal is only recorded: raising while torch is still starting
    processes would lose track of the ones already started. The first signal disarms,
    so a second Ctrl-C cannot interrupt the cleanup.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._armed = False
        self._previous: dict[int, _Handler] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if sig == signal.SIGINT and previous == signal.SIG_IGN:
                continue  # started as a background job: Ctrl-C is not meant for us
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if self._armed:
            self._armed = False
            raise Interrupted(signum)

    def arm(self) -> None:
        """Raise `Interrupted` for a signal that came before, and for any later one."""
        if self.received is not None:
            raise Interrupted(self.received)
        self._armed = True

    def disarm(self) -> None:
        self._armed = False

    def __exit__(self, *exc: object) -> None:
        self._armed = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


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


def _init_and_run(
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


def _local_worker(
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
    _init_and_run(cfg, worker, rank, world, local_rank, local_world, seat=seat)


def _launch_elastic(cfg: Config, worker: Worker, stop: StopSignals) -> None:
    """An elastic run (hsdp/run/replicas.py): the lighthouse, then one local world per replica, each restarted
    alone when it fails. Raises WorkerError if a replica was given up (the others still finished)."""
    note = elastic_resume_note(cfg)  # replicas resuming from different steps: say who heals from whom
    if note:
        print(note, file=sys.stderr)
    try:
        check_lighthouse_reachable(cfg)  # one line now, not a restart of every replica until max_restarts
    except ConfigError as e:
        raise WorkerError(str(e)) from None
    server, address = start_lighthouse(cfg)
    shard, local_world = cfg.mesh.replicate * cfg.mesh.shard, cfg.world_size  # a replica's (a site's) ranks
    try:
        with start_zygote(worker, cfg.compile.enabled).workers() as workers:
            stores: dict[int, dist.TCPStore] = {}  # a fresh one per start: a restarted world must not see old keys

            def start_group(m: int, restarts: int) -> list[int]:
                stores[m] = host_rendezvous_store(cfg.mesh.timeout_s)
                port, seat = stores[m].port, ReplicaSeat(m, restarts, address)
                targets = [
                    (_local_worker, (r, cfg, worker, port, shard, m * shard + r, local_world, seat))
                    for r in range(shard)
                ]
                return workers.start(targets)

            run = ElasticLaunch(cfg, workers, start_group)
            stopped_at: dict[int, float] = {}
            try:
                for m in range(cfg.mesh.sync):
                    run.start(m)
                stop.arm()
                while run.running:
                    for ended in workers.wait(0.2):
                        run.on_exit(ended)
                    # A stopped worker neither exits nor heartbeats: its replica's peers may wait on it forever
                    # (a replica of one rank has none that would time out). Fail its replica after the bound.
                    stalled = _stopped_too_long(workers, cfg.mesh.timeout_s, stopped_at)
                    if stalled is not None:
                        stopped_at.pop(workers.pids[stalled.index], None)  # a stalled worker has a pid
                        run.on_stalled(stalled)
                    run.restart_due()
            except Interrupted as e:
                stop.disarm()
                raise Interrupted(e.signum, stop_workers(workers)) from None
            finally:
                stop.disarm()
                stop_workers(workers)
                run.end()  # replicas.json: no live pids left
            try:
                write_summary(cfg, run)
            except OSError as e:  # a full disk: one line naming the file and the bytes free
                raise WorkerError(write_failure(cfg.run_dir / "summary.json", e)) from None
            failed = run.outcome()
            if failed:
                raise WorkerError(failed)
    finally:
        if server is not None:
            server.shutdown()


def stop_workers(workers: Workers, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM every running worker, SIGKILL those still running after `grace_s`; return how many were running."""
    running = len(workers.running())
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        if not workers.running():
            break
        workers.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while workers.running() and (left := deadline - time.monotonic()) > 0:
            workers.wait(left)
    return running


def start_zygote(worker: Worker, compiled: bool = False) -> Zygote:
    """This process's zygote (started on first use): it has imported torch, the engines and the worker's module,
    and forks workers.

    Spawning would import them again in every worker (~2 s of CPU each: on a 2-core box a
    4-rank run spent ~8 s of an 11 s, 3-step job starting up). The zygote is this process forked
    when that is clean (CPU torch, no other Python thread), else a fresh interpreter (no thread or
    CUDA state of ours: hsdp.run.zygote.can_fork_launcher); it is started once per launcher process and
    reused by later launches, including those of processes forked from this one (the test
    suite's warm launcher); it exits with the launcher (hsdp.run.zygote). `compiled`: it also
    prepares torch.compile once for all ranks (hsdp.compile.prewarm).
    """
    global _zygote
    if _zygote is None or not _zygote.alive():
        if _zygote is not None:
            _zygote.close()  # reap the dead one
        module = getattr(worker, "func", worker).__module__  # a functools.partial's function's module
        main = getattr(sys.modules["__main__"], "__file__", None) if module == "__main__" else None
        preload = ["torch", *RANK_LAZY_IMPORTS, "hsdp.run.launch", *engine_modules(compiled)]
        preload += ["hsdp.compile.prewarm"] if compiled else []
        preload += [] if module == "__main__" else [module]
        _zygote = Zygote(preload, main_path=os.path.abspath(main) if main else None)
    return _zygote


def _process_state(pid: Optional[int]) -> str:
    """The one-letter state of a process from /proc (R, S, D, T for stopped, ...); "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return ""


def _stopped_too_long(workers: Workers, timeout_s: float, stopped_at: dict[int, float]) -> Optional[Exit]:
    """A worker whose process has been stopped (SIGSTOP, a debugger) for longer than mesh.timeout_s, as a failure.

    Its peers would otherwise each wait out their own collective timeout, eager or compiled, and
    report themselves; this names the rank that stopped answering. `stopped_at`: this launch's
    pid → when it was first seen stopped.
    """
    now = time.monotonic()
    for index in workers.running():
        pid = workers.pids.get(index)
        if pid is None:  # not spawned yet
            continue
        if _process_state(pid) not in ("T", "t"):
            stopped_at.pop(pid, None)
            continue
        since = stopped_at.setdefault(pid, now)
        if now - since > timeout_s:
            why = f"its process (pid {pid}) has been stopped for over mesh.timeout_s={timeout_s:g} s"
            return Exit(index, None, why, stalled=True)
    return None


# What a rank raises when a peer died or went quiet: a symptom of another rank's failure, not a cause.
PEER_LOSS_SYMPTOMS = (
    "Connection closed by peer",  # gloo, the peer's sockets closed as it exited
    "Connection reset by peer",
    "remote worker crashing",  # torch's hint on a gloo peer loss
    "Broken pipe",
    "CollectiveTimeout",  # ours
    "Timed out waiting",  # gloo's
)


def _is_symptom(ended: Exit) -> bool:
    """True if `ended` failed because a peer failed first (its error is about the lost peer)."""
    return ended.code is not None and ended.code > 0 and any(s in ended.traceback for s in PEER_LOSS_SYMPTOMS)


def _root_cause(workers: Workers, failed: list[Exit], grace_s: float = 5.0) -> Exit:
    """The failure to report out of the ranks `failed` that just ended non-zero: the first whose error is its
    own; if all are peer-loss symptoms, one that ends within `grace_s` with an error of its own (the rank
    that raised tears its sockets down as it exits, so its peers' "connection closed" can reach the
    launcher before its own exit does on a busy machine); else the first."""
    deadline = time.monotonic() + grace_s
    ended = list(failed)
    while (cause := next((e for e in ended if not _is_symptom(e)), None)) is None:
        left = deadline - time.monotonic()
        if not workers.running() or left <= 0:
            return failed[0]
        ended = [e for e in workers.wait(min(left, 0.2)) if e.code != 0]
    return cause


def _not_answering(workers: Workers, failed: Exit, grace_s: float = 3.0) -> list[int]:
    """After a rank timed out in a collective: the ranks that are stopped, or that do not also fail within
    `grace_s` (their peers time out too), i.e. the ones that stopped answering."""
    if "CollectiveTimeout" not in failed.traceback and "Timed out waiting" not in failed.traceback:  # ours, gloo's
        return []
    deadline = time.monotonic() + grace_s
    while workers.running() and (left := deadline - time.monotonic()) > 0:
        stopped = [i for i in workers.running() if _process_state(workers.pids.get(i)) in ("T", "t")]
        if stopped:
            return stopped
        workers.wait(min(left, 0.2))
    return workers.running()


def _failure(ended: Exit, silent: Sequence[int] = ()) -> str:
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
    if cfg.elastic.enabled and not under_torchrun():  # under torchrun: one replica per agent, as below
        with StopSignals() as stop:
            return _launch_elastic(cfg, worker, stop)
    if under_torchrun():  # torchrun's agent owns the workers' lifetime and signals
        world = int(os.environ["WORLD_SIZE"])
        _init_and_run(
            cfg,
            worker,
            int(os.environ["RANK"]),
            world,
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            seat=seat,
        )
        return
    world = cfg.world_size
    store = host_rendezvous_store(cfg.mesh.timeout_s)
    port = store.port
    with StopSignals() as stop:
        if world == 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            stop.arm()
            try:
                _init_and_run(cfg, worker, 0, 1, 0, 1, store=store)  # in this process: no env flag left behind
            except KeyboardInterrupt:  # SIGINT with our handler not installed (not the main thread)
                raise Interrupted(signal.SIGINT) from None
            except Exception as e:  # same report as a spawned rank's failure (one line for a one-line error)
                raise WorkerError(_failure(Exit(0, 1, traceback.format_exc()))) from e
            return
        with start_zygote(worker, cfg.compile.enabled).workers() as workers:
            workers.start([(_local_worker, (rank, cfg, worker, port, world)) for rank in range(world)])
            failed: Optional[Exit] = None
            silent: list[int] = []
            stopped_at: dict[int, float] = {}
            try:
                stop.arm()
                while failed is None and workers.running():
                    ended = [e for e in workers.wait(1.0) if e.code != 0]
                    failed = _root_cause(workers, ended) if ended else None
                    if failed is None:
                        failed = _stopped_too_long(workers, cfg.mesh.timeout_s, stopped_at)
                if failed is not None and failed.index not in workers.running():
                    silent = _not_answering(workers, failed)
            except Interrupted as e:
                stop.disarm()
                raise Interrupted(e.signum, stop_workers(workers)) from None
            finally:
                stop.disarm()
                stop_workers(workers)  # the others after a failure; no-op after a clean run
            if failed is not None:
                raise WorkerError(_failure(failed, silent))
