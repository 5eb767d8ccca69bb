"""The elastic wing's state machine (hsdp/sync/elastic/phase.py) and its fault points' spec (hsdp/faults/spec.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.faults.spec import Fault, Place, parse_faults
from hsdp.sync.elastic import phase as phase_module
from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.lighthouse import QuorumStatus, lighthouse_unreachable, quorum_status
from hsdp.sync.elastic.phase import (
    HEAL_TRANSITIONS,
    ROUND_KIND_TRANSITIONS,
    ROUND_TRANSITIONS,
    TRANSITIONS,
    BadTransition,
    Checked,
    Heal,
    Phase,
    PhaseLog,
    Round,
    RoundKind,
)
from tests.helpers import REPO


def test_every_listed_transition_is_taken_and_every_other_refused() -> None:
    for start in Phase:
        for target in Phase:
            log = PhaseLog()
            log._phase = start  # a phase reached along the table (each is, from starting)
            if target in TRANSITIONS[start]:
                log.enter(target, "test")
                assert log.phase is target and log.history[-1] == (target.value, "test")
            else:
                with pytest.raises(BadTransition, match=f"{start.value} → {target.value}"):
                    log.enter(target, "test")


def test_every_phase_is_reachable_from_starting_and_only_leaving_ends() -> None:
    seen, todo = {Phase.STARTING}, [Phase.STARTING]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(Phase)
    assert [p for p in Phase if not TRANSITIONS[p]] == [Phase.LEAVING]


def test_the_table_in_the_docstring_and_the_design_doc_names_each_transition() -> None:
    """The docstring's table lists, per phase, the phases it may go to: the same as TRANSITIONS."""
    doc = phase_module.__doc__ or ""
    rows = re.findall(r"^    (\w[\w ]*?)\s{2,}.*$", doc, re.M)
    assert {p.value for p in Phase} <= {r.strip() for r in rows} | {"cut off"}, rows
    design = (REPO / "docs/design.md").read_text()
    for p in Phase:
        for target in TRANSITIONS[p]:
            assert f"{p.value} → {target.value}" in design, (p, target)


def test_a_has_trained_life_is_past_its_join() -> None:
    log = PhaseLog()
    log.enter(Phase.JOINING, "manager up")
    log.enter(Phase.HEALING, "offer")
    assert not log.has_trained  # a restart healing in its join: a peer asking it gets its state in the round
    log.enter(Phase.TRAINING, "caught up")
    log.enter(Phase.CUT_OFF, "no quorum")
    log.enter(Phase.HEALING, "healed when back")
    assert log.has_trained


# The smaller machines beside the phase: a round's life, its kind, a heal's (phase.py's docstring tables).
TABLES = [
    ("elastic round", ROUND_TRANSITIONS, Round.IDLE),
    ("elastic round kind", ROUND_KIND_TRANSITIONS, RoundKind.TRAINING),
    ("elastic heal", HEAL_TRANSITIONS, Heal.NONE),
]


@pytest.mark.parametrize("what,table,start", TABLES, ids=[t[0] for t in TABLES])
def test_every_legal_round_and_heal_transition_is_taken_and_every_other_refused_naming_both(
    what: str, table: dict, start: Any
) -> None:
    states = list(type(start))
    assert set(table) == set(states)  # every state has its row
    for now in states:
        for to in states:
            walk = Checked(what, table, now)  # a state reached along the table (each is, from the start)
            if to in table[now]:
                walk.enter(to, "test")
                assert walk.state is to
            else:
                with pytest.raises(BadTransition, match=re.escape(f"{what}: {now.value} → {to.value} is not a")):
                    walk.enter(to, "test")
                assert walk.state is now  # refused: unchanged


@pytest.mark.parametrize("what,table,start", TABLES, ids=[t[0] for t in TABLES])
def test_every_round_and_heal_state_is_reachable_and_none_ends(what: str, table: dict, start: Any) -> None:
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(type(start)), what
    assert all(table[s] for s in type(start)), what  # a rank's rounds and heals go on until its life ends


