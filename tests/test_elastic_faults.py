"""Elastic faults a WAN has (docs/design.md §9.6, Partitions): a replica's link cut while every process lives,
and the lighthouse lost and restarted at the same address.

One real run (2 replicas × 1 shard, the tiny model, DiLoCo every 8 steps) across the slow-link benchmark's
network namespaces (hsdp.bench.netns; needs root and iproute2, as CI here has): the faults are driven by
the steps the replicas log, not by time, and every check counts events (steps logged, quorum sizes, rejoins).
"""

from __future__ import annotations

import json
import re
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
import torch

from hsdp.bench import netns
from hsdp.bench.elastic import ElasticJob
from hsdp.bench.faults import flag_fault
from hsdp.bench.plan import LinkOptions, make_plan
from hsdp.comm.groups import Comm
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.faults.spec import parse_fault
from hsdp.run.pool import Exit
from hsdp.run.replicas import ElasticRun
from hsdp.sync.elastic.lighthouse import in_words, lighthouse_unreachable
from hsdp.sync.elastic.transport import Done, FTTransport, PartitionTimeout
from hsdp.sync.schedule import fragments_due

REPO = Path(__file__).resolve().parents[1]
needs_netns = pytest.mark.skipif(netns.missing_requirements() is not None, reason=netns.missing_requirements() or "")

STEPS = 72  # the lighthouse fault has three windows after LIGHTHOUSE_AFTER (past the syncs of steps 47, 55, 63)
CUT_AT = 12  # replica 1's link goes down once it logged this step (after the round of step 7)
RESTORE_AT = 24  # and comes back once replica 0 logged this one (it ran the rounds of steps 15, 23 alone)
LIGHTHOUSE_AFTER = 40  # the lighthouse is killed once both replicas logged this step or later (after the rejoin)
LIGHTHOUSE_DOWN_S = 2.0  # and started again 2 steps later, or after this long (a replica waiting at a sync for it)
OVERRIDES = [
    "mesh.sync=2",
    "mesh.shard=1",
    f"run.steps={STEPS}",
    "run.log_every=1",
    "run.eval_every=0",
    "run.eval_batches=1",  # the final eval only: 1 batch, not 8
    "run.save_model=true",
    "wandb.mode=disabled",
    # torchft's quorum timeout is max(this, 6 × elastic.timeout_s); the fresh join's wait for the other
    # replica's start is max(this, elastic.partition_timeout_s) = 180 s (30 s was too short on a loaded CI box).
    "mesh.timeout_s=30",
    "sync.warmup_steps=0",
    "sync.every=8",
    "sync.method=diloco",
    "elastic.enabled=true",
    # Not 2 s: re-forming the gloo group after the rejoin (its connect may take 6 × this) took longer than
    # 12 s on a box at load 15 and dropped that round on both replicas; nothing here dies, so detection speed
    # is not tested. Not more than 5: torchft's quorum timeout, max(mesh.timeout_s, 6 × this), stays 30 s.
    "elastic.timeout_s=5",
    # The cut replica's pause lasts until replica 0 has run 12 more steps: 51 s at load 15, and past 60 s on
    # a box with two busy loops beside the suite (PartitionTimeout, exit 1). The bound is not what this tests.
    "elastic.partition_timeout_s=180",
]


