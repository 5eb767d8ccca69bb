"""The elastic strategy: one torch.distributed world per replica on one pool, each restarted alone when it fails.

(elastic.enabled, docs/design.md §9.) `launch_elastic` starts torchft's lighthouse as a supervised process (unless
`elastic.lighthouse` names one), then `mesh.sync` replica groups of `mesh.shard` local workers on one pool
(hsdp/run/pool.py), each group with its own rendezvous port. `ElasticRun` reads the pool's events: when any
worker of a replica ends badly (or stalls), it kills the rest of that replica and starts it again (up to
`elastic.max_restarts` times); the new workers heal from a live replica at its next sync (hsdp/sync/elastic/)
while the others train on. Each worker is handed its `ReplicaSeat` (replica index, restart count,
lighthouse) as an argument. The run folder's `replicas.json` lists each replica's live pids and restarts,
rewritten on every change; `summary.json` merges the replicas' own (`merge_replica_summaries`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from hsdp.config.schema import Config, ConfigError
from hsdp.core.atomic import write_json, write_text
from hsdp.run.checkpoint import elastic_resume_note
from hsdp.run.guard import ONE_LINE_ERRORS
from hsdp.run.lighthouse import LighthouseError, LighthouseProcess, free_port
from hsdp.run.lives import given_up_entry
from hsdp.run.metrics import last_record, ledger_totals, merged_rates, read_records, write_failure
from hsdp.run.pool import Exit, Pool, WorkerError, start_zygote
from hsdp.run.rank import Worker, forked_ranks, host_rendezvous_store, worker_env
from hsdp.run.stop import StopSignals
from hsdp.sync.elastic import clear_markers, died_at, in_words, wait_for_lighthouse
from hsdp.sync.seam import ReplicaSeat

if TYPE_CHECKING:
    import torch.distributed as dist


# What a replica's worker imports besides the plain run's (the rank's manager, its heal server): imported once by
# the zygote (~0.2 s at load 13 that each restarted worker's start saved). torchft's import starts no thread, so
# the zygote still forks cleanly; its runtime starts with the worker's manager.
ELASTIC_PRELOAD = ("hsdp.sync.elastic.replica", "torchft.manager", "torchft.checkpointing.http_transport")


@dataclass
class Replica:
    """One replica group as the launcher tracks it."""

    index: int
    workers: list[int] = field(default_factory=list)  # the current generation's worker indices
    restarts: int = 0
    finished: int = 0  # workers of the current generation that exited 0
    failures: list[str] = field(default_factory=list)  # each failure's last line
    given_up: bool = False
    fatal: bool = False  # its last failure was one a restart repeats (a NaN, a full disk): not restarted
    restart_at: Optional[float] = None  # monotonic time of a pending restart
    died: tuple[tuple[str, float], ...] = ()  # its last death's marks (hsdp/core/timeline.py), for its restart

    @property
    def done(self) -> bool:
        return self.given_up or (self.restart_at is None and self.finished == len(self.workers))

    @property
    def training(self) -> bool:
        """Its workers are running (a replica a restarted one can heal from)."""
        return not self.given_up and self.restart_at is None and 0 < len(self.workers) and not self.done


def enter_torchrun_replica(cfg: Config) -> ReplicaSeat:
    """Under torchrun an agent (a machine) runs one replica: its world is that replica's mesh.shard ranks,
    torchrun restarts it (--max-restarts), and the replicas meet at a lighthouse started on its own.
    Returns this agent's seat (elastic.replica, torchrun's restart count, the lighthouse)."""
    e = cfg.elastic
    if not e.lighthouse:
        raise ConfigError(
            "elastic.lighthouse: under torchrun the replicas meet at a lighthouse started on its own "
            "(torchft_lighthouse --min_replicas 1 ...); set its address, e.g. http://HOST:29510"
        )
    if not 0 <= e.replica < cfg.mesh.sync:
        raise ConfigError(
            f"elastic.replica: under torchrun, this machine's replica index in 0..{cfg.mesh.sync - 1}, got {e.replica}"
        )
    check_lighthouse_reachable(cfg)
    os.environ.update(worker_env())
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return ReplicaSeat(e.replica, restarts, e.lighthouse)


def later_life(cfg: Config) -> bool:
    """Whether this start is a later life of its replica: torchrun restarted it, or its node was started again (its
    records are in the run folder)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return True
    return (cfg.run_dir / f"metrics.replica{cfg.elastic.replica}.jsonl").is_file()