def test_the_docstring_tables_list_every_round_and_heal_state() -> None:
    doc = phase_module.__doc__ or ""
    rows = {r.strip() for r in re.findall(r"^    (\w[\w ]*?)\s{2,}.*$", doc, re.M)}
    assert {s.value for s in [*Round, *Heal]} <= rows, rows


class _Manager:
    """torchft's Manager as the transport sees it: a quorum of 2, every round committed unless told."""

    def __init__(self) -> None:
        self.commit = True

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 0

    def current_step(self) -> int:
        return 0

    def errored(self) -> None:
        return None

    def should_commit(self) -> bool:
        return self.commit

    def allreduce(self, t: Any, reduce_op: Any) -> Any:
        from hsdp.sync.elastic.transport import Done

        return Done()


class _Everyone:
    def allgather(self, outs: Any, inps: Any, opts: Any) -> Any:
        import torch

        from hsdp.sync.elastic.transport import Done

        for chunk in outs[0]:  # the control row of each: counted, no work timed, a full period, kind training
            chunk.copy_(torch.tensor([1.0, 0.0, 1.0, 0.0]))
        return Done()


def test_a_transports_rounds_walk_the_round_table() -> None:
    """begin → open (quorum answered), first payload → sent, commit → committed or dropped (the next round then
    touched); a commit without a round, and a training round kind after the close, are refused."""
    import torch

    from hsdp.comm.groups import Comm
    from hsdp.sync.elastic.transport import FTTransport

    manager = _Manager()
    t = FTTransport(manager, _Everyone(), Comm({}))
    assert t.round is Round.IDLE and not t.open
    with pytest.raises(BadTransition, match="elastic round: idle → committed"):
        t.commit_round()
    t.joined_at = 0
    t.begin_round()
    assert t.round is Round.OPEN and t.open and t.counted and t.contributors == [0, 1]
    t.all_reduce_sum(torch.ones(2), async_op=False)
    assert t.round is Round.SENT
    manager.commit = False
    assert not t.commit_round() and t.round is Round.DROPPED and not t.open
    manager.commit = True
    t.begin_round()
    assert t.round is Round.OPEN and t.touched == [False, True]  # the round after a dropped one
    assert t.commit_round() and t.round is Round.COMMITTED  # a meeting: no payload, never sent
    t.closing = True
    assert t.kind is RoundKind.MEETING
    with t.resyncing("test"):
        assert t.kind is RoundKind.RESYNC and t.syncing
    assert t.kind is RoundKind.MEETING and t.closing
    with pytest.raises(BadTransition, match="elastic round kind: closing meeting → training"):
        t.closing = False


def test_a_heals_offer_is_taken_once_and_a_lost_source_asks_again() -> None:
    """none → offered (a peer's offer) → fetching (taken) → source lost (it died, stopped, or serves no more) →
    offered again, by another replica; a second take of the same offer is refused, naming both states; the
    sources tried are kept in order, and the one whose state was loaded."""
    from types import SimpleNamespace

    from hsdp.sync.elastic.heal import HealState

    life = SimpleNamespace(phase=Phase.TRAINING, has_trained=True, enter=lambda phase, why: None)
    heal = HealState(life)
    assert heal.stage is Heal.NONE and heal.offer is None and heal.healed_to is None
    heal.load_state_dict({"snapshot": "http://peer/checkpoint/", "step": 9, "step_s": 0.2, "replica": 0})
    assert heal.stage is Heal.OFFERED and heal.offer == ("http://peer/checkpoint/", 9, 0.2, 0) and heal.healed_to == 9
    assert heal.take_offer().step == 9 and heal.stage is Heal.FETCHING and heal.offer is None
    with pytest.raises(BadTransition, match="elastic heal: fetching → fetching"):
        heal.take_offer()
    heal.source_lost("its source, replica 0, is gone")
    assert heal.stage is Heal.LOST and heal.healed_to is None
    with pytest.raises(BadTransition, match="elastic heal: source lost → fetching"):
        heal.take_offer()
    heal.load_state_dict({"snapshot": "http://other/checkpoint/", "step": 11, "replica": 2})
    assert heal.offer == ("http://other/checkpoint/", 11, None, 2) and not heal.final and not heal.peer_joining
    heal.take_offer()
    assert heal.tried == [0, 2] and heal.source_replica is None


