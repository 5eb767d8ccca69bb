"""The heal of an elastic replica at a param sync (docs/design.md §9.2 "Heal in the same period"), in one real run.

Three replicas of the small model, one rank each, DiLoCo with int8 Δ and error feedback, two fragments (a
round every 2 steps). tests/elastic_heal_train.py orders, by events, a kill on each side of a heal: replica
1 dies, its restart heals and dies at its first step after the heal; its next restart heals from a replica
that dies at the step after it published the state (before the fetch), so it heals again from the third.

Three more runs place a source lost mid-heal by elastic.faults (dead before serving, dead or frozen in the
middle of the transfer), and the source's answers are checked on real snapshot servers without processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.sync.schedule import fragment_units, fragments_due
from tests.helpers import QUIET_ENV, REPO, SMALL

STEPS, KILL_STEP = 24, 2
OVERRIDES = SMALL + [
    "mesh.sync=3",
    "mesh.shard=1",
    "elastic.enabled=true",
    "elastic.timeout_s=2",
    "elastic.restart_delay_s=0.5",
    "sync.warmup_steps=0",
    "sync.every=4",
    "sync.fragments=2",
    "sync.method=diloco",
    "sync.quantize=int8",
    "sync.error_feedback=true",
    "run.save_model=false",
    f"run.steps={STEPS}",
]


@pytest.fixture(scope="module")
def healed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(run folder, markers folder with the saved states, replicas.json) of the one run all tests read."""
    out = tmp_path_factory.mktemp("elastic-heal")
    markers = out / "markers"
    markers.mkdir()
    cmd = [sys.executable, str(REPO / "tests/elastic_heal_train.py"), str(KILL_STEP), str(markers)]
    cmd += ["--config", str(REPO / "configs/tiny.yaml")]
    for o in [*OVERRIDES, f"run.out_dir={out}", "run.name=heal"]:
        cmd += ["--set", o]
    try:  # the hang guard: the whole run takes well under a minute on an idle 2-core box
        env = {**os.environ, **QUIET_ENV}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the elastic run hung:\n{(e.stderr or b'')[-3000:]}") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = out / "heal"
    return run_dir, markers, json.loads((run_dir / "replicas.json").read_text())


def _records(run_dir: Path, m: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]


def _summary(run_dir: Path, m: int) -> dict:
    return json.loads((run_dir / f"summary.replica{m}.json").read_text())


def _server(replicas: dict) -> int:
    """The replica that served replica 1's third start and died (restarted once; the third never was)."""
    restarts = {m: replicas[str(m)]["restarts"] for m in (0, 2)}
    assert sorted(restarts.values()) == [0, 1], restarts
    return next(m for m, n in restarts.items() if n == 1)


def test_kills_on_both_sides_of_a_heal_end_with_every_replica_trained_to_the_end(healed) -> None:
    """Exit 0; replica 1 restarted twice (killed before, then right after, a heal), the server once; every
    replica's metrics have each step once, up to the last."""
    run_dir, _, replicas = healed
    assert replicas["1"]["restarts"] == 2
    _server(replicas)
    for m in range(3):
        steps = [r["step"] for r in _records(run_dir, m)]
        assert len(steps) == len(set(steps)) and steps == sorted(steps) and steps[-1] == STEPS - 1, (m, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 3 and summary["finished_replicas"] == [0, 1, 2], summary


def test_a_healed_replica_counts_from_the_round_after_its_heal(healed) -> None:
    """The same period: replica 1's last start spectated the round it healed in and, its server dead before
    the fetch, the round it healed in again (heal_retries 1), fetched once, and counted in the next round,
    where all three replicas counted; the server's restart spectated one round only."""
    run_dir, _, replicas = healed
    restarted = {1: (2, 1), _server(replicas): (1, 0)}  # replica: (rounds spectated, heals begun again)
    for m, (spectated, retries) in restarted.items():
        s = _summary(run_dir, m)
        assert (s["spectated_rounds"], s["heal_retries"], s["heal_fetches"]) == (spectated, retries, 1), (m, s)
        first = s["heal_contributes_from"]
        assert fragments_due(first, load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES).sync), first
        at_first = next(r for r in _records(run_dir, m) if r["step"] >= first)
        assert at_first["step"] == first and at_first["replicas"] == 3, (m, at_first)
        assert 0 <= s["heal_skipped_steps"] < 2, s  # a round every 2 steps: at least one step trained


