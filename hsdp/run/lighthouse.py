"""torchft's lighthouse as a supervised process of its own: started, watched, and started again at the same address.

No replica holds the lighthouse (docs/design.md §9): the local elastic launcher (hsdp/run/replicas.py) and the
slow-link benchmark (hsdp/bench/elastic.py, in a network namespace of its own) each run `torchft_lighthouse` as a
child process with the run's timeouts (`lighthouse_command`), and start it again at the same address when it dies
(`LighthouseProcess.ensure`, or the launcher's `supervise` thread). The lighthouse keeps no state a restart loses
that the replicas do not send again: their heartbeats and their next quorum requests rebuild it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Optional, Union

from hsdp.config.schema import Config
from hsdp.sync.elastic import lighthouse_unreachable

START_TIMEOUT_S = 30.0  # how long a started lighthouse may take to accept connections
SUPERVISE_EVERY_S = 0.2  # how often the launcher's supervisor looks at its lighthouse


class LighthouseError(RuntimeError):
    """The lighthouse could not be started (one line)."""


def lighthouse_binary() -> list[str]:
    """torchft's `torchft_lighthouse` as this interpreter runs it without importing torch (torchft_lighthouse.py)."""
    return [sys.executable, str(Path(__file__).with_name("torchft_lighthouse.py"))]


def lighthouse_timeouts_ms(cfg: Config) -> tuple[int, int]:
    """The lighthouse's join and heartbeat timeouts (ms).

    heartbeat: a replica that stops heartbeating (dead) is out of the next quorum after elastic.heartbeat_timeout_s.
    Its manager heartbeats every 0.1 s from torchft's own thread, whatever the training thread does, so silence
    means a lost process (or a frozen or cut-off one), and a short bound is safe; a restart cannot meet the others
    before its previous life is dropped (it is another replica to the lighthouse), so this bounds every restart
    (docs/results/restart.md).
    join: how long a quorum waits for a replica that still heartbeats but has not asked yet (it is
    training towards the same round, or compiling its first step): mesh.timeout_s, the run's bound on
    a stalled rank. Slowness is not a failure; only silence is. Not the straggler bound either
    (elastic.round_timeout_s): with two replicas torchft's lighthouse never forms a quorum without one that
    heartbeats, and with more, one left out would heal a full state each time; the replicas keep that bound
    themselves, all in every quorum (docs/design.md §9.5).
    """
    return int(cfg.mesh.timeout_s * 1000), int(cfg.elastic.heartbeat_timeout_s * 1000)