class ScriptedFaults(ElasticJob):
    """The elastic job with its faults driven by logged steps: replica 1's link cut at CUT_AT and restored at
    replica 0's RESTORE_AT; then, just after a sync both replicas held, the lighthouse killed, and started
    again at the same address once replica 0 logged two more steps (its heartbeats failed meanwhile), before
    their next sync. A replica that reaches that sync while the lighthouse is down asks for no quorum until it
    accepts connections, then waits one heartbeat window (docs/design.md §9.6; counted on a fake clock
    below), so both replicas are in the restarted lighthouse's first quorum."""

    events: list[str]
    lighthouse_back_at: int = -1
    killed_at: float = 0.0

    def on_tick(self) -> None:
        super().on_tick()
        last = [self._logged_step(m) for m in range(2)]
        events = self.events
        if not events and last[1] >= CUT_AT:
            self.link.cut(1)
            events.append("cut")
        elif events == ["cut"] and last[0] >= RESTORE_AT:
            self.link.restore(1)
            events.append("restored")
        elif events == ["cut", "restored"] and min(last) >= LIGHTHOUSE_AFTER:
            past = [_past_sync(step, self.cfg) for step in last]
            # Both at most 3 steps past the same sync: restarted 2 steps later, it is back before the next one.
            # A 0.2 s tick can miss all three windows where steps are fast (a quiet box: ~0.05 s a step), so in
            # the last period it is killed wherever they are: a replica that reaches a sync while it is down waits.
            same = last[0] - past[0] == last[1] - past[1]
            if (same and max(past) <= 3) or min(last) >= STEPS - 8:
                self._stop_lighthouse()
                self.lighthouse_back_at = last[0] + 2
                self.killed_at = time.monotonic()
                events.append("lighthouse killed")
        elif events[-1:] == ["lighthouse killed"] and (
            last[0] >= self.lighthouse_back_at or time.monotonic() - self.killed_at >= LIGHTHOUSE_DOWN_S
        ):  # 2 steps later, or after LIGHTHOUSE_DOWN_S where replica 0 waits at a sync for it
            self._start_lighthouse()
            events.append("lighthouse restarted")


def _past_sync(step: int, cfg) -> int:
    """How many steps `step` is past the last sync round before it (1: the step right after it)."""
    k = 1
    while step - k >= 0 and not fragments_due(step - k, cfg.sync):
        k += 1
    return k


def _records(run_dir: Path, m: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()]


def _runs_of(values: list) -> list:
    """[2, 2, 1, 1, 2] -> [2, 1, 2]"""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _dropped_rounds(logs: Path, replica: int) -> dict[int, list[str]]:
    """torchft step → why, for each "elastic: sync round N (torchft step S) dropped (why)" line a replica's
    processes wrote. Keyed by the torchft step, the round's number on both replicas: a replica's own round
    count N skips the rounds it missed while cut off. A list per step: a dropped round does not advance
    torchft's step, so its retry, if dropped too, has the same one."""
    text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"*.node{replica}*.log")))
    drops: dict[int, list[str]] = {}
    for step, why in re.findall(r"elastic: sync round \d+ \(torchft step (\d+)\) dropped \((.*)\)", text):
        drops.setdefault(int(step), []).append(why)
    return drops


