"""The elastic wing's state machine (hsdp/sync/elastic/phase.py) and its fault points' spec (hsdp/config/faults.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hsdp.config.faults import Fault, Place, parse_faults
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.sync.elastic import phase as phase_module
from hsdp.sync.elastic.faults import FaultPoints
from hsdp.sync.elastic.phase import TRANSITIONS, BadTransition, Phase, PhaseLog
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
    ],
)
def test_a_bad_fault_spec_is_one_config_error_before_any_work(spec: str, message: str) -> None:
    overrides = ["elastic.enabled=true", "mesh.sync=2", "mesh.shard=1", f"elastic.faults={spec}"]
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
