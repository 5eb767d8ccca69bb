"""What one step of a config computes and moves: its units' held sizes and FLOP shares, and the bytes
of every collective, from the functions the engine counts with (docs/design.md §11.1, §4.2).

Bytes are never re-derived here. A unit's held elements come from `hsdp.core.layout.plan_layout` (the
engine's own dim-0 layout, padding included); a collective's bytes from `hsdp.comm.groups.ring_bytes_of`
(what `Comm` counts); a codec's payload from the codec classes of `hsdp.sync.codec` (`fields`: the
tensors it sends). The packed codecs (int8, int4, int2, top-k) pack a unit's fields into one payload, and a
round's payloads (all units of the fragments due) into one all-gather (`round_sync_messages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsdp.comm.groups import ring_bytes_of
from hsdp.config.schema import Config, SyncConfig
from hsdp.core.layout import DTYPES, plan_layout
from hsdp.models.gpt import GPT
from hsdp.models.muon import assign_owners, is_muon_matrix
from hsdp.sync.codec import DenseLowBitCodec, Fp32Codec, TopKCodec, build_codec
from hsdp.sync.schedule import fragment_units


@dataclass(frozen=True)
class Message:
    """One collective on a group of n ranks: its op and the bytes one rank sends (ring formula)."""

    op: str  # all_reduce | all_gather | reduce_scatter
    nbytes: int

    def hops(self, n: int) -> int:
        """Latency terms of a ring: n − 1 steps for a gather or scatter, 2(n − 1) for an all-reduce."""
        return 2 * (n - 1) if self.op == "all_reduce" else n - 1


@dataclass(frozen=True)
class Unit:
    """One unit of the model as the engine holds it: elements per rank and its share of the step's FLOPs."""

    held: int  # N_u: held elements per rank (hsdp.core.layout), padding included
    flops_share: float  # fraction of the model's forward/backward FLOPs in this unit
    embedding: bool  # backward needs no weights: not re-gathered (docs/design.md §11.1)


@dataclass(frozen=True)
class Workload:
    """A config's step: units, mesh and dtypes, and the sync config whose schedule and codec it runs."""

    units: tuple[Unit, ...]
    M: int  # replicas, or sites (mesh.sync)
    S: int  # shard group (mesh.shard)
    A: int  # micro-steps (optim.grad_accum)
    param_bytes: int  # b_p
    reduce_bytes: int  # b_r
    prefetch: bool
    sync: SyncConfig
    tokens_per_step: int  # the whole run's, all replicas
    flops_per_token: int
    params: int  # the model's parameters (unpadded)
    R: int = 1  # in-site replicas (mesh.replicate): each carries 1/R of its site's sync payloads (§4.1)
    muon: tuple[tuple[int, int], ...] = ()  # optim.name=muon: the whole shapes of the matrices Muon updates
    muon_exchange: str = "owner"  # optim.muon_exchange
    ns_steps: int = 5  # optim.muon_ns_steps

    # -------------------------------------------------------- Muon's exchanges and Newton–Schulz (§6.2)
    def muon_messages(self) -> list[Message]:
        """The optimizer step's shard-group collectives (bf16 pieces, hsdp/models/muon.py), as rank 0 sends them:
        owner: its rows to each matrix's owner, then the rows it owns back (two all_to_all); gather: one all_gather
        of its rows of every matrix. The busiest rank of owner's sends at most one matrix more than rank 0."""
        if not self.muon or self.S == 1:
            return []
        pieces = [-(-d0 // self.S) * d1 * 2 for d0, d1 in self.muon]
        if self.muon_exchange == "gather":
            return [Message("all_gather", ring_bytes_of("all_gather", self.S, sum(pieces)))]
        owners = assign_owners([torch.Size(s) for s in self.muon], self.S)
        to_owner = sum(b for b, o in zip(pieces, owners) if o != 0)
        from_owner = sum((self.S - 1) * b for b, o in zip(pieces, owners) if o == 0)
        return [Message("all_to_all", to_owner), Message("all_to_all", from_owner)]

    def muon_flops_per_step(self) -> float:
        """Newton–Schulz FLOPs one rank runs per step (owner: the matrices it owns; gather: all of them). Per
        iteration on a p×q matrix (p ≤ q): X·Xᵀ 2p²q, the quintic's A² 2p³, its product with X 2p²q."""
        if not self.muon:
            return 0.0
        cost = [self.ns_steps * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in self.muon]
        if self.muon_exchange == "gather" or self.S == 1:
            return float(sum(cost))
        owners = assign_owners([torch.Size(s) for s in self.muon], self.S)
        return float(max(sum(c for c, o in zip(cost, owners) if o == r) for r in range(self.S)))

    # -------------------------------------------------------- the shard group (per rank, per step)
    def gather_messages(self, u: int) -> Message:
        return Message("all_gather", ring_bytes_of("all_gather", self.S, self.units[u].held * self.param_bytes))

    def reduce_scatter_message(self, u: int) -> Message:
        return Message(
            "reduce_scatter", ring_bytes_of("reduce_scatter", self.S, self.units[u].held * self.reduce_bytes)
        )

    def shard_bytes_per_step(self) -> int:
        """§4.2: forward gathers and backward re-gathers per micro-step, one reduce-scatter, the grad norm (and
        Muon's exchanges)."""
        if self.S == 1:
            return 0
        gathers = sum(
            self.gather_messages(u).nbytes * (1 if unit.embedding else 2) for u, unit in enumerate(self.units)
        )
        scatters = sum(self.reduce_scatter_message(u).nbytes for u in range(len(self.units)))
        muon = sum(m.nbytes for m in self.muon_messages())
        return self.A * gathers + scatters + ring_bytes_of("all_reduce", self.S, 4) + muon

    # -------------------------------------------------------- the sync group (per rank)
    def grad_sync_message(self, u: int) -> Message:
        """Stage 3 of the grad reduction: the reduced grad shard (a site's: this rank's 1/R slice of it)
        all-reduced across replicas or sites (§11.1, §4.1)."""
        nbytes = -(-self.units[u].held // self.R) * self.reduce_bytes
        return Message("all_reduce", ring_bytes_of("all_reduce", self.M, nbytes))

    def grad_sync_bytes(self) -> int:
        return 0 if self.M == 1 else sum(self.grad_sync_message(u).nbytes for u in range(len(self.units)))

    def grad_stages(self, u: int, grad_sync: bool) -> list[tuple[str, Message]]:
        """After the shard group's reduce-scatter, the unit's grad collectives in the engine's order
        (hsdp/engines/collectives.py `replica_stages`), each with its channel: "inter" (the slow link) or
        "site" (the in-site replicas' fast link, §4.1)."""
        part = -(-self.units[u].held // self.R) * self.reduce_bytes  # one in-site replica's slice
        if not grad_sync or self.M == 1:
            whole = self.units[u].held * self.reduce_bytes
            return [("site", Message("all_reduce", ring_bytes_of("all_reduce", self.R, whole)))] if self.R > 1 else []
        if self.R == 1:
            return [("inter", self.grad_sync_message(u))]
        return [
            ("site", Message("reduce_scatter", ring_bytes_of("reduce_scatter", self.R, part))),
            ("inter", self.grad_sync_message(u)),
            ("site", Message("all_gather", ring_bytes_of("all_gather", self.R, part))),
        ]

    def param_sync_messages(self, u: int) -> list[Message]:
        """The collectives of one unit's param sync through the config's codec (§8.3–8.5), sliced per site."""
        return codec_messages(self.sync, self.units[u].held, self.M, self.R)

    def site_round_messages(self, units: list[int]) -> list[Message]:
        """The in-site all-gather of a round's slices after they crossed the slow link (§4.1): per unit
        for the fp32 all-reduce, one for a packed codec's gathered payloads (a row per site)."""
        if self.R == 1:
            return []
        payloads = [codec_payload(self.sync, self.units[u].held, self.R) for u in units]
        if payloads and all(op == "all_gather" for op, _ in payloads):
            return [Message("all_gather", ring_bytes_of("all_gather", self.R, self.M * sum(b for _, b in payloads)))]
        return [Message("all_gather", ring_bytes_of("all_gather", self.R, b)) for _, b in payloads]

    def fragments(self) -> list[list[int]]:
        return fragment_units(len(self.units), self.sync.fragments)

    def round_sync_messages(self, units: list[int]) -> list[Message]:
        """The collectives of one param-sync round over `units`: the fp32 codec's all-reduce per unit, or a
        packed codec's one all-gather of every unit's payload (hsdp/sync/codec.py `send_round`)."""
        messages = [m for u in units for m in self.param_sync_messages(u)]
        if messages and all(m.op == "all_gather" for m in messages):
            return [Message("all_gather", sum(m.nbytes for m in messages))]
        return messages

    def fragment_sync_bytes(self, f: int) -> int:
        if self.M == 1:
            return 0
        return sum(m.nbytes for u in self.fragments()[f] for m in self.param_sync_messages(u))

    def period_sync_bytes(self) -> int:
        """Bytes of one period H after the warmup: every fragment syncs once."""
        return sum(self.fragment_sync_bytes(f) for f in range(self.sync.fragments))


def codec_messages(sync: SyncConfig, n: int, M: int, parts: int = 1) -> list[Message]:
    """What the codec `sync` names sends for a unit of n held elements on M replicas (or sites, each
    sending its payload in `parts` slices, one per in-site replica: this rank's slice)."""
    op, nbytes = codec_payload(sync, n, parts)
    return [Message(op, ring_bytes_of(op, M, nbytes))]


def codec_payload(sync: SyncConfig, n: int, parts: int = 1) -> tuple[str, int]:
    """(op, bytes of this rank's input) of a unit of n held elements through the codec `sync` names; a
    site's payload is cut in `parts` slices of ⌈bytes/parts⌉ (hsdp/comm/site.py).

    Plain averaging (no θ_g) all-reduces θ_m itself, in fp32, as the fp32 codec does Δ_m.
    """
    codec = build_codec(sync)
    if isinstance(codec, Fp32Codec):
        return "all_reduce", 4 * -(-n // parts)
    if isinstance(codec, DenseLowBitCodec):
        fields = codec.values.fields(n)
    elif isinstance(codec, TopKCodec):
        fields = codec.fields(n)
    else:  # a codec this planner does not know yet: refuse rather than guess its bytes
        raise TypeError(f"plan: no byte count for codec {type(codec).__name__}")
    return "all_gather", -(-sum(f.nbytes for f in fields) // parts)


def unit_flops(unit: torch.nn.Module, index: int, cfg: Config) -> float:
    """A unit's training FLOPs per token, as `GPT.flops_per_token` counts them (its share of them)."""
    matmul = 0 if index == 0 else sum(p.numel() for p in unit.parameters() if p.dim() == 2)
    attention = 12 * cfg.model.seq_len * cfg.model.d_model if 0 < index <= cfg.model.n_layer else 0
    return 6 * matmul + attention


def build_workload(cfg: Config, params: int | None = None) -> Workload:
    """The config's workload; `params` scales every unit to a model of that many parameters (projection)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    S, M, R = cfg.mesh.shard, cfg.mesh.sync, cfg.mesh.replicate
    total = sum(p.numel() for p in model.parameters())
    scale = 1.0 if params is None else params / total
    flops = [unit_flops(unit, i, cfg) for i, unit in enumerate(model.units)]
    # an embedding's lookup has no matmul FLOPs, but its backward (a scatter-add) costs time: give it the
    # share of a matmul over its table, so the per-unit split never has a zero-time unit
    flops[0] = 6 * sum(p.numel() for p in model.units[0].parameters()) / cfg.model.seq_len
    units = tuple(
        Unit(
            held=max(1, round(plan_layout(unit, S).N * scale)),
            flops_share=f / sum(flops),
            embedding=i == 0,
        )
        for i, (unit, f) in enumerate(zip(model.units, flops))
    )
    per_token = model.flops_per_token() if params is None else 6 * params
    muon = tuple(
        (round(p.shape[0] * scale**0.5), round(p.shape[1] * scale**0.5))
        for n, p in model.named_parameters()
        if cfg.optim.name == "muon" and is_muon_matrix(n, p.dim())
    )
    return Workload(
        units=units,
        M=M,
        S=S,
        R=R,
        A=cfg.optim.grad_accum,
        param_bytes=DTYPES[cfg.precision.param_dtype].itemsize,
        reduce_bytes=DTYPES[cfg.precision.reduce_dtype].itemsize,
        prefetch=cfg.mesh.prefetch,
        sync=cfg.sync,
        tokens_per_step=M * R * S * cfg.data.batch_size * cfg.model.seq_len * cfg.optim.grad_accum,
        flops_per_token=per_token,
        params=total if params is None else params,
        muon=muon,
        muon_exchange=cfg.optim.muon_exchange,
        ns_steps=cfg.optim.muon_ns_steps,
    )


def state_bytes_per_rank(w: Workload) -> int:
    """What a healing replica fetches per rank (docs/design.md §9): its held params (fp32), AdamW's two
    moments (Muon's matrices: one momentum) and, for DiLoCo, the outer momentum; θ_g equals the params after a
    sync and is not sent twice."""
    held = sum(u.held for u in w.units)
    muon = sum(-(-d0 // w.S) * d1 for d0, d1 in w.muon)
    return held * (4 + 8 + (4 if w.sync.method == "diloco" else 0)) - 4 * muon
