"""Where each parameter lives: the dim-0 shard layout of a unit, apart from any runtime state;
and how one step's grads are reduced (`ReducePlan`).

Data only (torch, no collectives), below both users: the eager engine (hsdp/engines) and
the compiled step's graph (hsdp/compile/graph.py), which trace the same layout and divide
and sync grads by the same plan (docs/design.md §0).

A unit's params are sharded along dim 0 over the S ranks of its shard group, each
param padded to ceil(d0 / S) rows so every rank holds the same number of
elements (docs/design.md §5):

    held_flat [N]        this rank's rows of every param, param after param (fp32)
    all-gather [S, N]    every rank's held_flat, rank-major
    full_flat [S·N]      param-major: param i as its S padded chunks back to back,
                         so `full_flat[S·offset_i : S·offset_i + numel_i]` is param i

Our padded dim-0 split is `torch.chunk`'s for every param whose d0 divides into
equal chunks, and the last ranks hold fewer (possibly zero) real rows otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in its unit's shard and full buffers."""

    name: str  # name inside the unit, e.g. "attn.qkv.weight"
    owner: nn.Module  # the submodule that holds it
    attr: str  # attribute name on the owner
    shape: torch.Size
    rows: int  # dim-0 rows per rank: ceil(d0 / S)
    row_numel: int  # elements per dim-0 row
    offset: int  # start in the per-rank shard [N]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        return self.rows * self.row_numel

    def held_rows(self, shard_rank: int) -> int:
        """Rows of real (unpadded) data on `shard_rank`."""
        return max(0, min(self.rows, self.shape[0] - shard_rank * self.rows))


@dataclass(frozen=True)
class UnitLayout:
    """The shard layout of one unit over a shard group of S ranks."""

    specs: tuple[ParamSpec, ...]
    S: int

    @property
    def shard_sizes(self) -> list[int]:
        """Per-rank elements of each param (the split of held_flat)."""
        return [s.shard_numel for s in self.specs]

    @property
    def N(self) -> int:  # noqa: N802 - the design doc's name for it
        """Elements per rank (held_flat's length, padding included)."""
        return sum(s.shard_numel for s in self.specs)

    def full_views(self, full_flat: torch.Tensor) -> list[torch.Tensor]:
        """Each param's full tensor as a view into the param-major `full_flat` (padding dropped)."""
        return [full_flat[self.S * s.offset : self.S * s.offset + s.numel].view(s.shape) for s in self.specs]


def plan_layout(module: nn.Module, shard_size: int) -> UnitLayout:
    """Dim-0 sharding of every param of `module`, padded to equal shards."""
    specs, offset = [], 0
    for name, p in module.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        shape = p.shape if p.dim() > 0 else torch.Size([1])
        rows = -(-shape[0] // shard_size)
        row_numel = math.prod(shape[1:])
        specs.append(ParamSpec(name, module.get_submodule(owner_name), attr, shape, rows, row_numel, offset))
        offset += rows * row_numel
    return UnitLayout(tuple(specs), shard_size)


def divide_factors(divisor: int) -> tuple[float, float]:
    """Split a gradient divisor into pre- and post-reduction factors (pre·post = divisor).

    Dividing partly before the sum keeps fp16/bf16 sums from overflowing, and
    partly after keeps small grads from underflowing (as FSDP does).
    """
    pre = 1
    while divisor % pre == 0 and divisor / pre > pre:
        pre *= 2
    return float(pre), divisor / pre


def grad_divisor(shard_size: int, sync_size: int, sync_grads: bool, replicate_size: int = 1) -> int:
    """How many ranks' grads one step's mean is over: the shard group, the site's in-site replicas (every
    step), and the sites if they sync grads."""
    return shard_size * replicate_size * (sync_size if sync_grads else 1)


@dataclass(frozen=True)
class ReducePlan:
    """How one step's grads are reduced: dtype, whether replicas average too, and the split divisor."""

    reduce_dtype: torch.dtype
    sync_grads: bool  # all-reduce the grad shard across the sync group (exact HSDP / warmup)
    replicate: int  # in-site replicas: the grad shard is averaged across them every step
    pre: float  # divide before the sum (keeps low-precision sums from overflowing)
    post: float  # divide after it (keeps small grads from underflowing)


def reduce_plan(
    shard_size: int, sync_size: int, sync_grads: bool, reduce_dtype: torch.dtype, replicate_size: int = 1
) -> ReducePlan:
    """The mean over the shard group and the in-site replicas, and over the sites when they sync grads."""
    pre, post = divide_factors(grad_divisor(shard_size, sync_size, sync_grads, replicate_size))
    return ReducePlan(reduce_dtype, sync_grads, replicate_size, pre, post)