def lighthouse_command(cfg: Config, port: int, binary: Optional[Path] = None) -> list[str]:
    """The `torchft_lighthouse` command line for this run's replicas, listening on every address at `port`
    (the command the multi-host launch runs on the lighthouse's host: scripts/slurm/lighthouse.sh)."""
    join_ms, heartbeat_ms = lighthouse_timeouts_ms(cfg)
    return [
        *([str(binary)] if binary else lighthouse_binary()),
        *("--min_replicas", str(cfg.elastic.min_replicas), "--bind", f"[::]:{port}"),
        *("--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(heartbeat_ms)),
        *("--quorum_tick_ms", "100"),
    ]


def free_port() -> int:
    """A TCP port free on this host now (the lighthouse binds it a moment later; it keeps it across restarts)."""
    for family in (socket.AF_INET6, socket.AF_INET):  # the lighthouse binds [::]; a host without IPv6: 0.0.0.0
        try:
            with socket.socket(family) as s:
                s.bind(("", 0))
                return int(s.getsockname()[1])
        except OSError:
            continue
    raise LighthouseError("no free TCP port on this host for the lighthouse")


try:  # looked up here, not in the forked child (where a lock another thread held at the fork would hang it)
    _PRCTL: Optional[Callable[..., int]] = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the thread that started it ends (a launcher killed with -9 must not
    leave a lighthouse behind; `close` stops it first anyway). Linux only; elsewhere `close` is the only stop."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LighthouseProcess:
    """`torchft_lighthouse` as a child process at one address, started again there whenever it has died.

    `prefix` runs it elsewhere (`ip netns exec NS`: the benchmark's own namespace for it); `address` is what the
    replicas are told (elastic.lighthouse); `log` receives its output (None: this process's stderr); `answers`
    says whether it accepts connections (default: a connection to `address` from here; the benchmark's is
    made from inside the network, where its address exists)."""

    def __init__(
        self,
        cfg: Config,
        port: int,
        address: str,
        prefix: Sequence[str] = (),
        log: Optional[Union[Path, IO[str]]] = None,
        answers: Optional[Callable[[], bool]] = None,
    ) -> None:
        self.cmd = [*prefix, *lighthouse_command(cfg, port)]
        self.address, self.port, self.log = address, port, log
        self.answers = answers or (lambda: lighthouse_unreachable(address, 1.0) is None)
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0  # starts after the first (deaths it was restarted from)
        self.held = False  # stopped on purpose (`stop`): not started again until `start`
        self._closed = threading.Event()
        self._lock = threading.Lock()  # the supervisor thread and the caller both start and stop it
        self._thread: Optional[threading.Thread] = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, wait_s: float = START_TIMEOUT_S) -> LighthouseProcess:
        """Start it (unless it runs) and wait up to `wait_s` until it accepts connections (`answers`); LighthouseError
        naming its exit code, or the wait, if it does not."""
        with self._lock:
            self.held = False
            if not self.alive:
                self._spawn()
        if wait_s > 0:
            self._wait_ready(wait_s)
        return self

    def _spawn(self) -> None:
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}  # torchft logs every quorum at info
        out: Union[int, IO[str], None]
        if isinstance(self.log, Path):
            out = open(self.log, "a")
        else:
            out = self.log
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=out if out is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if out is not None else None,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which stops it in order
                preexec_fn=_die_with_parent,
            )
        except OSError as e:
            raise LighthouseError(f"cannot start the lighthouse ({self.cmd[0]}: {e.strerror})") from None
        finally:
            if isinstance(self.log, Path) and out is not None and not isinstance(out, int):
                out.close()  # the child keeps its own descriptor

    def _wait_ready(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            proc = self.proc
            if proc is not None and proc.poll() is not None:
                cmd = " ".join(self.cmd)
                raise LighthouseError(f"the lighthouse exited with code {proc.returncode} at its start: {cmd}")
            if self.answers():
                return
            if time.monotonic() > deadline:
                raise LighthouseError(f"the lighthouse did not answer at {self.address} within {wait_s:g} s")
            time.sleep(0.05)

    def ensure(self) -> bool:
        """Start it again at the same address if it died (and was not stopped on purpose); whether it was."""
        with self._lock:
            if self.held or self._closed.is_set() or self.proc is None or self.proc.poll() is None:
                return False
            code = self.proc.returncode
            self._spawn()
            self.restarts += 1
        print(f"elastic: the lighthouse exited ({code}); started again at {self.address}", file=sys.stderr, flush=True)
        return True

    def stop(self) -> None:
        """Kill it on purpose (a fault, the end of the run): not started again until `start`."""
        with self._lock:
            self.held = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            if self.proc is not None:
                self.proc.wait()

    def supervise(self, every_s: float = SUPERVISE_EVERY_S) -> LighthouseProcess:
        """A daemon thread that calls `ensure` every `every_s` until `close` (the local launcher's supervision)."""

        def watch() -> None:
            while not self._closed.wait(every_s):
                try:
                    self.ensure()
                except LighthouseError as e:  # retried at the next look; the replicas wait out their bounds
                    print(f"elastic: {e}", file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=watch, name="lighthouse-supervisor", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop supervising and stop it (the run is over)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        self.stop()
