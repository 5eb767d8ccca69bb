"""`elastic.faults`: deterministic faults at named points of an elastic replica's life (no torch).

A fault is placed by what the replica is doing, not by the clock, so a test or a benchmark gets the same
order of events on a quiet laptop and on a loaded CI box (docs/design.md §9.4, fault points):

    SPEC   := WHO "@" ROUND ":" POINT ":" ACTION       several joined by ","
    WHO    := REPLICA ["." LIFE] ["/" RANK]            LIFE: its restart count (0: the first start; default 0)
                                                       RANK: one rank of the replica's world (default: every rank)
    ROUND  := the replica's N-th sync round in that life after its join; 0: its join's rounds (and `start`)
    ACTION := die | exit | stall=SECONDS | stop=SECONDS | wait=WHO@ROUND:POINT

    1@2:before_quorum:die            replica 1 SIGKILLs itself before its 2nd round's quorum (every rank)
    1@3:after_quorum:die             ... inside round 3: the quorum formed with it, no part sent
    1.1@0:start:wait=0@2:before_commit   its restart starts its manager only once replica 0 has reached the
                                     commit of its round 2 (the round without replica 1)
    0@3:before_quorum:wait=1.1@0:asked_quorum    replica 0 asks round 3's quorum once the restart's request for
                                     its join's is at the lighthouse: both land in the same quorum
    0@2:before_serve:stall=5         replica 0 waits 5 s before serving its state to a healing peer
    1.1/1@0:before_fetch:stall=3     only rank 1 of replica 1's restart stalls before its heal's fetch (one
                                     slow GPU of a site; the replica's other ranks go on to the fetch)

Points (in the order a round passes them): start (before the replica's manager exists), before_quorum,
asked_quorum (its quorum request is registered at the lighthouse; only waited for, nothing placed there),
after_quorum (the round's members and contributors agreed), after_send (its first payload collective
done), before_commit, and around an out-of-band heal: before_fetch (the healing replica) and before_serve
(the peer serving it). Actions: `die` (SIGKILL, as a lost machine), `exit` (an error: exit 1 with one line),
`stall` (sleep on the training thread: heartbeats go on, a straggler), `stop` (SIGSTOP for SECONDS: the
whole process frozen, heartbeats too), `wait` (until another replica's rank of the same shard position has
passed that point; bounded by mesh.timeout_s).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

POINTS = (
    "start",
    "before_quorum",
    "asked_quorum",
    "after_quorum",
    "after_send",
    "before_commit",
    "before_fetch",
    "before_serve",
)
ACTIONS = ("die", "exit", "stall", "stop", "wait")


class FaultSpecError(ValueError):
    """A malformed `elastic.faults` entry (the config layer turns it into a one-line ConfigError)."""


@dataclass(frozen=True)
class Place:
    """A point of one replica's life: replica `replica`'s `life`-th start, its round `round`, at `point`."""

    replica: int
    life: int
    round: int
    point: str

    def __str__(self) -> str:
        life = f".{self.life}" if self.life else ""
        return f"{self.replica}{life}@{self.round}:{self.point}"


@dataclass(frozen=True)
class Fault:
    """What to do at a place: `action` with its `seconds` (stall, stop) or the place to `wait` for; on
    `rank` of the replica's world only, or on every rank (None)."""

    at: Place
    action: str
    seconds: float = 0.0
    wait_for: Optional[Place] = None
    rank: Optional[int] = None

    def __str__(self) -> str:
        arg = f"={self.wait_for}" if self.wait_for else f"={self.seconds:g}" if self.action in ("stall", "stop") else ""
        at = str(self.at)
        if self.rank is not None:
            who, _, rest = at.partition("@")
            at = f"{who}/{self.rank}@{rest}"
        return f"{at}:{self.action}{arg}"


_PLACE = re.compile(r"^(\d+)(?:\.(\d+))?@(\d+):(\w+)$")


def parse_place(text: str) -> Place:
    m = _PLACE.match(text.strip())
    if not m:
        raise FaultSpecError(f"expected REPLICA[.LIFE]@ROUND:POINT, got {text!r}")
    replica, life, round_, point = int(m[1]), int(m[2] or 0), int(m[3]), m[4]
    if point not in POINTS:
        raise FaultSpecError(f"unknown point {point!r} in {text!r} (one of {', '.join(POINTS)})")
    if point == "start" and round_ != 0:
        raise FaultSpecError(f"{text!r}: `start` is round 0 (before any round)")
    return Place(replica, life, round_, point)


_RANK = re.compile(r"^([^@/]*)/(\d+)@")


def parse_fault(text: str) -> Fault:
    text = text.strip()
    rank: Optional[int] = None
    m = _RANK.match(text)
    if m:  # WHO/RANK: one rank's fault
        rank, text = int(m[2]), f"{m[1]}@{text[m.end() :]}"
    fault = _parse_fault(text)
    return fault if rank is None else replace(fault, rank=rank)


def _parse_fault(text: str) -> Fault:
    if ":wait=" in text:  # the waited-for place has colons of its own
        head, _, arg = text.partition(":wait=")
        action = "wait"
    else:
        head, _, action = text.rpartition(":")
        action, _, arg = action.partition("=")
    if not head or action not in ACTIONS:
        raise FaultSpecError(f"expected WHO@ROUND:POINT:ACTION with ACTION one of {', '.join(ACTIONS)}, got {text!r}")
    at = parse_place(head)
    if at.point == "asked_quorum":  # passed on a watcher thread while the training thread waits in the quorum
        raise FaultSpecError(f"{text!r}: `asked_quorum` can only be waited for (wait=...@N:asked_quorum)")
    if action in ("die", "exit"):
        if arg:
            raise FaultSpecError(f"{text!r}: {action} takes no argument")
        return Fault(at, action)
    if action == "wait":
        target = parse_place(arg)
        if target.replica == at.replica and target.life == at.life:
            raise FaultSpecError(f"{text!r}: a replica cannot wait for its own life")
        return Fault(at, action, wait_for=target)
    try:
        seconds = float(arg)
    except ValueError:
        raise FaultSpecError(f"{text!r}: {action}=SECONDS expects a number, got {arg!r}") from None
    if not seconds > 0:
        raise FaultSpecError(f"{text!r}: {action}=SECONDS must be > 0, got {arg}")
    return Fault(at, action, seconds=seconds)


def parse_faults(text: str, replicas: int, ranks: Optional[int] = None) -> list[Fault]:
    """The faults of an `elastic.faults` value (comma-separated; empty: none), each on a replica < `replicas`
    (and a rank < `ranks`, the size of a replica's world, where one is named and `ranks` is given)."""
    faults = [parse_fault(part) for part in text.split(",") if part.strip()]
    for f in faults:
        if ranks is not None and f.rank is not None and f.rank >= ranks:
            raise FaultSpecError(f"{f}: rank {f.rank} is not one of a replica's {ranks} (mesh.replicate × mesh.shard)")
        for place in (f.at, f.wait_for):
            if place is not None and place.replica >= replicas:
                raise FaultSpecError(f"{f}: replica {place.replica} is not one of mesh.sync={replicas}")
    return faults