def test_fault_specs_parse_and_name_their_places() -> None:
    faults = parse_faults("1@3:before_quorum:die, 1.1@0:start:wait=0@3:before_commit,0@2:before_serve:stall=5", 2)
    assert faults == [
        Fault(Place(1, 0, 3, "before_quorum"), "die"),
        Fault(Place(1, 1, 0, "start"), "wait", wait_for=Place(0, 0, 3, "before_commit")),
        Fault(Place(0, 0, 2, "before_serve"), "stall", seconds=5.0),
    ]
    assert [str(f) for f in faults] == [
        "1@3:before_quorum:die",
        "1.1@0:start:wait=0@3:before_commit",
        "0@2:before_serve:stall=5",
    ]


def test_a_fault_on_one_rank_fires_on_that_rank_only(tmp_path: Path) -> None:
    """WHO/RANK places a fault on one rank of the replica's world (one slow GPU of a site); the others pass."""
    spec = "1.1/1@0:before_fetch:stall=0.01"
    (fault,) = parse_faults(spec, 2, ranks=2)
    assert fault == Fault(Place(1, 1, 0, "before_fetch"), "stall", seconds=0.01, rank=1) and str(fault) == spec
    ranks = [FaultPoints(spec, 2, replica=1, life=1, shard_rank=r, run_dir=tmp_path, wait_s=1) for r in (0, 1)]
    for points in ranks:
        points.at("before_fetch", 0)
    assert [p.fired for p in ranks] == [[], [spec]]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("1@3:before_quorum", "ACTION one of"),
        ("1@2:start:die", "`start` is round 0"),
        ("5@1:after_send:die", "replica 5 is not one of mesh.sync=2"),
        ("1@1:nowhere:die", "unknown point 'nowhere'"),
        ("1@1:after_send:stall=-1", "must be > 0"),
        ("1@1:after_send:stop=x", "expects a number"),
        ("1@1:after_send:wait=1@2:after_send", "cannot wait for its own life"),
        ("1@1:after_send:die=3", "takes no argument"),
        ("1@1:asked_quorum:die", "`asked_quorum` can only be waited for"),
        ("1/2@1:after_send:die", "rank 2 is not one of a replica's 2 (mesh.replicate × mesh.shard)"),
    ],
)
def test_a_bad_fault_spec_is_one_config_error_before_any_work(spec: str, message: str) -> None:
    overrides = ["elastic.enabled=true", "mesh.sync=2", "mesh.shard=2", f"elastic.faults={spec}"]
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        load_config(str(REPO / "configs/tiny.yaml"), overrides)
    assert str(e.value).startswith("elastic.faults: ") and "\n" not in str(e.value)


def test_faults_need_an_elastic_run() -> None:
    with pytest.raises(ConfigError, match="needs elastic.enabled=true"):
        load_config(str(REPO / "configs/tiny.yaml"), ["elastic.faults=1@3:before_quorum:die"])


def test_a_wait_is_released_by_the_marker_its_target_leaves(tmp_path: Path) -> None:
    """The waited-for replica marks the place when it passes it; the waiter returns then, and a wait for a place
    never reached fails with one line after its bound instead of hanging."""
    spec = "0@2:before_quorum:wait=1.1@1:before_quorum"
    target = FaultPoints(spec, 2, replica=1, life=1, shard_rank=0, run_dir=tmp_path, wait_s=5)
    waiter = FaultPoints(spec, 2, replica=0, life=0, shard_rank=0, run_dir=tmp_path, wait_s=0.3)
    waiter.at("before_quorum", 1)  # not the faulted round: nothing
    with pytest.raises(RuntimeError, match="1.1@1:before_quorum not reached within 0.3 s"):
        waiter.at("before_quorum", 2)
    target.at("before_quorum", 1)
    waiter.at("before_quorum", 2)  # returns at once: the marker is there
    assert waiter.fired == [spec, spec] and target.fired == []