def test_replicas_end_equal_after_the_last_sync_with_fragments_and_error_feedback(healed) -> None:
    """θ_g and the outer momentum of every unit bitwise equal in the three replicas; the params of the
    fragment that synced after the last step equal too (and equal θ_g); the other fragment's are each
    replica's own after its last local steps. A healed replica started from zero residuals and has its
    own since (it contributed with error feedback)."""
    run_dir, markers, replicas = healed
    states = [torch.load(markers / f"state.r{m}.pt") for m in range(3)]
    cfg = load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES)
    units = fragment_units(len(states[0]["held"]), cfg.sync.fragments)
    last = [u for f in fragments_due(STEPS - 1, cfg.sync) for u in units[f]]
    assert last and len(last) < len(states[0]["held"])  # one fragment synced last, not both
    for m in (1, 2):
        for u in range(len(states[0]["held"])):
            assert torch.equal(states[m]["global"][u], states[0]["global"][u]), (m, u)
            assert torch.equal(states[m]["momentum"][u], states[0]["momentum"][u]), (m, u)
        for u in last:
            assert torch.equal(states[m]["held"][u], states[0]["held"][u]), (m, u)
    assert all(torch.equal(states[0]["held"][u], states[0]["global"][u]) for u in last)
    for name in ("healed.r1.s1.pt", "healed.r1.s2.pt", f"healed.r{_server(replicas)}.s1.pt"):
        residuals = torch.load(markers / name)
        assert all(e is None or not e.any() for e in residuals), name
    assert any(e is not None and e.any() for e in states[1]["error"])


def test_steps_behind_is_the_fetch_over_the_peers_pace_leaving_one_step() -> None:
    """k = min(round(ℓ / p), n − a − 1), 0 without a pace (docs/design.md §9.2, Heal in the same period)."""
    from hsdp.sync.elastic.replica import steps_behind

    assert steps_behind(5.5, 0.4, 32) == 14  # the slow-link benchmark's fetch at its step time
    assert steps_behind(0.01, 0.2, 2) == 0  # a local fetch: under half a step
    assert steps_behind(60.0, 0.4, 32) == 31  # a fetch past the period: one step left to train
    assert steps_behind(5.5, None, 32) == 0  # the peer had no pace yet


def test_a_replica_healed_again_mid_training_finishes_the_heal_in_place() -> None:
    """A quorum that heals a training replica again (cut off and back, or a round behind its peers) is
    finished in place (hsdp/sync/elastic/replica.py): after the round it began as its own sync (spectated),
    anything in flight lands, catch_up continues from the offer without spectating that round again, and
    the training loop's next step is the one catch_up returns."""
    from types import SimpleNamespace

    from hsdp.sync.elastic.heal import HealState
    from hsdp.sync.elastic.phase import Phase
    from hsdp.sync.elastic.replica import ElasticReplica
    from hsdp.sync.seam import ReplicaSeat, ReplicaState

    cfg = load_config(str(REPO / "configs/tiny.yaml"), OVERRIDES)
    replica = ElasticReplica(cfg, ReplicaSeat(1, 0, "http://x:1"))
    calls: list = []
    policy = SimpleNamespace(finish=lambda: calls.append("finish"))
    replica._heal = HealState(replica)
    replica._heal.state = ReplicaState([], torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), policy)
    replica._transport = SimpleNamespace(
        open=False, rounds=3, touched=[], quorum_waits=[4.5], failure_in_rounds_since=lambda first: False
    )
    replica.enter(Phase.JOINING, "test")
    replica.enter(Phase.TRAINING, "test")

    def catch_up(spectated=False):
        calls.append(("catch_up", spectated))
        replica.heal.offer = None
        return 30

    replica._catch_up = catch_up
    steps = replica.steps(0, 40)
    assert [next(steps) for _ in range(12)] == list(range(12))
    replica.heal.load_state_dict({"snapshot": "http://peer/checkpoint/", "step": 9, "step_s": 0.2})
    assert replica.phase is Phase.HEALING and replica.heal.spectating
    replica.after_sync(11)
    assert calls == ["finish", ("catch_up", True)] and replica.rejoins == 1
    assert next(steps) == 30 and next(steps) == 31


