"""How Δ travels: a codec turns each replica's Δ_m into what crosses the transport and back
into the replicas' mean (docs/design.md §2.5).

    none:  Δ_m in fp32, summed by one all-reduce, ÷ M              bytes 2(M−1)/M · 4n
    int8:  Δ_m as int8 + one fp32 scale per `quant_block` elements,
           all-gathered, dequantized and averaged in fp32            bytes (M−1)·(n + 4⌈n/B⌉)

A codec's reduction is started (`start`, possibly async) and finished (`finish`:
waited, the mean written into `red.delta`). What the codec keeps alive between
the two lives in the `Reduction`, so several can be in flight at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hsdp.config.schema import ConfigError, SyncConfig
from hsdp.sync.transport import Transport, Work
from kernels.quant import MAX_BLOCK, dequantize_mean, quantize_int8


@dataclass
class Reduction:
    """One unit's Δ on its way to the replicas' mean: started, then finished (waited, averaged)."""

    delta: torch.Tensor  # Δ_m when started; mean_m Δ_m once finished
    works: list[Work] = field(default_factory=list)
    buffers: tuple[torch.Tensor, ...] = ()  # what the codec must keep alive until the wait
    done: bool = False


class Codec(Protocol):
    lossless: bool  # whether the mean it returns is the exact fp32 mean

    def start(self, delta: torch.Tensor, transport: Transport, async_op: bool) -> Reduction: ...

    def finish(self, red: Reduction, transport: Transport) -> None: ...


class Fp32Codec:
    """Δ_m as it is: one in-place fp32 all-reduce (sum), then ÷ M."""

    lossless = True

    def start(self, delta: torch.Tensor, transport: Transport, async_op: bool) -> Reduction:
        return Reduction(delta, [transport.all_reduce_sum(delta, async_op)])

    def finish(self, red: Reduction, transport: Transport) -> None:
        if red.done:
            return
        for work in red.works:
            work.wait()
        red.delta.div_(transport.size)
        red.works, red.done = [], True


class Int8Codec:
    """Δ_m as int8 values and one fp32 scale per block; every replica's pair is all-gathered."""

    lossless = False

    def __init__(self, block: int) -> None:
        self.block = block

    def start(self, delta: torch.Tensor, transport: Transport, async_op: bool) -> Reduction:
        q, scales = quantize_int8(delta, self.block)
        M = transport.size
        q_all = torch.empty(M * q.numel(), dtype=torch.int8, device=q.device)
        s_all = torch.empty(M * scales.numel(), dtype=torch.float32, device=q.device)
        works = [transport.all_gather(q_all, q, async_op), transport.all_gather(s_all, scales, async_op)]
        return Reduction(delta, works, (q, scales, q_all, s_all))

    def finish(self, red: Reduction, transport: Transport) -> None:
        if red.done:
            return
        for work in red.works:
            work.wait()
        _, _, q_all, s_all = red.buffers
        M = transport.size
        dequantize_mean(q_all.view(M, -1), s_all.view(M, -1), self.block, red.delta)
        red.works, red.buffers, red.done = [], (), True


def build_codec(cfg: SyncConfig) -> Codec:
    """The codec `sync.quantize` names."""
    return Int8Codec(cfg.quant_block) if cfg.quantize == "int8" else Fp32Codec()


def check_codec(cfg: SyncConfig) -> None:
    """What the codec's kernels support (ConfigError before any worker starts)."""
    if cfg.quant_block > MAX_BLOCK:  # one block is one register-tile row of the kernel
        raise ConfigError(f"sync.quant_block: expected at most {MAX_BLOCK}, got {cfg.quant_block}")
