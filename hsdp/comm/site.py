"""The sync group of a three-level mesh: a site's payload crosses the slow link once (docs/design.md §4.1).

On a `sync × replicate × shard` mesh the R replicas of a site hold the same
held shards (they average grads every step), so every payload the sync policy
sends (a pseudo-gradient, its int8 bytes, a top-k selection) is the same on
all of them. Sending it from each would put R copies on the slow link.
Instead each in-site replica carries one slice:

    slice_r   = payload[r·c : (r+1)·c]   (c = ceil(P / R), the last slice zero-padded)
    sync      : all-reduce (or all-gather) slice_r across the sites (slow link, P/R per rank)
    replicate : all-gather the R results inside the site (fast link) → the whole result

so the bytes one site sends over the slow link per round are what one replica
sends on a two-level mesh, and the site's R links (NICs) share them. The
alternative (replicate rank 0 syncs, then broadcasts in the site) moves the
same bytes but puts them all through one rank and leaves the others idle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from hsdp.comm.groups import Comm
from hsdp.comm.transport import Transport, Work


def slice_bounds(numel: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, stop, c): part `index` of `parts` equal slices of c = ceil(numel/parts) elements, clipped."""
    c = max(1, math.ceil(numel / parts))
    start = min(numel, index * c)
    return start, min(numel, start + c), c


def take_slice(flat: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """A zero-padded copy of slice `index` of `flat` (every slice has the same length c)."""
    start, stop, c = slice_bounds(flat.numel(), parts, index)
    part = torch.zeros(c, dtype=flat.dtype, device=flat.device)
    part[: stop - start] = flat[start:stop]
    return part


class SlicedWork:
    """A sync-group collective on one slice, finished by the site's all-gather when waited on."""

    def __init__(self, work: Work, finish: Callable[[], None]) -> None:
        self.work: Optional[Work] = work
        self.finish = finish

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.finish()


class SiteTransport:
    """The sites' collectives, each site's payload sliced across its replicate group (module docstring).

    `inner` carries the slices between sites (the c10d sync group, `GroupTransport`); it says who takes
    part in a round and whether the round commits, so this class only cuts and reassembles payloads.
    """

    def __init__(self, inner: Transport, comm: Comm) -> None:
        self.inner, self.comm = inner, comm
        self.may_fail = inner.may_fail  # fixed for a transport's life
        # mesh.backend=fake moves no data (an all-gather hands back copies of this rank's own slice, which a
        # codec would decode as garbage): there each rank sends its whole payload, as on a two-level mesh.
        fake = dist.get_backend() == "fake"
        self.parts = 1 if fake else comm.size("replicate")
        self.index = 0 if fake else dist.get_rank(comm.groups["replicate"])

    def gather_in_site(self, part: torch.Tensor) -> torch.Tensor:
        """The site's R slices, in replica order, from this rank's (on the replicate group's fast link)."""
        if self.parts == 1:
            return part
        whole = torch.empty(self.parts * part.numel(), dtype=part.dtype, device=part.device)
        self.comm.all_gather(whole, part, "replicate")
        return whole

    @property
    def counted(self) -> bool:
        return self.inner.counted

    @counted.setter
    def counted(self, value: bool) -> None:
        self.inner.counted = value

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def contributors(self) -> list[int]:
        return self.inner.contributors

    def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        return self.inner.contributed_rows(gathered)

    def begin_round(self) -> None:
        self.inner.begin_round()

    def commit_round(self) -> bool:
        return self.inner.commit_round()

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> SlicedWork:
        """t ← Σ over sites of t: this rank's slice over the slow link, then the site's slices gathered."""
        flat = t.view(-1)  # a view, so the result lands in t
        part = take_slice(flat, self.parts, self.index)

        def gather_slices() -> None:
            flat.copy_(self.gather_in_site(part)[: flat.numel()])

        work = SlicedWork(self.inner.all_reduce_sum(part, async_op=True), gather_slices)
        if not async_op:
            work.wait()
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> SlicedWork:
        """out ← concat over sites of inp: each site's slices over the slow link, then regrouped per site."""
        flat, sites = inp.view(-1), self.size
        part = take_slice(flat, self.parts, self.index)
        rows = torch.empty(sites * part.numel(), dtype=part.dtype, device=part.device)  # slice r of every site

        def gather_slices() -> None:
            whole = self.gather_in_site(rows)
            # [replica slice, site, c] → [site, replica slice · c]: each site's payload, padding dropped
            per_site = whole.view(self.parts, sites, -1).transpose(0, 1).reshape(sites, -1)
            out.view(sites, -1).copy_(per_site[:, : flat.numel()])

        work = SlicedWork(self.inner.all_gather(rows, part, async_op=True), gather_slices)
        if not async_op:
            work.wait()
        return work
