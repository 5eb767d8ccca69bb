"""One model at the end of an elastic run: the close (docs/design.md §9.7, "The close"; hsdp/sync/elastic/closing.py).

A round's commit is decided per replica, so the run's last round can commit on one replica and be dropped on
another, with no later round to heal it. The real runs here (2 replicas of the small model, DiLoCo every 8
steps, 16 steps: the last round is each replica's round 2) place that by elastic.faults, ordered by events:
replica 1 waits at its last round until replica 0 is at its own, then SIGSTOPs itself, so replica 0's last
round forms without it (its heartbeats stop) and commits alone; replica 1 comes back, drops its last round and
is brought level by the close. The unit tests below check the verdict, the rounds that mix a close with a
training round, the sync collectives' timing and the closed replicas' records without processes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from hsdp.comm.groups import Comm
from hsdp.config.loader import load_config
from hsdp.sync.elastic.closing import AGAIN, DIFFER, LEVEL, REDO, Records, closes_level, print_row, verdict
from hsdp.sync.elastic.transport import Done, FTTransport
from tests.helpers import REPO
from tests.test_elastic import ELASTIC, _finish, _params, _records, _start

MESH = ["mesh.sync=2", "mesh.shard=1", "run.steps=16"]
# replica 1, at its last round's quorum: once replica 0 is at its own, frozen (heartbeats too) for S seconds
MISSES_LAST_ROUND = "1@2:before_quorum:wait=0@2:before_quorum,1@2:before_quorum:stop={}"


def _summary(run_dir: Path, m: int) -> dict[str, Any]:
    return json.loads((run_dir / f"summary.replica{m}.json").read_text())


def _run(tmp_path: Path, name: str, faults: str, extra: tuple[str, ...] = ()) -> tuple[Path, int, str]:
    run_dir = tmp_path / name
    proc = _start(run_dir, [*ELASTIC, *MESH, f"elastic.faults={faults}", *extra])
    code, err = _finish(proc, timeout=120)  # the hang guard: each run takes about 10-20 s on an idle 2-core box
    return run_dir, code, err


def _equal(run_dir: Path) -> bool:
    a, b = _params(run_dir, 0), _params(run_dir, 1)
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_replica_that_missed_the_last_round_is_healed_whole_by_the_close(tmp_path: Path) -> None:
    """Replica 0's last round commits alone; replica 1, back 6 s later, meets it closing: it is behind (one round
    fewer committed), heals whole inside that meeting, drops its own last round, and both close level. Exit 0,
    bitwise-equal final models, each replica's final eval of that one model."""
    run_dir, code, err = _run(tmp_path, "healed", MISSES_LAST_ROUND.format(6))
    assert code == 0, err[-3000:]
    first, second = _summary(run_dir, 0), _summary(run_dir, 1)
    assert _records(run_dir, 0)[-1]["replicas"] == 1  # replica 0's last round: alone
    assert (first["dropped_syncs"], second["dropped_syncs"]) == (0, 1), (first, second)
    assert second["closing_heals"] == 1 and first["closing_heals"] == 0, second
    assert first["closing_verdict"] == second["closing_verdict"] == "level"
    assert first["closing_with"] == second["closing_with"] == [0, 1]
    assert "elastic: healed from a replica closing the run" in err
    assert _equal(run_dir)
    vals = [_records(run_dir, m)[-1]["val_loss"] for m in (0, 1)]  # each on its own val batches, one model
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == pytest.approx(sum(vals) / 2)


def test_a_last_round_dropped_on_every_replica_is_done_again(tmp_path: Path) -> None:
    """Replica 1 stalls after its first payload collective of the last round (heartbeats on): replica 0's next
    collective times out and both drop that round. No replica holds it, so the close does it again: exit 0,
    bitwise-equal final models."""
    run_dir, code, err = _run(tmp_path, "again", "1@2:after_send:stall=5")
    assert code == 0, err[-3000:]
    for m in (0, 1):
        s = _summary(run_dir, m)
        assert (s["dropped_syncs"], s["closing_redone"], s["closing_verdict"]) == (1, 1, "level"), s
    assert "its last round, dropped on every replica, done again" in err
    assert _equal(run_dir)


