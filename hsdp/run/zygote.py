"""A zygote: one process that imports torch and the worker's module once, then forks the local workers.

The launcher starts it (`Zygote(preload)`) and asks it over a Unix socket to fork one worker
per rank (`Zygote.spawn`; a launch's `Pool`, hsdp/run/pool.py, keeps track of them). The zygote is
the launcher itself, forked, when that is as clean as a fresh interpreter: one Python thread, a torch
built without CUDA and no torchft runtime (`can_fork_launcher`; the launcher has imported torch and
the worker's module already, which saves 2.5-3 s of CPU per launch on a 2-core box). Otherwise (a
CUDA build, whose driver state a fork would share; a launcher with threads; an elastic launcher
running torchft's lighthouse) it is a fresh interpreter, so nothing of the launcher's threads or
state is inherited. Everything is plain `os` / `socket` / `signal` (no multiprocessing internals).
A spawn request carries, as passed file descriptors, the launcher's stdout and stderr (the worker
writes where the launcher writes), the write end of a status pipe (the worker's traceback if it
raises) and the read end of the launch's lifeline pipe. The zygote reaps its children and reports
each exit status; it kills a worker on request.

Nothing is left behind when the launcher dies, even by `kill -9`:
- the zygote exits (killing its workers) when its socket reaches EOF, i.e. when the launcher
  and every process forked from it are gone (only the launcher holds the other end);
- it SIGKILLs a launch's workers when that launch's lifeline reaches EOF: the write end lives
  in the launching process only, so a launcher forked from a long-lived parent that keeps
  the zygote (the test suite's warm launcher) also takes its workers with it;
- a worker dies with the zygote (PR_SET_PDEATHSIG on Linux, a parent-pid watchdog elsewhere).
A worker holds no descriptor of the launcher's but its stdout/stderr, so none of the
EOFs above waits for a worker.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.util
import io
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, cast

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_HEADER = struct.Struct("!IB")  # a message: body length, number of passed descriptors; then the pickled body
_MAX_RECV = 1 << 18  # one receive (a SOCK_SEQPACKET message is whole, and smaller than the socket buffer)
_MAX_FDS = 64
_BLOCKED = {signal.SIGINT, signal.SIGTERM}  # held while a received message is parsed: no half-read message
_BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[2]); from hsdp.run.zygote import serve; serve()"


class _Channel:
    """Framed pickled messages, with descriptors, over a Unix socket (SOCK_SEQPACKET or SOCK_STREAM)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._fds: list[int] = []  # received descriptors not yet handed to their message

    def send(self, msg: dict, fds: Sequence[int] = ()) -> None:
        body = pickle.dumps(msg)
        data = _HEADER.pack(len(body), len(fds)) + body
        sent = socket.send_fds(self.sock, [data], list(fds)) if fds else self.sock.send(data)
        if sent < len(data):  # a stream socket may take part of it
            self.sock.sendall(data[sent:])

    def receive(self) -> list[tuple[dict, list[int]]]:
        """The messages completed by one receive (call when the socket is readable); EOFError at EOF."""
        with _signals_held():
            data, fds, flags, _ = socket.recv_fds(self.sock, _MAX_RECV, _MAX_FDS)
            self._fds.extend(fds)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise OSError("zygote message truncated")
            if not data:
                raise EOFError
            self._buf += data
            messages = []
            while len(self._buf) >= _HEADER.size:
                size, nfds = _HEADER.unpack_from(self._buf)
                if len(self._buf) < _HEADER.size + size:
                    break
                body = bytes(self._buf[_HEADER.size : _HEADER.size + size])
                del self._buf[: _HEADER.size + size]
                passed, self._fds = self._fds[:nfds], self._fds[nfds:]
                messages.append((pickle.loads(body), passed))
            return messages


