"""How Δ travels: a codec turns each replica's Δ_m into what crosses the transport and back into the
replicas' mean (docs/design.md §8.5). n = the unit's held elements, M = replicas, B = `quant_block`.

    codec                          collective            bytes one rank sends
    none   fp32                    all-reduce (sum) ÷ M  2(M−1)/M · 4n
    int8   8-bit + fp32 scale/B    all-gather (packed)   (M−1)·(n + 4⌈n/B⌉)
    int4   4-bit (2/byte) + scale  all-gather (packed)   (M−1)·(⌈n/2⌉ + 4⌈n/B⌉)
    int2   2-bit (4/byte) + 2 fp32 levels/B  (packed)    (M−1)·(⌈n/4⌉ + 8⌈n/B⌉)
    top-k  per chunk of C: the k = ⌈ρC⌉ largest |x| as (index within the chunk, value), ties to
           the lowest index (a last chunk shorter than k sends all of its elements); values fp32,
           int8, int4 or int2 as above over the c = (⌈n/C⌉ − 1)·k + min(k, n − (⌈n/C⌉ − 1)·C) selected
                                   all-gather (packed)   (M−1)·(⌈c·b/8⌉ + value bytes of c)

Top-k indices are bit-packed, b = ⌈log₂ C⌉ bits each (12 for C = 4096), across the whole payload.
Lossy codecs decode every replica's payload and sum in fp32 (replicas in order m = 0..M−1); the mean
divides by M, or with `sync.topk_mean: chosen` each coordinate by the replicas that sent it (0 where
none did).

Error feedback (`sync.error_feedback`, lossy codecs): replica m keeps e_m (fp32, the unit's size);
e_m ← β·e_m + Δ_m (β = `sync.error_feedback_decay`, 1 by default), it sends C(e_m), then
e_m ← e_m − D(C(e_m)), what it did not get across.

A reduction is started (`start`, possibly async) and finished (`finish`: waited, the mean written
into `red.delta`); what the codec keeps alive between the two lives in the `Reduction`.

Messages per round. The fp32 codec all-reduces each unit on its own (one all-reduce per unit: bucketing
them would change the order of an M ≥ 3 sum). The packed codecs (int8, int4, int2, top-k) split a start
in two: `encode` (the unit's payload bytes, the residual updated) and the round's `send_round`, which
concatenates the payloads of every unit of every fragment due in the round (in start order) and sends
them as ONE all-gather; each unit's reduction keeps where its bytes sit in every replica's row and
decodes only those (`finish`, per unit, as before). The bytes on the wire are the sum of the units'
formulas above, to the byte; only the message count changes (one per round instead of one per unit:
on a slow link each message pays the link's and gloo's latency). `start` is `encode` + a round of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from hsdp.comm.transport import Transport, Work
from hsdp.config.schema import ConfigError, SyncConfig
from kernels.bitpack import index_bits, pack_bits, packed_nbytes, unpack_bits
from kernels.quant import MAX_BLOCK, dequantize_mean, quantize_int8
from kernels.quant2 import dequantize_int2_mean, quantize_int2
from kernels.quant4 import dequantize_int4_mean, quantize_int4
from kernels.sparse_decode import decode_topk_int2_add
from kernels.topk import (
    MAX_CHUNK,
    scatter_add_chunks,
    topk_error_feedback,
    topk_index_dtype,
    topk_numel,
    topk_select,
)


class RoundGather:
    """One round's packed payloads, all-gathered as one message: each replica's row is its units' payloads
    concatenated in start order. Holds both buffers until the wait; the rows are read once."""

    def __init__(self, payload: torch.Tensor, transport: Transport, async_op: bool) -> None:
        self.payload: Optional[torch.Tensor] = payload  # dropped once the rows are read
        self.gathered = torch.empty(transport.size * payload.numel(), dtype=torch.uint8, device=payload.device)
        self.work = transport.all_gather(self.gathered, payload, async_op)
        self._rows: Optional[torch.Tensor] = None

    def rows(self, transport: Transport) -> torch.Tensor:
        """The contributing replicas' rows, [M, row bytes] (after the wait)."""
        if self._rows is None:
            self.work.wait()
            self._rows = transport.contributed_rows(self.gathered)
            self.payload = None
        return self._rows


