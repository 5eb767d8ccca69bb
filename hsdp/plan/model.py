"""The step-time model: one step's compute laid on a timeline with the collectives the engine issues,
overlapped only where the engine overlaps them (docs/design.md §8, §11.1, §4.2).

Two links (three on a three-level mesh), each a FIFO channel (a process group's collectives run one after another):

    inter   each replica's link to the others, per direction, shared by its S ranks' sync groups:
            a message of b bytes per rank takes S·b·8·overhead / inter_bps + latency · hops
            (hops: a ring's M − 1 steps for an all-gather, 2(M − 1) for an all-reduce); on a three-level
            mesh (§4.1) a site's link, shared by its R·S ranks, each sending a 1/R slice: R·S·b·8·…
    site    the in-site replicas' fast link (three-level mesh): b·8 / intra_bps, its own FIFO; free
            without an intra rate
    intra   a rank's shard-group link: b·8 / intra_bps (None: free, as in a compute-only run), or each
            collective's time as measured on the machine (`MeasuredIntra`, hsdp.plan.collectives)

`overhead` is the wire's framing: 1514/1448 for Ethernet + IPv4 + TCP with timestamps at MTU 1500
(what the benchmark's veths carry); 1 for the paper's closed forms.

A step (`Timeline.step`), as hsdp/engines run it (§11.1): forward, unit by unit, each unit waiting for
its gather (prefetched one unit ahead when `mesh.prefetch`); backward in reverse, every unit but the
embedding re-gathered (prefetched likewise); when a unit's grads exist every pending reduction
advances one stage — waits for its current collective, then launches the next (the reduce-scatter's
successor is the sync-group all-reduce on grad-sync steps) — and the unit's reduce-scatter starts; at
the end of backward everything pending is finished. Compute per unit is the calibrated step's,
split 1/3 forward, 2/3 backward, and across units by FLOPs (`Unit.flops_share`).

Measured intra times on a CPU (`shares_compute`) are charged to the compute clock where the collective
is issued instead: gloo's copies and loopback sends run on the cores that compute (4 ranks on 2 cores
here), so the engine's overlap does not hide them.

After the update, the sync schedule of hsdp.sync.schedule: a blocking param sync (τ = 0) adds the
calibrated sync compute and every unit's messages in order, each waited on; a delayed one (τ > 0)
adds the compute, queues the messages on the inter channel and waits for them after step s + τ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from hsdp.plan.workload import Message, Workload
from hsdp.sync.schedule import fragments_due

FRAMING = 1514 / 1448  # bytes on the wire per byte of TCP payload (Ethernet, IPv4, TCP + timestamps, MTU 1500)
FORWARD_SHARE = 1 / 3  # of a unit's training FLOPs: forward 2, backward 4 per weight and token
PERIODS = 3  # periods simulated after the warmup; the last is the steady state reported


@dataclass(frozen=True)
class MeasuredIntra:
    """Shard-group collective times measured on the machine (hsdp.plan.collectives); used instead of intra_bps."""

    time_of: Callable[[Message], float]  # seconds one shard-group collective takes
    shares_compute: bool  # it runs on the cores that compute (CPU, gloo): charged to the compute clock
    source: str = ""
    table: Optional[dict] = None  # the measurement as JSON (validate.json keeps it)


@dataclass(frozen=True)
class Link:
    inter_bps: float  # each replica's link, bits/s per direction
    latency_s: float = 0.0  # one-way, per ring hop
    intra_bps: Optional[float] = None  # the shard group's, per rank; None: free
    overhead: float = FRAMING
    intra_measured: Optional[MeasuredIntra] = None  # wins over intra_bps


@dataclass(frozen=True)
class Compute:
    """Compute-only times (no communication): from a fake-backend run or from FLOPs (hsdp.plan.calibrate)."""

    step_s: float  # one optimizer step: forward + backward of its micro-steps and the update
    sync_s: float = 0.0  # what a param-sync step adds (codec, outer step)
    source: str = ""
    warning: str = ""  # one line the command prints on stderr (e.g. a calibration on few steps)


@dataclass
class Prediction:
    rate_bps: float
    step_time_s: float  # mean over the run: warmup steps, then the steady period
    compute_s: float  # the same mean with free links
    exposed_comm_s: float
    compute_utilization: float
    sync_bytes_per_step: float  # per rank, mean
    shard_bytes_per_step: int  # per rank
    steps: int
    tokens: int
    time_to_tokens_s: float
    warmup_step_time_s: Optional[float] = None
    period_step_time_s: Optional[float] = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return {**out, **self.extra}


@dataclass
class _Pending:
    unit: int
    end: float  # when its current collective is through
    stages: list[tuple[str, Message]]  # what follows, each on its channel ("inter" | "site")


class Timeline:
    """The compute clock and the two channels' free times, advanced step by step."""

    def __init__(self, w: Workload, link: Link, compute: Compute) -> None:
        self.w, self.link, self.compute = w, link, compute
        self.t = self.inter_free = self.intra_free = self.site_free = 0.0
        self.landing: dict[int, float] = {}  # step → when its delayed syncs' messages are through

    # -- the channels
    def inter_time(self, m: Message) -> float:
        """A replica's (a site's: its R·S ranks each send a slice) sync-group messages share its link."""
        link, w = self.link, self.w
        return w.R * w.S * m.nbytes * 8 * link.overhead / link.inter_bps + link.latency_s * m.hops(w.M)

    def inter(self, start: float, messages: list[Message]) -> float:
        """Queue messages on the inter link from `start`; when the last is through."""
        for m in messages:
            self.inter_free = max(start, self.inter_free) + self.inter_time(m)
        return max(start, self.inter_free) if not messages else self.inter_free

    def intra(self, start: float, m: Message) -> float:
        """Issue a shard-group collective at `start` (the compute clock); when its result is there."""
        measured = self.link.intra_measured
        if m.nbytes == 0:
            return start
        if measured is not None:
            took = measured.time_of(m)
        elif self.link.intra_bps is not None:
            took = m.nbytes * 8 / self.link.intra_bps
        else:  # no intra link to model
            return start
        if measured is not None and measured.shares_compute:  # the compute waits while its cores communicate
            self.t = max(self.t, start) + took
            return self.t
        self.intra_free = max(start, self.intra_free) + took
        return self.intra_free

    def site(self, start: float, m: Message) -> float:
        """Issue an in-site replicas' collective (§4.1) at `start`: on the fast link at intra_bps, its own
        FIFO channel; free without one (a measured shard-group table does not cover the replicate group)."""
        if self.link.intra_bps is None or m.nbytes == 0:
            return start
        self.site_free = max(start, self.site_free) + m.nbytes * 8 / self.link.intra_bps
        return self.site_free

    # -- one step
    def step(self, s: int, grad_sync: bool) -> None:
        """Step s: its micro-steps, then the param syncs due after it (and those landing after it)."""
        for micro in range(self.w.A):
            self.forward()
            self.backward(grad_sync, last=micro == self.w.A - 1)
        for m in self.w.muon_messages():  # the optimizer step's exchanges (blocking: the update waits)
            self.t = self.intra(self.t, m)
        if s in self.landing:
            self.t = max(self.t, self.landing.pop(s))
        due = [] if grad_sync else fragments_due(s, self.w.sync)
        if due:
            self.param_sync(s, due)

    def unit_compute(self, u: int, share: float) -> float:
        return self.compute.step_s / self.w.A * share * self.w.units[u].flops_share

    def forward(self) -> None:
        U = len(self.w.units)
        ready = self.intra(self.t, self.w.gather_messages(0))
        for u in range(U):
            self.t = max(self.t, ready)
            if u + 1 < U and self.w.prefetch:  # the next unit's gather overlaps this unit's compute
                ready = self.intra(self.t, self.w.gather_messages(u + 1))
            self.t += self.unit_compute(u, FORWARD_SHARE)
            if u + 1 < U and not self.w.prefetch:
                ready = self.intra(self.t, self.w.gather_messages(u + 1))

    def backward(self, grad_sync: bool, last: bool) -> None:
        order = list(reversed(range(len(self.w.units))))
        regather = [u for u in order if not self.w.units[u].embedding]
        ready: dict[int, float] = {}
        pending: list[_Pending] = []
        for u in order:
            if u in regather:
                if u not in ready:
                    ready[u] = self.intra(self.t, self.w.gather_messages(u))
                self.t = max(self.t, ready[u])
                later = regather[regather.index(u) + 1 :]
                if later and self.w.prefetch:
                    ready[later[0]] = self.intra(self.t, self.w.gather_messages(later[0]))
            self.t += self.unit_compute(u, 1 - FORWARD_SHARE)
            if last:
                pending = [p for p in pending if not self.advance(p)]
                rs = self.intra(self.t, self.w.reduce_scatter_message(u))
                pending.append(_Pending(u, rs, self.w.grad_stages(u, grad_sync)))
        for p in pending:  # the end of backward lands every reduction
            while not self.advance(p):
                pass

    def advance(self, p: _Pending) -> bool:
        """PendingReduce.advance: wait for the current stage, start the next; True once done."""
        self.t = max(self.t, p.end)
        if not p.stages:
            return True
        channel, m = p.stages.pop(0)
        p.end = self.inter(self.t, [m]) if channel == "inter" else self.site(self.t, m)
        return False

    def param_sync(self, s: int, due: list[int]) -> None:
        self.t += self.compute.sync_s
        if self.w.M == 1:
            return
        fragments = self.w.fragments()
        units = [u for f in due for u in fragments[f]]
        messages, in_site = self.w.round_sync_messages(units), self.w.site_round_messages(units)
        if self.w.sync.delay == 0:
            for m in messages:  # blocking: each collective is waited on before the next starts
                self.t = self.inter(self.t, [m])
            for m in in_site:  # then the site gathers its slices
                self.t = self.site(self.t, m)
        else:
            end = self.inter(self.t, messages)
            for m in in_site:
                end = self.site(end, m)
            land = s + self.w.sync.delay
            self.landing[land] = max(self.landing.get(land, 0.0), end)


