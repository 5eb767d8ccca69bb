"""Stopping a launch on SIGINT/SIGTERM: `StopSignals` turns them into `Interrupted`.

SIGINT or SIGTERM to the launcher stops every local worker (SIGTERM, then SIGKILL after the pool's
`STOP_GRACE_S`) and the launch raises `Interrupted`, whose `exit_code` is 128 + the signal number (130 / 143).
A SIGINT that the launcher inherited as ignored (a background job of a script) stays ignored. Workers
ignore SIGINT themselves (a terminal's Ctrl-C reaches the whole process group, and the launcher coordinates
the stop) and die if the launcher dies without cleaning up (`kill -9`; hsdp/run/zygote.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from hsdp.run.pool import Pool

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, signal.Handlers, None]  # signal.getsignal's


class Interrupted(BaseException):
    """The launcher was asked to stop by a signal; its workers are gone when this is raised.

    A BaseException (like KeyboardInterrupt), so that `except Exception` in a worker
    running in-process does not swallow it.
    """

    def __init__(self, signum: int, workers: int = 0) -> None:
        self.signum = signum
        self.workers = workers  # how many were still running when it came
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

    @contextlib.contextmanager
    def guarding(self, pool: Pool) -> Iterator[None]:
        """A block that starts and watches `pool`'s workers (it arms once they are started): leaving it stops
        every worker still running (after a failure, the others; after a clean end, none), and `Interrupted`
        leaves it with how many were stopped."""
        try:
            yield
        except Interrupted as e:
            self.disarm()
            raise Interrupted(e.signum, pool.stop()) from None
        finally:
            self.disarm()
            pool.stop()

    def __exit__(self, *exc: object) -> None:
        self._armed = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
