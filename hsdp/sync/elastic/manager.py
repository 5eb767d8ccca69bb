"""The torchft Manager of one rank of an elastic replica, and the address its peers reach it at."""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

from hsdp import torch_compat
from hsdp.config.schema import Config
from hsdp.sync.elastic.heal import HealState
from hsdp.sync.elastic.lighthouse import in_words, wait_for_lighthouse
from hsdp.sync.elastic.seam import Manager, ProcessGroup, Snapshots

CONNECT_FACTOR = 6  # elastic.timeout_s multiples a quorum (and re-forming the group after it) may take


def build_manager(
    cfg: Config, replica: int, shard_rank: int, shard: int, lighthouse: str, heal: HealState
) -> tuple[Manager, ProcessGroup]:
    """(torchft Manager, its gloo group) of rank `shard_rank` of replica `replica`'s world of `shard` ranks (a
    site's replicate·shard ranks on a three-level mesh), meeting the other
    replicas at `lighthouse`; `heal` is what it sends a peer that heals from it and loads when it heals."""
    from torchft.manager import Manager as TorchftManager  # lazy: only elastic runs need torchft

    # torchft's checkpoint transport deserialises a peer's state from a read-only buffer, which torch warns
    # about on each heal; the tensors are copied into this replica's own buffers at once.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    # torchft warns on every quorum change that it cannot reset NCCL's flight recorder, also on gloo, where
    # there is none: a line that says nothing about this run.
    logging.getLogger("torchft.manager").addFilter(_drop_flight_recorder_notes)

    timeout = timedelta(seconds=cfg.elastic.timeout_s)
    # Re-forming the group after a quorum change waits for every member to reach it (one just healed, or
    # resumed after a partition): at load 15 that took more than 10 s and dropped the round. So the connect
    # gets CONNECT_FACTOR × elastic.timeout_s; a collective still fails after elastic.timeout_s.
    pg = torch_compat.elastic_gloo_group(CONNECT_FACTOR * timeout, timeout)
    # Where the peers reach this replica (its manager, and its state for a peer that heals from it).
    host = "127.0.0.1" if not cfg.elastic.lighthouse else address_towards(cfg.elastic.lighthouse)
    # One server, whichever try of the manager below succeeds; what it sends in a quorum tells the heal how many
    # peers an offer promised this rank's state to (they fetch it from the snapshot server below).
    transport = _http_transport(timeout, host, on_send=heal.promised_to)

    def start() -> Manager:
        return TorchftManager(
            pg=pg,
            load_state_dict=heal.load_state_dict,
            state_dict=heal.state_dict,
            min_replica_size=cfg.elastic.min_replicas,
            use_async_quorum=False,  # heal before the round's collectives, on the training thread
            init_sync=False,  # replicas start from the same seeded init: no copy at step 0
            timeout=timeout,
            # A quorum waits for the peers' next sync (up to sync.every steps away), not only for failures.
            quorum_timeout=timedelta(seconds=quorum_timeout_s(cfg)),
            quorum_retries=quorum_retries(cfg),
            connect_timeout=timeout,
            rank=shard_rank,
            world_size=shard,
            replica_id=f"replica_{replica}",
            lighthouse_addr=lighthouse,
            hostname=host,
            checkpoint_transport=transport,
            heartbeat_interval=timedelta(milliseconds=100),
        )

    # Only a replica's rank 0 talks to the lighthouse (the others wait for its manager's address).
    manager = (
        start_when_lighthouse_up(start, lighthouse, cfg.elastic.partition_timeout_s) if shard_rank == 0 else start()
    )
    heal.snapshots = _http_transport(timeout, host)  # this rank's state, for a peer healing out of band
    # the during_serve fault point; each state sent whole (a source leaving at the run's end waits for them)
    torch_compat.watch_http_transfers(heal.snapshots, heal.sending, heal.sent)
    return manager, pg


