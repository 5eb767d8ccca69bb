"""Network namespaces joined by tc-shaped veths: build, inspect, stop what runs inside, remove (docs/design.md §14.1).

For M replicas `SlowLink` creates the namespaces `hsl<pid><tag>n<m>` and joins them with veth links: for M = 2
one veth pair, for M > 2 one veth per replica into a bridge that lives in a namespace of its own (`...nb`). With
`lighthouse=True` (an elastic run's) the lighthouse's host is one more namespace (`...nl`, address 198.18.0.100)
with its own shaped veth into the bridge, which is then built for M = 2 too: no replica's namespace holds the
lighthouse. Every veth end gets `tc` shaping on egress — a token bucket (`tbf rate R`) and, with a delay d, a
`netem delay` in front of it — so each direction of each replica's link carries at most R and a packet takes d
one way. A rate of None keeps the same namespaces and veths without any qdisc (the baseline for "what does the
shaping cost"). Replica m's address is 198.18.0.(101+m) (the RFC 2544 benchmarking range), which exists only
inside these namespaces.

Names carry the pid, so concurrent benchmarks do not clash, and `cleanup_stale` removes
those of dead pids (a benchmark that was SIGKILLed). Needs root and iproute2 (`ip`, `tc`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hsdp.config.schema import ConfigError

PREFIX = "hsl"  # every namespace and link we create: hsl<pid><tag>...
SUBNET = "198.18.0"  # RFC 2544 benchmarking range; these addresses exist only inside our namespaces
HOST0 = 101  # replica m is SUBNET.(HOST0 + m): three digits, so c10d's order by address is m's order
LIGHTHOUSE_HOST = 100  # the lighthouse's own host (namespace ...nl), in no replica's torchrun world
MAX_REPLICAS = 99
TBF_LATENCY_MS = 50  # queue the token bucket keeps (beyond it, packets are dropped and TCP backs off)
_networks = itertools.count()  # SlowLink networks created by this process (each gets its own tag)


class SlowLinkError(RuntimeError):
    """Setting up the network or a run failed; the message is one line."""


class MissingRequirement(SlowLinkError):
    """This machine cannot build the network asked for (exit 2)."""


def missing_requirements() -> Optional[str]:
    """None if this process can build namespaces (root, `ip`, `tc`), else why not (one line)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"slowlink: needs iproute2 ({' and '.join(missing)} not found on PATH)"
    if os.geteuid() != 0:
        return "slowlink: needs root (network namespaces and tc)"
    return None


