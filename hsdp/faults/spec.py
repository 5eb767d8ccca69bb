"""The one fault grammar (no torch; docs/design.md §9.4): every fault the project injects is a `Fault`, written

    FAULTS := FAULT ("," FAULT)*
    FAULT  := WHO "@" WHEN ":" ACTION
    WHO    := REPLICA ["." LIFE] ["/" RANK]    LIFE: its restart count (default 0: the first start); RANK: one rank of
            | "lighthouse"                    its world (default: every rank); LIFE and RANK only at a ROUND:POINT
    WHEN   := ROUND ":" POINT                 a fault point of its ROUND-th sync round in that life (0: its join's)
            | STEP                            once it logged step STEP (a fraction of run.steps when < 1)
            | "t" SECONDS                     SECONDS into the run (from when every replica logged a step)
    ACTION := die | exit | stall=S | wait=PLACE | stop=PLACE           done by the replica itself, at a ROUND:POINT
            | kill[=S] | partition=S | slow=FACTOR[xS]                 done to it from outside, at a STEP or a time
            | stop=S                                                   either
    PLACE  := REPLICA[.LIFE]@ROUND:POINT

    die           SIGKILL of every rank reaching the point (a lost machine)
    exit          an error: exit 1 with one line
    stall=S       sleep S s on the training thread; heartbeats go on (a straggler)
    stop=S        SIGSTOP for S s: the whole process frozen, heartbeats too
    stop=PLACE    SIGSTOP until the same shard rank of another replica passed PLACE (bounded by mesh.timeout_s): a
                  freeze that outlasts what it must on any box, loaded or not
    wait=PLACE    until the same shard rank of another replica (or another life of it) passed PLACE, bounded by
                  mesh.timeout_s: faults ordered by events, never by the clock
    kill[=S]      the replica's node SIGKILLed, a replacement started S s later (default: elastic.restart_delay_s);
                  `lighthouse@tT:kill=S`, the one lighthouse fault: killed and started again S s later
    partition=S   its link down for S s, every process alive
    slow=F[xS]    it trains F× slower (F >= 1) for S s (default: to the end)

POINTS, in a round's order: start (round 0, before its manager), before_quorum, asked_quorum (its request registered
at the lighthouse: only waited for), after_quorum, after_send (its first payload collective done), before_commit; and
around an out-of-band heal before_fetch (the healing replica), before_serve and during_serve (the peer serving it:
part of its state sent, on its server's thread; no exit there). No replica is
special here: any replica, 0 included, may be hit (the lighthouse runs on a host of its own in the slow-link benchmark).

    1@2:before_quorum:die                    replica 1 SIGKILLs itself before its round 2's quorum (every rank)
    1.1@0:start:wait=0@2:before_commit       its restart starts its manager once replica 0 reached round 2's commit
    0@3:before_quorum:wait=1.1@0:asked_quorum    replica 0 asks round 3's quorum once the restart's join request is
                                             at the lighthouse: both land in the same quorum
    1.1/1@0:before_fetch:stall=3             only rank 1 of replica 1's restart stalls before its heal's fetch
    1@0.3:partition=20                       replica 1's link down at 30% of run.steps, for 20 s
    lighthouse@t40:kill=3                    the lighthouse lost 40 s in, back 3 s later

Every spelling compiles to it:

    elastic.faults=1@2:before_quorum:die     the grammar itself, each at a point (parse_faults; the replica does
                                             them: hsdp/sync/elastic/faults.py)
    --kill 1@0.3 (a run's kill:)             1@0.3:kill              the slow-link benchmark's flags (parse_flag;
    --partition 1@0.3:20 (partition:)        1@0.3:partition=20      hsdp/bench/faults.py checks them against the
    --slow 1:2@0.3:60 (slow:)                1@0.3:slow=2x60         run; --slow 1:3 is 1@0:slow=3)
    run.slowdown=2 run.slow_replica=1        1@0.3:slow=2x60         (run_slowdown; the rank does it:
      run.slow_from=0.3 run.slow_for_s=60                             hsdp/faults/slowdown.py)
    chaos: 7:30                              draws e.g. 2@t41.7:stop=5.2 (hsdp/faults/chaos.py)

A malformed fault is one line naming the key or flag, the fault as written, its form and an example (FaultSpecError,
which the config and the benchmark raise as their ConfigError): `elastic.faults: unknown point 'nowhere' (one of
start, ...) in '1@1:nowhere:die' (WHO@WHEN:ACTION, e.g. 1@2:before_quorum:die)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn, Optional, Protocol

POINTS = (
    "start",
    "before_quorum",
    "asked_quorum",
    "after_quorum",
    "after_send",
    "before_commit",
    "before_fetch",
    "before_serve",
    "during_serve",
)
ACTIONS = ("die", "exit", "stall", "stop", "wait", "kill", "partition", "slow")
AT_POINT = ("die", "exit", "stall", "stop", "wait")  # what a replica does itself, at a point of its round
AT_MOMENT = ("stop", "kill", "partition", "slow")  # what is done to it from outside, at a step or a time
ACTION_FORMS = "die, exit, stall=S, stop=S, stop=PLACE, wait=PLACE, kill[=S], partition=S, slow=FACTOR[xS]"
LIGHTHOUSE = "lighthouse"
FORM, EXAMPLE = "WHO@WHEN:ACTION", "1@2:before_quorum:die"

_NUMBER = r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
_WHO = re.compile(rf"(?P<replica>\d+)(?:\.(?P<life>\d+))?(?:/(?P<rank>\d+))?|{LIGHTHOUSE}")
_AT_POINT = re.compile(r"(\d+):([A-Za-z_]\w*):(.*)", re.S)  # ROUND:POINT:ACTION (a point is a name, an action too)
_PLACE = re.compile(r"(\d+)(?:\.(\d+))?@(\d+):(\w+)")  # wait's and stop's REPLICA[.LIFE]@ROUND:POINT


class FaultSpecError(ValueError):
    """A malformed fault: one line naming the key or flag (the config and the benchmark raise it as ConfigError)."""


def refusal(what: str, problem: str, text: str, form: str = FORM, example: str = EXAMPLE) -> FaultSpecError:
    """The grammar's one error: `{what}: {problem} in {text!r} ({form}, e.g. {example})`."""
    return FaultSpecError(f"{what}: {problem} in {text!r} ({form}, e.g. {example})")


