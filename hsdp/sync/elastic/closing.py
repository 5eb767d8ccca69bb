"""The run's close: one model at the end of an elastic run (docs/design.md §9.7, "The close").

A round's commit is decided per replica (torchft's `should_commit` agrees within a replica's world only), so
the run's last param round can commit on one replica and be dropped on another; mid-run the next quorum
heals the one behind, but after the last round there is none. So every replica closes the run after its
last step's sync (replica.py `_close`) with rounds of its own that only meet and compare:

    the quorum       a replica behind (fewer rounds committed) heals inside it, whole: a closing peer sends
                     its state in the round (nothing is left to train while it crosses)
    the fingerprints one row per member: whether its state holds the last round, its replica, the replicas it
                     still waits for, a hash of each held shard (`print_row`), all-gathered
    the verdict      every member reads the same rows (`verdict`): wait for a replica still to come, do the
                     last round again (nobody holds it: it was dropped everywhere), level, or differ

A replica that comes back after its peers closed finds their records (`Records`, in the run folder) and
compares with them. Replicas that still differ end with one line (`ReplicasDiffer`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, cast

import torch
import torch.distributed as dist

from hsdp.config.schema import Config
from hsdp.sync.elastic.phase import Heal
from hsdp.sync.schedule import grad_sync_due, steps_after_last_sync
from hsdp.sync.seam import ReplicaPolicy

if TYPE_CHECKING:
    from hsdp.sync.elastic.heal import HealState
    from hsdp.sync.elastic.transport import FTTransport

# A closing round's outcome on one rank; the replica's ranks agree on the largest (replica.py `_replica_max`).
LEVEL, DIFFER, REDO, AGAIN = 0, 1, 2, 3
# A fingerprint row: [applied, replica, waiting (a bitmask of replicas, WORD_BITS a word), hash of each shard ...]
WORD_BITS = 62  # an int64 word holds that many replicas' bits and stays positive
RECORDS = "closing"  # in the run folder: one record per closed replica's rank
POLL_S = 0.2  # between a closing replica's meetings while it waits for another to come


class _Weighed(Protocol):
    """SyncPolicy's ledger of the steps each fragment's next round weighs (not part of the heal's seam)."""

    since_sync: list[int]


class ReplicasDiffer(RuntimeError):
    """The replicas' final models differ and no closing round could bring them level: the message is the one
    line naming the replicas and how far apart they are."""


def closes_level(cfg: Config) -> bool:
    """Whether the run's replicas end with one model by design: its last step syncs every fragment and lands
    θ_m ← θ_g (α = 0), or its last step is a grad-sync round. A run with an unsynced tail ends apart by design
    (train.py says so at its start) and is not closed."""
    s, steps = cfg.sync, cfg.run.steps
    if grad_sync_due(steps - 1, s):
        return True
    alpha = s.alpha if s.delay > 0 or s.schedule == "torchft" else 0.0  # the policy's own rule (policy.py)
    return steps_after_last_sync(steps, s) == 0 and alpha == 0


def fingerprints(held: list[torch.Tensor]) -> list[int]:
    """One 63-bit hash of each held shard's bytes: equal iff the shards are bitwise equal (but for a collision)."""
    out = []
    for t in held:
        data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        out.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1)
    return out