@dataclass
class Reduction:
    """One unit's Δ on its way to the replicas' mean: started, then finished (waited, averaged)."""

    delta: torch.Tensor  # Δ_m when started; mean_m Δ_m once finished
    works: list[Work] = field(default_factory=list)
    buffers: tuple[torch.Tensor, ...] = ()  # what the codec must keep alive until the wait
    done: bool = False
    payload: Optional[torch.Tensor] = None  # a packed codec's encoded bytes (uint8) until its round is sent
    gather: Optional[RoundGather] = None  # the round's one all-gather that carries them (send_round)
    at: int = 0  # where this unit's bytes start in each replica's row of it
    nbytes: int = 0  # how many they are
    # a weighted mean (sync.weighting=tokens): each contributing row's factor c_j = M·w_j/Σw (mean 1), so the
    # codec's plain mean of c_j·x_j is Σ w_j x_j / Σ w_j. None: the plain mean. The fp32 codec's sum takes
    # each replica's own factor before it is sent (the policy scales Δ_m); a lossy codec's decode scales the
    # rows it decoded (their block scales, int2 tables, or values), so what each replica sends and its
    # error-feedback residual stay its own.
    factors: Optional[torch.Tensor] = None


class Codec(Protocol):
    lossless: bool  # whether the mean it returns is the exact fp32 mean
    packed: bool  # whether it has `encode`: its payloads travel in the round's one all-gather (send_round)

    def start(
        self, delta: torch.Tensor, transport: Transport, async_op: bool, error: Optional[torch.Tensor] = None
    ) -> Reduction:
        """Send Δ_m (+ e_m, updated in place, when `error` is given): one unit as a round of its own."""

    def finish(self, red: Reduction, transport: Transport) -> None: ...


class PackedCodec(Codec, Protocol):
    """A codec with `packed` true: `encode` a unit's payload, sent with the round's others (send_round)."""

    def encode(self, delta: torch.Tensor, error: Optional[torch.Tensor] = None) -> Reduction: ...


def send_round(reds: list[Reduction], transport: Transport, async_op: bool) -> None:
    """Send a round's encoded payloads (`reds` in start order) as one all-gather of their concatenation;
    each reduction learns where its bytes are in every replica's row."""
    if not reds:
        return
    payloads = [r.payload for r in reds if r.payload is not None]
    if len(payloads) != len(reds):
        raise ValueError("send_round: a reduction without a payload (not encoded, or already sent)")
    gather = RoundGather(torch.cat(payloads), transport, async_op)
    at = 0
    for r, payload in zip(reds, payloads):
        r.gather, r.at, r.nbytes = gather, at, payload.numel()
        r.works, r.payload = [gather.work], None  # every unit of the round waits on the same message
        at += r.nbytes


class _PackedCodec:
    """What the packed codecs share: `start` = `encode` + a round of one (`send_round`)."""

    lossless = False
    packed = True

    def encode(self, delta: torch.Tensor, error: Optional[torch.Tensor] = None) -> Reduction:
        raise NotImplementedError

    def start(
        self, delta: torch.Tensor, transport: Transport, async_op: bool, error: Optional[torch.Tensor] = None
    ) -> Reduction:
        red = self.encode(delta, error)
        send_round([red], transport, async_op)
        return red


def _accumulate(delta: torch.Tensor, error: Optional[torch.Tensor], decay: float) -> torch.Tensor:
    """x = β·e + Δ, what error feedback compresses (Δ alone without it); β = 1 skips the product, so
    plain error feedback is what it always was (fl(1·e) = e)."""
    if error is None:
        return delta
    if decay != 1.0:
        error.mul_(decay)
    return delta + error


def _wait(red: Reduction) -> None:
    for work in red.works:
        work.wait()
    red.works = []


class Fp32Codec:
    """Δ_m as it is: one in-place fp32 all-reduce (sum) per unit, then ÷ M."""

    lossless = True
    packed = False

    def start(
        self, delta: torch.Tensor, transport: Transport, async_op: bool, error: Optional[torch.Tensor] = None
    ) -> Reduction:
        return Reduction(delta, [transport.all_reduce_sum(delta, async_op)])

    def finish(self, red: Reduction, transport: Transport) -> None:
        if red.done:
            return
        _wait(red)
        red.delta.div_(len(transport.contributors))  # the parts that count (the transport says which)
        red.done = True


# ---------------------------------------------------------------- packed payloads (int4, top-k)
@dataclass(frozen=True)
class _Field:
    """One tensor of a packed payload: its dtype and element count."""

    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts' bytes, concatenated: one uint8 buffer per replica, so one all-gather sends all."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def _unpack(buf: torch.Tensor, fields: list[_Field]) -> list[torch.Tensor]:
    """The parts of one replica's packed payload (views, or copies where a part is not aligned)."""
    out, at = [], 0
    for f in fields:
        part = buf[at : at + f.nbytes]
        if (buf.storage_offset() + at) % f.dtype.itemsize:  # a view must start on its dtype's alignment
            part = part.clone()
        out.append(part.view(f.dtype))
        at += f.nbytes
    return out