# ---------------------------------------------------------------- a source lost mid-heal, placed by elastic.faults
# The stopped source (frozen mid-transfer, heartbeats too) is replica 0: torchft 0.2.0 names the lowest-numbered
# replica at the quorum's step. It stays frozen until the healing replica has healed elsewhere and reached its
# first round (stop=PLACE: ordered by that event, so the freeze outlasts the heal on a box at any load), and the
# third replica holds its round at step 19 until the source is back at its own round, so that the source, healed in
# place, usually still trains the run's last steps (or is healed whole by the run's close: the test takes either).
LOST_SOURCE = {
    "dies before serving": ("0@3:before_serve:die", "2@3:before_serve:die"),  # only the source reaches the point
    "dies mid-transfer": ("0@3:during_serve:die", "2@3:during_serve:die"),
    "stops mid-transfer": (
        "0@3:during_serve:stop=1.1@1:before_quorum",
        "2@5:before_quorum:wait=0@4:before_quorum",
    ),
}


@pytest.mark.parametrize("case", list(LOST_SOURCE))
def test_a_heal_whose_source_is_lost_heals_from_the_third_replica(tmp_path: Path, case: str) -> None:
    """Three replicas, one rank each (tests/test_elastic.py's kill case): replica 1 dies before its round 2, its
    restart heals out of band in round 3, and its source (the replica serving it) dies before publishing its state,
    dies in the middle of sending it, or is frozen there (SIGSTOP until the healing replica healed elsewhere). The
    healing replica gives up on it (refused, a cut transfer, no answer within elastic.timeout_s), asks the quorum
    again and heals from the third replica: its summary names both sources, in order. A dead source's restart heals;
    a stopped one comes back and heals in place. Exit 0, every replica's metrics to the last step, the final models
    bitwise equal."""
    from tests.test_elastic import ELASTIC, KILL, KILL_RUN_STEPS, _finish, _params, _replicas, _start, kill_faults

    run_dir = tmp_path / case.replace(" ", "-")
    mesh = ["mesh.sync=3", "mesh.shard=1", f"run.steps={KILL_RUN_STEPS}"]
    proc = _start(run_dir, ELASTIC + KILL + mesh + kill_faults(3, 2, LOST_SOURCE[case]))
    code, err = _finish(proc, timeout=240)  # the hang guard: each run takes 20-35 s on a 2-core box at load 10
    assert code == 0, err[-3000:]
    replicas = _replicas(run_dir)
    died = "stops" not in case
    source = _server(replicas) if died else 0
    third = 2 - source
    assert replicas["1"]["restarts"] == 1 and replicas[str(third)]["restarts"] == 0, replicas
    assert replicas[str(source)]["restarts"] == int(died), replicas
    healed = _summary(run_dir, 1)
    assert (healed["heal_sources"], healed["heal_source"]) == ([source, third], third), healed
    assert (healed["heal_retries"], healed["heal_fetches"], healed["spectated_rounds"]) == (1, 1, 2), healed
    assert f"elastic: replica 1: its source, replica {source}, " in err, err[-3000:]
    if not died:  # frozen: no answer within elastic.timeout_s; back, behind the others, healed in place
        assert "did not answer within 2 s (elastic.timeout_s)" in err and _summary(run_dir, source)["rejoins"] == 1
    print(f"{case}: from the source lost to the third's state loaded: {healed['heal_lost_s']} s")
    last = KILL_RUN_STEPS - 1
    for m in range(3):
        steps = [r["step"] for r in _records(run_dir, m)]
        assert len(steps) == len(set(steps)) and steps == sorted(steps), (m, steps)
        # The source, back (the frozen one) or restarted (the dead one), heals at the peers' next round and trains
        # the last steps, or, when the peers' last round closed before it asked (the rounds without it are quick on
        # a loaded box: replica 2 is held only until a frozen source is back at its own round, and a dead one's
        # restart took longer than the peers' rest of the run beside two busy loops), from the run's close, which
        # heals it whole with the final state (in a meeting, after a cut, or at the restart's join: `closing_heals`),
        # or from a peer's last round (its state after the last step loaded).
        s = _summary(run_dir, m)
        closed = m == source and (s["closing_heals"] >= 1 or s["elastic_phases"][-1].endswith(f"step {last} loaded"))
        assert steps[-1] == last or closed, (m, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 1 + int(died) and summary["finished_replicas"] == [0, 1, 2], summary
    reference = _params(run_dir, 0)
    for m in (1, 2):
        got = _params(run_dir, m)
        assert all(torch.equal(got[k], reference[k]) for k in reference), m


def test_replicas_healing_in_the_last_round_get_the_state_of_a_source_that_finishes(tmp_path: Path) -> None:
    """Replicas 0 and 1 die two steps before the end; their restarts heal, out of band, from replica 2 in the run's
    last round (tests/elastic_last_round_train.py). Replica 2 has nothing left to train, but its server stays up
    until both have fetched its state (HealState.linger): exit 0, every replica finished, three equal states."""
    markers = tmp_path / "markers"
    markers.mkdir()
    cmd = [sys.executable, str(REPO / "tests/elastic_last_round_train.py"), str(STEPS - 3), str(markers)]
    cmd += ["--config", str(REPO / "configs/tiny.yaml")]
    for o in [*OVERRIDES, f"run.out_dir={tmp_path}", "run.name=last"]:
        cmd += ["--set", o]
    try:  # the hang guard: well under a minute on an idle 2-core box
        proc = subprocess.run(
            cmd, cwd=REPO, env={**os.environ, **QUIET_ENV}, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the elastic run hung:\n{(e.stderr or b'')[-3000:]}") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "elastic: replica 2: serving its state to 2 healing peer(s) before leaving" in proc.stderr, proc.stderr[
        -3000:
    ]
    run_dir = tmp_path / "last"
    replicas = json.loads((run_dir / "replicas.json").read_text())
    assert [replicas[str(m)]["restarts"] for m in range(3)] == [1, 1, 0], replicas
    assert json.loads((run_dir / "summary.json").read_text())["finished_replicas"] == [0, 1, 2]
    for m in (0, 1):
        s = _summary(run_dir, m)
        assert (s["heal_fetches"], s["heal_source"], s["heal_retries"]) == (1, 2, 0), (m, s)
    states = [torch.load(markers / f"state.r{m}.pt") for m in range(3)]
    for m in (0, 1):
        for key in ("held", "global", "momentum"):
            assert all(torch.equal(a, b) for a, b in zip(states[m][key], states[2][key], strict=True)), (m, key)


# ---------------------------------------------------------------- a source's answers, on real snapshot servers
@pytest.fixture
def serving():
    """(a source's snapshot server, a healing rank's HealState with its own) on loopback: torchft's HTTP
    transport as manager.py builds it, elastic.timeout_s = 0.5 s."""
    from datetime import timedelta
    from types import SimpleNamespace

    from hsdp.sync.elastic.heal import HealState
    from hsdp.sync.elastic.manager import _http_transport

    timeout = timedelta(seconds=0.5)
    source = _http_transport(timeout, "127.0.0.1")
    heal = HealState(SimpleNamespace(phase=None, has_trained=True, enter=lambda phase, why: None), replica=1)
    heal.snapshots = _http_transport(timeout, "127.0.0.1")
    yield source, heal, timeout
    source.shutdown(wait=False)
    heal.snapshots.shutdown(wait=False)


def _offer(source, step: int = 9):
    from hsdp.sync.elastic.heal import Offer

    return Offer(source.address(), step, 0.1, 0)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # torchft's load (manager.py says)
def test_a_promised_state_is_waited_for_and_fetched_whole(serving) -> None:
    """Between its offer and its round's close the source's server answers with its promise: the healing rank
    waits, then loads the state it publishes (its END tensor last)."""
    import threading

    from hsdp.sync.elastic.heal import END, promise

    source, heal, timeout = serving
    source.send_checkpoint([], promise(9), {}, timeout)
    state = {"held": [torch.arange(4.0)], "step": 10, END: torch.ones(1)}
    later = threading.Timer(0.4, lambda: source.send_checkpoint([], 10, state, timeout))
    later.start()
    got = heal.fetch(_offer(source), 10, 30.0, timeout)
    later.join()
    assert torch.equal(got["held"][0], torch.arange(4.0)) and heal.fetches == 1 and heal.fetch_s >= 0.3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the server thread's death
@pytest.mark.parametrize("case", ["dropped", "gone", "stopped", "cut mid-transfer", "promise kept too long"])
def test_a_source_that_stops_serving_is_lost_within_elastic_timeout(serving, case: str) -> None:
    """Its copy dropped (−1) or another step served: lost at once; its server gone (refused): at once; no
    answer (a stopped process: its socket listens, nobody reads): after elastic.timeout_s; dead in the middle
    of sending its state (the during_serve point): at once, the cut transfer never loaded; a promise kept past
    mesh.timeout_s (the wait given here): lost then. Never a RuntimeError that would end the replica."""
    import socket
    import time

    from hsdp import torch_compat
    from hsdp.sync.elastic.heal import END, SourceLost, promise

    source, heal, timeout = serving
    offer, wait_s = _offer(source), 30.0
    if case == "dropped":
        source.send_checkpoint([], -1, {}, timeout)
        why, within = "serves this heal no more (HTTP 400", 0.5
    elif case == "gone":
        offer = offer._replace(url=f"http://127.0.0.1:{_closed_port()}/checkpoint/")
        why, within = "is gone (its server refuses connections)", 0.5
    elif case == "stopped":
        listener = socket.create_server(("127.0.0.1", 0))  # accepts connections (the kernel does), never answers
        offer = offer._replace(url=f"http://127.0.0.1:{listener.getsockname()[1]}/checkpoint/")
        why, within = "did not answer within 0.5 s (elastic.timeout_s)", 2.0
    elif case == "cut mid-transfer":

        def die() -> None:  # as a SIGKILL would: this answer's socket closed, part of the state sent
            raise SystemExit

        torch_compat.watch_http_transfers(source, die)
        source.send_checkpoint([], 10, {"held": [torch.zeros(1000)] * 3, "step": 10, END: torch.ones(1)}, timeout)
        why, within = "broke the transfer", 0.5
    else:
        source.send_checkpoint([], promise(9), {}, timeout)
        why, within, wait_s = "did not serve its promised state within 0.3 s (mesh.timeout_s)", 1.0, 0.3
    t0 = time.perf_counter()
    with pytest.raises(SourceLost, match=re.escape(f"its source, replica 0, {why}")):
        heal.fetch(offer, 10, wait_s, timeout)
    assert time.perf_counter() - t0 < within + wait_s * (case == "promise kept too long")
    assert heal.fetches == 0


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # torchft's load (manager.py says)
@pytest.mark.parametrize("peer", ["fetches", "is gone"])
def test_a_source_leaving_serves_its_owed_state_until_fetched_or_no_peer_is_left(serving, peer: str) -> None:
    """HealState.linger at the run's end: with its published state owed to one peer, it returns once the state
        was sent whole (the peer fetches it 0.3 s later), or, when the lighthouse says no other replica is left,
        after its next check (each second), the state unsent; in both well before mesh.timeout_s (here 120 s: the bound
    below is a hang guard that still tells the two apart)."""
    import threading
    import time

    from hsdp import torch_compat
    from hsdp.sync.elastic.heal import END

    source, heal, timeout = serving
    torch_compat.watch_http_transfers(heal.snapshots, lambda: None, heal.sent)
    heal.snapshots.send_checkpoint([], 10, {"held": [torch.arange(4.0)], END: torch.ones(1)}, timeout)
    heal.served_round, heal.owed = 0, 1
    got: list = []
    fetch = threading.Timer(0.3, lambda: got.append(source.recv_checkpoint(0, heal.snapshots.address(), 10, timeout)))
    if peer == "fetches":
        fetch.start()
    t0 = time.perf_counter()
    heal.linger(120.0, logs=False, peers_alive=lambda: peer == "fetches")
    waited = time.perf_counter() - t0
    if peer == "fetches":
        fetch.join()
        assert heal.sent_whole == 1 and torch.equal(got[0]["held"][0], torch.arange(4.0)) and 0.3 <= waited < 60
    else:
        assert heal.sent_whole == 0 and 1.0 <= waited < 60


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