@needs_netns
def test_a_cut_replica_rejoins_and_a_restarted_lighthouse_lets_the_run_finish(tmp_path: Path) -> None:
    """Replica 1's link is cut: replica 0 logs every step through the cut with quorum 1; the cut-off replica
    pauses at its sync, and when the link is back it rejoins in place (no restart): healed from replica 0,
    it continues at replica 0's step (its metrics skip the steps it missed) and both sync again (quorum 2).
    Then the lighthouse is killed and started again at the same address between two syncs: both replicas
    go on. Exit 0, the
    final params equal, every sync round of the schedule held by replica 0, no namespace left."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [*OVERRIDES, f"run.out_dir={tmp_path}", "run.name=faults"])
    target = [str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml")]
    for o in [*OVERRIDES, f"run.out_dir={tmp_path}", "run.name=faults"]:
        target += ["--set", o]
    link = netns.SlowLink(2, None, lighthouse=True)
    job = ScriptedFaults(link, 1, target, 29471, tmp_path / "logs", "faults", 60, cfg=cfg)
    job.events = []
    try:
        link.up()
        job.start()
        rc = job.wait(timeout_s=480)  # the hang guard
    finally:
        job.stop(grace_s=3)
        left = link.down()
    logs = "\n".join(p.read_text(errors="replace")[-2500:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert rc == 0, logs
    assert job.events == ["cut", "restored", "lighthouse killed", "lighthouse restarted"]
    assert left == [] and not [ns for ns in netns.list_namespaces() if ns.startswith(link.prefix)]

    run_dir = tmp_path / "faults"
    r0, r1 = _records(run_dir, 0), _records(run_dir, 1)
    assert [r["step"] for r in r0] == list(range(STEPS))  # replica 0 never stopped
    assert _runs_of([r["replicas"] for r in r0]) == [2, 1, 2], [r["replicas"] for r in r0]
    alone = [r["step"] for r in r0 if r["replicas"] == 1 and r["synced"]]
    assert len(alone) >= 2 and alone[0] > CUT_AT  # it synced alone (at least the rounds of steps 15 and 23)
    steps1 = [r["step"] for r in r1]
    gap = [(a, b) for a, b in zip(steps1, steps1[1:]) if b != a + 1]
    assert len(gap) == 1 and gap[0][0] >= CUT_AT and gap[0][1] > RESTORE_AT, gap  # paused, then the peers' step
    assert steps1[-1] == STEPS - 1

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rejoins"] == {"0": 0, "1": 1} and summary["replica_failures"] == 0, summary
    s0 = json.loads((run_dir / "summary.replica0.json").read_text())
    assert summary["survivor_touched_rounds"] == s0["elastic_touched_rounds"]  # the cut-off replica is no survivor
    # every sync of the schedule held by replica 0; none dropped by the faults (the cut fell between rounds).
    # A round is also dropped, whole and on every replica, when one of its collectives passes elastic.timeout_s
    # (5 s here): on a loaded box that is the bound doing its job, not a fault's effect, so such drops are
    # allowed when both replicas logged the same rounds as dropped, each for a timeout on one of them (the
    # other may only learn that its peer failed).
    assert [r["step"] for r in r0 if r["synced"]] == [s for s in range(STEPS) if fragments_due(s, cfg.sync)]
    drops = {m: _dropped_rounds(tmp_path / "logs", m) for m in (0, 1)}
    counts = {str(m): sum(len(whys) for whys in d.values()) for m, d in drops.items()}
    assert summary["dropped_syncs"] == counts, (summary["dropped_syncs"], drops, logs)
    assert {n: len(w) for n, w in drops[0].items()} == {n: len(w) for n, w in drops[1].items()}, (drops, logs)
    attempts = [whys for n in drops[0] for whys in zip(drops[0][n], drops[1][n])]  # each as both replicas logged it
    timed_out = [any(re.search(r"timed? ?out", why, re.I) for why in whys) for whys in attempts]
    assert all(timed_out), (drops, logs)
    a, b = torch.load(run_dir / "model.replica0.pt"), torch.load(run_dir / "model.replica1.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_partition_and_slow_are_checked_before_anything_runs(tmp_path: Path) -> None:
    """`--partition REPLICA@AT:SECONDS` / `partition:` (REPLICA@AT:partition=SECONDS: elastic runs, replica
    0..M-1, AT a step before run.steps) and `--slow REPLICA:FACTOR[@AT[:SECONDS]]` / `slow:` (REPLICA@AT:slow=F[xS],
    FACTOR >= 1): a bad value is one ConfigError naming the key, at plan time; a slow replica's node alone gets
    run.slowdown."""
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["elastic.enabled=true", "sync.warmup_steps=0"])
    half = cfg.run.steps // 2
    assert flag_fault("partition", "1@0.5:20", cfg, "--partition") == parse_fault(f"1@{half}:partition=20")
    assert flag_fault("partition", "1@7:2.5", cfg, "--partition") == parse_fault("1@7:partition=2.5")
    assert flag_fault("partition", "0@3:5", cfg, "--partition") == parse_fault("0@3:partition=5")
    for text, why in [("1@3", "REPLICA@AT:SECONDS"), ("1@3:0", "REPLICA@AT:SECONDS"), ("x@3:2", "REPLICA@AT"),
                      ("2@3:5", "not one of 0..1"), (f"1@{cfg.run.steps}:5", "before run.steps")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            flag_fault("partition", text, cfg, "--partition")
    plain = load_config(str(REPO / "configs" / "tiny.yaml"), [])
    with pytest.raises(ConfigError, match="runs.x.partition: a partition needs an elastic run"):
        flag_fault("partition", "1@3:5", plain, "runs.x.partition")
    assert flag_fault("slow", "1:3", cfg, "--slow") == parse_fault("1@0:slow=3")
    spell = flag_fault("slow", "1:2@0.3:60", cfg, "--slow")  # a spell: from 30% for 60 s
    assert spell == parse_fault("1@0.3:slow=2x60")
    assert spell.overrides() == ["run.slowdown=2", "run.slow_from=0.3", "run.slow_for_s=60"]
    for text, why in [("1", "REPLICA:FACTOR"), ("1:0.5", "FACTOR must be >= 1"), ("2:3", "replica 2"),
                      ("a:2", "REPLICA"), ("1:2@x", "REPLICA:FACTOR"), ("1:2@0.3:-1", "REPLICA:FACTOR")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            flag_fault("slow", text, cfg, "--slow")

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "base: tiny.yaml\nrates: [20mbit]\nruns:\n  plain: []\n"
        "  el: {set: [elastic.enabled=true, sync.warmup_steps=0], partition: '1@0.5:20'}\n"
    )
    (tmp_path / "tiny.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())
    plan = make_plan(LinkOptions(spec=str(spec), shared=[f"run.out_dir={tmp_path}"]))
    assert plan.partitions == {"el": parse_fault(f"1@{half}:partition=20")}
    with pytest.raises(ConfigError, match="--partition: no run is elastic"):
        make_plan(LinkOptions(rate="20mbit", runs=["plain="], partition="1@3:5", shared=[f"run.out_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match="--slow: expected REPLICA:FACTOR"):
        make_plan(LinkOptions(rate="20mbit", runs=["plain="], slow="1", shared=[f"run.out_dir={tmp_path}"]))
    slow = parse_fault("1@0:slow=3")
    job = ElasticJob(netns.SlowLink(2, None), 1, ["train.py"], 1, tmp_path, "x", slow=slow, cfg=cfg)
    spell = ["--set", "run.slowdown=3", "--set", "run.slow_from=0", "--set", "run.slow_for_s=0"]
    assert job.node_target(0) == ["train.py"] and job.node_target(1) == ["train.py", *spell]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _UnreachableManager:
    """torchft's Manager whose quorum fails `failures` times (each after `wait_s` on `clock`), then answers."""

    def __init__(self, clock: _Clock, failures: int, wait_s: float = 7.0) -> None:
        self.clock, self.failures, self.wait_s = clock, failures, wait_s
        self.attempts: list[Optional[float]] = []  # each attempt's timeout (None: torchft's own)
        self._quorum_future = "failed"  # what torchft keeps of a failed quorum (re-raised unless cleared)
        self._quorum_timeout = timedelta(seconds=30)

    def start_quorum(self, timeout: Optional[timedelta] = None) -> None:
        self.attempts.append(None if timeout is None else timeout.total_seconds())
        self._quorum_future = None
        if len(self.attempts) <= self.failures:
            self.clock.now += self.wait_s if timeout is None else min(self.wait_s, timeout.total_seconds())
            raise TimeoutError("lighthouse quorum timed out")

    def num_participants(self) -> int:
        return 2

    def current_step(self) -> int:
        return len(self.attempts)

    def errored(self) -> None:
        return None

    def should_commit(self) -> bool:
        return True