def check_lighthouse_reachable(cfg: Config, wait_s: Optional[float] = None) -> None:
    """ConfigError (one line) unless elastic.lighthouse, when set, accepts a connection within elastic.timeout_s
    (asked again every 0.5 s for up to `wait_s`): otherwise every replica's start would fail and be restarted until
    elastic.max_restarts is spent. By default a first start asks once (a wrong address is one line now), and a
    later life (`later_life`) waits up to elastic.partition_timeout_s, as a running replica waits for a lost
    lighthouse: no node is special, and the lighthouse's may be being restarted too."""
    url = cfg.elastic.lighthouse
    if not url:
        return
    if wait_s is None:
        wait_s = cfg.elastic.partition_timeout_s if later_life(cfg) else 0.0
    error = wait_for_lighthouse(
        url,
        wait_s,
        cfg.elastic.timeout_s,
        lambda e: print(
            f"elastic: the lighthouse at {url} does not answer ({in_words(e)}); waiting up to {wait_s:g} s "
            "(elastic.partition_timeout_s)",
            file=sys.stderr,
            flush=True,
        ),
    )
    if error:
        waited = f" within {wait_s:g} s (elastic.partition_timeout_s)" if wait_s > 0 else ""
        raise ConfigError(
            f"elastic.lighthouse: cannot reach {url}{waited} ({in_words(error)}); start torchft_lighthouse "
            "there first, or leave elastic.lighthouse empty to have the launcher start one"
        )


def lighthouse_answers(cfg: Config) -> bool:
    """Whether elastic.lighthouse (a lighthouse started on its own) accepts a connection; True without one
    (the launcher's own lighthouse is started again whenever it dies)."""
    try:
        check_lighthouse_reachable(cfg, wait_s=0.0)
    except ConfigError:
        return False
    return True


def start_lighthouse(cfg: Config) -> tuple[Optional[LighthouseProcess], str]:
    """torchft's lighthouse as a supervised process of its own (unless the config names one): started on a free
    port of this host, and started again at that address whenever it dies (hsdp/run/lighthouse.py); and its
    address. No replica's process holds it, so any replica may die."""
    if cfg.elastic.lighthouse:
        return None, cfg.elastic.lighthouse
    port = free_port()
    lighthouse = LighthouseProcess(cfg, port, f"http://{socket.gethostname()}:{port}")
    try:
        lighthouse.start()
    except LighthouseError as e:
        lighthouse.close()
        raise WorkerError(str(e)) from None
    return lighthouse.supervise(), lighthouse.address


def launch_elastic(cfg: Config, worker: Worker, stop: StopSignals) -> None:
    """An elastic run: the lighthouse, then one local world per replica on one pool, each restarted alone when it
    fails. Raises WorkerError if a replica was given up (the others still finished)."""
    note = elastic_resume_note(cfg)  # replicas resuming from different steps: say who heals from whom
    if note:
        print(note, file=sys.stderr)
    try:
        check_lighthouse_reachable(cfg)  # one line now, not a restart of every replica until max_restarts
    except ConfigError as e:
        raise WorkerError(str(e)) from None
    lighthouse, address = start_lighthouse(cfg)  # before the zygote, whose workers must not inherit its child
    try:
        zygote = start_zygote(worker, cfg.compile.enabled, ELASTIC_PRELOAD)
        with Pool(zygote, stall_after_s=cfg.mesh.timeout_s) as pool:
            run = ElasticRun(cfg, pool, worker, address)
            run.run(stop)
        try:
            run.write_summary()
        except OSError as e:  # a full disk: one line naming the file and the bytes free
            raise WorkerError(write_failure(cfg.run_dir / "summary.json", e)) from None
        failed = run.outcome()
        if failed:
            raise WorkerError(failed)
    finally:
        if lighthouse is not None:
            lighthouse.close()


