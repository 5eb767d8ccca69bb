"""Train across a real slow link: each replica in its own network namespace, joined by shaped veths.

    python -m hsdp.slowlink --rate 20mbit[,100mbit,...] [--delay-ms 5] [--config C] [--set k=v ...]
                            --runs NAME=override,override ... [--out DIR] [--plot]
    python -m hsdp.slowlink configs/ablations/slowlink.yaml [--only run,run] [--rate ...] [--plot]
    python -m hsdp.slowlink SPEC --no-run --plot   # tables and plots again from the outputs (no root needed)
    python -m hsdp.slowlink --cleanup        # remove namespaces left by a slowlink that was SIGKILLed

Needs root and iproute2 (`ip`, `tc`); without them it exits 2 with one line.

The network (one per rate; docs/design.md §9). For M = `mesh.sync` replicas it creates
the namespaces `hsl<pid><tag>n<m>` and joins them with veth links: for M = 2 one
veth pair, for M > 2 one veth per replica into a bridge that lives in a namespace
of its own (`...nb`). Every veth end gets `tc` shaping on egress — a token bucket
(`tbf rate R`) and, with `--delay-ms d`, a `netem delay` in front of it — so each
direction of each replica's link carries at most R and a packet takes d one way.
`--rate unshaped` keeps the same namespaces and veths without any qdisc (the
baseline for "how much does the shaping cost"). Replica m's address is
198.18.0.(101+m) (the RFC 2544 benchmarking range), which exists only inside
these namespaces: every process of the benchmark runs in one of them, and all
its traffic (rendezvous, gloo) goes to those addresses or to loopback.

A run is a multi-node torchrun job, one node per replica, each started with
`ip netns exec <its namespace>`:

    torchrun --nnodes M --nproc-per-node S --node-rank m --rdzv-backend c10d
             --rdzv-endpoint 198.18.0.101:PORT --rdzv-conf is_host=<m==0> --local-addr <its address>
             train.py --config C --set ...

with `GLOO_SOCKET_IFNAME=<its veth>`. torchrun numbers ranks node_rank·S + local_rank
(c10d orders the nodes by address, so node_rank = m) and hsdp's mesh is
rank = sync_rank·S + shard_rank (docs/design.md §1), so replica m is node m: its
shard group talks inside the namespace (the kernel routes a namespace's own
address locally, unshaped) and only the sync group (plus the world group's
few logging bytes and the rendezvous) crosses the shaped link. The tx byte
counters of the veths are read before and after each run to show it
(`link_bytes` ≈ M·S·sync_bytes plus TCP/IP headers).

Before the runs of a rate, a probe (this module under the same torchrun setup)
times one all_reduce of a known size on the sync group and compares it with
bytes / rate (ring bytes as in hsdp.comm.groups); the same size on a shard group shows
the local path is not shaped. Every run is bounded by its config's `run.steps`
and by `--timeout-s`; the torchrun rendezvous by `--rdzv-timeout-s`.

Everything created is removed at the end, on an error, and on SIGINT / SIGTERM /
SIGHUP (the processes in the namespaces are stopped first); names carry the pid,
so concurrent benchmarks do not clash, and `--cleanup` removes those of dead pids.

Outputs: run folders `<run.out_dir>/<name>-<run>-<rate>/` (train.py's usual
config.yaml, metrics.jsonl, summary.json), node logs in `<out>/logs/`, and in
`<out>` (default `<run.out_dir>/<name>`): `slowlink.json` (per run: median and mean
step time, train and wall time, final val loss, sync and link bytes, rate, time
to the target val loss; the probes; the crossover rates), `slowlink.md` (the
tables, also printed) and with `--plot` the PNGs of hsdp.sweep's `--plot` for each
rate (val loss vs tokens, vs sync bytes, vs wall-clock). slowlink.json/.md are rewritten
after every run, so an interrupted sweep keeps what it measured; `--only run,run` re-runs
those runs and keeps the other entries of the earlier slowlink.json.

Target: the final val loss of the `--target` run (default: the first run) at each
rate; a run's time to target is the cumulative step time (metrics.jsonl's
`step_time_s`, which excludes evals, so `run.log_every=1` is needed) up to the
first eval whose val loss is at or below it.

Spec file (all keys but `runs` optional; CLI flags override it):

    base: configs/tiny.yaml
    set: [wandb.mode=disabled, run.log_every=1, run.eval_every=16]
    rates: [1000mbit, 100mbit, 20mbit]      # or unshaped
    delay_ms: 0
    target: hsdp
    timeout_s: 900                           # per run
    runs:
      hsdp: []                               # at every rate
      diloco-h32-int8: [sync.warmup_steps=0, sync.every=32, sync.method=diloco, sync.quantize=int8]
      int8-delay-unshaped: {set: [sync.delay=1, ...], rates: [unshaped]}   # only at these rates
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hsdp.config.schema import ConfigError
from hsdp.config.loader import load_config
from hsdp.run.launch import Interrupted
from hsdp.sweep import read_records, read_spec, str_list, wall_clock

REPO = Path(__file__).resolve().parents[1]
PREFIX = "hsl"  # every namespace and link we create: hsl<pid><tag>...
SUBNET = "198.18.0"  # RFC 2544 benchmarking range; these addresses exist only inside our namespaces
HOST0 = 101  # replica m is SUBNET.(HOST0 + m): three digits, so c10d's order by address is m's order
MAX_REPLICAS = 99
BASE_PORT = 29400
SPEC_KEYS = ("base", "set", "rates", "delay_ms", "target", "timeout_s", "probe_s", "runs")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TBF_LATENCY_MS = 50  # queue the token bucket keeps (beyond it, packets are dropped and TCP backs off)
_instances = 0  # SlowLink networks created by this process (each gets its own tag)


class SlowLinkError(RuntimeError):
    """Setting up the network or a run failed; the message is one line."""


class MissingRequirement(SlowLinkError):
    """This machine cannot build the network asked for (exit 2)."""


# ------------------------------------------------------------------ environment and rates


def missing_requirements() -> Optional[str]:
    """None if this process can build namespaces (root, `ip`, `tc`), else why not (one line)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"slowlink: needs iproute2 ({' and '.join(missing)} not found on PATH)"
    if os.geteuid() != 0:
        return "slowlink: needs root (network namespaces and tc)"
    return None


