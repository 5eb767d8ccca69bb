"""Start the workers: torchrun's environment, or `sync·shard` local processes.

Under torchrun (RANK/WORLD_SIZE set) this process is one worker. Otherwise a
world of 1 runs in-process and a larger world runs as local processes (gloo on
CPU, nccl on CUDA), forked from a multiprocessing fork server that has already
imported torch and the worker's module (`start_fork_server`). A crash on any
rank terminates every rank (torch.multiprocessing does that on the first
failure) and `launch` raises `WorkerError` carrying that rank's traceback; a
hung collective fails after `mesh.timeout_s`.

Stopping: SIGINT or SIGTERM to the launcher stops every local worker (SIGTERM,
then SIGKILL after `STOP_GRACE_S`) and `launch` raises `Interrupted`, whose
`exit_code` is 128 + the signal number (130 / 143). A SIGINT that the launcher
inherited as ignored (a background job of a script) stays ignored. Workers
ignore SIGINT themselves (a terminal's Ctrl-C reaches the whole process group,
and the launcher coordinates the stop) and are killed by the kernel if the
launcher dies without cleaning up (`kill -9`): the fork server exits when the
launcher is gone, and the workers die with it (PR_SET_PDEATHSIG on Linux, a
parent-pid watchdog elsewhere).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import importlib
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hsdp.config.schema import Config
from hsdp.config.preflight import check_world_size

Worker = Callable[[Config], None]
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_GRACE_S = 3.0  # seconds a worker gets to exit after SIGTERM before it is killed
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


class StopSignals:
    """While active, SIGINT/SIGTERM in the main thread become `Interrupted` once armed.

    Before `arm()` a signal is only recorded: raising while torch is still starting
    processes would lose track of the ones already started. The first signal disarms,
    so a second Ctrl-C cannot interrupt the cleanup.
    """

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._armed = False
        self._previous: dict[int, object] = {}

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _init_and_run(cfg: Config, worker: Worker, rank: int, world: int, local_rank: int, local_world: int) -> None:
    torch.set_num_threads(threads_per_rank(local_world))
    device = pick_device(local_rank)
    timeout = datetime.timedelta(seconds=cfg.mesh.timeout_s)
    if cfg.mesh.backend == "fake":  # older torch registers the fake backend only when this module is imported
        importlib.import_module("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group(
        backend_for(cfg, device),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        worker(cfg)
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


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` (the launcher) dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl failed")
    except (AttributeError, OSError):  # not Linux: poll the parent instead

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def _spawned(
    local_rank: int,
    cfg: Config,
    worker: Worker,
    port: int,
    world: int,
    parent_pid: Optional[int],
    launcher_pid: int,
    env: dict[str, str],
) -> None:
    let_fork_server_exit_with_launcher()
    write_where_the_launcher_writes(launcher_pid)
    die_with_parent(parent_pid or os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what a Ctrl-C stops
    os.environ.clear()  # the launcher's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    _init_and_run(cfg, worker, local_rank, world, local_rank, world)


def stop_workers(processes: list, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM every live worker, SIGKILL those still alive after `grace_s`; return how many were alive."""
    alive = [p for p in processes if p is not None and p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    return len(alive)


def start_fork_server(worker: Worker) -> None:
    """Workers fork from a server that has already imported torch and the worker's module.

    Spawning would import them again in every worker (~2 s of CPU each: on a 2-core box a
    4-rank run spent ~8 s of an 11 s, 3-step job starting up). The server starts once per
    launcher process, before any CUDA or thread pool exists in it, and exits with the launcher.
    """
    from multiprocessing import forkserver

    module = getattr(worker, "func", worker).__module__  # a functools.partial's function's module
    forkserver.set_forkserver_preload(["torch", "hsdp.run.launch", module])
    forkserver.ensure_running()


def let_fork_server_exit_with_launcher() -> None:
    """Close this worker's copy of the launcher's end of the fork server's "alive" pipe.

    multiprocessing hands it to every forked child (so children could start processes too);
    while a worker holds it, the server never sees the launcher die, and the workers, which
    die with the server, would outlive a `kill -9` of the launcher.
    """
    from multiprocessing import forkserver

    fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)  # a private attribute (3.10–3.13)
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None


def write_where_the_launcher_writes(launcher_pid: int) -> None:
    """Point this worker's stdout/stderr at the launcher's, if they differ (Linux).

    A worker inherits them from the fork server, i.e. from whoever started it: the same
    files for `python train.py`, but not for later runs of a long-lived process that
    launches several (the test suite's warm launcher), whose output would be lost.
    """
    for fd in (1, 2):
        source = f"/proc/{launcher_pid}/fd/{fd}"
        try:
            theirs, ours = os.stat(source), os.fstat(fd)
            if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
                continue
            reopened = os.open(source, os.O_WRONLY | os.O_APPEND)
        except OSError:  # not Linux, or the launcher's fd is closed: keep ours
            continue
        os.dup2(reopened, fd)
        os.close(reopened)


def fork_server_pid() -> Optional[int]:
    """The fork server's pid: the workers' parent, whose death (it exits with the launcher) ends them.

    None if this Python does not expose it; then a worker takes its parent at start as the fork server.
    """
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(cfg: Config, worker: Worker) -> None:
    """Run `worker(cfg)` on every rank of the mesh.

    Raises WorkerError if any rank fails, Interrupted (after stopping the workers)
    on SIGINT/SIGTERM. The mesh is assumed validated (`load_config`).
    """
    if under_torchrun():  # torchrun's agent owns the workers' lifetime and signals
        world = int(os.environ["WORLD_SIZE"])
        check_world_size(cfg, world)
        _init_and_run(
            cfg,
            worker,
            int(os.environ["RANK"]),
            world,
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        )
        return
    world = cfg.world_size
    port = _free_port()
    with StopSignals() as stop:
        if world == 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            stop.arm()
            try:
                _init_and_run(cfg, worker, 0, 1, 0, 1)
            except KeyboardInterrupt:  # SIGINT with our handler not installed (not the main thread)
                raise Interrupted(signal.SIGINT) from None
            except Exception as e:  # same report as a spawned rank's failure
                raise WorkerError(f"rank 0 failed:\n{traceback.format_exc()}") from e
            return
        start_fork_server(worker)
        context = mp.start_processes(
            _spawned,
            args=(cfg, worker, port, world, fork_server_pid(), os.getpid(), dict(os.environ)),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        try:
            stop.arm()
            while not context.join(timeout=1.0):  # wake every second so a signal handler can run
                continue
        except Interrupted as e:
            stop.disarm()
            raise Interrupted(e.signum, stop_workers(context.processes)) from None
        except mp.ProcessRaisedException as e:
            raise WorkerError(f"rank {e.error_index} failed:{str(e).split('following error:', 1)[-1]}") from None
        except mp.ProcessExitedException as e:
            raise WorkerError(f"rank {e.error_index} exited with code {e.exit_code}") from None
        finally:
            stop.disarm()
            stop_workers(context.processes)  # no-op after a clean join; never leave a worker behind