def run_tool(args: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run `ip`/`tc`; SlowLinkError with its stderr if it fails (and `check`)."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise SlowLinkError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def list_namespaces() -> list[str]:
    out = run_tool(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = run_tool(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
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


def add_veth(ns: str, name: str, peer_ns: str, peer: str) -> None:
    """A veth pair: `name` in namespace `ns`, its other end `peer` in `peer_ns`."""
    run_tool(["ip", "-n", ns, "link", "add", name, "type", "veth", "peer", "name", peer, "netns", peer_ns])


def _tag(n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[n] if n < 26 else letters[n // 26 - 1] + letters[n % 26]


@dataclass
class SlowLink:
    """M namespaces joined by shaped veths (a bridge namespace for M > 2). `up()` builds, `down()` removes."""

    replicas: int
    rate_bps: Optional[int]
    delay_ms: float = 0.0
    pin_cores: bool = False  # replica m's processes run on the m-th CPU core this process may use
    lighthouse: bool = False  # one more namespace, the lighthouse's host, on its own link into the bridge
    prefix: str = ""
    namespaces: list[str] = field(default_factory=list)  # replica m's namespace
    bridge_ns: Optional[str] = None
    ifnames: list[str] = field(default_factory=list)  # replica m's veth (inside its namespace)
    addrs: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # namespaces to delete (recorded before creation)

    def __post_init__(self) -> None:
        if not 2 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"mesh.sync: slowlink needs 2..{MAX_REPLICAS} replicas, got {self.replicas}")
        if not self.prefix:
            self.prefix = f"{PREFIX}{os.getpid()}{_tag(next(_networks))}"
        p = self.prefix
        self.namespaces = [f"{p}n{m}" for m in range(self.replicas)]
        self.bridge_ns = f"{p}nb" if self.replicas > 2 or self.lighthouse else None
        self.ifnames = [f"{p}e{m}" for m in range(self.replicas)]
        self.addrs = [f"{SUBNET}.{HOST0 + m}" for m in range(self.replicas)]

    @property
    def lighthouse_ns(self) -> str:
        """The lighthouse host's namespace (with `lighthouse=True`)."""
        assert self.lighthouse, "this network has no lighthouse host (SlowLink(..., lighthouse=True))"
        return f"{self.prefix}nl"

    @property
    def lighthouse_addr(self) -> str:
        return f"{SUBNET}.{LIGHTHOUSE_HOST}"

    def _hosts(self) -> list[tuple[str, str, str]]:
        """(namespace, veth, address) of every host on the network: the replicas, then the lighthouse's."""
        hosts = list(zip(self.namespaces, self.ifnames, self.addrs))
        if self.lighthouse:
            hosts.append((self.lighthouse_ns, f"{self.prefix}el", self.lighthouse_addr))
        return hosts

    # -- build
    def up(self) -> SlowLink:
        """Namespaces, veths (and bridge), addresses, then the shaping of every veth end."""
        hosts = [ns for ns, _, _ in self._hosts()]
        for ns in [*hosts, *([self.bridge_ns] if self.bridge_ns else [])]:
            self.created.append(ns)  # first: a signal between the two lines still gets it removed
            run_tool(["ip", "netns", "add", ns])
            run_tool(["ip", "-n", ns, "link", "set", "lo", "up"])
        shaped = self._join_pair() if self.bridge_ns is None else self._join_through_bridge(self.bridge_ns)
        for ns, dev, addr in self._hosts():
            run_tool(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            run_tool(["ip", "-n", ns, "link", "set", dev, "up"])
        for ns, dev, with_delay in shaped:
            self._shape(ns, dev, self.delay_ms if with_delay else 0.0)
        return self

    def _join_pair(self) -> list[tuple[str, str, bool]]:
        """M = 2: one veth pair, one end in each namespace; both ends shaped with the delay."""
        ns0, ns1 = self.namespaces
        add_veth(ns0, self.ifnames[0], ns1, self.ifnames[1])
        return [(ns0, self.ifnames[0], True), (ns1, self.ifnames[1], True)]

    def _join_through_bridge(self, bridge_ns: str) -> list[tuple[str, str, bool]]:
        """M > 2 (or a lighthouse host): a bridge in its own namespace (`bridge_ns`), one veth per host into it."""
        br, shaped = f"{self.prefix}br", []
        run_tool(["ip", "-n", bridge_ns, "link", "add", br, "type", "bridge"])
        run_tool(["ip", "-n", bridge_ns, "link", "set", br, "up"])
        for m, (ns, dev, _) in enumerate(self._hosts()):
            port = f"{self.prefix}b{m}"
            add_veth(ns, dev, bridge_ns, port)
            run_tool(["ip", "-n", bridge_ns, "link", "set", port, "master", br])
            run_tool(["ip", "-n", bridge_ns, "link", "set", port, "up"])
            # uplink: rate + the one-way delay; downlink (bridge port egress): rate only, so every
            # host-to-host path has one delay and two token buckets of the same rate
            shaped += [(ns, dev, True), (bridge_ns, port, False)]
        return shaped

    def _shape(self, ns: str, dev: str, delay_ms: float) -> None:
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        tbf = []
        if self.rate_bps is not None:
            burst = max(64 * 1024, self.rate_bps // 8 // 500)  # ≥ 2 ms at the rate
            tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]
        if delay_ms > 0:
            netem = [*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "100000"]
            proc = run_tool(netem, check=False)
            if proc.returncode != 0:
                raise MissingRequirement(
                    f"--delay-ms needs the netem qdisc, which this kernel lacks "
                    f"(tc: {proc.stderr.strip()}); run without --delay-ms"
                )
            if tbf:
                run_tool([*tc, "parent", "1:1", "handle", "10:", *tbf])
        elif tbf:
            run_tool([*tc, "root", *tbf])

    # -- use
    def exec_prefix(self, m: int) -> list[str]:
        """The command prefix that runs a program in replica m's namespace (and on its own core if pinned:
        a replica then stands for a machine of its own, whose stopped or slowed trainer frees no CPU for
        the others)."""
        prefix = [shutil.which("ip") or "ip", "netns", "exec", self.namespaces[m]]
        if self.pin_cores:
            prefix += [shutil.which("taskset") or "taskset", "--cpu-list", str(sorted(os.sched_getaffinity(0))[m])]
        return prefix

    def lighthouse_prefix(self) -> list[str]:
        """The command prefix that runs a program on the lighthouse's host (its namespace; not pinned: it
        takes little CPU, and a core of a replica's would make it share that replica's machine)."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.lighthouse_ns]

    def tx_bytes(self) -> list[int]:
        """Bytes each replica has sent on its veth (its uplink), as the kernel counts them (L2 frames)."""
        out = []
        for ns, dev in zip(self.namespaces, self.ifnames):
            info = json.loads(run_tool(["ip", "-n", ns, "-s", "-j", "link", "show", dev]).stdout)
            out.append(int(info[0]["stats64"]["tx"]["bytes"]))
        return out

    def qdiscs(self) -> str:
        """`tc qdisc show` of replica 0's veth (for the log)."""
        return run_tool(["tc", "-n", self.namespaces[0], "qdisc", "show", "dev", self.ifnames[0]]).stdout.strip()

    # -- faults
    def cut(self, m: int) -> None:
        """Replica m's link goes down (a partition): its veth end is set down and the other end loses its
        carrier, so no packet crosses either way (new connections from m fail at once: its route to the others
        goes with the link). Its own address stays, so its processes still reach each other."""
        run_tool(["ip", "-n", self.namespaces[m], "link", "set", self.ifnames[m], "down"])

    def restore(self, m: int) -> None:
        """Replica m's link back up after `cut`: its qdiscs stayed, and the kernel puts its route back."""
        run_tool(["ip", "-n", self.namespaces[m], "link", "set", self.ifnames[m], "up"])

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
                alive = [pid for pid in alive if is_alive(pid)]
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
                run_tool(["ip", "netns", "del", ns], check=False)
        left = leftovers(self.prefix)
        self.created = [ns for ns in self.created if ns in left]
        return left


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces, and links in this (the root) namespace, whose names start with `prefix`."""
    names = [ns for ns in list_namespaces() if ns.startswith(prefix)]
    out = run_tool(["ip", "-o", "link", "show"], check=False).stdout
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
        if not ns.startswith(PREFIX) or not digits.isdigit() or is_alive(int(digits)):
            continue
        for pid in namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run_tool(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed
