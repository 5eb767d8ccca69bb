"""One launch's worker processes: start them, poll what happened to them, signal them, stop them.

A `Pool` owns the workers one launch forks through this launcher's zygote (hsdp/run/zygote.py; `start_zygote`
starts it once per process). It reports and decides nothing: `poll` hands out events, a worker that ended
(its exit status and traceback) or one stopped (SIGSTOP, a debugger) for longer than the pool's stall bound,
and the launch's strategy (hsdp/run/local.py, hsdp/run/replicas.py) reads them and acts through the pool's
`start`, `signal` and `stop`. Nothing here calls back into a strategy.

Leaving the pool (it is a context manager) closes the launch's lifeline pipe, so the zygote SIGKILLs any
worker still running; `stop` is the graceful way out (SIGTERM, then SIGKILL after `STOP_GRACE_S`).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from hsdp.engines.registry import engine_modules
from hsdp.run.zygote import Zygote
from hsdp.torch_compat import RANK_LAZY_IMPORTS

STOP_GRACE_S = 3.0  # seconds a worker gets to exit after SIGTERM before it is killed
KILL_WAIT_S = 10.0  # seconds to wait for the zygote to report SIGKILLed workers gone
Target = tuple[Callable, tuple]  # a worker's function and its arguments (pickled to the zygote)
_zygote: Optional[Zygote] = None  # start_zygote's


@dataclass
class Exit:
    """What happened to worker `index`: it ended with `code` (as os.waitstatus_to_exitcode, -N: killed by signal
    N; None if unknown), or, `stalled`, it still runs but has been stopped past the pool's stall bound."""

    index: int
    code: Optional[int]
    traceback: str = ""  # what the worker's target raised, or why the code is unknown, or why it stalled
    stalled: bool = False


class WorkerError(RuntimeError):
    """A worker rank failed; the message holds that rank's error."""


def start_zygote(worker: Callable, compiled: bool = False, also: Sequence[str] = ()) -> Zygote:
    """This process's zygote (started on first use): it has imported torch, the engines and the worker's module,
    and forks workers.

    Spawning would import them again in every worker (~2 s of CPU each: on a 2-core box a
    4-rank run spent ~8 s of an 11 s, 3-step job starting up). The zygote is this process forked
    when that is clean (CPU torch, no other Python thread), else a fresh interpreter (no thread or
    CUDA state of ours: hsdp.run.zygote.can_fork_launcher); it is started once per launcher process and
    reused by later launches, including those of processes forked from this one (the test
    suite's warm launcher); it exits with the launcher (hsdp.run.zygote). `compiled`: it also
    prepares torch.compile once for all ranks (hsdp.compile.prewarm). `also`: more modules to preload (an
    elastic run's torchft: a restarted replica's start is on the clock, docs/results/restart.md).
    """
    global _zygote
    if _zygote is None or not _zygote.alive():
        if _zygote is not None:
            _zygote.close()  # reap the dead one
        module = getattr(worker, "func", worker).__module__  # a functools.partial's function's module
        main = getattr(sys.modules["__main__"], "__file__", None) if module == "__main__" else None
        # hsdp.run.rank: the forked ranks' entry (run_forked_rank)
        preload = ["torch", *RANK_LAZY_IMPORTS, "hsdp.run.rank", *engine_modules(compiled)]
        preload += ["hsdp.compile.prewarm"] if compiled else []
        preload += [] if module == "__main__" else [module]
        preload += also
        _zygote = Zygote(preload, main_path=os.path.abspath(main) if main else None)
    return _zygote


