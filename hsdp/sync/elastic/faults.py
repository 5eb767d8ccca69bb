"""FaultPoints: this rank's `elastic.faults` (hsdp/faults/spec.py), done where the replica passes each point.

The wing calls `at(point, round)` at every named point of a replica's life; with no faults configured it
does nothing. A point another replica waits for leaves a marker file (run folder, `faults/`) once this rank
has passed it, so a `wait` is ordered by events, never by the clock.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from hsdp.faults.spec import Fault, Place, parse_faults

MARKERS = "faults"  # in the run folder: one empty file per (place, shard rank) that someone waits for
POLL_S = 0.05


class FaultInjected(RuntimeError):
    """An `exit` fault: the replica fails with this one line (its launcher restarts it as after any failure)."""


class FaultPoints:
    """The faults of replica `replica`'s `life`-th start, on rank `shard_rank` of its world (its site's rank on
    a three-level mesh)."""

    def __init__(
        self, spec: str, replicas: int, replica: int, life: int, shard_rank: int, run_dir: Path, wait_s: float
    ) -> None:
        faults = parse_faults(spec, replicas)
        self.replica, self.life, self.shard_rank = replica, life, shard_rank
        self.mine = [
            f
            for f in faults
            if (f.at.replica, f.at.life) == (replica, life) and f.rank in (None, shard_rank)  # every rank, or this one
        ]
        # the places of this life that some fault waits for: marked when passed
        self.watched = {
            f.wait_for for f in faults if f.wait_for and (f.wait_for.replica, f.wait_for.life) == (replica, life)
        }
        self.markers = run_dir / MARKERS
        self.wait_s = wait_s
        self.fired: list[str] = []  # the faults done so far (a test reads them from the summary)

    def at(self, point: str, round_: int) -> None:
        """This rank passes `point` of its round `round_` (0 for `start`): do the faults placed there."""
        if not self.mine and not self.watched:
            return
        place = Place(self.replica, self.life, round_, point)
        for fault in self.mine:
            if fault.at == place:
                self._do(fault)
        if place in self.watched:
            self.markers.mkdir(parents=True, exist_ok=True)
            self._marker(place).touch()

    def watches(self, point: str, round_: int) -> bool:
        """Whether some fault waits for this life's `point` of round `round_`."""
        return Place(self.replica, self.life, round_, point) in self.watched

    def watch(self, point: str, round_: int, reached: Callable[[], bool]) -> None:
        """Mark `point` of round `round_` once `reached()` (polled on a daemon thread) — for a point the
        training thread cannot see pass, as it waits inside torchft (`asked_quorum`). Only when some fault
        waits for it; the thread ends when marked, or after mesh.timeout_s (the waiter then fails itself)."""
        place = Place(self.replica, self.life, round_, point)
        if not self.watches(point, round_):
            return

        def poll() -> None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < self.wait_s:
                if reached():
                    self.markers.mkdir(parents=True, exist_ok=True)
                    self._marker(place).touch()
                    return
                time.sleep(POLL_S)

        threading.Thread(target=poll, name=f"fault-{point}", daemon=True).start()

    def _marker(self, place: Place) -> Path:
        return self.markers / f"{place.replica}.{place.life}.{place.round}.{place.point}.rank{self.shard_rank}"

    def _do(self, fault: Fault) -> None:
        self.fired.append(str(fault))
        print(f"elastic: fault {fault} (replica {self.replica}, rank {self.shard_rank})", file=sys.stderr, flush=True)
        if fault.action == "die":
            self._note_death()
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "exit":
            raise FaultInjected(f"fault {fault}: replica {self.replica} fails here")
        elif fault.action == "stall":
            time.sleep(fault.seconds)
        elif fault.action == "stop":
            # a stopped process cannot wake itself: a child sends SIGCONT after the spell (S seconds, or once the
            # PLACE's marker exists, at most mesh.timeout_s). The signal goes to this thread, which stops the
            # process at once: sent to the process, another thread may take it while this one goes on (a snapshot
            # server's thread, at during_serve, would finish its transfer first).
            subprocess.Popen(["sh", "-c", f"{self._until(fault)}; kill -CONT {os.getpid()}"], start_new_session=True)
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        elif fault.action == "wait":
            assert fault.wait_for is not None
            marker, t0 = self._marker(fault.wait_for), time.monotonic()
            while not marker.exists():
                if time.monotonic() - t0 > self.wait_s:
                    raise RuntimeError(f"fault {fault}: {fault.wait_for} not reached within {self.wait_s:g} s")
                time.sleep(POLL_S)

    def _note_death(self) -> None:
        """Leave the time of this death where the launcher reads it (`died_at`): the restart's first mark."""
        self.markers.mkdir(parents=True, exist_ok=True)
        path = self.markers / f"died.{self.replica}.{self.life}.rank{self.shard_rank}"
        path.write_text(repr(time.time()))

    def _until(self, fault: Fault) -> str:
        """The shell that a stop's waker runs before its SIGCONT: `sleep S`, or a poll for stop=PLACE's marker."""
        if fault.wait_for is None:
            return f"sleep {fault.seconds}"
        polls = max(1, round(self.wait_s / POLL_S))
        marker = shlex.quote(str(self._marker(fault.wait_for)))
        return f"i=0; while [ ! -e {marker} ] && [ $i -lt {polls} ]; do sleep {POLL_S}; i=$((i+1)); done"


def died_at(run_dir: Path, replica: int, life: int) -> Optional[float]:
    """When a `die` fault killed replica `replica`'s `life`-th start (time.time(), its first rank's), or None (it
    died otherwise: only the launcher's detection is known)."""
    times = []
    for path in (run_dir / MARKERS).glob(f"died.{replica}.{life}.rank*"):
        with contextlib.suppress(OSError, ValueError):
            times.append(float(path.read_text()))
    return min(times, default=None)


def clear_markers(run_dir: Path) -> None:
    """Remove an earlier launch's markers (a resumed run's lives count from 0 again)."""
    folder = run_dir / MARKERS
    if folder.is_dir():
        for f in folder.iterdir():
            f.unlink(missing_ok=True)