def step_times(w: Workload, link: Link, compute: Compute) -> tuple[Optional[float], Optional[float]]:
    """(a warmup / grad-sync step's time, the mean step of a steady period after the warmup)."""
    sync = w.sync
    warm = None
    if sync.warmup_steps is None or sync.warmup_steps > 0:
        tl = Timeline(w, link, compute)
        tl.step(0, grad_sync=True)
        warm = tl.t
    if sync.warmup_steps is None:
        return warm, None
    tl = Timeline(w, link, compute)
    starts = []
    for i in range(PERIODS * sync.every):
        starts.append(tl.t)
        tl.step(sync.warmup_steps + i, grad_sync=False)
    period_start = starts[-sync.every]
    return warm, (tl.t - period_start) / sync.every


def predict(w: Workload, link: Link, compute: Compute, steps: int, tokens: Optional[int] = None) -> Prediction:
    """The config's mean step, compute, exposed communication and bytes at one link rate."""
    free = Link(inter_bps=float("inf"), latency_s=0.0, intra_bps=None, overhead=1.0)
    warm, period = step_times(w, link, compute)
    warm_c, period_c = step_times(w, free, compute)
    sync = w.sync
    n_warm = steps if sync.warmup_steps is None else min(steps, sync.warmup_steps)
    n_rest = steps - n_warm

    def mean(a: Optional[float], b: Optional[float]) -> float:
        return ((a or 0.0) * n_warm + (b or 0.0) * n_rest) / max(1, steps)

    step_s, compute_s = mean(warm, period), mean(warm_c, period_c)
    sync_bytes = (w.grad_sync_bytes() * n_warm + w.period_sync_bytes() / sync.every * n_rest) / max(1, steps)
    tokens = tokens if tokens is not None else steps * w.tokens_per_step
    return Prediction(
        rate_bps=link.inter_bps,
        step_time_s=step_s,
        compute_s=compute_s,
        exposed_comm_s=step_s - compute_s,
        compute_utilization=compute_s / step_s if step_s > 0 else 1.0,
        sync_bytes_per_step=sync_bytes,
        shard_bytes_per_step=w.shard_bytes_per_step(),
        steps=steps,
        tokens=tokens,
        time_to_tokens_s=tokens / w.tokens_per_step * step_s,
        warmup_step_time_s=warm,
        period_step_time_s=period,
    )