@contextlib.contextmanager
def _signals_held():
    """Delay SIGINT/SIGTERM (their Python handlers may raise) until the block is done; main thread only."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _socket_pair() -> tuple[socket.socket, socket.socket]:
    try:
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except (AttributeError, OSError):  # e.g. macOS: a byte stream, framed the same way
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` dies, even by SIGKILL."""
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
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class Zygote:
    """The launcher's handle on its zygote process: spawn and kill requests, and their replies.

    It tracks no worker: a launch's `Pool` (hsdp/run/pool.py) does. The zygote preloads the modules
    `preload` and, if `main_path`, that script as `__main__` (under the name `__mp_main__`, so its
    `if __name__ == "__main__"` block does not run). A process forked from the starting one can use it
    too, one launch at a time.
    """

    def __init__(self, preload: Sequence[str], main_path: Optional[str] = None, fork: Optional[bool] = None) -> None:
        """`fork`: fork this process (True), start a fresh interpreter (False), or whichever is clean (None)."""
        ours, theirs = _socket_pair()
        settings = {"fd": theirs.fileno(), "preload": list(preload), "main_path": main_path}
        use_fork = can_fork_launcher() if fork is None else fork
        with theirs:
            if use_fork:
                self.proc: subprocess.Popen | _Forked = _fork_zygote(settings, ours)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, *(f"-W{w}" for w in sys.warnoptions), "-c", _BOOT, json.dumps(settings)]
                    + [json.dumps(sys.path)],
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,  # it prints nothing; a worker gets the launcher's stdout per request
                )
        self._channel = _Channel(ours)
        self._owner = os.getpid()
        self.gone = False
        atexit.register(self.close)

    def alive(self) -> bool:
        """Whether the zygote still serves (also from a process forked from ours: its socket has no hang-up)."""
        if self.gone or self._channel.sock.fileno() < 0:
            return False
        poll = select.poll()
        poll.register(self._channel.sock, select.POLLIN)
        self.gone = any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, events in poll.poll(0))
        return not self.gone

    def fileno(self) -> int:
        """Our end of the socket, readable when a reply came (for `select`); -1 once closed."""
        return self._channel.sock.fileno()

    def spawn(self, spawn_id: str, function: Callable, args: tuple, status_fd: int, lifeline_fd: int) -> None:
        """Ask for a worker running `function(*args)` in this process's directory, sys.path, argv and environment,
        writing to our stdout/stderr; its traceback goes to `status_fd`, and it is killed when `lifeline_fd`'s
        pipe reaches EOF. The reply (`receive`) says "spawned" with its pid, or "exited"."""
        std = [fd if _is_open(fd) else os.open(os.devnull, os.O_WRONLY) for fd in (1, 2)]
        try:
            request = {"op": "spawn", "id": spawn_id, "payload": _payload(function, args)}
            self._send(request, [status_fd, lifeline_fd, *std])
        finally:
            for ours, fd in zip((1, 2), std):
                if fd != ours:
                    os.close(fd)

    def kill(self, spawn_id: str, sig: int) -> None:
        """Send `sig` to that worker (the zygote has not reaped it yet, so its pid is still that worker's)."""
        self._send({"op": "kill", "id": spawn_id, "sig": int(sig)})

    def receive(self) -> list[dict]:
        """The replies one read of the socket completes (call when `fileno()` is readable): {"op": "spawned",
        "id", "pid"} or {"op": "exited", "id", "code", "why"?}; an empty list, with `gone` set, if the zygote
        is gone."""
        try:
            messages = self._channel.receive()
        except (EOFError, OSError):
            self.gone = True
            return []
        for _, fds in messages:
            for fd in fds:  # the zygote passes none; never leak one
                os.close(fd)
        return [msg for msg, _ in messages]

    def _send(self, msg: dict, fds: Sequence[int] = ()) -> None:
        try:
            self._channel.send(msg, fds)
        except ConnectionError:  # BrokenPipeError, ConnectionResetError: it is gone
            self.gone = True

    def close(self, timeout: float = 5.0) -> None:
        """Close our end (the zygote exits, killing any worker left) and reap it; the starting process only."""
        if os.getpid() != self._owner or self._channel.sock.fileno() < 0:
            return
        self._channel.sock.close()
        self.gone = True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class _MainTracker(pickle.Pickler):
    """A pickler that notes whether anything is pickled by reference to `__main__`."""

    uses_main = False

    def reducer_override(self, obj: object) -> Any:  # NotImplemented: pickle it as usual
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.uses_main = True
        return NotImplemented


def _payload(function: Callable, args: tuple) -> bytes:
    """What a forked worker needs: the launcher's directory, sys.path, argv and environment, and the target."""
    target = io.BytesIO()
    pickler = _MainTracker(target)
    pickler.dump((function, args))
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    spec = {
        "cwd": os.getcwd(),
        "sys_path": list(sys.path),
        "argv": list(sys.argv),
        "env": dict(os.environ),
        "main_path": os.path.abspath(main_file) if pickler.uses_main and main_file else None,
        "target": target.getvalue(),
    }
    return pickle.dumps(spec)


