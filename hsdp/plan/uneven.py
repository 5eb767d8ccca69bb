"""Uneven replicas in the planner (docs/design.md §8.12, §9.5): what one round costs each replica when their
step times differ, under the three ways of pacing the rounds.

Inputs: each replica's step time s_m (its compute; the planner's compute × `--speeds`), the period H
(sync.every), the round's own sync time T (what the step model exposes per period), the straggler bound B
(elastic.round_timeout_s) and the paced window W (sync.every_s / fragments). A replica that trains k steps
arrives at the round after k·s_m; the round ends T after the last arrival.

    lockstep   k_m = H;  everyone waits for the slowest
    bound      the pace-setter (fastest) trains H; the others k_m = min(H, max(1, ⌊D/s_m⌋)) with the
               deadline D = H·s_min + ¾B (straggler.py's DEADLINE_SHARE); a replica arriving after
               H·s_min + B is late: its Δ is dropped (not merged)
    paced      k_m = min(H, max(1, ⌊W/s_m⌋)): a step is trained if it ends within the window

Per mode: the steps each replica trains per round, the round's time, each replica's wait (the last
arrival less its own) ÷ the round's time, goodput (merged ÷ trained steps) and merged steps per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEADLINE_SHARE = 0.75  # hsdp/sync/elastic/straggler.py: a cut replica aims to arrive by pace + ¾ bound


@dataclass(frozen=True)
class UnevenRound:
    """One steady round of a pacing mode."""

    mode: str
    steps: list[int]  # trained per replica per round
    round_s: float
    wait_fraction: list[float]  # per replica: waiting at the round ÷ the round's time
    goodput: float  # merged ÷ trained steps
    merged_steps_per_s: float  # over all replicas

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _round(mode: str, steps: list[int], step_s: list[float], sync_s: float, merged: list[bool]) -> UnevenRound:
    arrivals = [k * s for k, s in zip(steps, step_s)]
    last = max(arrivals)
    round_s = last + sync_s
    trained = sum(steps)
    kept = sum(k for k, m in zip(steps, merged) if m)
    return UnevenRound(
        mode,
        steps,
        round_s,
        [(last - a) / round_s for a in arrivals],
        kept / trained,
        kept / round_s,
    )


def uneven_rounds(step_s: list[float], every: int, sync_s: float, bound_s: float, window_s: float) -> list[UnevenRound]:
    """The steady round under lockstep, the bound (when bound_s > 0) and paced rounds (when window_s > 0)."""
    H = every
    out = [_round("lockstep", [H] * len(step_s), step_s, sync_s, [True] * len(step_s))]
    if bound_s > 0:
        pace = H * min(step_s)
        deadline = pace + DEADLINE_SHARE * bound_s
        steps = [H if s == min(step_s) else min(H, max(1, math.floor(deadline / s))) for s in step_s]
        merged = [k * s <= pace + bound_s for k, s in zip(steps, step_s)]
        out.append(_round("bound", steps, step_s, sync_s, merged))
    if window_s > 0:
        steps = [min(H, max(1, math.floor(window_s / s))) for s in step_s]
        out.append(_round("paced", steps, step_s, sync_s, [True] * len(step_s)))
    return out


def uneven_table(rounds: list[UnevenRound]) -> str:
    """The modes side by side (markdown)."""
    lines = [
        "| pacing | steps per round (each replica) | round | wait ÷ round (each replica) | goodput | merged steps/s |",
        "|---|---|---:|---|---:|---:|",
    ]
    for r in rounds:
        waits = ", ".join(f"{w:.2f}" for w in r.wait_fraction)
        steps = ", ".join(map(str, r.steps))
        lines.append(
            f"| {r.mode} | {steps} | {r.round_s:.3g} s | {waits} | {r.goodput:.2f} | {r.merged_steps_per_s:.3g} |"
        )
    return "\n".join(lines)
