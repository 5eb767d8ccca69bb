"""A multi-node torchrun job across a SlowLink: one node per replica, each in its own namespace.

Node m is started with `ip netns exec <its namespace>` as

    torchrun --nnodes M --nproc-per-node S --node-rank m --rdzv-backend c10d
             --rdzv-endpoint 198.18.0.101:PORT --rdzv-conf is_host=<m==0> --local-addr <its address>
             <target...>

with `GLOO_SOCKET_IFNAME=<its veth>`. torchrun numbers ranks node_rank·S + local_rank
(c10d orders the nodes by address, so node_rank = m) and hsdp's mesh is
rank = sync_rank·S + shard_rank (docs/design.md §4), so replica m is node m: its shard
group talks inside the namespace (the kernel routes a namespace's own address locally,
unshaped) and only the sync group (plus the world group's few logging bytes and the
rendezvous) crosses the shaped link. On a three-level mesh a node is a site: S above is its
R·S ranks (rank = (site·R + replicate_rank)·S + shard_rank), so its replicate and shard groups
stay inside the namespace and only the sync group crosses. Each node logs to
`<log_dir>/<name>.node<m>.log`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hsdp.bench.netns import SlowLink
from hsdp.bench.spec import REPO
from hsdp.faults.spec import Fault

TIMED_OUT = 124  # a job's return code when it ran past its bound


@dataclass
class Job:
    """One torchrun per replica namespace; `wait` bounds it in time and stops every node on a failure."""

    link: SlowLink
    nproc: int
    target: list[str]  # what torchrun runs: [script, args...] or ["-m", module, args...]
    port: int
    log_dir: Path
    name: str
    rdzv_timeout_s: int = 120
    procs: list[subprocess.Popen] = field(default_factory=list)
    slow: Optional[Fault] = None  # one replica's node trains slower (a slow fault, hsdp/faults/spec.py)

    def node_command(self, m: int) -> list[str]:
        link, timeout = self.link, self.rdzv_timeout_s
        return [
            *link.exec_prefix(m),
            sys.executable,
            "-m",
            "torch.distributed.run",
            *("--nnodes", str(link.replicas), "--nproc-per-node", str(self.nproc), "--node-rank", str(m)),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"{link.addrs[0]}:{self.port}"),
            *("--rdzv-id", f"{link.prefix}-{self.port}"),
            *("--rdzv-conf", f"is_host={int(m == 0)},join_timeout={timeout},read_timeout={timeout}"),
            *("--local-addr", link.addrs[m], "--max-restarts", "0", "--monitor-interval", "0.5"),
            *self.node_target(m),
        ]

    def node_target(self, m: int) -> list[str]:
        """What node m's torchrun runs: the target, plus run.slowdown on the slow replica's node only."""
        slow = self.slow is not None and self.slow.replica == m
        spell = [a for o in self.slow.overrides() for a in ("--set", o)] if slow and self.slow else []
        return [*self.target, *spell]

    def faults(self) -> dict[str, Any]:
        """The faults injected into this run, as slowlink.json records them."""
        return {"slow": self.slow.to_json()} if self.slow else {}

    def node_env(self, m: int) -> dict[str, str]:
        return {
            **os.environ,
            "GLOO_SOCKET_IFNAME": self.link.ifnames[m],
            "HSDP_NO_BAR": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }

    def log_path(self, m: int) -> Path:
        return self.log_dir / f"{self.name}.node{m}.log"

    def start(self) -> Job:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for m in range(self.link.replicas):
            cmd = self.node_command(m)
            with open(self.log_path(m), "w") as log:
                log.write("+ " + " ".join(cmd) + "\n")
                log.flush()
                self.procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=self.node_env(m), start_new_session=True
                    )
                )
        return self

    def wait(self, timeout_s: float) -> int:
        """0 when every node exits 0; else the first failure's code (124 on timeout). Stops all nodes on failure."""
        deadline = time.monotonic() + timeout_s
        rc = 0
        while True:
            self.on_tick()
            codes = [p.poll() for p in self.current_nodes()]
            failed = [c for c in codes if c is not None and c != 0]  # in node order
            if all(c is not None for c in codes) and not self.node_pending():
                rc = failed[0] if failed else 0
                break
            if failed:
                rc = failed[0]
                break
            if time.monotonic() > deadline:
                rc = TIMED_OUT
                break
            time.sleep(0.2)
        if rc != 0:
            self.stop()
        return rc

    def on_tick(self) -> None:
        """Called every 0.2 s while waiting (an elastic job kills and replaces nodes here)."""

    def current_nodes(self) -> list[subprocess.Popen]:
        """The node processes whose exit codes decide the job (not those killed on purpose)."""
        return self.procs

    def node_pending(self) -> bool:
        """A node is still to be started (the job is not done even if every current node has exited)."""
        return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM each node's torchrun (it stops its workers), then SIGKILL whatever is left in the namespaces."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        self.link.stop_processes(grace_s=3.0)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of every node's log (for a failure's message)."""
        out = []
        for m in range(self.link.replicas):
            path = self.log_path(m)
            text = path.read_text(errors="replace").splitlines() if path.is_file() else []
            out.append(f"--- {path}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)