def test_a_watched_point_is_marked_once_the_probe_says_so(tmp_path: Path) -> None:
    """`asked_quorum` is passed inside torchft's blocking quorum: a watcher thread marks it when its probe turns
    true, and only for a place some fault waits for."""
    spec = "0@3:before_quorum:wait=1.1@0:asked_quorum"
    target = FaultPoints(spec, 2, replica=1, life=1, shard_rank=0, run_dir=tmp_path, wait_s=30)
    waiter = FaultPoints(spec, 2, replica=0, life=0, shard_rank=0, run_dir=tmp_path, wait_s=30)
    assert target.watches("asked_quorum", 0) and not target.watches("asked_quorum", 1)
    asked = threading.Event()
    target.watch("asked_quorum", 0, asked.is_set)
    time.sleep(0.2)
    assert not (tmp_path / "faults").exists()  # the probe is still false: no marker yet
    asked.set()
    waiter.at("before_quorum", 3)  # returns once the watcher marked the place (bounded by wait_s)
    assert waiter.fired == [spec]


def test_the_lighthouse_status_counts_the_requests_for_the_next_quorum() -> None:
    """quorum_status reads torchft's lighthouse page: its quorum id, the pending requests (a request from a
    replica that is not heartbeating counts as registered, not healthy) and the replicas heartbeating."""
    from torchft.coordination import LighthouseClient, LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=60_000)
    try:
        url = server.address()
        assert quorum_status(url, 5.0) == QuorumStatus(quorum_id=0, pending=0, heartbeating=0)
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=5))
        client.heartbeat("beating")
        assert quorum_status(url, 5.0) == QuorumStatus(quorum_id=0, pending=0, heartbeating=1)
        threading.Thread(target=_ask_quietly, args=(client,), daemon=True).start()  # blocks: min_replicas=2
        deadline = time.monotonic() + 30
        while quorum_status(url, 5.0)[:2] != (0, 1):  # (its heartbeat count by then depends on the time)
            assert time.monotonic() < deadline, quorum_status(url, 5.0)
            time.sleep(0.05)
    finally:
        server.shutdown()
    assert quorum_status("http://localhost:1", 1.0) is None  # nothing listens: None, not an error


def _ask_quietly(client: Any) -> None:
    try:
        client.quorum(replica_id="r0", timeout=timedelta(seconds=20), address="a", store_address="s", step=0)
    except Exception:
        pass  # the lighthouse shut down under it


def _lighthouse_process(port: int, min_replicas: int) -> subprocess.Popen:
    """torchft's lighthouse as its own process (killed, its connections are reset, as a lost machine's are)."""
    cmd = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", str(min_replicas)]
    cmd += ["--bind", f"[::]:{port}", "--join_timeout_ms", "100", "--quorum_tick_ms", "50"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}
    )
    deadline = time.monotonic() + 60
    while lighthouse_unreachable(f"http://localhost:{port}", 1.0) is not None:
        assert proc.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
        time.sleep(0.05)
    return proc


def _manager_server(lighthouse: str, quorum_retries: int) -> Any:
    """torchft's ManagerServer of a one-rank replica_0 (what rank 0's Manager starts), asking `lighthouse`."""
    from torchft._torchft import ManagerServer

    return ManagerServer(
        replica_id="replica_0",
        lighthouse_addr=lighthouse,
        hostname="localhost",
        bind="[::]:0",
        store_addr="localhost:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=1),
        quorum_retries=quorum_retries,
    )