def _load_main(path: str) -> None:
    """Make the script `path` this process's `__main__` (as `__mp_main__`: its main block does not run)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file and os.path.abspath(main_file) == path:
        return
    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    assert spec is not None and spec.loader is not None  # a path gets a source file loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    spec.loader.exec_module(module)
    sys.modules["__main__"] = module


# ------------------------------------------------------------------------- the zygote process
def can_fork_launcher() -> bool:
    """Whether a fork of this process is as clean a zygote as a fresh interpreter: Linux, no Python thread but
    this one (none can hold a lock the child would inherit), a torch without CUDA (no driver state to share),
    and torchft's native module not loaded (a local elastic launcher runs torchft's lighthouse: its Rust
    runtime's threads and state would be shared with the workers' torchft clients, which died of SIGSEGV).

    Other native threads may run (torch's own, a TCPStore's): torch and glibc are fork-aware, as torch's
    DataLoader relies on, and the child touches none of their state."""
    torch = sys.modules.get("torch")
    if torch is not None and (torch.version.cuda is not None or torch.version.hip is not None):
        return False
    return sys.platform == "linux" and threading.active_count() == 1 and "torchft._torchft" not in sys.modules


class _Forked:
    """The launcher's handle on a forked zygote: the part of `subprocess.Popen` that `Zygote.close` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                continue
            assert timeout is not None and deadline is not None  # without a timeout, waitpid blocked until the exit
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _fork_zygote(settings: dict, ours: socket.socket) -> _Forked:
    """Fork this (single-threaded) process into the zygote; the child serves and never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return _Forked(pid)
    try:  # as the fresh interpreter starts: stdin and stdout on /dev/null, stderr inherited, no other fd
        ours.close()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        os.closerange(3, settings["fd"])
        os.closerange(settings["fd"] + 1, os.sysconf("SC_OPEN_MAX"))
        for sig in signal.valid_signals():  # the launcher's Python handlers (SIGTERM, ...) are not the zygote's
            with contextlib.suppress(OSError, ValueError, TypeError):
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        serve(settings)
    finally:
        os._exit(1)


def serve(settings: Optional[dict] = None) -> None:
    """The zygote's main: `python -c _BOOT <settings> <sys.path>`, or a forked launcher's (see `Zygote`)."""
    settings = settings if settings is not None else json.loads(sys.argv[1])
    channel = _Channel(socket.socket(fileno=settings["fd"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the launcher decides
    for name in settings["preload"]:
        importlib.import_module(name)
    if settings["main_path"]:
        _load_main(settings["main_path"])
    gc.freeze()  # what is loaded now stays shared with the workers (the collector won't touch it)
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's exit wakes select() through wake_r
    children: dict[int, str] = {}  # unreaped pid -> spawn id
    lifelines: dict[int, int] = {}  # lifeline read end -> pid
    try:
        while True:
            sock = channel.sock.fileno()
            readable, _, _ = select.select([sock, wake_r, *lifelines], [], [])
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
            for fd in readable:
                if fd in lifelines:  # EOF: the launch that started this worker is gone
                    _kill(lifelines.pop(fd), signal.SIGKILL, children)
                    os.close(fd)
            _reap(channel, children, lifelines)
            if sock not in readable:
                continue
            for msg, fds in channel.receive():
                if msg["op"] == "spawn":
                    pid = _fork_worker(msg, fds, [channel.sock.fileno(), wake_r, wake_w, *lifelines])
                    if pid is not None:
                        children[pid] = msg["id"]
                        lifelines[fds[1]] = pid
                        channel.send({"op": "spawned", "id": msg["id"], "pid": pid})
                    else:
                        channel.send({"op": "exited", "id": msg["id"], "code": None, "why": "fork failed"})
                elif msg["op"] == "kill":
                    pid = next((p for p, i in children.items() if i == msg["id"]), None)
                    if pid is None:  # already reaped and reported, or never forked
                        channel.send({"op": "exited", "id": msg["id"], "code": None, "why": "gone"})
                    else:
                        _kill(pid, msg["sig"], children)
    except (EOFError, OSError):  # the launcher is gone (EOF, or a broken pipe when replying)
        pass
    finally:
        for pid in children:
            _kill(pid, signal.SIGKILL, children)
    os._exit(0)


def _kill(pid: int, sig: int, children: dict[int, str]) -> None:
    if pid in children:  # not reaped yet, so the pid is still that worker
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(channel: _Channel, children: dict[int, str], lifelines: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        spawn_id = children.pop(pid, None)
        for fd in [fd for fd, p in lifelines.items() if p == pid]:
            del lifelines[fd]
            os.close(fd)
        if spawn_id is not None:
            channel.send({"op": "exited", "id": spawn_id, "code": os.waitstatus_to_exitcode(status)})


def _fork_worker(msg: dict, fds: list[int], close: Iterable[int]) -> Optional[int]:
    """Fork a worker for a spawn request (fds: status pipe, lifeline, stdout, stderr); its pid, None if fork failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        pid = None
    if pid == 0:
        _run_worker(msg["payload"], fds, list(close), zygote)
    for fd in fds if pid is None else (fds[0], fds[2], fds[3]):  # the lifeline stays watched
        os.close(fd)
    return pid


def _run_worker(payload: bytes, fds: list[int], close: list[int], zygote: int) -> None:
    """In the forked child: become the launcher's worker, run the target, exit (never returns)."""
    status, lifeline, out, err = fds
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in [*close, lifeline]:  # nothing of the zygote's or the launcher's but stdout/stderr stays open
            os.close(fd)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        # as if started on the launcher's stdout (sys.stdout: the interpreter's TextIOWrapper)
        cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=sys.stdout.isatty())
        die_with_parent(zygote)
        spec = pickle.loads(payload)
        os.chdir(spec["cwd"])
        sys.path[:] = spec["sys_path"]
        sys.argv[:] = spec["argv"]
        os.environ.clear()
        os.environ.update(spec["env"])
        if spec["main_path"]:
            _load_main(spec["main_path"])
        function, args = pickle.loads(spec["target"])
        function(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        with contextlib.suppress(OSError):
            text = traceback.format_exc().encode()
            while text:
                text = text[os.write(status, text) :]
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
