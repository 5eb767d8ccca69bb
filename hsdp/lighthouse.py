"""Run an elastic run's lighthouse on a host of its own, supervised; or wait until one answers.

    python -m hsdp.lighthouse --config C [--set k=v ...] [--port 29510]   # until SIGTERM / SIGINT
    python -m hsdp.lighthouse --wait http://HOST:29510 [--timeout-s 600]  # exit 0 once it answers

The first runs `torchft_lighthouse` with the run's timeouts and min_replicas (hsdp/run/lighthouse.py) and
starts it again at the same port whenever it dies, until it is told to stop. The second is what a replica's
site runs before its torchrun, so that the replicas' start (which refuses an unreachable lighthouse in one
line) does not race the lighthouse's. The multi-host launch (scripts/slurm/, docs/usage.md) runs both.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from typing import Optional

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.run.lighthouse import LighthouseError, LighthouseProcess
from hsdp.sync.elastic import in_words, lighthouse_unreachable

DEFAULT_PORT = 29510


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hsdp.lighthouse", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="the run's YAML config (its elastic and mesh timeouts, min_replicas)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override (repeatable)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port on every address (default {DEFAULT_PORT})")
    p.add_argument("--wait", metavar="URL", help="only wait until a lighthouse answers at URL, then exit 0")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on --wait (default 600)")
    return p.parse_args(argv)


def wait_for(url: str, timeout_s: float) -> int:
    """0 once the lighthouse at `url` accepts a connection; 1 with one line if it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        error = lighthouse_unreachable(url, 2.0)
        if error is None:
            return 0
        if time.monotonic() > deadline:
            print(f"lighthouse: no answer at {url} within {timeout_s:g} s ({in_words(error)})", file=sys.stderr)
            return 1
        time.sleep(0.5)


def serve(args: argparse.Namespace) -> int:
    """The lighthouse, supervised, until SIGTERM or SIGINT (then stopped: exit 0)."""
    # the lighthouse needs none of the run's other checks: only its timeouts and min_replicas
    cfg = load_config(args.config, [*args.set, "elastic.lighthouse="])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    address = f"http://{socket.gethostname()}:{args.port}"
    lighthouse = LighthouseProcess(cfg, args.port, f"http://localhost:{args.port}")
    try:
        lighthouse.start().supervise()
        print(f"lighthouse: listening on port {args.port} ({address}); started again whenever it dies", flush=True)
        stop.wait()
    finally:
        lighthouse.close()
    print(f"lighthouse: stopped (restarted {lighthouse.restarts} times)", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.wait:
        return wait_for(args.wait, args.timeout_s)
    try:
        return serve(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except LighthouseError as e:
        print(f"lighthouse: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
