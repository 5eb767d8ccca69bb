"""The one fault grammar (hsdp/faults/spec.py, docs/design.md §9.4): every form parses to the Fault it means and is
written back the same, any Fault round-trips through its text, every spelling that compiles to it (elastic.faults,
the slow-link flags, run.slowdown's keys, the chaos generator) gives the same Fault, and every malformed input is one
line naming the key or flag, the text as written and an example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.faults.chaos import Chaos, draw_schedule, kind, parse_chaos
from hsdp.faults.spec import (
    AT_MOMENT,
    AT_POINT,
    POINTS,
    Fault,
    FaultSpecError,
    Place,
    parse_fault,
    parse_faults,
    parse_flag,
    run_slowdown,
)

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")

FORMS = [  # each form of WHO, WHEN and ACTION, as written, and the Fault it means
    ("1@2:before_quorum:die", Fault(Place(1, 0, 2, "before_quorum"), "die")),
    ("0@3:after_quorum:exit", Fault(Place(0, 0, 3, "after_quorum"), "exit")),
    ("0@2:before_serve:stall=5", Fault(Place(0, 0, 2, "before_serve"), "stall", seconds=5.0)),
    ("2@3:during_serve:die", Fault(Place(2, 0, 3, "during_serve"), "die")),
    ("1@1:after_send:stop=2.5", Fault(Place(1, 0, 1, "after_send"), "stop", seconds=2.5)),
    (
        "1.1@0:start:wait=0@2:before_commit",
        Fault(Place(1, 1, 0, "start"), "wait", wait_for=Place(0, 0, 2, "before_commit")),
    ),
    (
        "0@3:before_quorum:wait=1.1@0:asked_quorum",
        Fault(Place(0, 0, 3, "before_quorum"), "wait", wait_for=Place(1, 1, 0, "asked_quorum")),
    ),
    ("1.1/1@0:before_fetch:stall=3", Fault(Place(1, 1, 0, "before_fetch"), "stall", seconds=3.0, rank=1)),
    ("2/0@4:before_commit:die", Fault(Place(2, 0, 4, "before_commit"), "die", rank=0)),
    ("1@77:kill", Fault(Place(1, step=77), "kill")),
    ("1@0.3:kill=5", Fault(Place(1, step=0.3), "kill", seconds=5.0)),
    ("0@0.3:kill", Fault(Place(0, step=0.3), "kill")),  # no replica is special in the grammar
    ("1@0.3:partition=20", Fault(Place(1, step=0.3), "partition", seconds=20.0)),
    ("1@0:slow=3", Fault(Place(1, step=0), "slow", factor=3.0)),
    ("1@0.3:slow=2x60", Fault(Place(1, step=0.3), "slow", seconds=60.0, factor=2.0)),
    ("2@t41.7:stop=5.2", Fault(Place(2, at_s=41.7), "stop", seconds=5.2)),
    (
        "0@3:during_serve:stop=1.1@1:before_quorum",
        Fault(Place(0, 0, 3, "during_serve"), "stop", wait_for=Place(1, 1, 1, "before_quorum")),
    ),
    ("1@t12.5:partition=8", Fault(Place(1, at_s=12.5), "partition", seconds=8.0)),
    ("0@t3:slow=3x15.25", Fault(Place(0, at_s=3.0), "slow", seconds=15.25, factor=3.0)),
    ("lighthouse@t40:kill=3", Fault(Place(None, at_s=40.0), "kill", seconds=3.0)),
]


@pytest.mark.parametrize("text,fault", FORMS, ids=[t for t, _ in FORMS])
def test_every_form_parses_to_the_fault_it_means_and_is_written_back_the_same(text: str, fault: Fault) -> None:
    assert parse_fault(text) == fault
    assert str(fault) == text


def test_steps_and_numbers_are_read_in_their_other_spellings_too() -> None:
    """A whole number may carry its point (77.0 is step 77), a time its exponent; written back in the short form."""
    assert str(parse_fault(" 1@77.0:kill ")) == "1@77:kill"
    assert parse_fault("1@t1e2:stop=2") == Fault(Place(1, at_s=100.0), "stop", seconds=2.0)
    assert Place(1, step=0.3).step_of(200) == 60 and Place(1, step=77).step_of(200) == 77


def test_the_benchmark_flags_and_run_slowdown_compile_to_the_same_faults() -> None:
    """The documented spellings (docs/usage.md, configs/ablations) are the grammar with the action filled in."""
    assert parse_flag("kill", "1@0.3", "--kill") == parse_fault("1@0.3:kill")
    assert parse_flag("kill", "1@77", "--kill") == parse_fault("1@77:kill")
    assert parse_flag("partition", "1@0.3:20", "--partition") == parse_fault("1@0.3:partition=20")
    assert parse_flag("slow", "1:3", "--slow") == parse_fault("1@0:slow=3")
    assert parse_flag("slow", "1:2@0.3", "--slow") == parse_fault("1@0.3:slow=2")
    assert parse_flag("slow", "1:2@0.3:60", "--slow") == parse_fault("1@0.3:slow=2x60")

    slow = parse_fault("1@0.3:slow=2x60")
    assert slow.overrides() == ["run.slowdown=2", "run.slow_from=0.3", "run.slow_for_s=60"]
    cfg = load_config(TINY, ["mesh.sync=3", "run.slow_replica=1", *slow.overrides()])
    assert run_slowdown(cfg.run, 1) == slow  # what the node's keys place on it is the flag's fault
    assert run_slowdown(cfg.run, 0) is None and run_slowdown(load_config(TINY, []).run, 1) is None
    every = load_config(TINY, ["run.slowdown=1.5", "run.slow_from=40"]).run  # slow_replica -1: every replica
    assert [run_slowdown(every, m) for m in (0, 1)] == [parse_fault(f"{m}@40:slow=1.5") for m in (0, 1)]


def test_the_chaos_generator_draws_faults_the_grammar_reads_back() -> None:
    drawn = draw_schedule(Chaos(7, 5.0), replicas=3, horizon_s=2000, restart_delay_s=1.5)
    assert {kind(f) for f in drawn} == {"kill", "stop", "partition", "slow", "lighthouse"}
    for f in drawn:
        assert parse_fault(str(f)) == f and f.at.when == "time"
    assert parse_chaos("7:30", "--chaos") == Chaos(7, 30.0)
    assert str(next(f for f in drawn if kind(f) == "kill")).endswith(":kill=1.5")  # its restart delay


# ------------------------------------------------------------------ any Fault round-trips through its text
positive = st.floats(min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False)
non_negative = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
steps = st.one_of(st.integers(0, 10**9).map(float), st.floats(0.0, 1.0, exclude_max=True))


@st.composite
def points(draw: st.DrawFn, replica: int, life: int, waited_for: bool = False) -> Place:
    point = draw(st.sampled_from([p for p in POINTS if waited_for or p != "asked_quorum"]))
    return Place(replica, life, 0 if point == "start" else draw(st.integers(0, 10**6)), point)


@st.composite
def faults(draw: st.DrawFn) -> Fault:
    """Any valid Fault: a replica's own at a point, one done to it at a step or a time, or the lighthouse's."""
    replica = draw(st.integers(0, 10**4))
    when = draw(st.sampled_from(["point", "step", "time", "lighthouse"]))
    if when == "lighthouse":
        return Fault(Place(None, at_s=draw(non_negative)), "kill", seconds=draw(st.just(0.0) | positive))
    if when == "point":
        life, rank = draw(st.integers(0, 50)), draw(st.none() | st.integers(0, 512))
        at = draw(points(replica, life))
        action = draw(st.sampled_from([a for a in AT_POINT if (at.point, a) != ("during_serve", "exit")]))
        if action in ("die", "exit"):
            return Fault(at, action, rank=rank)
        if action == "wait" or (action == "stop" and draw(st.booleans())):  # wait=PLACE, stop=PLACE
            other = draw(st.tuples(st.integers(0, 10**4), st.integers(0, 50)).filter(lambda o: o != (replica, life)))
            return Fault(at, action, wait_for=draw(points(*other, waited_for=True)), rank=rank)
        return Fault(at, action, seconds=draw(positive), rank=rank)
    at = Place(replica, step=draw(steps)) if when == "step" else Place(replica, at_s=draw(non_negative))
    action = draw(st.sampled_from(AT_MOMENT))
    if action == "slow":
        factor = draw(st.floats(min_value=1.0, allow_nan=False, allow_infinity=False))
        return Fault(at, action, seconds=draw(st.just(0.0) | positive), factor=factor)
    return Fault(at, action, seconds=draw(st.just(0.0) | positive) if action == "kill" else draw(positive))


@settings(max_examples=400, deadline=None)
@given(faults())
def test_any_fault_round_trips_through_its_text(fault: Fault) -> None:
    text = str(fault)
    assert parse_fault(text) == fault, text
    assert str(parse_fault(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(faults().filter(lambda f: f.at.when == "point"), max_size=5))
def test_an_elastic_faults_value_round_trips_fault_by_fault(listed: list[Fault]) -> None:
    assert parse_faults(",".join(map(str, listed)), replicas=10**4 + 1) == listed


# ------------------------------------------------------------------ one line naming the key or flag
MALFORMED = [  # (text, why)
    ("", "expected WHO@WHEN:ACTION"),
    ("1", "expected WHO@WHEN:ACTION"),
    ("x@3:kill", "expected WHO a replica"),
    ("lighthouse.1@t3:kill", "expected WHO a replica"),
    ("1@3", "expected ACTION one of"),
    ("1@3:before_quorum", "expected ACTION one of"),
    ("1@2:before_quorum:explode", "expected ACTION one of"),
    ("1@x:kill", "expected WHEN a ROUND:POINT, a STEP or a time tSECONDS"),
    ("1@-1:kill", "expected WHEN"),
    ("1@t-3:stop=1", "expected WHEN"),
    ("1@2.5:kill", "a STEP is a whole number"),
    ("1@2:nowhere:die", "unknown point 'nowhere'"),
    ("1@2:start:die", "`start` is round 0"),
    ("1@2:asked_quorum:die", "`asked_quorum` can only be waited for"),
    ("0@2:during_serve:exit", "`during_serve` is passed on the snapshot server's thread"),
    ("1@2:before_quorum:die=3", "die takes no argument"),
    ("1@2:before_quorum:stall", "stall=SECONDS expects a number"),
    ("1@2:before_quorum:stall=0", "stall=SECONDS must be > 0"),
    ("1@2:before_quorum:stop=nan", "stop=SECONDS expects a number"),
    ("1@2:before_quorum:wait=1@3:after_send", "cannot wait for its own life"),
    ("1@2:before_quorum:wait=0@3", "wait=PLACE expects REPLICA[.LIFE]@ROUND:POINT"),
    ("1@2:before_quorum:wait=0@3:nowhere", "unknown point 'nowhere'"),
    ("1@0.3:die", "die is done by the replica itself"),
    ("1@t3:wait=0@0:start", "wait is done by the replica itself"),
    ("1@t3:stop=0@0:start", "stop=PLACE is done by the replica itself"),
    ("1@0.5:stop=0@0:start", "stop=PLACE is done by the replica itself"),
    ("1@2:before_quorum:stop=1@3:after_send", "cannot wait for its own life"),
    ("1@2:before_quorum:stop=0@3", "stop=PLACE expects REPLICA[.LIFE]@ROUND:POINT"),
    ("1@2:before_quorum:kill", "kill is done to a replica from outside"),
    ("1@2:before_quorum:slow=2", "slow is done to a replica from outside"),
    ("1@0.3:kill=", "kill=SECONDS expects a number"),
    ("1@0.3:partition=-2", "partition=SECONDS must be > 0"),
    ("1@0.3:slow=0.5", "slow=FACTOR must be >= 1"),
    ("1@0.3:slow=2x0", "slow=FACTORxSECONDS must be > 0"),
    ("1@0.3:slow=2y3", "slow=FACTOR expects a number"),
    ("lighthouse@3:kill", "the lighthouse has no steps or rounds and is only killed"),
    ("lighthouse@t3:stop=1", "the lighthouse has no steps or rounds and is only killed"),
    ("1.1@0.3:kill", "LIFE and RANK place a fault inside a replica's life"),
    ("1/0@t3:stop=2", "LIFE and RANK place a fault inside a replica's life"),
    ("1@2:before\nquorum:die", "expected ACTION one of"),
]


def _one_line(e: pytest.ExceptionInfo[Exception], what: str, shown: str, example: str) -> None:
    message = str(e.value)
    assert message.startswith(f"{what}: ") and "\n" not in message, message
    assert repr(shown) in message and f"e.g. {example})" in message, message


@pytest.mark.parametrize("text,why", MALFORMED, ids=[t for t, _ in MALFORMED])
def test_a_malformed_fault_is_one_line_naming_the_key_the_text_and_an_example(text: str, why: str) -> None:
    with pytest.raises(FaultSpecError, match=re.escape(why)) as e:
        parse_fault(text, "elastic.faults")
    _one_line(e, "elastic.faults", text.strip(), "1@2:before_quorum:die")


@pytest.mark.parametrize(
    "flag,text,why",
    [
        ("kill", "1", "expected REPLICA@STEP"),
        ("kill", "x@3", "expected WHO a replica"),
        ("kill", "1@3:before_quorum", "expected REPLICA@STEP"),
        ("partition", "1@3", "expected REPLICA@AT:SECONDS"),
        ("partition", "1@3:0", "partition=SECONDS must be > 0"),
        ("slow", "1", "expected REPLICA:FACTOR[@AT[:SECONDS]]"),
        ("slow", "1:0.5", "slow=FACTOR must be >= 1"),
        ("slow", "1:2@x", "expected WHEN"),
        ("slow", "1:2@0.3:-1", "slow=FACTORxSECONDS must be > 0"),
    ],
)
def test_a_malformed_flag_is_one_line_naming_the_flag_and_its_own_example(flag: str, text: str, why: str) -> None:
    example = {"kill": "1@0.3", "partition": "1@0.3:20", "slow": "1:2@0.3:60"}[flag]
    with pytest.raises(FaultSpecError, match=re.escape(why)) as e:
        parse_flag(flag, text, f"--{flag}")
    _one_line(e, f"--{flag}", text, example)


@pytest.mark.parametrize("text", ["7", "x:3", "7:0", "7:-1", "-7:30", "7:30:1"])
def test_a_malformed_chaos_value_is_one_line_too(text: str) -> None:
    with pytest.raises(FaultSpecError, match="SEED:MTBF_S") as e:
        parse_chaos(text, "runs.x.chaos")
    _one_line(e, "runs.x.chaos", text, "7:30")


@pytest.mark.parametrize(
    "faults,why",
    [
        ("1@77:kill", "a replica does these itself, at a ROUND:POINT"),
        ("0@1:after_send:die,5@1:after_send:die", "replica 5 is not one of mesh.sync=2"),
        ("1@1:after_send:wait=3@0:start", "replica 3 is not one of mesh.sync=2"),
        ("1/2@1:after_send:die", "rank 2 is not one of a replica's 2 (mesh.replicate × mesh.shard)"),
    ],
)
def test_elastic_faults_takes_the_replicas_own_faults_as_one_config_error(faults: str, why: str) -> None:
    overrides = ["elastic.enabled=true", "mesh.sync=2", "mesh.shard=2", f"elastic.faults={faults}"]
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        load_config(TINY, overrides)
    assert str(e.value).startswith("elastic.faults: ") and "\n" not in str(e.value)
