"""The planner's uneven-replica rounds (hsdp/plan/uneven.py), against rounds worked out by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hsdp.plan.uneven import uneven_rounds
from tests.helpers import REPO


def test_lockstep_bound_and_paced_rounds_by_hand() -> None:
    # replica 1 takes 0.2 s a step, replica 0 0.1 s; H = 16, 0.2 s of sync per round
    lock, bound, paced = uneven_rounds([0.1, 0.2], every=16, sync_s=0.2, bound_s=0.5, window_s=1.6)
    # lockstep: both train 16; replica 1 arrives at 3.2 s, replica 0 at 1.6 s and waits 1.6 of 3.4 s
    assert lock.steps == [16, 16] and lock.round_s == pytest.approx(3.4)
    assert lock.wait_fraction == pytest.approx([1.6 / 3.4, 0.0]) and lock.goodput == 1.0
    # bound: pace 1.6 s, deadline 1.6 + 0.375 s: replica 1 fits ⌊1.975 / 0.2⌋ = 9 steps, arrives at 1.8 s,
    # within pace + bound (2.1 s): counted; replica 0 waits 0.2 of 2.0 s
    assert bound.steps == [16, 9] and bound.round_s == pytest.approx(2.0)
    assert bound.wait_fraction == pytest.approx([0.1, 0.0]) and bound.goodput == 1.0
    # paced: a 1.6 s window fits 16 and 8 steps; both arrive at 1.6 s, nobody waits
    assert paced.steps == [16, 8] and paced.round_s == pytest.approx(1.8)
    assert paced.wait_fraction == pytest.approx([0.0, 0.0]) and paced.merged_steps_per_s == pytest.approx(24 / 1.8)


def test_a_replica_too_slow_for_the_bound_is_late_and_its_steps_are_not_merged() -> None:
    # replica 1's one step (3 s) ends past pace + bound (1.6 + 0.5 s): its Δ is dropped
    _, bound, paced = uneven_rounds([0.1, 3.0], every=16, sync_s=0.2, bound_s=0.5, window_s=1.6)
    assert bound.steps == [16, 1] and bound.goodput == pytest.approx(16 / 17)
    # paced: every period trains its first step, and the round waits for it
    assert paced.steps == [16, 1] and paced.goodput == 1.0 and paced.round_s == pytest.approx(3.2)


def test_only_the_modes_asked_for() -> None:
    assert [r.mode for r in uneven_rounds([0.1, 0.2], 8, 0.0, 0.0, 0.0)] == ["lockstep"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--speeds", "1,2,3"], "--speeds: expected one factor per replica"),
        (["--speeds", "1,0.5"], "--speeds: expected factors >= 1"),
        (["--bound", "0.5"], "--bound: only used with --speeds"),
        (["--speeds", "1,2", "--window", "0"], "--window: expected seconds > 0"),
    ],
)
def test_bad_speeds_are_one_line_before_any_work(args: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "hsdp.plan", "configs/tiny.yaml", "--inter", "20mbit", "--compute-s", "0.1"]
    proc = subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
