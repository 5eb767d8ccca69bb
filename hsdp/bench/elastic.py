"""An elastic job across a SlowLink: the lighthouse on its own host, one torchrun per replica, and a node kill.

An elastic run (`elastic.enabled=true`, docs/design.md §9) is not one torch.distributed world:
each replica is its own world, and the replicas meet at torchft's lighthouse. No replica is special:
the run folder is prepared first (`train.py ... --prepare`, on the lighthouse's host), then
`torchft_lighthouse` starts in a namespace of its own (the link's lighthouse host, 198.18.0.100, its
own shaped veth; `LighthouseProcess`, started again at the same address whenever it dies, unless a
fault holds it down), then node m runs, inside its namespace,

    torchrun --nnodes 1 --nproc-per-node S --rdzv-backend c10d --rdzv-endpoint <its address>:PORT
             --rdzv-conf is_host=1 --local-addr <its address> train.py ... --set elastic.replica=m
                                                     --set elastic.lighthouse=http://198.18.0.100:LPORT

(MASTER_ADDR is then the node's own address, which torchft advertises to the other replicas for
the sync group's store). A kill (`m@STEP:kill`, a Fault of hsdp/faults/spec.py; any replica, 0
included) takes replica m's node down at a step: every process in its namespace gets SIGKILL as
soon as its metrics file logs that step (a machine lost); after `elastic.restart_delay_s` (or the
kill's own seconds) a replacement node starts the same command, joins at the survivors' next sync
and heals from them (unless they have finished by then; one that starts but finds no live replica
fails, as a restarted replica does locally). The job is done when every replica's current node has
exited; a killed node's exit code is expected and ignored. summary.json is merged from the
replicas' own summaries after the job (`merge_replica_summaries`: its rates are a survivor's).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hsdp.bench.job import Job
from hsdp.bench.netns import namespace_pids, run_tool
from hsdp.config.schema import Config
from hsdp.faults.spec import Fault
from hsdp.run.lighthouse import LighthouseError, LighthouseProcess
from hsdp.run.replicas import merge_replica_summaries

LIGHTHOUSE_PORT = 29510
PREPARE_TIMEOUT_S = 180.0  # train.py --prepare: the config's checks and the run folder (imports torch)


def logged_steps(path: Path) -> list[int]:
    """The steps a replica's metrics file logged (a line being written skipped); [] before it exists."""
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            steps.append(int(json.loads(line)["step"]))
    return steps