def start_when_lighthouse_up(start: Callable[[], Manager], lighthouse: str, bound_s: float) -> Manager:
    """`start()` (rank 0's torchft Manager, which connects to the lighthouse once, for elastic.timeout_s, and
    raises if it cannot) once the lighthouse at `lighthouse` accepts connections, waiting for it up to
    `bound_s` (elastic.partition_timeout_s), as a replica at a sync waits for a lost lighthouse.

    A replica (re)started while the lighthouse is down, e.g. restarted after a kill during a lighthouse
    restart, would otherwise exit at once and be restarted again: a second process start for nothing."""
    deadline = time.monotonic() + bound_s
    told = False  # the line is printed once, at the first wait

    def say_waiting(why: OSError) -> None:
        nonlocal told
        if not told:
            told = True
            print(
                f"elastic: the lighthouse at {lighthouse} does not accept connections ({in_words(why)}); "
                f"waiting up to elastic.partition_timeout_s={bound_s:g} s for it",
                file=sys.stderr,
                flush=True,
            )

    while True:
        why = wait_for_lighthouse(lighthouse, max(0.0, deadline - time.monotonic()), 1.0, say_waiting, poll_s=0.2)
        if why is None:
            try:
                return start()
            except RuntimeError as e:  # it went away between the probe and the manager's connect
                if "failed to connect" not in str(e) or time.monotonic() > deadline:
                    raise
                why = ConnectionError(str(e).splitlines()[0])
                say_waiting(why)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"elastic: the lighthouse at {lighthouse} did not accept connections within "
                f"elastic.partition_timeout_s={bound_s:g} s ({in_words(why)})"
            )


def quorum_timeout_s(cfg: Config) -> float:
    """torchft's bound on one quorum: it waits for the peers' next sync (up to sync.every steps away), not only
    for failures."""
    return max(cfg.mesh.timeout_s, CONNECT_FACTOR * cfg.elastic.timeout_s)


def quorum_retries(cfg: Config) -> int:
    """How often torchft's manager asks the lighthouse again within one quorum, about every elastic.timeout_s.

    A lighthouse lost while a quorum request is at it fails that request; with no retry torchft's manager
    never answers its own caller (its Rust side does not broadcast a failed quorum) and the replica waits out
    the whole quorum timeout (mesh.timeout_s, 300 s by default) even when a new lighthouse is up a second
    later. A retry sleeps quorum_timeout ÷ (retries + 1) and reconnects: about elastic.timeout_s. That is
    much longer than a manager's heartbeat interval (0.1 s), so a restarted lighthouse has heard every live
    replica before the first retry reaches it and does not form a quorum of the early ones alone."""
    return max(1, math.ceil(quorum_timeout_s(cfg) / cfg.elastic.timeout_s) - 1)


def _http_transport(
    timeout: timedelta, host: str, on_send: Optional[Callable[[list[int], dict[str, Any]], None]] = None
) -> Snapshots:
    """torchft's HTTP checkpoint transport (heals), advertising `host` instead of this machine's hostname;
    `on_send(dst_ranks, state)` is told of each state it is asked to send (torchft's quorum asks)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class _Transport(HTTPTransport):
        def address(self) -> str:
            port = torch_compat.http_transport_port(self)  # torchft's own server (as its address() reads it)
            return f"http://{f'[{host}]' if ':' in host else host}:{port}/checkpoint/"

        def send_checkpoint(
            self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
        ) -> None:
            if on_send is not None:
                on_send(dst_ranks, state_dict)
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    transport = _Transport(timeout=timeout, num_chunks=0)
    torch_compat.silence_http_access_log(transport)  # a line per heal request on the user's terminal says nothing
    return transport


def address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host: what the other replicas can reach it at.

    torchft advertises it for this replica's manager; the hostname (its default) may resolve to a
    loopback address (127.0.1.1 on Debian) or to an interface the peers cannot reach.
    """
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route and source address
        return s.getsockname()[0]


def _drop_flight_recorder_notes(record: logging.LogRecord) -> bool:
    return "NCCL flight recorder" not in record.getMessage()