def process_state(pid: Optional[int]) -> str:
    """The one-letter state of a process from /proc (R, S, D, T for stopped, ...); "" if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return ""


class Pool:
    """One launch's workers, forked by `zygote`: each reported once by `poll` when it ends.

    `stall_after_s`: a running worker whose process has been stopped for longer is reported once as
    `Exit(stalled=True)` (its peers would otherwise each wait out their own collective timeout); None: never.
    Use as a context manager: leaving it closes the lifeline (the zygote then kills any worker still running)
    and the status pipes.
    """

    def __init__(self, zygote: Zygote, stall_after_s: Optional[float] = None) -> None:
        self._zygote = zygote
        self.stall_after_s = stall_after_s
        self._lifeline_r, self._lifeline_w = os.pipe()
        self._ids: dict[str, int] = {}  # spawn id -> worker index
        self.pids: dict[int, int] = {}  # worker index -> pid, once the zygote has forked it
        self._status: dict[int, int] = {}  # status pipe read end -> worker index
        self._tracebacks: dict[int, bytearray] = {}
        self._exits: dict[int, Exit] = {}
        self._new: list[Exit] = []  # exits not yet handed out by poll()
        self._stopped_at: dict[int, float] = {}  # worker index -> when its process was first seen stopped
        self._stalled: set[int] = set()  # workers already reported as stalled

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in [fd for fd in (self._lifeline_w, self._lifeline_r, *self._status) if fd >= 0]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._status.clear()
        self._lifeline_w = self._lifeline_r = -1

    def start(self, targets: Sequence[Target]) -> list[int]:
        """Fork one worker per `(function, args)`; return their indices once all are forked.

        The first call's workers are 0..n-1; a later call (an elastic run restarting a replica) numbers
        its workers on from there.
        """
        first = len(self._tracebacks)
        indices = list(range(first, first + len(targets)))
        for index, (function, args) in zip(indices, targets):
            spawn_id = uuid.uuid4().hex
            status_r, status_w = os.pipe()
            os.set_blocking(status_r, False)
            self._status[status_r] = index
            self._tracebacks[index] = bytearray()
            self._ids[spawn_id] = index
            try:
                self._zygote.spawn(spawn_id, function, args, status_w, self._lifeline_r)
            finally:
                os.close(status_w)  # the worker holds the write end now: EOF when it (and its children) end
            if self._zygote.gone:
                self._zygote_gone()
        while any(i not in self.pids and i not in self._exits for i in indices):
            self._read(None)
        return indices

    def running(self) -> list[int]:
        return [i for i in self._ids.values() if i not in self._exits]

    def poll(self, timeout: Optional[float]) -> list[Exit]:
        """What happened since the last call, waiting up to `timeout` seconds for a worker to end: the workers
        that ended, then those newly stalled (each reported once; a stalled worker still runs)."""
        if not self._new and self.running():
            self._read(timeout)
        ended, self._new = self._new, []
        return ended + self._newly_stalled()

    def stopped(self) -> list[int]:
        """The running workers whose processes are stopped right now (SIGSTOP, a debugger)."""
        return [i for i in self.running() if process_state(self.pids.get(i)) in ("T", "t")]

    def signal(self, sig: int, indices: Optional[Sequence[int]] = None) -> None:
        """Send `sig` to every running worker, or to those of `indices` (through the zygote: a pid it has not
        reaped yet is still that worker)."""
        for spawn_id, index in self._ids.items():
            if index not in self._exits and (indices is None or index in indices):
                self._zygote.kill(spawn_id, sig)
        if self._zygote.gone:
            self._zygote_gone()

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """SIGTERM every running worker, SIGKILL those still running after `grace_s`; return how many were
        running. Their exits are consumed here: a stopped launch reads no more events."""
        running = len(self.running())
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
            if not self.running():
                break
            self.signal(sig)
            deadline = time.monotonic() + wait_s
            while self.running() and (left := deadline - time.monotonic()) > 0:
                self.poll(left)
        return running

    def _newly_stalled(self) -> list[Exit]:
        """The running workers stopped for longer than `stall_after_s` and not reported yet, as events."""
        if self.stall_after_s is None:
            return []
        now, stalled = time.monotonic(), []
        for index in self.running():
            pid = self.pids.get(index)
            if pid is None or index in self._stalled:  # not forked yet, or already reported
                continue
            if process_state(pid) not in ("T", "t"):
                self._stopped_at.pop(index, None)
                continue
            since = self._stopped_at.setdefault(index, now)
            if now - since > self.stall_after_s:
                self._stalled.add(index)
                why = f"its process (pid {pid}) has been stopped for over mesh.timeout_s={self.stall_after_s:g} s"
                stalled.append(Exit(index, None, why, stalled=True))
        return stalled

    def _read(self, timeout: Optional[float]) -> None:
        """Wait up to `timeout` for the zygote's replies and the workers' status pipes, and take them in."""
        if self._zygote.gone:
            return self._zygote_gone()
        sock = self._zygote.fileno()
        readable, _, _ = select.select([sock, *self._status], [], [], timeout)
        for fd in readable:
            if fd in self._status:
                self._read_status(fd)
        if sock in readable:
            for msg in self._zygote.receive():
                self._take_reply(msg)
            if self._zygote.gone:
                self._zygote_gone()

    def _take_reply(self, msg: dict) -> None:
        index = self._ids.get(msg.get("id", ""))
        if index is None or index in self._exits:
            return  # about an earlier launch's worker (its launcher was killed), or already reported
        if msg["op"] == "spawned":
            self.pids[index] = msg["pid"]
        elif msg["op"] == "exited":
            for fd in [fd for fd, i in self._status.items() if i == index]:
                self._read_status(fd)
            text = self._tracebacks[index].decode(errors="replace") or msg.get("why", "")
            self._ended(Exit(index, msg["code"], text))

    def _read_status(self, fd: int) -> None:
        index = self._status[fd]
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:  # the worker (and anything it forked) closed it
                del self._status[fd]
                os.close(fd)
                return
            self._tracebacks[index] += chunk

    def _ended(self, ended: Exit) -> None:
        self._exits[ended.index] = ended
        self._new.append(ended)

    def _zygote_gone(self) -> None:
        for index in self.running():  # its workers die with it
            self._ended(Exit(index, None, "the zygote process exited"))