def head(replicas: int) -> int:
    """Where a row's hashes begin, for a run of `replicas` replicas: after applied, replica and the mask's words."""
    return 2 + -(-replicas // WORD_BITS)


def mask_words(members: set[int], replicas: int) -> list[int]:
    """`members` as a bitmask over `replicas` replicas, WORD_BITS per int64 word (lowest replicas first)."""
    bits = sum(1 << m for m in members)
    return [(bits >> (WORD_BITS * w)) & ((1 << WORD_BITS) - 1) for w in range(head(replicas) - 2)]


def print_row(applied: bool, replica: int, waiting: set[int], prints: list[int], replicas: int) -> torch.Tensor:
    """This rank's row of a closing round (module docstring); `waiting`: the replicas it still waits for."""
    return torch.tensor([int(applied), replica, *mask_words(waiting, replicas), *prints], dtype=torch.int64)


@dataclass(frozen=True)
class Verdict:
    """What a closing round's rows say (the same on every member: they read the same rows)."""

    status: int
    present: list[int]  # the members' replicas, in the rows' order
    differing: list[int]  # the units whose shards are not equal on every member


def verdict(rows: Optional[torch.Tensor], last_round_syncs: bool, replicas: int) -> Verdict:
    """The outcome of a closing round from its gathered rows (None: the round was lost) in a run of `replicas`:
    AGAIN while a member waits for a replica that is not among them, REDO when no member holds the last param
    round (`last_round_syncs`: it was one; a grad-sync round cannot be done again), else LEVEL or DIFFER."""
    if rows is None:
        return Verdict(AGAIN, [], [])
    present = [int(r) for r in rows[:, 1]]
    here = torch.tensor(mask_words(set(present), replicas), dtype=torch.int64)
    k = head(replicas)
    prints = rows[:, k:]
    differing = [u for u in range(prints.shape[1]) if bool((prints[:, u] != prints[0, u]).any())]
    if bool((rows[:, 2:k] & ~here).any()):
        return Verdict(AGAIN, present, differing)
    if last_round_syncs and not bool(rows[:, 0].any()):
        return Verdict(REDO, present, differing)
    return Verdict(DIFFER if differing else LEVEL, present, differing)


def given_up(run_dir: Path) -> set[int]:
    """The replicas the local launcher gave up (replicas.json; under torchrun there is none: an empty set)."""
    try:
        state = json.loads((run_dir / "replicas.json").read_text())
    except (OSError, ValueError):
        return set()
    return {int(m) for m, r in state.items() if isinstance(r, dict) and r.get("given_up")}


class Records:
    """The closed replicas' records: `<run>/closing/replica<m>.rank<r>.json`, each rank its own (what it closed
    with: its hashes, the square of its params' norm, the verdict). A replica deletes its own when it starts (a
    record there is an earlier launch's), so every record read during a run was written in it."""

    def __init__(self, run_dir: Path, replica: int, rank: int) -> None:
        self.dir, self.replica, self.rank = run_dir / RECORDS, replica, rank

    def path(self, replica: int) -> Path:
        return self.dir / f"replica{replica}.rank{self.rank}.json"

    def forget_own(self) -> None:
        self.path(self.replica).unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(self.replica).with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path(self.replica))  # whole or absent: a peer may read it at any moment

    def others(self) -> dict[int, dict[str, Any]]:
        """The records of the other replicas (this rank's shard position) that closed already."""
        out: dict[int, dict[str, Any]] = {}
        if not self.dir.is_dir():
            return out
        for p in self.dir.glob(f"replica*.rank{self.rank}.json"):
            try:
                record = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if record.get("replica") != self.replica:
                out[int(record["replica"])] = record
        return out


def verdicts(run_dir: Path) -> dict[str, str]:
    """replica → its close's verdict (level, differ) from the records of its ranks (a benchmark's check)."""
    out: dict[str, str] = {}
    for p in sorted((run_dir / RECORDS).glob("replica*.rank*.json")) if (run_dir / RECORDS).is_dir() else []:
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        m = str(record.get("replica"))
        out[m] = "differ" if record.get("verdict") == "differ" or out.get(m) == "differ" else "level"
    return out


def differ_line(reference: int, apart: dict[int, tuple[float, float, float]], values: float, units: int) -> str:
    """The one line of replicas that closed together and still differ: per replica m of `apart`, (its params
    that differ from `reference`'s, the squared norm of the difference, its units that differ), of `values`
    params in `units` sync units."""
    parts = [
        f"replica {m} differs from replica {reference} in {n:,.0f} of {values:,.0f} params ({u:.0f} of {units} "
        f"units), norm of the difference {math.sqrt(sq):.4g}"
        for m, (n, sq, u) in sorted(apart.items())
    ]
    return "elastic: the replicas end with different models: " + "; ".join(parts)