def _finish_gather(red: Reduction, transport: Transport) -> tuple[int, int, torch.Tensor]:
    """Wait for the round's all-gather: (M, the unit's n, the M contributing replicas' bytes of this unit as
    [M, payload] rows: columns of the round's rows)."""
    red.works = []  # the round's one message: RoundGather waits for it once
    assert red.gather is not None, "finish before the round was sent (send_round)"
    rows = red.gather.rows(transport)[:, red.at : red.at + red.nbytes]
    return rows.shape[0], red.delta.numel(), rows


class _Values:
    """Dense values (the whole Δ, or top-k's selected values): fp32, int8 or int4 + block scales, int2 + tables."""

    def __init__(self, quantize: str, block: int) -> None:
        self.quantize, self.block = quantize, block

    def fields(self, n: int) -> list[_Field]:
        nb = math.ceil(n / self.block)
        if self.quantize == "int8":
            return [_Field(torch.int8, n), _Field(torch.float32, nb)]
        if self.quantize == "int4":
            return [_Field(torch.uint8, math.ceil(n / 2)), _Field(torch.float32, nb)]
        if self.quantize == "int2":
            return [_Field(torch.uint8, math.ceil(n / 4)), _Field(torch.float32, 2 * nb)]
        return [_Field(torch.float32, n)]

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.quantize == "int8":
            return list(quantize_int8(x, self.block))
        if self.quantize == "int4":
            return list(quantize_int4(x, self.block))
        if self.quantize == "int2":
            return list(quantize_int2(x, self.block))
        return [x]

    def decode_mean(self, parts: list[torch.Tensor], M: int, out: torch.Tensor) -> None:
        """out ← mean over the M replicas' decoded values (parts: each field stacked [M, ...])."""
        if self.quantize == "int8":
            dequantize_mean(parts[0], parts[1], self.block, out)
        elif self.quantize == "int4":
            dequantize_int4_mean(parts[0], parts[1], self.block, out)
        elif self.quantize == "int2":
            dequantize_int2_mean(parts[0], parts[1], self.block, out)
        else:
            torch.sum(parts[0], dim=0, out=out)  # fp32, replicas in order
            out.div_(M)

    def decode(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """out ← one replica's decoded values."""
        self.decode_mean([p.view(1, -1) for p in parts], 1, out)


class DenseLowBitCodec(_PackedCodec):
    """int8 / int4 / int2: Δ_m as 8-bit values, or packed 4- or 2-bit ones, + their block scales or tables."""

    def __init__(self, quantize: str, block: int, decay: float = 1.0) -> None:
        self.values, self.decay = _Values(quantize, block), decay

    def encode(self, delta: torch.Tensor, error: Optional[torch.Tensor] = None) -> Reduction:
        x = _accumulate(delta, error, self.decay)
        parts = self.values.encode(x)
        if error is not None:  # e ← x − D(C(x))
            self.values.decode(parts, error)
            torch.sub(x, error, out=error)
        return Reduction(delta, payload=_pack(parts))

    def finish(self, red: Reduction, transport: Transport) -> None:
        if red.done:
            return
        M, n, rows = _finish_gather(red, transport)
        fields = self.values.fields(n)
        per_replica = [_unpack(rows[m], fields) for m in range(M)]
        stacked = [torch.stack([parts[i] for parts in per_replica]) for i in range(len(fields))]
        if red.factors is not None:  # decoding is linear in a row's scales (int2: its table): weight them
            stacked[1].mul_(red.factors.to(stacked[1].dtype).view(M, 1))
        self.values.decode_mean(stacked, M, red.delta)
        red.buffers, red.gather, red.done = (), None, True


class TopKCodec(_PackedCodec):
    """Per chunk, the ⌈density·chunk⌉ largest |x| as (bit-packed index within the chunk, value); values
    dense-coded. The mean divides each coordinate by M (`mean="all"`) or by the replicas that sent it."""

    def __init__(
        self, density: float, chunk: int, quantize: str, block: int, decay: float = 1.0, mean: str = "all"
    ) -> None:
        self.chunk, self.k = chunk, math.ceil(density * chunk)
        self.bits = index_bits(chunk)
        self.values, self.decay, self.mean = _Values(quantize, block), decay, mean

    def selected(self, n: int) -> int:
        """c: how many (index, value) pairs one replica sends for a unit of n elements."""
        return topk_numel(n, self.chunk, self.k)

    def fields(self, n: int) -> list[_Field]:
        c = self.selected(n)
        return [_Field(torch.uint8, packed_nbytes(c, self.bits)), *self.values.fields(c)]

    def encode(self, delta: torch.Tensor, error: Optional[torch.Tensor] = None) -> Reduction:
        if error is None:
            idx, vals = topk_select(delta, self.chunk, self.k)
        else:  # error ← (β·e + Δ) with the selected positions zeroed
            if self.decay != 1.0:
                error.mul_(self.decay)
            idx, vals = topk_error_feedback(delta, error, self.chunk, self.k)
        parts = self.values.encode(vals)
        if error is not None and self.values.quantize != "none":  # … and what quantizing them lost
            decoded = torch.empty_like(vals)
            self.values.decode(parts, decoded)
            scatter_add_chunks(idx, vals - decoded, self.chunk, self.k, error)
        return Reduction(delta, payload=_pack([pack_bits(idx, self.bits), *parts]))

    def finish(self, red: Reduction, transport: Transport) -> None:
        if red.done:
            return
        M, n, rows = _finish_gather(red, transport)
        fields = self.fields(n)
        red.delta.zero_()
        c = self.selected(n)
        vals = torch.empty(c, dtype=torch.float32, device=red.delta.device)
        idx = torch.empty(c, dtype=topk_index_dtype(self.chunk), device=red.delta.device)
        senders = torch.zeros_like(red.delta) if self.mean == "chosen" else None
        ones = torch.ones_like(vals) if senders is not None else None
        factors = None if red.factors is None else red.factors.tolist()
        # SparseLoCo's payload: one launch per replica (its kernel counts senders by 1, not by a factor)
        fused = self.values.quantize == "int2" and self.bits > 0 and not (factors and senders is not None)
        for m in range(M):  # replicas in order, then ÷ M (or ÷ how many sent each coordinate)
            packed_idx, *parts = _unpack(rows[m], fields)
            if factors is not None and ones is not None:  # mean="chosen": Σ c_j x_j over Σ c_j of the senders
                ones.fill_(factors[m])
            if fused:  # unpack + dequantize + scatter-add (+ count) in one kernel, the same sums
                packed_vals, table = parts  # int2's two fields
                if factors is not None:  # ±table: decoding is linear in it
                    table = table * factors[m]
                block = self.values.block
                decode_topk_int2_add(
                    packed_idx, packed_vals, table, self.bits, self.chunk, self.k, block, red.delta, senders
                )
                continue
            unpack_bits(packed_idx, self.bits, idx)
            self.values.decode(parts, vals)
            if factors is not None:
                vals.mul_(factors[m])
            scatter_add_chunks(idx, vals, self.chunk, self.k, red.delta)
            if senders is not None and ones is not None:  # both set with mean="chosen"
                scatter_add_chunks(idx, ones, self.chunk, self.k, senders)
        if senders is None:
            red.delta.div_(M)
        else:  # a coordinate nobody sent (or only replicas of factor 0) is 0 / 1 = 0
            red.delta.div_(senders.masked_fill_(senders == 0, 1.0))
        red.buffers, red.gather, red.done = (), None, True


def build_codec(cfg: SyncConfig) -> Codec:
    """The codec `sync.quantize` / `sync.topk` name."""
    decay = cfg.error_feedback_decay
    if cfg.topk > 0:
        return TopKCodec(cfg.topk, cfg.topk_chunk, cfg.quantize, cfg.quant_block, decay, cfg.topk_mean)
    if cfg.quantize in ("int8", "int4", "int2"):
        return DenseLowBitCodec(cfg.quantize, cfg.quant_block, decay)
    return Fp32Codec()


def check_codec(cfg: SyncConfig) -> None:
    """What the codec's kernels support (ConfigError before any worker starts)."""
    if cfg.quant_block > MAX_BLOCK:  # one block is one register-tile row of the kernel
        raise ConfigError(f"sync.quant_block: expected at most {MAX_BLOCK}, got {cfg.quant_block}")
    if cfg.topk > 0 and cfg.topk_chunk > MAX_CHUNK:  # one chunk is one program's tile
        raise ConfigError(f"sync.topk_chunk: expected at most {MAX_CHUNK}, got {cfg.topk_chunk}")