def test_a_replica_back_after_the_others_closed_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """Replica 1 stays frozen past replica 0's wait at the close (elastic.partition_timeout_s=2): replica 0
    closes without it and finishes; replica 1 then syncs its last round alone, finds replica 0's record of
    another model, and the run ends non-zero with one line naming both replicas and how far apart they are."""
    run_dir, code, err = _run(tmp_path, "apart", MISSES_LAST_ROUND.format(12), ("elastic.partition_timeout_s=2",))
    assert code == 1, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "elastic: the replicas end with different models: replica 1 differs from replica 0" in line, line
    assert re.search(r"which closed the run without it, in [1-9]\d* of \d+ units \(param norms ", line), line
    assert "replica 0 finished" in line, line
    assert _summary(run_dir, 0)["closing_with"] == [0] and "elastic: closed the run without replica(s) 1" in err
    assert not (run_dir / "model.replica1.pt").exists()


# ---------------------------------------------------------------- without processes


def _rows(replicas: int, *rows: tuple[int, int, set[int], list[int]]) -> torch.Tensor:
    return torch.stack([print_row(bool(a), m, waits, p, replicas) for a, m, waits, p in rows])


@pytest.mark.parametrize("replicas", [3, 130])  # 130: the waiting mask spans three int64 words
def test_the_verdict_of_a_closing_meeting(replicas: int) -> None:
    """Wait while a member waits for a replica not among them; do the last round again when no member holds it
    (a param round; a grad-sync round cannot be); else level or differ, naming the units that differ."""
    far = replicas - 1
    assert verdict(None, True, replicas).status == AGAIN  # the round was lost
    assert verdict(_rows(replicas, (1, 0, {far}, [5, 6]), (1, 1, set(), [5, 6])), True, replicas).status == AGAIN
    assert verdict(_rows(replicas, (1, 0, {1}, [5, 6]), (1, 1, set(), [5, 6])), True, replicas).status == LEVEL
    assert verdict(_rows(replicas, (1, 0, set(), [5, 6]), (1, far, {0}, [5, 6])), True, replicas).status == LEVEL
    apart = _rows(replicas, (0, 0, set(), [5, 6]), (0, 1, set(), [5, 7]))
    assert verdict(apart, True, replicas).status == REDO
    assert verdict(apart, False, replicas).status == DIFFER  # a grad-sync end cannot be done again
    v = verdict(_rows(replicas, (1, 0, set(), [5, 6, 1]), (0, 1, set(), [5, 7, 2])), True, replicas)
    assert (v.status, v.present, v.differing) == (DIFFER, [0, 1], [1, 2])


def test_the_close_applies_where_the_run_ends_on_a_full_sync() -> None:
    """A run ends with one model by design when its last step syncs every fragment with α = 0, or is a
    grad-sync step; an unsynced tail, a fragment synced earlier or α > 0 leave the replicas apart by design."""

    def cfg(*overrides: str) -> Any:
        base = ["elastic.enabled=true", "mesh.sync=2", "sync.warmup_steps=0", "sync.every=8", "run.steps=16"]
        return load_config(str(REPO / "configs/tiny.yaml"), [*base, *overrides])

    assert closes_level(cfg())
    assert closes_level(cfg("sync.delay=1"))  # it lands at the end (finish), θ_m ← θ_g
    assert not closes_level(cfg("run.steps=20"))  # 4 steps after the last sync
    assert not closes_level(cfg("sync.fragments=2"))  # fragment 0 synced 4 steps before the end
    assert not closes_level(cfg("sync.delay=1", "sync.alpha=0.5"))
    assert closes_level(cfg("sync.warmup_steps=16"))  # exact HSDP to the end: every step a grad round


