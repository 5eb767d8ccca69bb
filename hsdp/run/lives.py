"""A replica's lives, and its ledger over all of them (summary.json's `replica_ledger`; docs/design.md §9.3).

A life is one start of an elastic replica's workers: its first, each restart after a failure (healed from a live
replica), each resumed launch. Each life's metrics records (metrics.replica<m>.jsonl; a later life keeps the earlier
ones, hsdp/run/metrics.py `open_metrics`) carry its index `life` and its own counts so far, `life_trained_tokens` and
`life_merged_tokens` (hsdp/run/ledger.py). A replica's figures over the run are sums over its lives:

    trained_tokens   Σ of what each life trained, a life that died included up to its last record: those tokens
                     were trained (the work was done) even though the model that held them was lost
    merged_tokens    Σ of what each life's rounds carried into the global model (a dead life's last period's never is)
    restarts         the index of its last life: the times it was started again (a life that logged no record is
                     counted here, but has no entry in `lives`)
    lives            one entry per life that logged: life, first_step and last_step (its logged steps),
                     trained_tokens, merged_tokens, ended ("finished"; "restarted": it ended, by a failure or a
                     stopped launch, and the replica was started again; "given_up": it failed and was not)

Its `sync_wait_s` and `skipped_steps` are counters carried over its lives too (hsdp/run/metrics.py CARRIED).

A dead life's count ends at its last record: the steps it trained after it (at most run.log_every, the step it
died in included) are in no file and counted nowhere. A resumed launch keeps the records up to its checkpoint's
step: an earlier launch's lives count up to there (the steps after it are trained again, and counted then).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

FINISHED, RESTARTED, GIVEN_UP = "finished", "restarted", "given_up"  # how a life ended


def life_index(restart: int, previous: Optional[dict[str, Any]]) -> int:
    """This process's life: after the earlier life whose record it continues (`previous`, the last record kept from
    before it), and no lower than the launcher's `restart` count (lives of this launch that logged nothing)."""
    before = (previous or {}).get("life")
    return restart if before is None else max(restart, int(before) + 1)


def lives_of(records: Iterable[dict[str, Any]], last_life: int, last_ended: str = FINISHED) -> list[dict[str, Any]]:
    """Each life's entry from a replica's metrics records (in file order; a record without `life`, from before
    lives were logged, is skipped). Life `last_life`, the replica's last start, ended as `last_ended`; every other
    was `restarted` (so was the last one logged when its last start logged nothing: it died, or healed at the close)."""
    lives: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("life") is None:
            continue
        life = lives.setdefault(int(r["life"]), {"life": int(r["life"]), "first_step": r["step"]})
        # the counts are cumulative within a life: its last record holds them
        life.update(last_step=r["step"], trained_tokens=r["life_trained_tokens"], merged_tokens=r["life_merged_tokens"])
    ordered = [lives[i] for i in sorted(lives)]
    for life in ordered:
        life["ended"] = last_ended if life["life"] == last_life else RESTARTED
    return ordered


def over_lives(entry: dict[str, Any], lives: list[dict[str, Any]], restarts: int) -> dict[str, Any]:
    """A replica's ledger entry over the run: `entry` (its waits and skips, counted over its lives) with its trained
    and merged tokens the sums over `lives`, `restarts` and `lives`."""
    return {
        **entry,
        "trained_tokens": sum(life["trained_tokens"] for life in lives),
        "merged_tokens": sum(life["merged_tokens"] for life in lives),
        "restarts": restarts,
        "lives": lives,
    }


def given_up_entry(records: list[dict[str, Any]], restarts: int) -> dict[str, Any]:
    """The ledger entry of a replica that wrote no summary (given up), from its metrics records alone: its lives
    (its last start, the launcher's `restarts` or a later life's index, `given_up`), and its waits and skips so far
    from its last record."""
    last_life = max([restarts, *(int(r["life"]) for r in records if r.get("life") is not None)])
    last = records[-1] if records else {}
    wait, wall = float(last.get("sync_wait_s") or 0.0), float(last.get("elapsed_s") or 0.0)
    entry = {
        "sync_wait_s": round(wait, 3),
        "wait_fraction": round(wait / wall, 4) if wall > 0 else None,
        "skipped_steps": int(last.get("skipped_steps") or 0),
    }
    return over_lives(entry, lives_of(records, last_life, GIVEN_UP), last_life)