class _Flags:
    def allgather(self, outs, inps, opts):
        for chunk in outs[0]:
            chunk.fill_(1.0)
        return Done()


def _transport(manager: _UnreachableManager, clock: _Clock, bound: float, **kwargs) -> FTTransport:
    t = FTTransport(manager, _Flags(), Comm({}), clock=clock, partition_timeout_s=bound, **kwargs)
    t.quorum.pause_retry_s = 0.0
    return t


def test_a_replica_without_quorum_pauses_and_ends_with_one_line_after_the_bound(capsys) -> None:
    """Quorum attempts that fail (a cut link, a dead lighthouse) are retried, each waiting at most what is left
    of elastic.partition_timeout_s; a quorum within it resumes the round (counted: one failure, its time);
    none within it is PartitionTimeout, one line naming the key. Times are the fake clock's."""
    clock = _Clock()
    manager = _UnreachableManager(clock, failures=3)
    t = _transport(manager, clock, bound=60)
    t.begin_round()
    assert t.open and t.participants == 2 and len(manager.attempts) == 4
    assert manager.attempts[0] is None and all(a is not None and a <= 30 for a in manager.attempts[1:])
    assert t.quorum.failures == 1 and t.quorum.failed_s == 14.0  # from the first failure: two more attempts
    assert "paused at this sync" in capsys.readouterr().err

    clock = _Clock()
    manager = _UnreachableManager(clock, failures=10**6)
    t = _transport(manager, clock, bound=60)
    with pytest.raises(PartitionTimeout) as e:
        t.begin_round()
    assert "elastic.partition_timeout_s=60" in str(e.value) and "\n" not in str(e.value)
    assert clock.now <= 7 + 60 + 1  # the first attempt, then retries bounded by what was left (>= 1 s each)