@dataclass
class ElasticJob(Job):
    """`Job`'s contract (start, wait, stop, log_tail) for an elastic run, with an optional node kill."""

    cfg: Optional[Config] = None
    kill: Optional[Fault] = None  # REPLICA@STEP:kill[=S] (hsdp/bench/faults.py: its step taken of run.steps)
    lighthouse: Optional[LighthouseProcess] = None
    prepare_rc: int = 0  # train.py --prepare's exit code (non-zero: no node started, the job failed)
    killed_at: Optional[float] = None  # monotonic time of the kill
    replacement_due: Optional[float] = None
    stale: set[int] = field(default_factory=set)  # indices into procs of killed nodes
    partition: Optional[Fault] = None  # REPLICA@STEP:partition=S
    started_at: float = 0.0  # monotonic time of start()
    cut: dict[str, Any] = field(default_factory=dict)  # what happened around the partition (slowlink.json)

    @property
    def config(self) -> Config:
        """The run's config (`cfg`: a field with a default only because Job's fields come first)."""
        assert self.cfg is not None, "an elastic job needs its run's config"
        return self.cfg

    @property
    def lighthouse_addr(self) -> str:
        return f"http://{self.link.lighthouse_addr}:{LIGHTHOUSE_PORT}"

    def node_command(self, m: int) -> list[str]:
        a = self.link.addrs[m]
        return [
            *self.link.exec_prefix(m),
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nnodes", "1", "--nproc-per-node", str(self.nproc), "--max-restarts", "0"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a}:{self.port}", "--local-addr", a),
            *("--rdzv-id", f"{self.link.prefix}-{self.port}-{m}", "--rdzv-conf", "is_host=1"),
            *("--monitor-interval", "0.5"),
            *self.node_target(m),
            *("--set", f"elastic.replica={m}", "--set", f"elastic.lighthouse={self.lighthouse_addr}"),
        ]

    def start(self) -> ElasticJob:
        """The run folder prepared, the lighthouse up on its own host, then every replica's node at once."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The benchmark's own run folder (always run.overwrite=true): remove it here, so that the kill's step
        # watch reads no previous run's files.
        shutil.rmtree(self.config.run_dir, ignore_errors=True)
        self.started_at = time.monotonic()
        if not self._prepare():
            return self
        (self.log_dir / f"{self.name}.lighthouse.log").write_text("")
        try:
            self._start_lighthouse()
        except LighthouseError as e:
            self._fail_start(f"slowlink: {e}")
            return self
        for m in range(self.link.replicas):
            self.procs.append(self._start_node(m))
        return self

    def _prepare(self) -> bool:
        """`train.py ... --prepare` on the lighthouse's host (the run's checks, the run folder, config.yaml) before
        any replica starts, as the multi-host launch does (docs/usage.md); False (and the job failed) if it fails."""
        cmd = [*self.link.lighthouse_prefix(), sys.executable, *self.target, "--prepare"]
        path = self.log_dir / f"{self.name}.prepare.log"
        with open(path, "w") as log:
            log.write("+ " + " ".join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=self.node_env(0), timeout=PREPARE_TIMEOUT_S
                ).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        if rc != 0:
            self.prepare_rc = rc
            print(f"[slowlink] preparing the run folder failed (exit {rc}; {path})", flush=True)
        return rc == 0

    def _fail_start(self, line: str) -> None:
        print(line, flush=True)
        self.prepare_rc = 1

    def _answers(self) -> bool:
        """Whether the lighthouse accepts a connection, asked from its own host (its address exists only in
        the network's namespaces)."""
        where = (self.link.lighthouse_addr, LIGHTHOUSE_PORT)
        probe = f"import socket; socket.create_connection({where!r}, 1).close()"
        cmd = [*self.link.lighthouse_prefix(), sys.executable, "-c", probe]
        return run_tool(cmd, check=False).returncode == 0

    def _start_lighthouse(self) -> None:
        """Start the lighthouse on its host (the first time, or again after a fault held it down)."""
        if self.lighthouse is None:
            log = self.log_dir / f"{self.name}.lighthouse.log"
            self.lighthouse = LighthouseProcess(
                self.config, LIGHTHOUSE_PORT, self.lighthouse_addr, self.link.lighthouse_prefix(), log, self._answers
            )
        self.lighthouse.start(wait_s=30.0 if not self.procs else 0.0)  # the nodes' first check needs it up

    def _start_node(self, m: int, generation: int = 0) -> subprocess.Popen:
        cmd = self.node_command(m)
        suffix = f".{generation}" if generation else ""
        with open(self.log_dir / f"{self.name}.node{m}{suffix}.log", "w") as log:
            log.write("+ " + " ".join(cmd) + "\n")
            log.flush()
            env = self.node_env(m)
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _logged_step(self, m: int) -> int:
        """The last step replica m's metrics file logged (-1 before the first)."""
        return max(logged_steps(self.config.run_dir / f"metrics.replica{m}.jsonl"), default=-1)

    def _reached(self, fault: Fault) -> bool:
        """Whether the fault's replica logged its step (a kill's, a partition's: taken of run.steps at plan time)."""
        return self._logged_step(_node(fault)) >= fault.at.step_of(self.config.run.steps)

    def _kill_node(self, kill: Fault) -> None:
        """SIGKILL every process in the killed replica's namespace: its torchrun and its ranks at once."""
        m = _node(kill)
        for pid in namespace_pids(self.link.namespaces[m]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs[m].wait()
        self.stale.add(m)
        self.killed_at = time.monotonic()
        self.replacement_due = self.killed_at + (kill.seconds or self.config.elastic.restart_delay_s)
        print(f"[slowlink] killed replica {m}'s node at its step {self._logged_step(m)}", flush=True)

    def on_tick(self) -> None:
        """Start the lighthouse again if it died (a fault that holds it down aside); kill the node once its replica
        logs the kill step; start its replacement when due; cut and restore a partitioned replica's link."""
        if self.lighthouse is not None:
            self.lighthouse.ensure()
        self._partition_tick()
        if self.kill is not None and self.killed_at is None and self._reached(self.kill):
            self._kill_node(self.kill)
        if self.kill is not None and self.replacement_due is not None and time.monotonic() >= self.replacement_due:
            m = _node(self.kill)
            self.replacement_due = None
            others = [p.poll() for i, p in enumerate(self.procs) if i != m]
            if not all(c == 0 for c in others):  # as the launcher: no replacement once the others finished
                self.procs[m] = self._start_node(m, generation=1)
                self.stale.discard(m)

    def _partition_tick(self) -> None:
        """Cut the partitioned replica's link once it logs the step; restore it `seconds` later. The steps
        every replica has logged at both moments are recorded (the survivors' steps during the cut)."""
        p, now = self.partition, time.monotonic()
        if p is None or "restored_s" in self.cut:
            return
        if "cut_s" not in self.cut and self._reached(p):
            self.link.cut(_node(p))
            steps = [self._logged_step(m) for m in range(self.link.replicas)]
            self.cut.update(cut_s=round(now - self.started_at, 3), steps_at_cut=steps)
            print(
                f"[slowlink] cut replica {p.replica}'s link at its step {steps[_node(p)]} for {p.seconds:g} s",
                flush=True,
            )
        elif "cut_s" in self.cut and now - self.started_at >= self.cut["cut_s"] + p.seconds:
            self._restore_link()

    def _restore_link(self) -> None:
        """The partitioned replica's link back up (also when the run ends during the cut: the network is
        reused by the next run at this rate)."""
        if self.partition is None or "cut_s" not in self.cut or "restored_s" in self.cut:
            return
        self.link.restore(_node(self.partition))
        steps = [self._logged_step(m) for m in range(self.link.replicas)]
        self.cut.update(restored_s=round(time.monotonic() - self.started_at, 3), steps_at_restore=steps)
        print(f"[slowlink] restored replica {self.partition.replica}'s link (steps logged: {steps})", flush=True)

    def faults(self) -> dict[str, Any]:
        out = super().faults()
        if self.kill:
            out["kill"] = {**self.kill.to_json(), "done": self.killed_at is not None}
        if self.partition:
            out["partition"] = {**self.partition.to_json(), **self.cut}
        return out

    def current_nodes(self) -> list[subprocess.Popen]:
        return [p for i, p in enumerate(self.procs) if i not in self.stale]

    def node_pending(self) -> bool:
        return self.replacement_due is not None

    def wait(self, timeout_s: float) -> int:
        """`Job.wait`, then the lighthouse stopped and summary.json merged from the replicas' summaries (the
        preparation's exit code if it failed: nothing started)."""
        if self.prepare_rc:
            return self.prepare_rc
        rc = super().wait(timeout_s)
        self._restore_link()
        self._stop_lighthouse()
        self._write_summary()
        return rc

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
        self._restore_link()
        self._stop_lighthouse()

    def _stop_lighthouse(self) -> None:
        """The lighthouse killed on purpose (a fault, the end): not started again until `_start_lighthouse`."""
        if self.lighthouse is not None:
            self.lighthouse.stop()

    def _write_summary(self) -> None:
        """summary.json from the replicas' own summaries (as the local launcher writes it)."""
        m = self.kill.replica if self.kill is not None and self.killed_at is not None else None
        failures = {r: int(r == m) for r in range(self.link.replicas)}
        merge_replica_summaries(self.config.run_dir, failures, restarts=failures)


def _node(fault: Fault) -> int:
    """The node (namespace) of the replica a kill or partition hits."""
    assert fault.replica is not None, f"{fault} hits no replica's node"
    return fault.replica
