"""Whether this replica can reach the lighthouse now (asked before each quorum, and by the launcher)."""

from __future__ import annotations

import socket
from typing import Optional
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


def in_words(e: OSError) -> str:
    """An OSError in a few words ("Connection refused", "timed out")."""
    return e.strerror or str(e) or type(e).__name__