def test_no_quorum_is_asked_for_while_the_lighthouse_refuses_connections(capsys) -> None:
    """While the lighthouse is down (lost, restarting, or cut off), the replica pauses at its sync without asking
    torchft for a quorum (torchft would fail it at once and keep the caller waiting out its whole quorum
    timeout); once it accepts connections again, one heartbeat window later, the first attempt gets the quorum.
    Counted: no attempt while down, one failure, its time on the fake clock (each refused probe 2 s, the
    retries' sleep 0, the window 5 s)."""
    clock = _Clock()
    manager = _UnreachableManager(clock, failures=0)
    refusals = []

    def lighthouse_unreachable() -> Optional[OSError]:
        if len(refusals) < 3:
            refusals.append(len(manager.attempts))
            clock.now += 2.0
            return ConnectionRefusedError(111, "Connection refused")
        return None

    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.now += s

    t = _transport(manager, clock, 60, lighthouse_unreachable=lighthouse_unreachable, heartbeat_window_s=5.0)
    t.quorum.sleep = sleep
    t.begin_round()
    assert refusals == [0, 0, 0] and len(manager.attempts) == 1  # not one quorum asked for while it refused
    assert manager.attempts[0] is not None and manager.attempts[0] <= 30  # a retry's bound: what is left
    # back: one heartbeat window (every live replica reconnects to a restarted lighthouse), then the quorum
    assert sleeps == [0.0, 0.0, 0.0, 5.0]
    assert t.quorum.failures == 1 and t.quorum.failed_s == 4.0 + 5.0  # from the first refusal: two probes, the window
    err = capsys.readouterr().err
    assert "the lighthouse does not accept connections: Connection refused" in err and "paused at this sync" in err

    clock = _Clock()  # a cut link (unreachable, not refused): the same lighthouse knows every replica, no window
    manager = _UnreachableManager(clock, failures=0)
    cut = iter([OSError(101, "Network is unreachable")] * 2)
    t = _transport(manager, clock, 60, lighthouse_unreachable=lambda: next(cut, None), heartbeat_window_s=5.0)
    sleeps.clear()
    t.quorum.pause_retry_s, t.quorum.sleep = 0.5, sleep
    t.begin_round()
    assert sleeps == [0.5, 0.5] and len(manager.attempts) == 1 and t.quorum.failed_s == 1.0

    clock = _Clock()  # a lighthouse that never comes back: the partition bound still ends the pause
    manager = _UnreachableManager(clock, failures=0)

    def never_back() -> Optional[OSError]:
        clock.now += 2.0  # each probe waits out its connect timeout
        return TimeoutError("timed out")

    t = _transport(manager, clock, 10, lighthouse_unreachable=never_back)
    with pytest.raises(PartitionTimeout) as e:
        t.begin_round()
    assert manager.attempts == [] and "the lighthouse does not accept connections: timed out" in str(e.value)
    assert clock.now == 2.0 + 10.0  # the first refusal, then probes until the bound had passed


def test_a_lighthouse_restarted_while_the_replica_trained_is_given_one_heartbeat_window(capsys) -> None:
    """A lighthouse restarted between two of this replica's rounds (it never saw a refusal): its quorum id
    went back, so the replica waits one heartbeat window before asking (every live replica's manager has
    heartbeated to the new one by then, and it does not form a quorum of this replica alone). A quorum id that
    only grows, or a status that cannot be read, asks at once."""
    from hsdp.sync.elastic.lighthouse import QuorumStatus

    clock = _Clock()
    manager = _UnreachableManager(clock, failures=0)
    ids = iter([None, 4, 7, 0, 2])  # unreadable, then 4 and 7 (the same lighthouse), 0 (a new one), 2
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.now += s

    def status() -> Optional[QuorumStatus]:
        quorum_id = next(ids)
        return None if quorum_id is None else QuorumStatus(quorum_id, 0)

    t = _transport(manager, clock, 60, lighthouse_status=status, heartbeat_window_s=5.0)
    t.quorum.sleep = sleep
    waits = []
    for _ in range(5):
        t.begin_round()
        t.commit_round()
        waits.append(list(sleeps))
    assert waits == [[], [], [], [5.0], [5.0]]  # only before the round after the id went back from 7 to 0
    assert t.quorum.lighthouse_restarts == 1 and len(manager.attempts) == 5
    assert "the lighthouse was restarted (its quorum id went back from 7 to 0)" in capsys.readouterr().err


