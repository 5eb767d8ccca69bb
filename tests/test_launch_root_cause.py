"""Which rank's failure the launcher reports when several end at once (hsdp.run.local.root_cause).

A rank that raises tears its connections down as it exits; its peers then fail with "connection
closed by peer". On a busy machine their exits can reach the launcher before (or in the same batch
as) the failing rank's own: the report must still name the rank whose error is its own.
"""

from __future__ import annotations

from hsdp.run.local import root_cause
from hsdp.run.pool import Exit

CAUSE = "Traceback (most recent call last):\nRuntimeError: injected fault on rank 2 at step 3\n"
PEER_LOST = (
    "Traceback (most recent call last):\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:538] "
    "Connection closed by peer [127.0.0.1]:4242\nThis is typically caused by a remote worker crashing.\n"
)
TIMED_OUT = "Traceback (most recent call last):\nhsdp.comm.CollectiveTimeout: all_gather took over 30 s\n"


class ScriptedWorkers:
    """The part of hsdp.run.pool.Pool that root_cause uses: each poll() hands out the next batch."""

    def __init__(self, batches: list[list[Exit]], running: list[int]) -> None:
        self.batches, self._running, self.waits = list(batches), list(running), 0

    def running(self) -> list[int]:
        return self._running

    def poll(self, timeout: float) -> list[Exit]:
        self.waits += 1
        batch = self.batches.pop(0) if self.batches else []
        self._running = [i for i in self._running if i not in {e.index for e in batch}]
        return batch


def test_the_failing_rank_is_named_when_its_peers_exit_reaches_the_launcher_first() -> None:
    workers = ScriptedWorkers([[], [Exit(3, 1, PEER_LOST)], [Exit(2, 1, CAUSE)]], running=[0, 2, 3])
    assert root_cause(workers, [Exit(1, 1, PEER_LOST)]).index == 2


def test_the_failing_rank_is_named_when_it_ends_in_the_same_batch_as_its_peers() -> None:
    workers = ScriptedWorkers([], running=[0, 3])
    assert root_cause(workers, [Exit(1, 1, PEER_LOST), Exit(2, 1, CAUSE)]).index == 2
    assert workers.waits == 0  # the cause was at hand: no waiting


def test_a_rank_killed_by_a_signal_is_a_cause_and_its_peers_timeouts_are_not() -> None:
    workers = ScriptedWorkers([[Exit(2, -9)]], running=[0, 2, 3])
    assert root_cause(workers, [Exit(1, 1, TIMED_OUT)]).index == 2


def test_a_first_failure_of_its_own_is_reported_without_waiting() -> None:
    workers = ScriptedWorkers([[Exit(2, 1, CAUSE)]], running=[0, 2, 3])
    assert root_cause(workers, [Exit(1, 1, "Traceback (most recent call last):\nValueError: bad shard\n")]).index == 1
    assert workers.waits == 0


def test_only_symptoms_within_the_grace_report_the_first() -> None:
    """A stopped rank never ends: after the grace the first symptom stands (the launcher then names the
    ranks that stopped answering)."""
    workers = ScriptedWorkers([[Exit(3, 1, TIMED_OUT)]], running=[0, 2, 3])
    assert root_cause(workers, [Exit(1, 1, TIMED_OUT)], grace_s=0.5).index == 1