class ElasticRun:
    """The elastic strategy: the replica groups of one run on one pool of workers.

    It reads the pool's events and decides: a worker that ended cleanly counts towards its replica's finish;
    one that failed or stalled gets its replica's other workers killed, and the replica restarted after
    elastic.restart_delay_s (up to elastic.max_restarts), or given up.
    """

    def __init__(self, cfg: Config, pool: Pool, worker: Worker, lighthouse: str) -> None:
        self.cfg, self.pool, self.worker, self.lighthouse = cfg, pool, worker, lighthouse
        self.replicas = [Replica(m) for m in range(cfg.mesh.sync)]
        self.owner: dict[int, int] = {}  # worker index -> replica (current generation only)
        self.stores: dict[int, dist.TCPStore] = {}  # each replica's rendezvous, kept while its workers run
        self.ended = False  # the launch is over (its workers stopped): no pid is live
        self.lighthouse_lost = False  # elastic.lighthouse stopped answering: every replica is given up
        clear_markers(cfg.run_dir)  # elastic.faults' markers of an earlier launch (lives count from 0 again)

    def run(self, stop: StopSignals) -> None:
        """Start every replica, then follow the pool's events until each replica finished or was given up."""
        try:
            with stop.guarding(self.pool):
                for m in range(self.cfg.mesh.sync):
                    self.start_replica(m)
                stop.arm()
                while self.running:
                    for event in self.pool.poll(0.2):
                        if event.stalled:
                            self.worker_stalled(event)
                        else:
                            self.worker_ended(event)
                    self.restart_due()
        finally:
            self.end()  # replicas.json: no live pids left

    def start_replica(self, m: int) -> None:
        """Start replica m's world: a fresh rendezvous (a restarted world must not see old keys), its ranks
        numbered among all the launcher's workers, each handed the replica's seat."""
        r, cfg = self.replicas[m], self.cfg
        shard = cfg.mesh.replicate * cfg.mesh.shard  # a replica's (a site's) ranks
        self.stores[m] = host_rendezvous_store(cfg.mesh.timeout_s)
        # a restart's seat carries the launcher's marks of it, the new life's timeline's first (restart.md)
        marks = (*r.died, ("restart", time.time())) if r.restarts else ()
        seat = ReplicaSeat(m, r.restarts, self.lighthouse, marks)
        targets = forked_ranks(cfg, self.worker, self.stores[m].port, shard, m * shard, cfg.world_size, seat)
        r.workers, r.finished = self.pool.start(targets), 0
        for i in r.workers:
            self.owner[i] = m
        self.write_replicas_json()

    def worker_ended(self, e: Exit) -> None:
        """A worker ended: count a clean finish, or restart (or give up on) its replica."""
        m = self.owner.pop(e.index, None)
        if m is None:
            return  # a worker of a replica's earlier generation (killed when it was restarted)
        r = self.replicas[m]
        if e.code == 0:
            r.finished += 1
            return
        # its life's first failure (the rest are killed for it and read as an earlier generation's): when it
        # died (known when a fault killed it) and when this launcher saw it, for its restart's timeline
        killed = died_at(self.cfg.run_dir, m, r.restarts)
        r.died = (*((("killed", killed),) if killed is not None else ()), ("detected", time.time()))
        last = (e.traceback.strip().splitlines() or [f"exit code {e.code}"])[-1]
        r.failures.append(last)
        rest = [i for i in r.workers if i in self.owner]
        for i in rest:
            self.owner.pop(i)
        self.pool.signal(signal.SIGKILL, rest)  # the replica's survivors would wait on it
        r.workers = []
        # A divergence (NaN/inf) or a failed save is not a lost process: the restarted replica would heal and
        # reach the same state again, so it is given up at once, naming the error, instead of restarted.
        r.fatal = last.split(":", 1)[0] in ONE_LINE_ERRORS
        if r.fatal:
            r.failures[-1] = last.split(": ", 1)[-1]  # its message is the whole story (as the plain launcher's)
        if r.fatal or r.restarts >= self.cfg.elastic.max_restarts or self.lighthouse_lost:
            r.given_up = True
        elif not lighthouse_answers(self.cfg):
            # Its lighthouse (one started on its own) is gone: a restart would wait elastic.partition_timeout_s
            # for a quorum and fail again, replica after replica. Give up on all of them; the others fail the
            # same way once their own bound passes (their checkpoints stay as they were last written).
            self.lighthouse_lost = True
            for x in self.replicas:
                if not x.done or x is r:
                    x.given_up, x.restart_at = True, None
        elif not any(x.training for x in self.replicas):
            # Nobody to heal from (every other replica finished, failed or waits for its own restart): a restart
            # would find no live replica and fail again, spending every restart. Give up on all that wait.
            for x in self.replicas:
                if not x.done or x is r:
                    x.given_up, x.restart_at = True, None
        else:
            r.restarts += 1
            r.restart_at = time.monotonic() + self.cfg.elastic.restart_delay_s
        self.write_replicas_json()
        self.tell(r, last)

    def tell(self, r: Replica, last: str) -> None:
        """One line on the launcher's output per replica event (its workers' lines say how it healed)."""
        died = f"elastic: replica {r.index} died ({last[:200]})"
        if r.given_up:
            print(f"{died}; given up", file=sys.stderr, flush=True)
        elif r.restart_at is not None:
            delay, limit = self.cfg.elastic.restart_delay_s, self.cfg.elastic.max_restarts
            print(f"{died}; restart {r.restarts} of {limit} in {delay:g} s", file=sys.stderr, flush=True)

    def worker_stalled(self, e: Exit) -> None:
        """A worker stopped (SIGSTOP, a debugger) for longer than mesh.timeout_s: a stopped worker neither exits
        nor heartbeats, so its replica's peers may wait on it forever (a replica of one rank has none that would
        time out). Kill it and fail its replica (restarted and healed like any failure, or given up), naming
        the pid."""
        self.pool.signal(signal.SIGKILL, [e.index])
        self.worker_ended(Exit(e.index, None, f"a worker stopped answering: {e.traceback}", stalled=True))

    def end(self) -> None:
        """The launch is over and its workers are gone: replicas.json lists no live pid."""
        self.ended = True
        self.write_replicas_json()

    def restart_due(self) -> None:
        """Start the replicas whose restart delay has passed."""
        for r in self.replicas:
            if r.restart_at is not None and time.monotonic() >= r.restart_at:
                r.restart_at = None
                self.start_replica(r.index)
                print(f"elastic: replica {r.index} restarted (start {r.restarts + 1})", file=sys.stderr, flush=True)

    @property
    def running(self) -> bool:
        return not all(r.done for r in self.replicas)

    def write_replicas_json(self) -> None:
        """replicas.json: each replica's live worker pids and its restarts (atomic rewrite)."""
        state = {
            str(r.index): {
                "pids": []
                if r.given_up or self.ended
                else [self.pool.pids[i] for i in r.workers if i in self.pool.pids],
                "restarts": r.restarts,
                "given_up": r.given_up,
                "ended": self.ended,
            }
            for r in self.replicas
        }
        write_json(self.cfg.run_dir / "replicas.json", state)

    def write_summary(self) -> None:
        """summary.json of this run (see `merge_replica_summaries`)."""
        failures = {r.index: len(r.failures) for r in self.replicas}
        given_up = {r.index for r in self.replicas if r.given_up}
        merge_replica_summaries(self.cfg.run_dir, failures, {r.index: r.restarts for r in self.replicas}, given_up)

    def outcome(self) -> Optional[str]:
        """None if every replica finished; else the one line saying which replica was given up and why."""
        lost = [r for r in self.replicas if r.given_up]
        if not lost:
            return None
        r = lost[0]
        if self.lighthouse_lost:
            return (
                f"the lighthouse at {self.cfg.elastic.lighthouse} stopped answering: replicas given up after "
                f"elastic.partition_timeout_s={self.cfg.elastic.partition_timeout_s:g} s without a quorum "
                f"(last: {next(x for x in reversed(lost) if x.failures).failures[-1]}); each replica's last "
                "checkpoint is kept (run.resume=auto continues once a lighthouse runs there again)"
            )
        ok = [str(x.index) for x in self.replicas if not x.given_up]
        others = f"; replica{'s' if len(ok) > 1 else ''} {', '.join(ok)} finished" if ok else ""
        if not r.failures:  # given up while waiting for its restart: the replica that failed last left it alone
            r = next(x for x in reversed(lost) if x.failures)
        if r.fatal:
            why = "not restarted: a restart would fail the same way"
        elif r.restarts >= self.cfg.elastic.max_restarts:
            why = f"elastic.max_restarts={self.cfg.elastic.max_restarts}"
        else:
            why = "no live replica left to heal from"
        given_up = f"replicas {', '.join(str(x.index) for x in lost)} given up; " if len(lost) > 1 else ""
        return f"{given_up}replica {r.index} failed {len(r.failures)} times ({why}), last: {r.failures[-1]}{others}"