def test_a_restarted_lighthouse_is_asked_once_the_last_quorums_replicas_heartbeat_to_it() -> None:
    """The wait before asking a restarted lighthouse ends when as many replicas heartbeat to it as were in the
    last quorum (2 here), polled every 0.1 s; never more than the heartbeat window (a replica of that quorum
    died: the count stays short); a page that does not say how many heartbeat: the whole window at once."""
    from hsdp.sync.elastic.lighthouse import QuorumStatus

    def run(beating: list[Optional[int]]) -> list[float]:
        clock = _Clock()
        manager = _UnreachableManager(clock, failures=0)  # its quorums have 2 participants
        ids = iter([7, 0])  # the round before the restart, then a fresh lighthouse
        counts = iter(beating)
        sleeps: list[float] = []

        def sleep(s: float) -> None:
            sleeps.append(round(s, 6))
            clock.now += s

        def status() -> Optional[QuorumStatus]:
            quorum_id = next(ids, 0)
            return QuorumStatus(quorum_id, 0, next(counts) if quorum_id == 0 else None)

        t = _transport(manager, clock, 60, lighthouse_status=status, heartbeat_window_s=5.0)
        t.quorum.sleep = sleep
        for _ in range(2):
            t.begin_round()
            t.commit_round()
        return sleeps

    # the detecting read (1 heartbeating: this replica), then the wait's reads: 1, then 2
    assert run([1, 1, 2]) == [0.1, 0.1]
    assert run([2]) == []  # both already heartbeat: no wait at all
    short = run([1] * 60)  # the other never comes back: the window, not more
    assert sum(short) == pytest.approx(5.0) and max(short) == pytest.approx(0.1)
    assert run([None]) == [5.0]  # the page does not say: the whole window


def test_lighthouse_unreachable_says_why_a_port_refuses_and_nothing_for_one_that_listens() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    error = lighthouse_unreachable(f"http://127.0.0.1:{port}", 1.0)
    assert isinstance(error, ConnectionRefusedError) and in_words(error) == "Connection refused"
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert lighthouse_unreachable(f"http://127.0.0.1:{server.getsockname()[1]}", 1.0) is None


class _Pool:
    """The pool as ElasticRun uses it (no processes): each start is one worker, numbered from 0."""

    def __init__(self) -> None:
        self.pids = {0: 100, 1: 101}
        self.started = 0

    def start(self, targets) -> list[int]:
        self.started += 1
        return [self.started - 1]

    def signal(self, sig, indices) -> None:
        pass


def test_the_launcher_gives_up_every_replica_when_its_lighthouse_is_gone(tmp_path: Path) -> None:
    """A replica that failed while elastic.lighthouse (started on its own) refuses connections is not restarted
    (it would wait out the bound again): every replica is given up and the outcome is one line naming the
    lighthouse; with the lighthouse answering, the same failure is restarted."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = ["elastic.enabled=true", "mesh.sync=2", "mesh.shard=1", "elastic.timeout_s=1"]
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [*overrides, f"elastic.lighthouse=http://127.0.0.1:{port}"])
    cfg.run.out_dir, cfg.run.name = str(tmp_path), "lost"
    (tmp_path / "lost").mkdir()
    run = ElasticRun(cfg, _Pool(), print, lighthouse="")
    run.start_replica(0)
    run.start_replica(1)
    run.worker_ended(Exit(1, 1, "PartitionTimeout: no quorum for 120 s"))
    assert run.lighthouse_lost and all(r.given_up for r in run.replicas)
    line = run.outcome()
    assert f"the lighthouse at http://127.0.0.1:{port} stopped answering" in line and "\n" not in line

    with socket.socket() as server:  # now it answers: the failure is restarted as usual
        server.bind(("127.0.0.1", 0))
        server.listen()
        cfg.elastic.lighthouse = f"http://127.0.0.1:{server.getsockname()[1]}"
        run = ElasticRun(cfg, _Pool(), print, lighthouse="")
        run.start_replica(0)
        run.start_replica(1)
        run.worker_ended(Exit(1, 1, "PartitionTimeout: no quorum for 120 s"))
        assert not run.lighthouse_lost and run.replicas[1].restart_at is not None