def test_a_quorum_in_flight_when_the_lighthouse_restarts_completes_at_the_new_one() -> None:
    """A lighthouse killed while a replica's quorum request is at it: with the retries build_manager gives
    torchft's manager (quorum_retries), the manager asks again about every elastic.timeout_s and the request
    completes at the lighthouse restarted at the same address. Without them torchft's manager never answers
    its caller and the replica waits out the whole quorum timeout, which this test's caller (30 s) turns into
    an error. (The first lighthouse wants 2 replicas, so the request waits there; the second, 1.)"""
    from torchft._torchft import ManagerClient

    from hsdp.sync.elastic.manager import quorum_retries, quorum_timeout_s

    cfg = load_config(
        str(REPO / "configs/tiny.yaml"), ["elastic.enabled=true", "elastic.timeout_s=1", "mesh.timeout_s=30"]
    )
    assert quorum_timeout_s(cfg) == 30 and quorum_retries(cfg) == 29  # a retry every 30 / 30 = 1 s
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    first = _lighthouse_process(port, min_replicas=2)
    manager = _manager_server(f"http://localhost:{port}", quorum_retries(cfg))
    client = ManagerClient(manager.address(), connect_timeout=timedelta(seconds=5))
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            q = client._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=quorum_timeout_s(cfg)),
                init_sync=False,
                commit_failures=0,
            )
            result["size"] = q.replica_world_size
        except Exception as e:  # the caller's timeout: the manager never answered
            result["error"] = e

    asker = threading.Thread(target=ask, daemon=True)
    second = None
    try:
        asker.start()
        time.sleep(0.5)  # the request waits at the first lighthouse (min_replicas 2)
        first.kill()
        first.wait()
        second = _lighthouse_process(port, min_replicas=1)
        asker.join(timeout=60)  # the hang guard
        assert result.get("size") == 1, result
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        manager.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_a_replica_started_while_the_lighthouse_is_down_waits_for_it(capfd) -> None:
    """A replica (re)started during a lighthouse outage (a kill's restart while the lighthouse restarts, as in
    the chaos soaks): rank 0's manager is started once the lighthouse accepts connections, with one line
    saying what it waits for, instead of torchft's connect failing after elastic.timeout_s and the replica
    exiting 1 (to be restarted again). A manager whose connect still fails (the lighthouse went away between
    the probe and the connect) is tried again; past the bound the error names elastic.partition_timeout_s."""
    from torchft._torchft import ManagerServer

    from hsdp.sync.elastic.manager import start_when_lighthouse_up

    port = _free_port()
    url = f"http://localhost:{port}"

    def torchft_start() -> ManagerServer:  # torchft's own connect, as rank 0's Manager makes it
        return _manager_server(url, quorum_retries=1)

    # what the wait relies on: torchft's connect to a lighthouse that is not there raises this
    with pytest.raises(RuntimeError, match="failed to connect"):
        torchft_start()
    with pytest.raises(RuntimeError, match=r"did not accept connections within elastic.partition_timeout_s=0.5 s"):
        start_when_lighthouse_up(torchft_start, url, 0.5)

    lighthouse: list[subprocess.Popen] = []
    late = threading.Timer(1.5, lambda: lighthouse.append(_lighthouse_process(port, min_replicas=1)))
    late.start()
    try:
        manager = start_when_lighthouse_up(torchft_start, url, 60.0)  # the hang guard: the lighthouse is late 1.5 s
        manager.shutdown()
    finally:
        late.join()
        for proc in lighthouse:
            proc.kill()
            proc.wait()
    assert len(lighthouse) == 1
    err = capfd.readouterr().err
    assert err.count(f"elastic: the lighthouse at {url} does not accept connections (Connection refused)") == 2, err

    tries: list[int] = []

    def flaky() -> str:  # the probe passes (a listener is up) but the first connect fails
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("failed to connect to the lighthouse within timeout of 1s")
        return "started"

    with socket.socket() as listener:  # a port of its own: the killed lighthouse's may still be in TIME_WAIT
        listener.bind(("localhost", 0))
        listener.listen()
        listening = f"http://localhost:{listener.getsockname()[1]}"
        assert start_when_lighthouse_up(flaky, listening, 60.0) == "started" and len(tries) == 2