def parse_rate(text: str) -> tuple[str, Optional[int]]:
    """'20mbit' → ('20mbit', 20_000_000); 'unshaped' → ('unshaped', None). Units: bit, kbit, mbit, gbit."""
    t = str(text).strip().lower()
    if t in ("unshaped", "none"):
        return "unshaped", None
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)])
            except ValueError:
                break
            if value <= 0:
                break
            bits = int(round(value * scale))
            return f"{value:g}{unit}", bits
    raise ConfigError(f"--rate: expected e.g. 20mbit, 1gbit, 500kbit or unshaped, got {text!r}")


def rate_mbit(bits: Optional[int]) -> Optional[float]:
    return None if bits is None else bits / 1e6


# ------------------------------------------------------------------ the network


def _run(args: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SlowLinkError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _tag(n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[n] if n < 26 else letters[n // 26 - 1] + letters[n % 26]


@dataclass
class SlowLink:
    """M namespaces joined by shaped veths (a bridge namespace for M > 2). `up()` builds, `down()` removes."""

    replicas: int
    rate_bps: Optional[int]
    delay_ms: float = 0.0
    prefix: str = ""
    namespaces: list[str] = field(default_factory=list)  # replica m's namespace
    bridge_ns: Optional[str] = None
    ifnames: list[str] = field(default_factory=list)  # replica m's veth (inside its namespace)
    addrs: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # namespaces to delete (recorded before creation)

    def __post_init__(self) -> None:
        global _instances
        if not 2 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"mesh.sync: slowlink needs 2..{MAX_REPLICAS} replicas, got {self.replicas}")
        if not self.prefix:
            self.prefix = f"{PREFIX}{os.getpid()}{_tag(_instances)}"
            _instances += 1
        p = self.prefix
        self.namespaces = [f"{p}n{m}" for m in range(self.replicas)]
        self.bridge_ns = f"{p}nb" if self.replicas > 2 else None
        self.ifnames = [f"{p}e{m}" for m in range(self.replicas)]
        self.addrs = [f"{SUBNET}.{HOST0 + m}" for m in range(self.replicas)]

    # -- build
    def up(self) -> SlowLink:
        for ns in [*self.namespaces, *([self.bridge_ns] if self.bridge_ns else [])]:
            self.created.append(ns)  # first: a signal between the two lines still gets it removed
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        p, shaped = self.prefix, []
        if self.bridge_ns is None:  # M = 2: one veth pair, one end in each namespace
            _run(
                [
                    "ip",
                    "-n",
                    self.namespaces[0],
                    "link",
                    "add",
                    self.ifnames[0],
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self.ifnames[1],
                    "netns",
                    self.namespaces[1],
                ]
            )
            shaped = [(self.namespaces[0], self.ifnames[0], True), (self.namespaces[1], self.ifnames[1], True)]
        else:  # M > 2: a bridge in its own namespace, one veth per replica into it
            br = f"{p}br"
            _run(["ip", "-n", self.bridge_ns, "link", "add", br, "type", "bridge"])
            _run(["ip", "-n", self.bridge_ns, "link", "set", br, "up"])
            for m, ns in enumerate(self.namespaces):
                port = f"{p}b{m}"
                _run(
                    [
                        "ip",
                        "-n",
                        ns,
                        "link",
                        "add",
                        self.ifnames[m],
                        "type",
                        "veth",
                        "peer",
                        "name",
                        port,
                        "netns",
                        self.bridge_ns,
                    ]
                )
                _run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", br])
                _run(["ip", "-n", self.bridge_ns, "link", "set", port, "up"])
                # uplink: rate + the one-way delay; downlink (bridge port egress): rate only, so every
                # replica-to-replica path has one delay and two token buckets of the same rate
                shaped += [(ns, self.ifnames[m], True), (self.bridge_ns, port, False)]
        for m, ns in enumerate(self.namespaces):
            _run(["ip", "-n", ns, "addr", "add", f"{self.addrs[m]}/24", "dev", self.ifnames[m]])
            _run(["ip", "-n", ns, "link", "set", self.ifnames[m], "up"])
        for ns, dev, with_delay in shaped:
            self._shape(ns, dev, self.delay_ms if with_delay else 0.0)
        return self

    def _shape(self, ns: str, dev: str, delay_ms: float) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        tbf = []
        if self.rate_bps is not None:
            burst = max(64 * 1024, self.rate_bps // 8 // 500)  # ≥ 2 ms at the rate
            tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]
        if delay_ms > 0:
            proc = _run(
                [*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000"], check=False
            )
            if proc.returncode != 0:
                raise MissingRequirement(
                    f"--delay-ms needs the netem qdisc, which this kernel lacks "
                    f"(tc: {proc.stderr.strip()}); run without --delay-ms"
                )
            if tbf:
                _run([*tc, "parent", "1:1", "handle", "10:", *tbf])
        elif tbf:
            _run([*tc, "root", *tbf])

    # -- use
    def exec_prefix(self, m: int) -> list[str]:
        return [shutil.which("ip") or "ip", "netns", "exec", self.namespaces[m]]

    def tx_bytes(self) -> list[int]:
        """Bytes each replica has sent on its veth (its uplink), as the kernel counts them (L2 frames)."""
        out = []
        for ns, dev in zip(self.namespaces, self.ifnames):
            info = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", dev]).stdout)
            out.append(int(info[0]["stats64"]["tx"]["bytes"]))
        return out

    def qdiscs(self) -> str:
        """`tc qdisc show` of replica 0's veth (for the log)."""
        return _run(["tc", "-n", self.namespaces[0], "qdisc", "show", "dev", self.ifnames[0]]).stdout.strip()

    # -- tear down
    def stop_processes(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL, every process still inside our namespaces (all started by us)."""
        alive = [pid for ns in self.created if ns in list_namespaces() for pid in namespace_pids(ns)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while alive and time.monotonic() < deadline:
                alive = [pid for pid in alive if _alive(pid)]
                time.sleep(0.1)
            if not alive:
                break
        return len(alive)

    def down(self) -> list[str]:
        """Stop what runs inside, delete our namespaces (their veths and bridge go with them).

        Returns what could not be removed (empty on success)."""
        self.stop_processes()
        existing = set(list_namespaces())
        for ns in reversed(self.created):
            if ns in existing:
                _run(["ip", "netns", "del", ns], check=False)
        left = leftovers(self.prefix)
        self.created = [ns for ns in self.created if ns in left]
        return left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces, and links in this (the root) namespace, whose names start with `prefix`."""
    names = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(prefix):
            names.append(parts[1].strip().split("@")[0])
    return names


def names_of_pid(pid: int) -> list[str]:
    """What `leftovers` finds of the networks made by slowlink process `pid` (hsl<pid><letters>...)."""
    return [n for n in leftovers(f"{PREFIX}{pid}") if n[len(f"{PREFIX}{pid}")].isalpha()]


def cleanup_stale() -> list[str]:
    """Remove namespaces named by a slowlink process that no longer exists; return their names."""
    removed = []
    for ns in list_namespaces():
        digits = ns[len(PREFIX) :].split("n")[0].rstrip("abcdefghijklmnopqrstuvwxyz")
        if not ns.startswith(PREFIX) or not digits.isdigit() or _alive(int(digits)):
            continue
        for pid in namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed


# ------------------------------------------------------------------ signals


class StopOnSignal:
    """SIGINT/SIGTERM/SIGHUP raise `Interrupted` once; inside `shielded()` (the teardown) they are only noted."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._shield = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        first = self.received is None
        self.received = self.received or signum
        if first and not self._shield:
            raise Interrupted(signum)

    @contextmanager
    def shielded(self) -> Iterator[None]:
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


# ------------------------------------------------------------------ multi-node jobs


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

    def start(self) -> Job:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        link = self.link
        for m in range(link.replicas):
            cmd = [
                *link.exec_prefix(m),
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(link.replicas),
                "--nproc-per-node",
                str(self.nproc),
                "--node-rank",
                str(m),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"{link.addrs[0]}:{self.port}",
                "--rdzv-id",
                f"{link.prefix}-{self.port}",
                "--rdzv-conf",
                f"is_host={int(m == 0)},join_timeout={self.rdzv_timeout_s},read_timeout={self.rdzv_timeout_s}",
                "--local-addr",
                link.addrs[m],
                "--max-restarts",
                "0",
                "--monitor-interval",
                "0.5",
                *self.target,
            ]
            env = {
                **os.environ,
                "GLOO_SOCKET_IFNAME": link.ifnames[m],
                "HSDP_NO_BAR": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            log = open(self.log_dir / f"{self.name}.node{m}.log", "w")
            log.write("+ " + " ".join(cmd) + "\n")
            log.flush()
            self.procs.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            )
            log.close()
        return self

    def wait(self, timeout_s: float) -> int:
        """0 when every node exits 0; else the first failure's code (124 on timeout). Stops all nodes on failure."""
        deadline = time.monotonic() + timeout_s
        rc = 0
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                rc = next((c for c in codes if c != 0), 0)
                break
            if any(c not in (None, 0) for c in codes):
                rc = next(c for c in codes if c not in (None, 0))
                break
            if time.monotonic() > deadline:
                rc = 124
                break
            time.sleep(0.2)
        if rc != 0:
            self.stop()
        return rc

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
        out = []
        for m in range(self.link.replicas):
            path = self.log_dir / f"{self.name}.node{m}.log"
            text = path.read_text(errors="replace").splitlines() if path.is_file() else []
            out.append(f"--- {path}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)


# ------------------------------------------------------------------ the probe


def probe_bytes(rate_bps: Optional[int], replicas: int, seconds: float) -> int:
    """fp32 all_reduce size whose ring bytes take about `seconds` at the rate (clamped to 256 KiB..128 MiB)."""
    if rate_bps is None:
        return 64 * 2**20
    ring_factor = 2 * (replicas - 1) / replicas
    nbytes = int(rate_bps / 8 * seconds / ring_factor)
    return max(256 * 1024, min(128 * 2**20, nbytes // 4 * 4))


def probe_worker(out: str, nbytes: int, reps: int) -> None:
    """Under torchrun in the namespaces: time an all_reduce on the sync group, then the same on a shard group."""
    import datetime

    import torch
    import torch.distributed as dist

    from hsdp.comm.mesh import build_mesh

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    world, shard = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mesh = build_mesh(world // shard, shard, torch.device("cpu"))
    t = torch.ones(nbytes // 4)
    small = torch.ones(1)
    mesh.comm.all_reduce(small, "sync")  # connections up, both sides in
    mesh.comm.all_reduce(small, "shard")
    sync_s, shard_s = [], []
    for _ in range(reps):  # one stream on the link: only shard rank 0's sync group
        dist.barrier()
        if mesh.shard_rank == 0:
            t0 = time.perf_counter()
            mesh.comm.all_reduce(t, "sync")
            sync_s.append(time.perf_counter() - t0)
    for _ in range(reps if shard > 1 else 0):  # every replica's shard group at once, inside the namespaces
        dist.barrier()
        t0 = time.perf_counter()
        mesh.comm.all_reduce(t, "shard")
        shard_s.append(time.perf_counter() - t0)
    dist.barrier()
    if mesh.rank == 0:
        from hsdp.comm.groups import ring_bytes_of

        Path(out).write_text(
            json.dumps(
                {
                    "tensor_bytes": nbytes,
                    "ring_bytes": ring_bytes_of("all_reduce", mesh.sync_size, nbytes),
                    "sync_s": sync_s,
                    "shard_s": shard_s,
                    "replicas": mesh.sync_size,
                    "shard": shard,
                }
            )
        )
    dist.destroy_process_group()


def run_probe(
    link: SlowLink, shard: int, seconds: float, reps: int, port: int, log_dir: Path, label: str, timeout_s: float = 120
) -> dict:
    """Run the probe; returns its numbers with the expectation bytes·8/rate and the ratio measured/expected."""
    nbytes = probe_bytes(link.rate_bps, link.replicas, seconds)
    out = log_dir / f"probe-{label}.json"
    out.unlink(missing_ok=True)
    job = Job(
        link,
        shard,
        ["-m", "hsdp.slowlink", "_probe", str(out), str(nbytes), str(reps)],
        port,
        log_dir,
        f"probe-{label}",
    ).start()
    rc = job.wait(timeout_s)
    if rc != 0 or not out.is_file():
        raise SlowLinkError(f"probe at {label} failed (exit {rc}); logs:\n{job.log_tail()}")
    res = json.loads(out.read_text())
    res["sync_s_median"] = statistics.median(res["sync_s"])
    res["shard_s_median"] = statistics.median(res["shard_s"]) if res["shard_s"] else None
    res["expected_s"] = res["ring_bytes"] * 8 / link.rate_bps if link.rate_bps else None
    res["measured_over_expected"] = (res["sync_s_median"] / res["expected_s"]) if res["expected_s"] else None
    res["effective_mbit"] = res["ring_bytes"] * 8 / res["sync_s_median"] / 1e6
    res["rate"] = label
    return res


# ------------------------------------------------------------------ spec and plan


@dataclass
class Plan:
    name: str
    base: str
    shared: list[str]
    rates: list[tuple[str, Optional[int]]]  # every network, in the order they are built
    default_rates: list[str]  # the rates of a run without its own `rates`
    delay_ms: float
    target: str
    timeout_s: float
    probe_s: float
    runs: dict[str, tuple[list[str], Optional[list[str]]]]  # run → (overrides, rate labels or None = all)
    out: Path
    out_dir: Path  # run.out_dir (absolute)
    mesh: tuple[int, int] = (0, 0)  # (M, S) of the base config with the shared overrides


def load_spec(path: str) -> dict:
    spec = read_spec(path, "spec", SPEC_KEYS)
    runs = spec.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: {path}: expected a mapping of run name to overrides")
    parsed = {}
    for run, entry in runs.items():
        if isinstance(entry, dict):
            bad = [k for k in entry if k not in ("set", "rates")]
            if bad:
                raise ConfigError(f"runs.{run}: {path}: unknown keys {bad} (expected: set, rates)")
            rates = entry.get("rates")
            parsed[str(run)] = (
                str_list(path, f"runs.{run}.set", entry.get("set")),
                None if rates is None else [str(r) for r in rates],
            )
        else:
            parsed[str(run)] = (str_list(path, f"runs.{run}", entry), None)
    spec["runs"] = parsed
    spec["set"] = str_list(path, "set", spec.get("set"))
    if "base" in spec:
        base = Path(spec["base"]).expanduser()
        candidates = [base] if base.is_absolute() else [Path(path).resolve().parent / base, REPO / base]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise ConfigError(f"base: {spec['base']} not found")
        spec["base"] = str(found.resolve())
    return spec


def parse_runs_arg(items: list[str]) -> dict[str, tuple[list[str], None]]:
    runs = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--runs: expected NAME=override,override (or NAME= for none), got {item!r}")
        runs[name] = ([o for o in rest.split(",") if o], None)
    return runs


def make_plan(args: argparse.Namespace) -> Plan:
    spec = load_spec(args.spec) if args.spec else {"runs": {}, "set": []}
    runs = parse_runs_arg(args.runs) if args.runs else spec["runs"]
    if not runs:
        raise ConfigError("--runs: no runs (give --runs NAME=overrides ... or a spec file)")
    base = args.config or spec.get("base") or str(REPO / "configs" / "tiny.yaml")
    rate_text = args.rate.split(",") if args.rate else [str(r) for r in spec.get("rates", [])]
    if not rate_text:
        raise ConfigError("--rate: no rate (e.g. --rate 20mbit, or rates: in the spec)")
    rates = [parse_rate(r) for r in rate_text]
    plan_rates = list(dict.fromkeys(rates))  # the rates every run without its own `rates` runs at
    if not args.rate:  # a run's own rates may add networks (e.g. unshaped for one run only)
        for _, only in runs.values():
            plan_rates += [r for r in map(parse_rate, only or []) if r not in plan_rates]
    else:  # --rate restricts every run to those rates
        runs = {
            run: (o, None if only is None else [r for r in only if parse_rate(r) in rates])
            for run, (o, only) in runs.items()
        }
    target = args.target or spec.get("target") or next(iter(runs))
    if target not in runs:
        raise ConfigError(f"--target: {target!r} is not a run (runs: {', '.join(runs)})")
    name = args.name or (Path(args.spec).stem if args.spec else "slowlink")
    shared = [*spec["set"], *args.set]
    cfg = load_config(base, shared)
    out_dir = Path(cfg.run.out_dir).expanduser().resolve()
    plan = Plan(
        name=name,
        base=base,
        shared=shared,
        rates=plan_rates,
        default_rates=[r[0] for r in rates],
        delay_ms=args.delay_ms if args.delay_ms is not None else float(spec.get("delay_ms", 0)),
        target=target,
        timeout_s=args.timeout_s or float(spec.get("timeout_s", 1200)),
        probe_s=args.probe_s if args.probe_s is not None else float(spec.get("probe_s", 2.0)),
        runs=runs,
        out=Path(args.out).expanduser().resolve() if args.out else out_dir / name,
        out_dir=out_dir,
        mesh=(cfg.mesh.sync, cfg.mesh.shard),
    )
    if plan.delay_ms < 0:
        raise ConfigError(f"--delay-ms: expected >= 0, got {plan.delay_ms}")
    for run, label in plan_items(plan):  # validate every run's config before building anything
        c = load_config(base, overrides(plan, run, label))
        if (c.mesh.sync, c.mesh.shard) != plan.mesh:
            raise ConfigError(
                f"runs.{run}: mesh {c.mesh.sync}x{c.mesh.shard} differs from the base's "
                f"{plan.mesh[0]}x{plan.mesh[1]} (one network per rate)"
            )
    if not 2 <= plan.mesh[0] <= MAX_REPLICAS:
        raise ConfigError(f"mesh.sync: slowlink needs 2..{MAX_REPLICAS} replicas, got {plan.mesh[0]}")
    return plan


def plan_items(plan: Plan) -> list[tuple[str, str]]:
    """(run, rate label) in the order they run: rate by rate, runs in spec order."""
    items = []
    for label, _ in plan.rates:
        for run, (_, only) in plan.runs.items():
            if label in (plan.default_rates if only is None else [parse_rate(r)[0] for r in only]):
                items.append((run, label))
    return items


def run_name(plan: Plan, run: str, label: str) -> str:
    return f"{plan.name}-{run}-{label}"


def overrides(plan: Plan, run: str, label: str) -> list[str]:
    return [
        *plan.shared,
        *plan.runs[run][0],
        f"run.name={run_name(plan, run, label)}",
        "run.overwrite=true",
        "run.resume=never",
        f"run.out_dir={plan.out_dir}",
    ]


# ------------------------------------------------------------------ results


def time_to_target(records: list[dict], target: Optional[float]) -> dict:
    """First eval at or below `target`: its step, tokens and the training seconds up to it."""
    if target is None:
        return {}
    cum = wall_clock(records)
    for r in records:
        if "val_loss" in r and r["val_loss"] <= target + 1e-9:
            return {
                "step_to_target": r["step"],
                "tokens_to_target": r["tokens"],
                "sync_bytes_to_target": r["sync_bytes"],
                "time_to_target_s": cum[r["step"]] if cum else None,
            }
    return {"step_to_target": None, "tokens_to_target": None, "sync_bytes_to_target": None, "time_to_target_s": None}


def summarize(run_dir: Path) -> Optional[dict]:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    comm = s.get("comm", {})
    sync_ops = {k: v for k, v in comm.items() if k.startswith("sync/")}
    return {
        "steps": s["steps"],
        "tokens": s["tokens"],
        "median_step_s": s["median_step_time_s"],
        "mean_step_s": s["train_time_s"] / s["steps"],
        "train_time_s": s["train_time_s"],
        "wall_time_s": s["wall_time_s"],
        "final_val_loss": s["final_val_loss"],
        "sync_bytes": s["sync_bytes"],
        "shard_bytes": s["shard_bytes"],
        "sync_seconds": sum(v["seconds"] for v in sync_ops.values()),
        "sync_calls": sum(v["calls"] for v in sync_ops.values()),
    }


def evaluate_results(plan: Plan, results: list[dict]) -> None:
    """Targets, times to target, ratios to the target run at the same rate, and the sync-time check (in place)."""
    targets = {}
    for r in results:
        if r["run"] == plan.target and r.get("final_val_loss") is not None:
            targets[r["rate"]] = r["final_val_loss"]
    fallback = next(iter(targets.values()), None)
    S = plan.mesh[1]
    for r in results:
        if r.get("final_val_loss") is None:
            continue
        r["target_val_loss"] = targets.get(r["rate"], fallback)
        run_dir = Path(r["dir"])
        r.update(time_to_target(read_records(run_dir), r["target_val_loss"]))
        if r["rate_bps"]:  # every shard rank's sync group shares the replica's link
            r["sync_expected_s"] = S * r["sync_bytes"] * 8 / r["rate_bps"]
            r["sync_measured_over_expected"] = r["sync_seconds"] / r["sync_expected_s"] if r["sync_bytes"] else None
        if r.get("link_bytes") is not None and r["sync_bytes"]:
            r["link_over_sync"] = r["link_bytes"] / (plan.mesh[0] * S * r["sync_bytes"])
    ref = {r["rate"]: r for r in results if r["run"] == plan.target and r.get("final_val_loss") is not None}
    for r in results:
        base = ref.get(r["rate"])
        if base is None or r.get("final_val_loss") is None:
            continue
        r["mean_step_vs_target_run"] = r["mean_step_s"] / base["mean_step_s"]
        a, b = r.get("time_to_target_s"), base.get("time_to_target_s")
        r["time_to_target_vs_target_run"] = a / b if a is not None and b else None


def fit_time(points: list[tuple[float, float]]) -> Optional[tuple[float, float]]:
    """Least squares T(rate) = a + b / rate over (rate_mbit, seconds); None with fewer than 2 rates."""
    if len({p for p, _ in points}) < 2:
        return None
    xs = [1 / p for p, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def crossing(mine: Optional[tuple[float, float]], ref: Optional[tuple[float, float]]) -> dict:
    """Where a + b/r (mine) meets the reference's: {"crossover_mbit": r*, "wins": below|above|all|never}."""
    if not mine or not ref:
        return {"crossover_mbit": None, "wins": None}
    (a1, b1), (a0, b0) = mine, ref
    da, db = a1 - a0, b0 - b1  # mine costs da more compute, saves db on the link (bits/Mbit·s)
    if da <= 0 and db >= 0:
        return {"crossover_mbit": None, "wins": "all"}
    if da >= 0 and db <= 0:
        return {"crossover_mbit": None, "wins": "never"}
    return {"crossover_mbit": db / da, "wins": "below" if da > 0 else "above"}


def crossovers(plan: Plan, results: list[dict]) -> dict:
    """Per run: the rates (measured) where it beats the target run, and the fitted rate below which it wins.

    Two criteria: mean step time (throughput) and time to the target val loss. The fit is T = a + b/rate
    (compute + bytes/rate) through each run's points; the crossover solves a_run + b_run/r = a_ref + b_ref/r.
    """
    out = {}
    shaped = [r for r in results if r.get("rate_mbit") and r.get("final_val_loss") is not None]
    ref = [r for r in shaped if r["run"] == plan.target]
    for run in plan.runs:
        if run == plan.target:
            continue
        mine = [r for r in shaped if r["run"] == run]
        entry = {}
        for key in ("mean_step_s", "time_to_target_s"):
            pairs = [
                (r["rate_mbit"], r[key], b[key])
                for r in mine
                for b in ref
                if b["rate"] == r["rate"] and r.get(key) is not None and b.get(key) is not None
            ]
            wins = sorted(rate for rate, a, b in pairs if a < b)
            fit_a = fit_time([(r["rate_mbit"], r[key]) for r in mine if r.get(key) is not None])
            fit_b = fit_time([(b["rate_mbit"], b[key]) for b in ref if b.get(key) is not None])
            entry[key] = {
                "wins_at_mbit": wins,
                "measured_at_mbit": sorted(p for p, _, _ in pairs),
                **crossing(fit_a, fit_b),
            }
        out[run] = entry
    return out


# ------------------------------------------------------------------ formatting


def _mib(b: Optional[float]) -> str:
    return "–" if b is None else f"{b / 2**20:,.1f} MiB"


def _s(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f} s"


def _x(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _rate(r: dict) -> str:
    return "unshaped" if r["rate_bps"] is None else f"{r['rate_mbit']:g} Mbit/s"


def tables(plan: Plan, results: list[dict], probes: list[dict], cross: dict) -> str:
    M, S = plan.mesh
    lines = [
        f"Mesh {M}×{S} (replicas × shard), one network namespace per replica, "
        f"one-way delay {plan.delay_ms:g} ms; target = final val loss of `{plan.target}` at the same rate.",
        "",
        "| run | rate | steps | median step | mean step | mean vs "
        + plan.target
        + " | train time | final val | sync bytes | link bytes | to target | vs "
        + plan.target
        + " | tokens at target | sync bytes at target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.get("final_val_loss") is None:
            lines.append(f"| {r['run']} | {_rate(r)} | failed (exit {r.get('returncode')}) |" + " |" * 11)
            continue
        ttt = r.get("time_to_target_s")
        tt = (
            "not reached"
            if r.get("step_to_target") is None and r.get("target_val_loss") is not None
            else _s(ttt, 1)
            if ttt is not None
            else "–"
        )
        tok = r.get("tokens_to_target")
        lines.append(
            f"| {r['run']} | {_rate(r)} | {r['steps']} | {_s(r['median_step_s'])} | {_s(r['mean_step_s'])} | "
            f"{_x(r.get('mean_step_vs_target_run'))} | {_s(r['train_time_s'], 1)} | {r['final_val_loss']:.4f} | "
            f"{_mib(r['sync_bytes'])} | {_mib(r.get('link_bytes'))} | {tt} | "
            f"{_x(r.get('time_to_target_vs_target_run'))} | {'–' if tok is None else f'{tok / 1e6:.2f}M'} | "
            f"{_mib(r.get('sync_bytes_to_target'))} |"
        )
    if probes:
        lines += [
            "",
            "Probe: one all_reduce (fp32, gloo) on the sync group across the link, vs ring bytes / rate; "
            "the same size on a shard group stays inside a namespace.",
            "",
            "| rate | tensor | ring bytes | expected (bytes·8/rate) | measured (median) | measured / expected "
            "| effective rate | same size, shard group |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in probes:
            exp = p.get("expected_s")
            lines.append(
                f"| {p['rate']} | {_mib(p['tensor_bytes'])} | {_mib(p['ring_bytes'])} | {_s(exp)} | "
                f"{_s(p['sync_s_median'])} | {_x(p.get('measured_over_expected'))} | "
                f"{p['effective_mbit']:.1f} Mbit/s | {_s(p.get('shard_s_median'))} |"
            )
    shaped = [r for r in results if r.get("sync_expected_s")]
    if shaped:
        lines += [
            "",
            f"Sync collectives in the runs: Comm's recorded seconds on the sync group vs "
            f"S·sync_bytes·8/rate (S = {S} sync groups share a replica's link; overlapped or delayed "
            "syncs hide part of their time, so only blocking ones should be near 1×); link bytes = "
            "what the replicas' veths sent, vs M·S·sync_bytes.",
            "",
            "| run | rate | sync calls | recorded | expected | recorded / expected | link / (M·S·sync) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in shaped:
            lines.append(
                f"| {r['run']} | {_rate(r)} | {r['sync_calls']} | {_s(r['sync_seconds'], 1)} | "
                f"{_s(r['sync_expected_s'], 1)} | {_x(r.get('sync_measured_over_expected'))} | "
                f"{_x(r.get('link_over_sync'))} |"
            )
    if cross:
        lines += [
            "",
            f"Crossover vs `{plan.target}` (fit T = a + b/rate through the measured rates):",
            "",
            "| run | mean step: wins at (Mbit/s) | fitted crossover | time to target: wins at | fitted crossover |",
            "|---|---|---:|---|---:|",
        ]

        def fmt(e: dict) -> tuple[str, str]:
            wins = ", ".join(f"{w:g}" for w in e["wins_at_mbit"]) or "none"
            c, side = e["crossover_mbit"], e["wins"]
            fit = {None: "–", "all": "wins at every rate", "never": "never wins"}.get(
                side, f"wins {side} {c:,.0f} Mbit/s" if c is not None else "–"
            )
            return wins, fit

        for run, e in cross.items():
            a, b = fmt(e["mean_step_s"]), fmt(e["time_to_target_s"])
            lines.append(f"| {run} | {a[0]} | {a[1]} | {b[0]} | {b[1]} |")
    return "\n".join(lines)


def make_plots(plan: Plan, results: list[dict]) -> list[Path]:
    """hsdp.sweep's plots, one set per rate, with the target as a line."""
    from hsdp.sweep import plot_runs  # lazy: matplotlib is an optional extra

    written = []
    for label, _ in plan.rates:
        dirs = {r["run"]: Path(r["dir"]) for r in results if r["rate"] == label and r.get("final_val_loss")}
        if not dirs:
            continue
        target = next(
            (r.get("target_val_loss") for r in results if r["rate"] == label and r.get("target_val_loss") is not None),
            None,
        )
        bps = dict(plan.rates)[label]
        link = "an unshaped veth" if bps is None else f"a {bps / 1e6:g} Mbit/s link"
        title = f"{plan.name}: {plan.mesh[0]}×{plan.mesh[1]} (replicas × shard) over {link}"
        written += plot_runs(dirs, plan.out, f"{plan.name}-{label}", title=title, target=target)
    return written


# ------------------------------------------------------------------ main


def previous_report(plan: Plan) -> tuple[dict[tuple[str, str], dict], dict[str, dict]]:
    """Records and probes of an earlier slowlink.json in `plan.out` (reused for what is not re-run)."""
    try:
        report = json.loads((plan.out / "slowlink.json").read_text())
    except (OSError, ValueError):
        return {}, {}
    runs = {(r["run"], r["rate"]): r for r in report.get("runs", []) if "run" in r and "rate" in r}
    return runs, {p["rate"]: p for p in report.get("probes", []) if "rate" in p}


def record(plan: Plan, run: str, label: str, bps: Optional[int], measured: Optional[dict] = None) -> dict:
    """A run's entry: where and how it ran, what slowlink measured around it, and its summary.json."""
    rec = {
        "run": run,
        "rate": label,
        "rate_bps": bps,
        "rate_mbit": rate_mbit(bps),
        "delay_ms": plan.delay_ms,
        "dir": str(plan.out_dir / run_name(plan, run, label)),
    }
    for key in ("cmd_wall_s", "returncode", "link_bytes"):
        if measured and key in measured:
            rec[key] = measured[key]
    summary = summarize(Path(rec["dir"])) if rec.get("returncode", 0) == 0 else None
    if summary:
        rec.update(summary)
    return rec


def write_report(plan: Plan, results: dict[tuple[str, str], dict], probes: dict[str, dict]) -> str:
    """slowlink.json and slowlink.md from what is known so far (written after every run); returns the tables."""
    ordered = [results[k] for k in plan_items(plan) if k in results]
    probe_list = [probes[label] for label, _ in plan.rates if label in probes]
    evaluate_results(plan, ordered)
    cross = crossovers(plan, ordered)
    md = tables(plan, ordered, probe_list, cross)
    report = {
        "name": plan.name,
        "base": plan.base,
        "set": plan.shared,
        "mesh": list(plan.mesh),
        "delay_ms": plan.delay_ms,
        "target_run": plan.target,
        "runs": ordered,
        "probes": probe_list,
        "crossover": cross,
    }
    (plan.out / "slowlink.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (plan.out / "slowlink.md").write_text(md + "\n")
    return md


def execute(
    plan: Plan, todo: set[tuple[str, str]], stop: StopOnSignal, rdzv_timeout_s: int, probe_reps: int, skip_probe: bool
) -> tuple[dict[tuple[str, str], dict], dict[str, dict]]:
    """Run the (run, rate) pairs in `todo`, one network per rate; the others come from earlier outputs."""
    prev_runs, probes = previous_report(plan)
    results = {
        (run, label): record(plan, run, label, dict(plan.rates)[label], prev_runs.get((run, label)))
        for run, label in plan_items(plan)
        if (run, label) not in todo
    }
    logs = plan.out / "logs"
    port = BASE_PORT
    M, S = plan.mesh
    for label, bps in plan.rates:
        here = [run for run, lab in plan_items(plan) if lab == label and (run, lab) in todo]
        if not here:
            continue
        link = None
        try:
            link = SlowLink(M, bps, plan.delay_ms)
            link.up()  # after the assignment: a failure half-way is still torn down below
            print(
                f"[slowlink] {label}: namespaces {', '.join(link.namespaces)}; {link.qdiscs() or 'no qdisc'}",
                flush=True,
            )
            if not skip_probe:
                port += 1
                p = probes[label] = run_probe(link, S, plan.probe_s, probe_reps, port, logs, label)
                print(
                    f"[slowlink] probe {label}: {p['tensor_bytes'] / 2**20:.1f} MiB all_reduce in "
                    f"{p['sync_s_median']:.3f} s (expected {_s(p.get('expected_s'))}), "
                    f"shard group {_s(p.get('shard_s_median'))}",
                    flush=True,
                )
            for run in here:
                port += 1
                args = [str(REPO / "train.py"), "--config", plan.base]
                for o in overrides(plan, run, label):
                    args += ["--set", o]
                print(f"[slowlink] {run} @ {label}: {' '.join(args[3:])}", flush=True)
                before = link.tx_bytes()
                t0 = time.perf_counter()
                job = Job(link, S, args, port, logs, f"{run}-{label}", rdzv_timeout_s).start()
                rc = job.wait(plan.timeout_s)
                measured = {
                    "cmd_wall_s": time.perf_counter() - t0,
                    "returncode": rc,
                    "link_bytes": sum(link.tx_bytes()) - sum(before),
                }
                if rc != 0:
                    why = "timed out" if rc == 124 else f"exit {rc}"
                    print(f"[slowlink] {run} @ {label} {why}; logs:\n{job.log_tail()}", file=sys.stderr, flush=True)
                results[(run, label)] = record(plan, run, label, bps, measured)
                write_report(plan, results, probes)  # an interrupted sweep keeps what it measured
        finally:
            if link is not None:
                with stop.shielded():
                    left = link.down()
                if left:
                    print(f"[slowlink] could not remove: {', '.join(left)}", file=sys.stderr)
    return results, probes


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m hsdp.slowlink", description="train across a shaped link between network namespaces"
    )
    p.add_argument("spec", nargs="?", help="YAML file with base, set, rates, runs (see the module docstring)")
    p.add_argument("--rate", help="comma-separated rates: 20mbit, 1gbit, unshaped (overrides the spec's)")
    p.add_argument("--delay-ms", type=float, default=None, help="one-way netem delay (default 0)")
    p.add_argument("--config", help="base config (default: the spec's base, else configs/tiny.yaml)")
    p.add_argument("--set", action="append", default=[], help="override for every run (repeatable)")
    p.add_argument("--runs", nargs="+", metavar="NAME=o,o", help="runs and their overrides (replaces the spec's)")
    p.add_argument("--only", default="", help="comma-separated runs to (re)run; others' outputs are reused")
    p.add_argument("--target", help="run whose final val loss is the target (default: the first)")
    p.add_argument("--name", help="prefix of run folders and the output folder (default: the spec's stem)")
    p.add_argument("--out", help="folder for slowlink.json/.md, PNGs, logs (default <run.out_dir>/<name>)")
    p.add_argument("--timeout-s", type=float, default=None, help="bound on each run (default 1200)")
    p.add_argument("--rdzv-timeout-s", type=int, default=120, help="bound on the torchrun rendezvous")
    p.add_argument("--probe-s", type=float, default=None, help="probe size in seconds at the rate (default 2)")
    p.add_argument("--probe-reps", type=int, default=3)
    p.add_argument("--no-probe", action="store_true")
    p.add_argument("--plot", action="store_true", help="also write PNGs (needs matplotlib: pip install -e .[plot])")
    p.add_argument(
        "--no-run",
        action="store_true",
        help="run nothing (no root needed): tables and plots from the run folders and slowlink.json",
    )
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by slowlink processes that died")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_probe"]:  # inside a probe job (torchrun worker)
        probe_worker(argv[1], int(argv[2]), int(argv[3]))
        return 0
    args = parse_args(argv)
    why = missing_requirements()
    if why and not args.no_run:
        print(why, file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespaces{': ' + ', '.join(removed) if removed else ''}")
        return 0
    try:
        plan = make_plan(args)
        only = set(filter(None, args.only.split(",")))
        if only - set(plan.runs):
            raise ConfigError(f"--only: unknown runs {sorted(only - set(plan.runs))}")
        if args.plot:
            import matplotlib  # noqa: F401  (fail now, not after an hour of runs)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("slowlink: --plot needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
        return 2
    todo = set() if args.no_run else {(run, label) for run, label in plan_items(plan) if not only or run in only}
    plan.out.mkdir(parents=True, exist_ok=True)
    with StopOnSignal() as stop:
        try:
            results, probes = execute(plan, todo, stop, args.rdzv_timeout_s, args.probe_reps, args.no_probe)
        except Interrupted as e:
            report = plan.out / "slowlink.json"
            kept = f" (results so far in {report})" if report.is_file() else ""
            print(f"interrupted by {e}: stopped the runs and removed the namespaces{kept}", file=sys.stderr)
            return e.exit_code
        except SlowLinkError as e:
            print(f"slowlink: {e}", file=sys.stderr)
            return 2 if isinstance(e, MissingRequirement) else 1
    print(write_report(plan, results, probes))
    if args.plot:
        ordered = [results[k] for k in plan_items(plan) if k in results]
        for path in make_plots(plan, ordered):
            print(f"wrote {path}")
    return 0 if all(r.get("final_val_loss") is not None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
