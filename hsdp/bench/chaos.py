"""Seeded chaos in the slow-link benchmark: the faults hsdp/faults/chaos.py draws, applied to an elastic job.

`chaos: SEED:MTBF_S` (a run's key, or `--chaos SEED:MTBF_S`) draws Faults at times (hsdp/faults/chaos.py has the
schedule and its kinds); each is applied here to a replica's node, or to the lighthouse:

    R@tT:kill=D         every trainer process of a replica's node gets SIGKILL (a lost machine); the launcher's
                        rule starts a replacement after D = elastic.restart_delay_s, which heals from a live replica
    R@tT:stop=S         its trainers are SIGSTOPped for the spell (a frozen machine: heartbeats stop too)
    R@tT:partition=S    its link is down for the spell (hsdp.bench.netns.SlowLink.cut), every process alive
    R@tT:slow=FxS       its trainers run 1/F of the time for the spell (SIGSTOP/SIGCONT at 10 Hz: a throttled GPU)
    lighthouse@tT:kill=S    the lighthouse (on its own host) is killed and started again after the spell (the
                            control plane lost); held down until then, where a lighthouse that dies on its own
                            is started again at once (hsdp/run/lighthouse.py)

T counts from when every replica logged a step. At most one fault holds a replica at a time (faults on different
replicas overlap freely): a fault drawn for a replica still in an earlier one (killed and not yet back, stopped, cut,
slowed) hits the next replica that is up instead (the draw's replica is uniform over the group; an outage is not made
longer by the faults that fall into it), and waits only while none is. slowlink.json records when each was drawn and
applied, and the replica it was drawn for where it moved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from hsdp.bench.elastic import ElasticJob, logged_steps
from hsdp.bench.netns import namespace_pids
from hsdp.faults.chaos import Chaos, draw_schedule, kind
from hsdp.faults.spec import Fault
from hsdp.run.replicas import merge_replica_summaries
from hsdp.sync.elastic import closes_level, verdicts

SLOW_PERIOD_S = 0.1
WAIT = "wait"  # _target's answer while every replica a fault could move to is held
BACK_TIMEOUT_S = 120.0  # a killed replica counts as back once its replacement logs a step, or after this


@dataclass
class Applied:
    """A fault as it happened: drawn, applied (None: the run ended first), over (None: still on at the end)."""

    fault: Fault
    applied_s: Optional[float] = None
    over_s: Optional[float] = None
    step: Optional[int] = None  # the replica's last logged step when applied
    drawn_for: Optional[int] = None  # the replica it was drawn for, where that one was held and it moved

    def to_json(self) -> dict[str, Any]:
        f = self.fault
        drawn = {"fault": str(f), "kind": kind(f), "replica": f.replica, "at_s": f.at.at_s, "seconds": f.seconds}
        moved = {} if self.drawn_for is None else {"drawn_for": self.drawn_for}
        return {**drawn, **moved, "applied_s": self.applied_s, "over_s": self.over_s, "step": self.step}


class _Slowdown(threading.Thread):
    """Runs `pids` a 1/`factor` of the time until `stop` is set (then leaves them running)."""

    def __init__(self, pids: list[int], factor: float) -> None:
        super().__init__(daemon=True, name="chaos-slow")
        self.pids, self.factor, self.stop = pids, factor, threading.Event()

    def run(self) -> None:
        on = SLOW_PERIOD_S / self.factor
        while not self.stop.is_set():
            _signal(self.pids, signal.SIGSTOP)
            self.stop.wait(SLOW_PERIOD_S - on)
            _signal(self.pids, signal.SIGCONT)
            self.stop.wait(on)
        _signal(self.pids, signal.SIGCONT)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class ChaosJob(ElasticJob):
    """An ElasticJob driven by a chaos schedule (every kill, stop, cut, slow spell and lighthouse loss)."""

    chaos: Optional[Chaos] = None
    schedule: list[Applied] = field(default_factory=list)
    _holding: dict[Optional[int], Applied] = field(default_factory=dict)  # replica (None: lighthouse) → its fault
    _slowdowns: dict[int, _Slowdown] = field(default_factory=dict)
    _generation: dict[int, int] = field(default_factory=dict)
    _pending: dict[int, float] = field(default_factory=dict)  # replica → when its replacement starts
    _clock0: Optional[float] = None  # when every replica had logged a step: the schedule's time 0
    crashes: list[dict[str, Any]] = field(default_factory=list)  # nodes that failed on their own, restarted

    horizon_s: float = 3600.0  # the schedule's span: the run's time bound

    def start(self) -> ChaosJob:
        assert self.chaos is not None
        drawn = draw_schedule(self.chaos, self.link.replicas, self.horizon_s, self.config.elastic.restart_delay_s)
        self.schedule = [Applied(f) for f in drawn]
        super().start()
        return self

    def now_s(self) -> Optional[float]:
        """Seconds since every replica logged its first step (None before: faults hit a training group, not
        its start-up, which no schedule measures)."""
        if self._clock0 is None:
            if any(self._logged_step(m) < 0 for m in range(self.link.replicas)):
                return None
            self._clock0 = time.monotonic()
        return time.monotonic() - self._clock0

    def trainer_pids(self, m: int) -> list[int]:
        """Every process of replica m's node (the lighthouse runs on a host of its own)."""
        return namespace_pids(self.link.namespaces[m])

    # ------------------------------------------------------------ the schedule, tick by tick
    def on_tick(self) -> None:
        now = self.now_s()
        if now is None:
            return
        self._end_spells(now)
        self._restart_crashed(now)
        self._start_replacements(now)
        for a in self.schedule:
            due = a.fault.at.at_s is not None and a.fault.at.at_s <= now
            if a.applied_s is None and due:
                target = self._target(a.fault.replica)
                if isinstance(target, str):  # WAIT
                    continue
                if target != a.fault.replica:
                    a.drawn_for, a.fault = a.fault.replica, replace(a.fault, at=replace(a.fault.at, replica=target))
                self._apply(a, now)

    def _target(self, m: Optional[int]) -> Optional[int] | str:
        """Where a fault drawn for replica m (None: the lighthouse) lands now: m while no fault holds it, else the
        next replica in order that no fault holds and whose node trains (not finished, not awaiting its
        replacement); WAIT while there is none (the lighthouse's fault always waits for the lighthouse)."""
        if m not in self._holding:
            return m
        if m is None:
            return WAIT
        n = self.link.replicas
        for other in ((m + k) % n for k in range(1, n)):
            if other not in self._holding and other not in self._pending and self.procs[other].poll() is None:
                return other
        return WAIT

    def _apply(self, a: Applied, now: float) -> None:
        f, m = a.fault, a.fault.replica
        if m is not None and self.procs[m].poll() is not None:
            return  # its node has finished the run: nothing left to hit
        a.applied_s, a.step = round(now, 3), None if m is None else self._logged_step(m)
        self._holding[m] = a
        print(f"[chaos] {f} at {now:.1f} s (step {a.step})", flush=True)
        if m is None:  # the lighthouse's one fault: killed, started again after the spell
            self._stop_lighthouse()
        elif f.action == "kill":
            self._kill(m, f)
        elif f.action == "stop":
            _signal(self.trainer_pids(m), signal.SIGSTOP)
        elif f.action == "partition":
            self.link.cut(m)
        elif f.action == "slow":
            self._slowdowns[m] = _Slowdown(self.trainer_pids(m), f.factor)
            self._slowdowns[m].start()

    def _kill(self, m: int, kill: Fault) -> None:
        _signal(self.trainer_pids(m), signal.SIGKILL)
        self.procs[m].wait()
        self.stale.add(m)
        self._pending[m] = time.monotonic() + (kill.seconds or self.config.elastic.restart_delay_s)

    def _restart_crashed(self, now: float) -> None:
        """A node that exited non-zero on its own (a replica failing in the chaos: e.g. the peer it healed from
        died and no other was ahead) is restarted after elastic.restart_delay_s, as the launcher and torchrun's
        --max-restarts restart a failed replica, up to elastic.max_restarts times per replica; past that its
        exit ends the job."""
        for m, proc in enumerate(self.procs):
            code = proc.poll()
            if m in self.stale or code in (None, 0):
                continue
            if verdicts(self.config.run_dir).get(str(m)) == "differ":
                continue  # it ended apart from the others (closing.py): a restart cannot mend that; the job fails
            mine = sum(c["replica"] == m for c in self.crashes)
            if mine >= self.config.elastic.max_restarts:
                continue
            self.crashes.append({"replica": m, "at_s": round(now, 3), "exit_code": code})
            print(f"[chaos] replica {m}'s node exited {code} on its own at {now:.1f} s; restarting it", flush=True)
            self.stale.add(m)
            self._pending[m] = time.monotonic() + self.config.elastic.restart_delay_s

    def _start_replacements(self, now: float) -> None:
        for m, due in list(self._pending.items()):
            if time.monotonic() < due or None in self._holding:
                continue  # not due, or the lighthouse is down (a replacement's first check would fail)
            del self._pending[m]
            others = [p.poll() for i, p in enumerate(self.procs) if i != m]
            if all(c == 0 for c in others):  # as the launcher: no replacement once the others finished
                self._holding.pop(m, None)
                continue
            self._generation[m] = self._generation.get(m, 0) + 1
            self.procs[m] = self._start_node(m, generation=self._generation[m])
            self.stale.discard(m)

    def _end_spells(self, now: float) -> None:
        for m, a in list(self._holding.items()):
            f = a.fault
            if m is not None and f.action == "kill":
                assert a.applied_s is not None
                if m in self._pending:
                    continue
                # back: its replacement logged a step past the kill's (healed), finished, or is taking too long
                back = self._logged_step(m) > (a.step if a.step is not None else -1)
                if back or self.procs[m].poll() is not None or now > a.applied_s + BACK_TIMEOUT_S:
                    self._over(m, a, now)
            elif now >= (a.applied_s or 0) + f.seconds:
                if m is None:
                    self._start_lighthouse()
                else:
                    self._end_spell(m, f)
                self._over(m, a, now)

    def _end_spell(self, m: int, f: Fault) -> None:
        """Replica m's stop, cut or slow spell over: its trainers running, its link up."""
        if f.action == "stop":
            _signal(self.trainer_pids(m), signal.SIGCONT)
        elif f.action == "partition":
            self.link.restore(m)
        elif f.action == "slow":
            self._slowdowns.pop(m).stop.set()

    def _over(self, m: Optional[int], a: Applied, now: float) -> None:
        a.over_s = round(now, 3)
        del self._holding[m]

    def node_pending(self) -> bool:
        return bool(self._pending)

    def _undo_all(self) -> None:
        """Every spell ended (the run is over or stopped): processes running, links up, the lighthouse gone."""
        now = self.now_s() or 0.0
        for m, a in list(self._holding.items()):
            if m is not None and a.fault.action != "kill":
                self._end_spell(m, a.fault)
            if m is None or a.fault.action != "kill":
                self._over(m, a, now)

    def wait(self, timeout_s: float) -> int:
        rc = super().wait(timeout_s)
        self._undo_all()
        return rc

    def stop(self, grace_s: float = 10.0) -> None:
        self._undo_all()
        super().stop(grace_s)

    def _write_summary(self) -> None:
        """summary.json from the replicas' own summaries, with every replica's kills as its failures."""
        kills = {r: 0 for r in range(self.link.replicas)}
        for a in self.schedule:
            if a.applied_s is not None and a.fault.action == "kill" and a.fault.replica is not None:
                kills[a.fault.replica] += 1
        for c in self.crashes:
            kills[c["replica"]] += 1
        merge_replica_summaries(self.config.run_dir, kills, restarts=kills)

    def faults(self) -> dict[str, Any]:
        out = super().faults()
        applied = [a for a in self.schedule if a.applied_s is not None]
        out["chaos"] = {"seed": self.chaos.seed, "mtbf_s": self.chaos.mtbf_s} if self.chaos else {}
        out["faults"] = [a.to_json() for a in applied]
        out["crashes"] = self.crashes
        return out


