"""The chaos generator (no torch): `SEED:MTBF_S` and the Faults it draws; hsdp/bench/chaos.py applies them.

`chaos: SEED:MTBF_S` (a slow-link run's key, or `--chaos SEED:MTBF_S`) draws faults over the whole group with mean
time MTBF_S between them, up front over the run's time bound from `random.Random(SEED)` (the same seed, the same
schedule): exponential gaps, then a kind, a replica and a spell, each uniformly. Each is a Fault at a time of the
grammar (hsdp/faults/spec.py), T seconds from when every replica logged a step:

    kind        drawn as                    spell
    kill        R@tT:kill=D                 D = elastic.restart_delay_s (its replacement's start)
    stop        R@tT:stop=S                 2–12 s
    partition   R@tT:partition=S            5–20 s
    slow        R@tT:slow=3xS               10–30 s
    lighthouse  lighthouse@tT:kill=S        2–6 s

Every kind but the lighthouse's is drawn on any replica, 0 included: no replica holds the lighthouse or the run
folder (the benchmark runs the lighthouse on a host of its own and prepares the folder before any replica starts).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from hsdp.faults.spec import Fault, Place, refusal

KINDS = ("kill", "stop", "partition", "slow", "lighthouse")
SPELL_S = {"stop": (2.0, 12.0), "partition": (5.0, 20.0), "slow": (10.0, 30.0), "lighthouse": (2.0, 6.0)}
SLOW_FACTOR = 3.0  # a slowed node runs 1/3 of the time
FORM, EXAMPLE = "SEED:MTBF_S", "7:30"


@dataclass(frozen=True)
class Chaos:
    """The seed and the mean time between faults (over the whole group) of a chaos schedule."""

    seed: int
    mtbf_s: float


def parse_chaos(text: str, what: str) -> Chaos:
    """'SEED:MTBF_S' (MTBF_S > 0), or the grammar's FaultSpecError naming `what`."""
    shown = str(text).strip()
    m = re.fullmatch(r"(\d+):(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)", shown)
    if not m:
        raise refusal(what, f"expected {FORM}", shown, FORM, EXAMPLE)
    if not float(m[2]) > 0:
        raise refusal(what, f"MTBF_S must be > 0, got {m[2]}", shown, FORM, EXAMPLE)
    return Chaos(int(m[1]), float(m[2]))


def kind(fault: Fault) -> str:
    """A drawn fault's kind (slowlink.json's `kind`, the planner's): its action, or `lighthouse`."""
    return "lighthouse" if fault.replica is None else fault.action


def draw_schedule(chaos: Chaos, replicas: int, horizon_s: float, restart_delay_s: float) -> list[Fault]:
    """The faults of `chaos` over `horizon_s` seconds for `replicas` replicas: exponential gaps of mean MTBF_S,
    a kind uniformly, a replica uniformly among those the kind may hit, a spell uniformly in its range."""
    rng = random.Random(chaos.seed)
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / chaos.mtbf_s)
        if t >= horizon_s:
            return faults
        drawn = rng.choice(KINDS)
        replica = None if drawn == "lighthouse" else rng.randrange(replicas)
        lo, hi = SPELL_S.get(drawn, (restart_delay_s, restart_delay_s))
        at, spell = Place(replica, at_s=round(t, 3)), round(rng.uniform(lo, hi), 3)
        if drawn == "slow":
            faults.append(Fault(at, "slow", seconds=spell, factor=SLOW_FACTOR))
        else:
            faults.append(Fault(at, "kill" if drawn == "lighthouse" else drawn, seconds=spell))