class _Manager:
    """torchft's Manager as FTTransport sees it: a quorum of `n`, errors reported, collectives that take `s`."""

    def __init__(self, n: int, seconds: float = 0.0) -> None:
        self.n, self.seconds = n, seconds
        self.error: Optional[_Errored] = None

    def start_quorum(self) -> None:
        self.error = None

    def num_participants(self) -> int:
        return self.n

    def participating_rank(self) -> int:
        return 0

    def errored(self) -> Optional[Any]:
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = _Errored(e)

    def current_step(self) -> int:
        return 0

    def should_commit(self) -> bool:
        return self.error is None

    def allreduce(self, t: torch.Tensor, reduce_op: Any) -> Any:
        return _Slow(self.seconds)


class _Errored:
    """What torchft's errored() returns: the reported exception, wrapped."""

    def __init__(self, e: Exception) -> None:
        self.original_exception = e


class _Slow:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        import time

        time.sleep(self.seconds)


class _Kinds:
    """The contributor all-gather: every member counted, on time, with the round kind of each as scripted."""

    def __init__(self, kinds: list[float]) -> None:
        self.kinds = kinds

    def allgather(self, outs: list[list[torch.Tensor]], inps: Any, opts: Any) -> Done:
        for chunk, kind in zip(outs[0], self.kinds, strict=True):
            chunk.copy_(torch.tensor([1.0, 0.0, 1.0, kind]) if chunk.numel() == 4 else torch.zeros_like(chunk))
        return Done()


@pytest.mark.parametrize("closing", [False, True])
def test_a_round_that_mixes_a_close_with_training_is_dropped_on_every_side(closing: bool) -> None:
    """A replica still in its last param round (kind 0) meets one that closes (kind 1): whichever side this is,
    the round is aborted at its first collective (its later collectives would not pair up) and not committed;
    a round of one kind goes on."""
    manager = _Manager(2)
    transport = FTTransport(manager, _Kinds([0.0, 1.0]), Comm({}))
    transport.closing = closing
    transport.begin_round()
    assert manager.error is not None and not transport.all_closing
    assert isinstance(transport.all_reduce_sum(torch.ones(3), async_op=True), Done)  # a no-op: the round is lost
    assert not transport.commit_round()
    transport.pg = _Kinds([1.0, 1.0])
    transport.closing = True
    transport.begin_round()
    assert manager.error is None and transport.all_closing and transport.commit_round()


def test_an_elastic_runs_sync_collectives_are_timed() -> None:
    """The torchft transport times its sync collectives into the comm counters, as the c10d group's are: the
    slow-link report read 0.0 s for every elastic run before."""
    manager = _Manager(2, seconds=0.05)
    comm = Comm({})
    transport = FTTransport(manager, _Kinds([0.0, 0.0]), comm)
    transport.begin_round()
    transport.all_reduce_sum(torch.ones(4), async_op=False)
    transport.all_reduce_sum(torch.ones(4), async_op=True).wait()
    got = comm.report()["sync/all_reduce"]
    assert got["calls"] == 2 and got["seconds"] >= 0.1, got


def test_a_closed_replicas_record_is_read_by_the_others_and_forgotten_by_its_next_life(tmp_path: Path) -> None:
    """Each rank's record is its own file, read by the other replicas' same rank; a replica's new life deletes
    its own (an earlier launch's) before it meets anyone."""
    zero, one = Records(tmp_path, 0, 1), Records(tmp_path, 1, 1)
    zero.write({"replica": 0, "prints": [1, 2], "verdict": "level"})
    assert set(one.others()) == {0} and zero.others() == {} and Records(tmp_path, 1, 0).others() == {}
    Records(tmp_path, 0, 1).forget_own()
    assert one.others() == {}