def late_line(me: int, apart: dict[int, tuple[float, float, float]], units: int) -> str:
    """The one line of a replica that came back after `apart`'s replicas closed the run without it and differs
    from them: per replica m, (its units that differ from this replica's, m's squared param norm, this
    replica's squared param norm), of `units` sync units."""
    parts = [
        f"replica {me} differs from replica {m}, which closed the run without it, in {u:.0f} of {units} units "
        f"(param norms {math.sqrt(mine):.6g} here, {math.sqrt(theirs):.6g} there)"
        for m, (u, theirs, mine) in sorted(apart.items())
    ]
    return "elastic: the replicas end with different models: " + "; ".join(parts)


class RunClose:
    """The close of one rank of replica `replica` (module docstring): its meetings over `transport`, where a
    replica behind heals whole (`heal` sends and loads the state), the last round done again through `policy`
    where no replica holds it, the verdict, this rank's record. `catch_up(spectated)`: the replica's out-of-band
    heal from a peer ahead that is not closing (replica.py `_catch_up`); `replica_max`: the largest value over
    the replica's ranks (they go on together); `logs`: this rank prints the replica's lines; `counted`: this
    rank's params count in the replica's sums (in-site replicas hold the same shards); `since_sync`: the steps
    the last round weighed (set again when it is done again)."""

    def __init__(
        self,
        cfg: Config,
        replica: int,
        records: Records,
        transport: FTTransport,
        heal: HealState,
        policy: ReplicaPolicy,
        catch_up: Callable[[bool], int],
        replica_max: Callable[[int], int],
        logs: bool,
        counted: bool,
        since_sync: Optional[list[int]],
    ) -> None:
        self.cfg, self.replica, self.records = cfg, replica, records
        self.transport, self.heal, self.policy = transport, heal, policy
        self.catch_up, self.replica_max, self.logs, self.counted = catch_up, replica_max, logs, counted
        self.since_sync = since_sync
        self.last = cfg.run.steps - 1
        self.rounds = 0  # meetings (a round done again is a sync round, counted as one)
        self.seconds = 0.0
        self.redone = 0  # the last round done again (it was dropped on every replica)
        self.heals = 0  # healed whole from a closing replica in a meeting
        self.closed_with: list[int] = []
        self.verdict: Optional[str] = None  # level, differ
        self._prints: tuple[tuple[int, int, int], list[int]] = ((-1, -1, -1), [])  # (the state's key, its hashes)

    def stats(self) -> dict[str, Any]:
        return {
            "closing_rounds": self.rounds,
            "closing_s": round(self.seconds, 3),
            "closing_with": self.closed_with,
            "closing_redone": self.redone,
            "closing_verdict": self.verdict,
        }

    def run(self) -> None:
        """Meet until the verdict is level (or differ: ReplicasDiffer, after this rank's record). Replicas that
        have neither closed (their records) nor been given up (replicas.json) are waited for, up to
        elastic.partition_timeout_s (a frozen or cut-off replica coming back); a close whose meetings keep
        failing past twice that ends with one line."""
        cfg, t, heal = self.cfg, self.transport, self.heal
        bound = cfg.elastic.partition_timeout_s
        if t.open:  # a round left open for a step that never came (healed at the last grad-sync round)
            t.commit_round()
        heal.closing = t.closing = True
        t0 = time.perf_counter()
        deadline = t0 + bound
        syncs = not grad_sync_due(self.last, cfg.sync)  # the last round was a param sync: it can be done again
        told: set[int] = set()
        kept = t.participants  # the last sync's (the metrics' `replicas`, the run's tokens): not the close's
        while True:
            if time.perf_counter() > deadline + bound:  # past every replica's wait (a later closer's too)
                raise RuntimeError(f"elastic: closing the run: no closing round held within {2 * bound:g} s")
            waiting = self.still_to_come(deadline)
            v, rows = self.meet(waiting, syncs)
            away = waiting - set(v.present) if v.present else set()
            if away - told and self.logs:
                print(
                    f"elastic: closing the run: waiting up to {bound:g} s (elastic.partition_timeout_s) for "
                    f"replica(s) {', '.join(map(str, sorted(away)))}",
                    file=sys.stderr,
                    flush=True,
                )
            told |= away
            if v.status == AGAIN:
                time.sleep(POLL_S)
            elif v.status == REDO:
                self.sync_again()
            else:
                break
        t.participants = kept
        if told - set(v.present) and self.logs:  # waited for, not back: a record tells them if they come later
            print(
                f"elastic: closed the run without replica(s) {', '.join(map(str, sorted(told - set(v.present))))} "
                f"(not back within elastic.partition_timeout_s={bound:g} s)",
                file=sys.stderr,
                flush=True,
            )
        line = self.differ(v, rows) if v.status == DIFFER else None
        line = self.against_records(v.present) or line
        self.seconds = time.perf_counter() - t0
        self.closed_with, self.verdict = v.present, "differ" if line else "level"
        held = heal.seam.held
        self.records.write(
            {
                "replica": self.replica,
                "rank": self.records.rank,
                "step": t.manager.current_step(),
                "applied": heal.applied_last,
                "prints": self.prints(),
                "sq_norm": sum(float(h.double().pow(2).sum()) for h in held),
                "with": v.present,
                "verdict": self.verdict,
            }
        )
        if line:
            raise ReplicasDiffer(line)

    def prints(self) -> list[int]:
        """This rank's hashes, computed again only when its state changed (a heal, the last round done again):
        a replica waiting for another meets every POLL_S, and a big shard takes a while to hash."""
        key = (self.heal.heals, self.policy.dropped, self.redone)
        if self._prints[0] != key:
            self._prints = (key, fingerprints(self.heal.seam.held))
        return self._prints[1]

    def still_to_come(self, deadline: float) -> set[int]:
        """The replicas this one waits for: every other that has neither closed nor been given up, until
        `deadline` (then none)."""
        if time.perf_counter() > deadline:
            return set()
        done = set(self.records.others()) | given_up(self.cfg.run_dir)
        return set(range(self.cfg.mesh.sync)) - done - {self.replica}

    def meet(self, waiting: set[int], syncs: bool) -> tuple[Verdict, Optional[torch.Tensor]]:
        """One meeting: its quorum (a replica behind heals whole here), every member's fingerprints, the verdict
        its rows give (`verdict`), agreed over the replica's ranks. A meeting counts no training round:
        torchft's step is set back after it, so a later heal still goes to the replica that committed more of
        the run's rounds."""
        t, heal = self.transport, self.heal
        manager = t.manager
        self.rounds += 1
        heals = heal.heals
        t.begin_round()
        self.heals += heal.heals - heals  # behind a closing peer: healed whole in its quorum
        if heal.stage is Heal.OFFERED:  # a peer ahead still trains (it is not closing): heal from it out of band
            # that round is its sync round (dropped here: its members disagree on closing)
            with t.resyncing("a peer still training healed this replica in a meeting"):
                self.catch_up(False)
            return Verdict(AGAIN, [], []), None
        base = manager.current_step()
        rows = None
        if t.all_closing and not manager.errored():
            rows = t.gather(print_row(heal.applied_last, self.replica, waiting, self.prints(), self.cfg.mesh.sync))
        v = verdict(rows, syncs, self.cfg.mesh.sync)
        status = self.replica_max(v.status)  # the replica's ranks go on together (their rounds pair up)
        ok = t.commit_round()
        manager.load_state_dict({**manager.state_dict(), "step": base})
        if not ok:
            return Verdict(AGAIN, v.present, v.differing), None
        return Verdict(status, v.present, v.differing), rows

    def sync_again(self) -> None:
        """No replica at the close holds the last param round (it was dropped on every one): do it again, as a
        round of its own, from the state it left (θ_m, θ_g, b and residuals as they were before it)."""
        t, heal, policy = self.transport, self.heal, self.policy
        if self.since_sync is not None:  # the steps that round weighs (its start set them to 0)
            cast(_Weighed, policy).since_sync = list(self.since_sync)
        before = policy.dropped
        with t.resyncing("the last round, dropped on every replica, done again"):
            policy.start_due(self.last)
            if self.cfg.sync.delay > 0:
                policy.finish()  # τ > 0: land it now
        if heal.stage is Heal.OFFERED:  # a peer ahead met this round (dropped: it was not closing): heal from it
            self.catch_up(True)
        elif policy.dropped == before:
            heal.applied_last = True
            self.redone += 1
            if self.logs:
                print(
                    "elastic: closing the run: its last round, dropped on every replica, done again",
                    file=sys.stderr,
                    flush=True,
                )

    def differ(self, v: Verdict, rows: Optional[torch.Tensor]) -> str:
        """The line for replicas that closed together and still differ: how many params and how far, against
        the lowest-numbered one (one more gather of the differing units, and a sum over the replica's ranks)."""
        held = self.heal.seam.held
        n = self.cfg.mesh.sync
        ref = v.present.index(min(v.present))
        sums = torch.zeros(n, 2, dtype=torch.float64)  # per replica: params that differ, squared difference
        units = torch.zeros(n, dtype=torch.float64)  # per replica: units that differ (a max over ranks)
        values = torch.tensor([float(sum(h.numel() for h in held)) if self.counted else 0.0], dtype=torch.float64)
        if v.differing and rows is not None:
            prints = rows[:, head(n) :]
            got = self.transport.gather(torch.cat([held[u].detach().reshape(-1).float().cpu() for u in v.differing]))
            for i, r in enumerate(v.present):
                units[r] = float((prints[i] != prints[ref]).sum())
                if got is not None and self.counted:
                    sums[r, 0] = float((got[i] != got[ref]).sum())
                    sums[r, 1] = float((got[i].double() - got[ref].double()).pow(2).sum())
        comm = self.transport.comm
        for x in (sums, values):
            comm.all_reduce(x, "world")
        comm.all_reduce(units, "world", op=dist.ReduceOp.MAX)
        apart = {r: (float(sums[r, 0]), float(sums[r, 1]), float(units[r])) for r in v.present if units[r] > 0}
        return differ_line(v.present[ref], apart, float(values[0]), len(held))

    def against_records(self, present: list[int]) -> Optional[str]:
        """The line if replicas that closed the run before this one came back (their records) hold another model;
        None if they hold this one (or none closed without it). Agreed over the replica's ranks."""
        held = self.heal.seam.held
        mine = self.prints()
        n = self.cfg.mesh.sync
        units = torch.zeros(n, dtype=torch.float64)  # per earlier replica: units that differ (max over ranks)
        norms = torch.zeros(n, 2, dtype=torch.float64)  # its squared param norm, this replica's (sums)
        my_sq = sum(float(h.double().pow(2).sum()) for h in held) if self.counted else 0.0
        for r, record in self.records.others().items():
            if r in present:
                continue
            theirs = record.get("prints") or []
            units[r] = float(sum(a != b for a, b in zip(mine, theirs)) + abs(len(mine) - len(theirs)))
            norms[r] = torch.tensor([float(record.get("sq_norm") or 0.0) if self.counted else 0.0, my_sq])
        comm = self.transport.comm
        comm.all_reduce(units, "world", op=dist.ReduceOp.MAX)
        comm.all_reduce(norms, "world")
        apart = {r: (float(units[r]), float(norms[r, 0]), float(norms[r, 1])) for r in range(n) if units[r] > 0}
        return late_line(self.replica, apart, len(held)) if apart else None