def after_chaos(job: ElasticJob, replicas: int) -> dict[str, Any]:
    """What a chaos schedule (or a kill, a partition) left behind, checked: the steps each replica did not train,
    whether the replicas' final params are bitwise equal (run.save_model; and each replica's own close said so:
    `closing`), every complete checkpoint's checksums, the processes still in the namespaces (the lighthouse's
    host's too)."""
    import torch

    from hsdp.config.schema import ConfigError as Invalid
    from hsdp.run.checkpoint import complete_checkpoints
    from hsdp.run.checkpoint.find import replica_home
    from hsdp.run.checkpoint.validate import verify_files

    assert job.cfg is not None
    run_dir, steps = job.cfg.run_dir, job.cfg.run.steps
    out: dict[str, Any] = {"steps_lost": {}, "replicas_equal": None, "checkpoints": 0, "invalid_checkpoints": []}
    for m in range(replicas):
        logged = set(logged_steps(run_dir / f"metrics.replica{m}.jsonl"))
        out["steps_lost"][str(m)] = steps - len(logged)
    # the replicas that finished (one that ended early, e.g. cut off in the last period while its peers
    # finished, has no final model: counted in `models`)
    models = [p for p in (run_dir / f"model.replica{m}.pt" for m in range(replicas)) if p.is_file()]
    out["models"] = len(models)
    # equal only if the run ends on a full sync (a last period without one leaves the replicas apart by design)
    out["ends_on_sync"] = closes_level(job.cfg)
    out["closing"] = verdicts(run_dir)  # each replica's close: level, or differ (it ended with one line)
    if len(models) >= 2 and out["ends_on_sync"]:
        first = torch.load(models[0])
        out["replicas_equal"] = all(
            all(torch.equal(first[k], other[k]) for k in first) for other in (torch.load(p) for p in models[1:])
        )
    if "differ" in out["closing"].values():  # a replica that ended apart saved no model: the models alone miss it
        out["replicas_equal"] = False
    for m in range(replicas):
        for path in complete_checkpoints(replica_home(run_dir, m)):
            out["checkpoints"] += 1
            try:
                verify_files(path)
            except Invalid as e:
                out["invalid_checkpoints"].append(f"{path.name} of replica {m}: {e}")
    hosts = [*job.link.namespaces, *([job.link.lighthouse_ns] if job.link.lighthouse else [])]
    out["processes_left"] = sum(len(namespace_pids(ns)) for ns in hosts)
    return out
