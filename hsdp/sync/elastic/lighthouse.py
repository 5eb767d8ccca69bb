"""Whether this replica can reach the lighthouse now (asked before each quorum, and by the launcher)."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import NamedTuple, Optional
from urllib.parse import urlsplit


def lighthouse_unreachable(url: str, timeout_s: float) -> Optional[OSError]:
    """Why the lighthouse at `url` does not accept a TCP connection within `timeout_s` (ConnectionRefusedError:
    its host answers and no lighthouse listens; others: unreachable, timed out), or None when it does.

    A replica asks this before each quorum: when torchft's manager cannot reach the lighthouse, its quorum
    fails at once in Rust but the training processes waiting on it are not told (torchft's `_run_quorum`
    returns before its broadcast) and wait out the whole quorum timeout — 300 s with the defaults — even if
    the lighthouse is back a second later.
    """
    parts = urlsplit(url)
    if parts.port is None:  # the config refuses such an address (check_lighthouse); say so if one gets here
        return OSError(f"no port in the lighthouse address {url!r}")
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=timeout_s).close()
    except OSError as e:
        return e
    return None


def wait_for_lighthouse(
    url: str, wait_s: float, probe_s: float, on_wait: Callable[[OSError], None], poll_s: float = 0.5
) -> Optional[OSError]:
    """Probe the lighthouse at `url` (each probe up to `probe_s`) every `poll_s` until it accepts a connection
    (None) or `wait_s` has passed (the last probe's error). `on_wait(error)` is called once, at the first failed
    probe, when there is time to wait: the caller's line saying what it waits for."""
    deadline = time.monotonic() + wait_s
    error = lighthouse_unreachable(url, probe_s)
    if error is not None and wait_s > 0:
        on_wait(error)
    while error is not None and time.monotonic() < deadline:
        time.sleep(poll_s)
        error = lighthouse_unreachable(url, probe_s)
    return error


def in_words(e: OSError) -> str:
    """An OSError in a few words ("Connection refused", "timed out")."""
    return e.strerror or str(e) or type(e).__name__


class QuorumStatus(NamedTuple):
    """What the lighthouse's status page says: the id of its last quorum, the requests waiting for the next and
    how many replicas' managers heartbeat to it (None where the page does not say)."""

    quorum_id: int
    pending: int
    heartbeating: Optional[int] = None


# torchft's /status page (templates/status.html): "Current quorum_id: N" and the next quorum's status line,
# which ends "[H/P participants healthy][B heartbeating]..." with P the requests registered for the next
# quorum and B the replicas whose managers heartbeat to it
_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")
_PENDING = re.compile(r"\[(\d+)/(\d+) participants healthy\]")
_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")


def quorum_status(url: str, timeout_s: float) -> Optional[QuorumStatus]:
    """The lighthouse's QuorumStatus, or None when it cannot be read (unreachable, or a page of another shape).

    Read before each quorum (transport.py: a quorum id that went back is a restarted lighthouse, asked once
    the replicas of the last quorum heartbeat to it) and by the `asked_quorum` fault point (faults.py: a
    replica's quorum request is at the lighthouse once the pending count rises, or the quorum id moves on)."""
    parts = urlsplit(url)
    try:
        with urllib.request.urlopen(f"http://{parts.hostname}:{parts.port}/status", timeout=timeout_s) as r:
            page = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    quorum, pending = _QUORUM_ID.search(page), _PENDING.search(page)
    if quorum is None or pending is None:
        return None
    beating = _HEARTBEATING.search(page)
    return QuorumStatus(int(quorum[1]), int(pending[2]), None if beating is None else int(beating[1]))


def others_heartbeat(url: str, timeout_s: float) -> bool:
    """Whether a replica other than the asking one heartbeats to the lighthouse at `url` (True when its status page
    cannot be read: nothing says they are gone)."""
    status = quorum_status(url, timeout_s)
    return status is None or status.heartbeating is None or status.heartbeating > 1