def _mean(values: list[Optional[float]]) -> Optional[float]:
    """The mean of the values that are not None (None if none is)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def merge_replica_summaries(
    run_dir: Path, failures: dict[int, int], restarts: dict[int, int], given_up: Collection[int] = ()
) -> None:
    """summary.json of an elastic run from its replicas' own summary.replica<m>.json (each kept), with one
    definition per field as a plain run's summary:

    final_loss, final_val_loss   the mean over the replicas that finished (as a plain run's world mean:
                                 the replicas are of equal size); `finished_replicas` lists them
    tokens                       Σ of `replica_ledger`'s trained_tokens: what each replica trained in all
                                 its lives, a dead life's up to its last record (without a ledger: each
                                 replica's trained_tokens, a given-up one's from its last metrics record)
    replica_ledger               per replica over all its lives (hsdp/run/lives.py): trained and merged tokens,
                                 restarts, `lives`; a given-up replica's from its metrics file
    train_time_s, wall_time_s    the longest replica's (they train side by side)
    tokens_per_s, mfu            the steady rate: the first finished replica's that never failed nor was cut
                                 off, else the first finished one's (the run's tokens per step over its
                                 median step, as a plain run's)
    wall_tokens_per_s, wall_mfu  tokens / train_time_s (wall_mfu scaled with it)
    survivor_lost_s              the most a replica that never failed nor was cut off (no rejoin) lost to
                                 its peers' failures (its failure-touched steps' excess over its usual sync
                                 step, `elastic_lost_s`; a cut-off replica's own pause is not a survivor's loss)

    The other fields are that replica's, plus the launcher's failure and restart counts.
    """
    summaries = {}
    for m in failures:
        path = run_dir / f"summary.replica{m}.json"
        if path.is_file() and m not in given_up:
            summaries[m] = json.loads(path.read_text())
    if not summaries:
        return

    def survived(m: int, s: dict) -> bool:
        return not failures[m] and not s.get("rejoins")

    # each replica's ledger over its lives (a given-up replica's from its metrics file, hsdp/run/lives.py)
    ledger = {k: v for s in summaries.values() for k, v in (s.get("replica_ledger") or {}).items()}
    for m in failures:
        if ledger and m not in summaries:
            ledger[str(m)] = given_up_entry(read_records(run_dir / f"metrics.replica{m}.jsonl"), restarts[m])
    # the replica whose rates stand for the run: the first that never failed nor was cut off (any replica may be
    # killed, replica 0 too), else the first finished
    first = summaries[min((m for m, s in summaries.items() if survived(m, s)), default=min(summaries))]

    trained = 0
    for m in failures:  # a replica without a summary (given up) trained what its last record says
        own = summaries[m] if m in summaries else (last_record(run_dir / f"metrics.replica{m}.jsonl") or {})
        trained += own.get("trained_tokens") or 0
    if len(ledger) == len(failures):
        # Σ over every replica's lives: its counter can fall short of them (a resumed replica that healed past
        # its checkpoint counts from the checkpoint, not the earlier launch's steps its records keep)
        trained = sum(e["trained_tokens"] for e in ledger.values())
    train_time = max((s.get("train_time_s") or 0.0) for s in summaries.values())
    merged = {
        **first,
        "final_loss": _mean([s.get("final_loss") for s in summaries.values()]),
        "final_val_loss": _mean([s.get("final_val_loss") for s in summaries.values()]),
        "finished_replicas": sorted(summaries),
        "tokens": trained,
        "trained_tokens": trained,
        **merged_rates(first, trained, train_time),
        "train_time_s": train_time,
        "wall_time_s": max((s.get("wall_time_s") or 0.0) for s in summaries.values()),
        "replica_failures": sum(failures.values()),
        "replica_restarts": {str(m): n for m, n in restarts.items()},
        "heals": sum(s.get("heals", 0) for s in summaries.values()),
        "dropped_syncs": {str(m): s.get("dropped_syncs", 0) for m, s in summaries.items()},
        # cuts (a partition, a lost lighthouse; docs/design.md §9): per replica, its rejoins (healed mid-run
        # after a cut), the time it was paused at its sync for them, and the rounds whose quorum failed outright
        **{
            key: {str(m): s.get(key, 0) for m, s in summaries.items()}
            for key in ("rejoins", "rejoin_paused_s", "quorum_failures", "quorum_failed_s")
        },
        # the time a replica that never failed nor was cut off lost to its peers' failures (max over them)
        "survivor_lost_s": max(
            (s.get("elastic_lost_s", 0.0) for m, s in summaries.items() if survived(m, s)),
            default=None,
        ),
        # how many of its rounds a failure touched (a count: what survivor_lost_s is spent in)
        "survivor_touched_rounds": max(
            (s.get("elastic_touched_rounds", 0) for m, s in summaries.items() if survived(m, s)),
            default=None,
        ),
    }
    if ledger:  # goodput and the most any replica waited, over every replica
        merged.update(ledger_totals(ledger))
    # atomic: a failed write (a full disk) leaves the old one or none
    write_text(run_dir / "summary.json", json.dumps(merged, indent=1, allow_nan=False))