def number(x: float) -> str:
    """`x` as the grammar writes it: a whole number without its point, else the shortest text that reads back."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


@dataclass(frozen=True)
class Place:
    """WHO@WHEN (a rank aside): replica `replica` (None: the lighthouse) in its `life`-th start, at `point` of its
    round `round`, or once it logged step `step` (a fraction of run.steps when < 1), or `at_s` seconds into the run."""

    replica: Optional[int]
    life: int = 0
    round: int = 0
    point: str = ""
    step: Optional[float] = None
    at_s: Optional[float] = None

    @property
    def when(self) -> str:
        """Which WHEN it is: "point", "step" or "time"."""
        return "point" if self.point else "step" if self.step is not None else "time"

    def step_of(self, steps: int) -> int:
        """Its step in a run of `steps` steps (a fraction taken of them)."""
        assert self.step is not None, f"{self} is not placed at a step"
        return int(self.step * steps) if self.step < 1 else int(self.step)

    def who(self, rank: Optional[int] = None) -> str:
        if self.replica is None:
            return LIGHTHOUSE
        return f"{self.replica}" + (f".{self.life}" if self.life else "") + ("" if rank is None else f"/{rank}")

    @property
    def when_text(self) -> str:
        """Its WHEN as written: ROUND:POINT, STEP or tSECONDS."""
        if self.point:
            return f"{self.round}:{self.point}"
        return number(self.step) if self.step is not None else f"t{number(self.at_s or 0.0)}"

    def __str__(self) -> str:
        return f"{self.who()}@{self.when_text}"


@dataclass(frozen=True)
class Fault:
    """`action` at a place: with its `seconds` (stall, stop, partition; kill's restart delay, 0: the run's
    elastic.restart_delay_s; slow's spell, 0: to the end), the place to `wait_for`, slow's `factor`; on `rank` of the
    replica's world only, or on every rank (None). `str` writes it in the grammar, `parse_fault` reads it back."""

    at: Place
    action: str
    seconds: float = 0.0
    wait_for: Optional[Place] = None
    rank: Optional[int] = None
    factor: float = 1.0

    @property
    def replica(self) -> Optional[int]:
        """The replica it hits (None: the lighthouse)."""
        return self.at.replica

    def __str__(self) -> str:
        arg = ""
        if self.wait_for is not None:  # wait=PLACE, stop=PLACE
            arg = f"={self.wait_for}"
        elif self.action == "slow":
            arg = f"={number(self.factor)}" + (f"x{number(self.seconds)}" if self.seconds else "")
        elif self.action in ("stall", "stop", "partition") or (self.action == "kill" and self.seconds):
            arg = f"={number(self.seconds)}"
        return f"{self.at.who(self.rank)}@{self.at.when_text}:{self.action}{arg}"

    def to_json(self) -> dict[str, Any]:
        """As slowlink.json records it: the fault as written, the replica, its WHEN's fields and its spell."""
        out: dict[str, Any] = {"fault": str(self), "replica": self.replica}
        if self.at.point:
            out.update(life=self.at.life, round=self.at.round, point=self.at.point, rank=self.rank)
        elif self.at.step is not None:
            out["step"] = int(self.at.step) if self.at.step >= 1 else self.at.step
        else:
            out["at_s"] = self.at.at_s
        out["seconds"] = self.seconds
        if self.action == "slow":
            out["factor"] = self.factor
        return out

    def overrides(self) -> list[str]:
        """A slow fault as the run.* overrides its node's command line takes (which `run_slowdown` reads back)."""
        assert self.action == "slow" and self.at.step is not None, f"{self} is no slow fault at a step"
        return [
            f"run.slowdown={number(self.factor)}",
            f"run.slow_from={number(self.at.step)}",
            f"run.slow_for_s={number(self.seconds)}",
        ]


class _Reader:
    """One fault's text being read: a refusal names `what`, the text as `shown` (the user's), the form, an example."""

    def __init__(self, shown: str, what: str, form: str, example: str) -> None:
        self.shown, self.what, self.form, self.example = shown, what, form, example

    def fail(self, problem: str) -> NoReturn:
        raise refusal(self.what, problem, self.shown, self.form, self.example)

    def number(self, text: str, name: str) -> float:
        if not re.fullmatch(rf"[-+]?{_NUMBER}", text):
            self.fail(f"{name} expects a number, got {text!r}")
        return float(text)

    def positive(self, text: str, name: str) -> float:
        value = self.number(text, name)
        if not value > 0:
            self.fail(f"{name} must be > 0, got {text}")
        return value


def parse_fault(
    text: str, what: str = "elastic.faults", *, shown: Optional[str] = None, form: str = FORM, example: str = EXAMPLE
) -> Fault:
    """One fault written WHO@WHEN:ACTION (the grammar above, its rules checked), or FaultSpecError naming `what` and
    the text as the user wrote it (`shown`: a flag's shorter spelling, `form` and `example` that flag's)."""
    text = text.strip()
    r = _Reader(text if shown is None else shown, what, form, example)
    who, sep, rest = text.partition("@")
    if not sep:
        r.fail("expected WHO@WHEN:ACTION")
    m = _WHO.fullmatch(who)
    if not m:
        r.fail(f"expected WHO a replica (REPLICA[.LIFE][/RANK]) or {LIGHTHOUSE}, got {who!r}")
    replica = None if m[0] == LIGHTHOUSE else int(m["replica"])
    life, rank = int(m["life"] or 0), None if m["rank"] is None else int(m["rank"])
    point = _AT_POINT.fullmatch(rest)
    if point:
        at, action = _point(r, replica, life, int(point[1]), point[2]), point[3]
    else:
        when, _, action = rest.partition(":")
        at = _moment(r, replica, life, when)
    fault = _action(r, at, action, rank)
    _check(r, fault)
    return fault


def _point(r: _Reader, replica: Optional[int], life: int, round_: int, point: str) -> Place:
    if point not in POINTS:
        r.fail(f"unknown point {point!r} (one of {', '.join(POINTS)})")
    if point == "start" and round_ != 0:
        r.fail("`start` is round 0 (before any round)")
    return Place(replica, life, round_, point)


def _moment(r: _Reader, replica: Optional[int], life: int, when: str) -> Place:
    """A STEP or a time tSECONDS."""
    if not re.fullmatch(rf"t?{_NUMBER}", when):
        r.fail(f"expected WHEN a ROUND:POINT, a STEP or a time tSECONDS, got {when!r}")
    if when.startswith("t"):
        return Place(replica, life, at_s=float(when[1:]))
    step = float(when)
    if step >= 1 and not step.is_integer():
        r.fail(f"a STEP is a whole number (or a fraction of run.steps below 1), got {when}")
    return Place(replica, life, step=step)


def _action(r: _Reader, at: Place, text: str, rank: Optional[int]) -> Fault:
    name, eq, arg = text.partition("=")
    if name not in ACTIONS:
        r.fail(f"expected ACTION one of {ACTION_FORMS}")
    if name in ("die", "exit") or (name == "kill" and not eq):
        if eq:
            r.fail(f"{name} takes no argument")
        return Fault(at, name, rank=rank)
    if name == "wait" or (name == "stop" and "@" in arg):
        m = _PLACE.fullmatch(arg)
        if not m:
            r.fail(f"{name}=PLACE expects REPLICA[.LIFE]@ROUND:POINT, got {arg!r}")
        return Fault(at, name, wait_for=_point(r, int(m[1]), int(m[2] or 0), int(m[3]), m[4]), rank=rank)
    if name == "slow":
        factor, x, seconds = arg.partition("x")
        f = r.number(factor, "slow=FACTOR")
        if not f >= 1:
            r.fail(f"slow=FACTOR must be >= 1 (1: full speed), got {factor}")
        s = r.positive(seconds, "slow=FACTORxSECONDS") if x else 0.0
        return Fault(at, name, seconds=s, rank=rank, factor=f)
    return Fault(at, name, seconds=r.positive(arg, f"{name}=SECONDS"), rank=rank)


def _check(r: _Reader, f: Fault) -> None:
    """The rules between WHO, WHEN and ACTION."""
    at = f.at
    if at.point == "asked_quorum":  # passed on a watcher thread while the training thread waits in the quorum
        r.fail("`asked_quorum` can only be waited for (wait=...@N:asked_quorum)")
    if at.point == "during_serve" and f.action == "exit":  # on the server's thread: it would fail the transfer only
        r.fail("`during_serve` is passed on the snapshot server's thread: die, stall, stop or wait there, not exit")
    if at.replica is None and (at.when != "time" or f.action != "kill"):
        r.fail(f"the lighthouse has no steps or rounds and is only killed: {LIGHTHOUSE}@tSECONDS:kill=SECONDS")
    if (at.life or f.rank is not None) and at.when != "point":
        r.fail("LIFE and RANK place a fault inside a replica's life: only at a ROUND:POINT")
    if at.when == "point" and f.action not in AT_POINT:
        r.fail(f"{f.action} is done to a replica from outside: at a STEP or a time tSECONDS, not at a point")
    if at.when != "point" and f.action not in AT_MOMENT:
        r.fail(f"{f.action} is done by the replica itself: at a ROUND:POINT")
    if f.wait_for is not None and at.when != "point":
        r.fail(f"{f.action}=PLACE is done by the replica itself: at a ROUND:POINT (from outside: {f.action}=SECONDS)")
    if f.wait_for is not None and (f.wait_for.replica, f.wait_for.life) == (at.replica, at.life):
        r.fail("a replica cannot wait for its own life")


def parse_faults(text: str, replicas: int, ranks: Optional[int] = None, what: str = "elastic.faults") -> list[Fault]:
    """An elastic.faults value (comma-separated; empty: none): faults a replica does itself, each at a ROUND:POINT,
    on a replica < `replicas` (mesh.sync) and a rank < `ranks` (a replica's world, where given)."""
    faults = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        f, r = parse_fault(part, what), _Reader(part, what, FORM, EXAMPLE)
        if f.at.when != "point":
            r.fail("a replica does these itself, at a ROUND:POINT (steps, times: --kill, --partition, --slow, chaos)")
        if ranks is not None and f.rank is not None and f.rank >= ranks:
            r.fail(f"rank {f.rank} is not one of a replica's {ranks} (mesh.replicate × mesh.shard)")
        for place in (f.at, f.wait_for):
            if place is not None and place.replica is not None and place.replica >= replicas:
                r.fail(f"replica {place.replica} is not one of mesh.sync={replicas}")
        faults.append(f)
    return faults


# ------------------------------------------------------------------ the shorter spellings that compile to a Fault
FLAGS: dict[str, tuple[re.Pattern[str], str, str]] = {
    # the slow-link benchmark's flag (and its spec key): its spelling, its form, an example
    "kill": (re.compile(r"([^@:,]+)@([^@:,]+)"), "REPLICA@STEP", "1@0.3"),
    "partition": (re.compile(r"([^@:,]+)@([^@:,]+):([^@:,]+)"), "REPLICA@AT:SECONDS", "1@0.3:20"),
    "slow": (
        re.compile(r"([^@:,]+):([^@:,]+)(?:@([^@:,]+)(?::([^@:,]+))?)?"),
        "REPLICA:FACTOR[@AT[:SECONDS]]",
        "1:2@0.3:60",
    ),
}


def parse_flag(flag: str, text: str, what: str) -> Fault:
    """A benchmark flag's value (or its spec key's) as the Fault it stands for, or FaultSpecError naming `what`:
    `--kill WHO@WHEN` is WHO@WHEN:kill, `--partition WHO@WHEN:S` WHO@WHEN:partition=S, `--slow R:F[@WHEN[:S]]`
    R@WHEN:slow=F[xS] (WHEN 0 without @: from the start)."""
    spelling, form, example = FLAGS[flag]
    shown = str(text).strip()
    m = spelling.fullmatch(shown)
    if not m:
        raise refusal(what, f"expected {form}", shown, form, example)
    if flag == "kill":
        full = f"{m[1]}@{m[2]}:kill"
    elif flag == "partition":
        full = f"{m[1]}@{m[2]}:partition={m[3]}"
    else:
        full = f"{m[1]}@{m[3] or 0}:slow={m[2]}" + (f"x{m[4]}" if m[4] else "")
    return parse_fault(full, what, shown=shown, form=form, example=example)


class RunKeys(Protocol):
    """The run section's keys that place run.slowdown (hsdp.config.schema.RunConfig's; not imported: the config
    imports this room)."""

    steps: int
    slowdown: float
    slow_replica: int
    slow_from: float
    slow_for_s: float


def run_slowdown(run: RunKeys, replica: int) -> Optional[Fault]:
    """run.slowdown, run.slow_replica (-1: every replica), run.slow_from (a step, or a fraction of run.steps when
    < 1) and run.slow_for_s (0: to the end) as the slow Fault they place on `replica`; None where it is not slowed."""
    if run.slowdown == 1 or run.slow_replica not in (-1, replica):
        return None
    start = run.slow_from if run.slow_from < 1 else float(int(run.slow_from))
    return Fault(Place(replica, step=start), "slow", seconds=run.slow_for_s, factor=run.slowdown)
