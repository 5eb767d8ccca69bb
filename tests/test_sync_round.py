"""One message per sync round (docs/design.md §8.5): a packed codec's payloads for every unit of every
fragment due in a round leave in ONE all-gather; the fp32 codec still all-reduces each unit alone.

Two replicas' SyncPolicy objects in one process over a loopback transport that records each collective.
The reference is the same policies with each unit sent as a round of its own (the codec's `start`, the
path before bucketing): the bucketed run must give the same θ_m, θ_g and residuals bit for bit, the same
bytes per rank (the sum over units of the §8.5 payload formula, tests/test_compress.py), and one call per
round where the reference makes one per unit. Sync every 2 steps in 4 fragments: fragments 0 and 3 are
due at the same steps, and 1 and 2, so a round spans two fragments; τ = 1, so both replicas issue their
round before either waits (an in-process loopback cannot run a blocking round)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hsdp.config.schema import SyncConfig
from hsdp.sync.codec import Reduction, build_codec
from hsdp.sync.policy import SyncPolicy
from hsdp.sync.schedule import fragments_due
from tests.test_compress import payload_bytes

M = 2
SIZES = [431, 4968, 97, 1200, 4096, 5, 777, 64]  # held elements per unit: short last chunks, odd payloads
STEPS = 9
BASE = dict(warmup_steps=0, every=2, fragments=4, method="diloco", delay=1, alpha=0.0)
CODECS = {
    "sparseloco": dict(
        topk=0.05,
        topk_chunk=64,
        quantize="int2",
        quant_block=16,
        error_feedback=True,
        error_feedback_decay=0.9,
        topk_mean="chosen",
        outer_lr=1.0,
        outer_momentum=0.0,
    ),  # fmt: skip
    "int8-ef": dict(quantize="int8", quant_block=16, error_feedback=True),
    "int4": dict(quantize="int4", quant_block=64),
    "topk-fp32": dict(topk=0.1, topk_chunk=300),
    "fp32": dict(),
}


@dataclasses.dataclass
class _Work:
    fn: object
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            self.fn()
            self.done = True


class _Loop:
    """M replicas in one process: the i-th collective completes (on wait) once every replica issued its i-th.
    Records each replica's calls as (op, bytes that replica hands the collective)."""

    def __init__(self) -> None:
        self.slots: dict[int, list] = {}
        self.calls: list[list[tuple[str, int]]] = [[] for _ in range(M)]

    def transport(self, m: int):
        group = self

        class Transport:
            may_fail, counted, size, contributors = False, True, M, list(range(M))
            issued = 0

            def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
                return gathered.view(M, -1)

            def begin_round(self) -> None:
                pass

            def commit_round(self) -> bool:
                return True

            def _issue(self, op: str, t: torch.Tensor) -> list:
                slot = group.slots.setdefault(self.issued, [None] * M)
                slot[m] = t.clone()
                self.issued += 1
                group.calls[m].append((op, t.numel() * t.element_size()))
                return slot

            def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> _Work:
                slot = self._issue("all_gather", inp)
                return _Work(lambda: out.copy_(torch.cat(slot)))

            def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> _Work:
                slot = self._issue("all_reduce", t)
                return _Work(lambda: t.copy_(sum(slot[1:], slot[0].clone())))  # replicas in order

        return Transport()


class _OneUnitPerMessage:
    """The codec as it sent before bucketing: each unit's `start` is a round of its own."""

    lossless, packed = False, False

    def __init__(self, codec) -> None:
        self.codec = codec

    def start(self, delta, transport, async_op, error=None) -> Reduction:
        return self.codec.start(delta, transport, async_op, error=error)

    def finish(self, red: Reduction, transport) -> None:
        self.codec.finish(red, transport)


def _train(cfg: SyncConfig, bucketed: bool) -> tuple[list[SyncPolicy], _Loop, list[int]]:
    """STEPS steps of a fake local update on M replicas; (policies, their transport, units per round)."""
    loop = _Loop()
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in SIZES]
    policies = []
    for m in range(M):
        codec = build_codec(cfg)
        held = [t.clone() for t in init]
        policies.append(SyncPolicy(cfg, held, loop.transport(m), None if bucketed else _OneUnitPerMessage(codec)))
    units_per_round = []
    for step in range(STEPS):
        for m, p in enumerate(policies):
            step_g = torch.Generator().manual_seed(1000 * step + m)
            for h in p.held:
                h.add_(torch.randn(h.shape, generator=step_g), alpha=1e-2)
            p.after_step(step)
        due = fragments_due(step, cfg)
        if due:
            units_per_round.append(sum(len(policies[0].fragments[f]) for f in due))
    for p in policies:
        p.finish()
    return policies, loop, units_per_round


def _state(p: SyncPolicy) -> list[torch.Tensor]:
    out = list(p.held)
    out += [s.global_params for s in p.outer if s is not None]
    out += [e for e in p.state.error if e is not None]
    return out


@pytest.mark.parametrize("name", list(CODECS))
def test_one_message_per_round_same_bits_same_bytes(name: str):
    cfg = SyncConfig(**BASE, **CODECS[name])
    bucketed, loop, units_per_round = _train(cfg, bucketed=True)
    reference, ref_loop, _ = _train(cfg, bucketed=False)
    assert len(units_per_round) == STEPS and max(units_per_round) == 4  # two fragments of 2 units each round
    for m in range(M):
        for got, want in zip(_state(bucketed[m]), _state(reference[m]), strict=True):
            assert torch.equal(got, want), name
        sent = sum(b for _, b in loop.calls[m])
        assert sent == sum(b for _, b in ref_loop.calls[m])
        if name == "fp32":  # per unit, as before: an all-reduce of 4n bytes per unit per round
            assert [op for op, _ in loop.calls[m]] == ["all_reduce"] * sum(units_per_round)
            continue
        assert [op for op, _ in loop.calls[m]] == ["all_gather"] * len(units_per_round)  # one per round
        assert len(ref_loop.calls[m]) == sum(units_per_round)  # one per unit before
        frags = bucketed[m].fragments
        per_round = [
            sum(payload_bytes(SIZES[u], cfg) for f in fragments_due(s, cfg) for u in frags[f]) for s in range(STEPS)
        ]
        assert [b for _, b in loop.calls[m]] == per_round  # the §8.5 payloads of the round's units, summed
    if cfg.error_feedback:
        assert all(float(e.abs().max()) > 0 for e in bucketed[0].state.error)


def test_state_dict_mid_flight_equals_never_stopping():
    """A checkpoint taken with a bucketed round in flight finishes every unit of it from the one message;
    a fresh pair of policies loaded from it lands the round as the uninterrupted pair does."""
    cfg = SyncConfig(**BASE, **CODECS["sparseloco"])
    loop = _Loop()
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in SIZES]
    ps = [SyncPolicy(cfg, [t.clone() for t in init], loop.transport(m)) for m in range(M)]
    for m, p in enumerate(ps):
        for h in p.held:
            h.add_(torch.randn(h.shape, generator=torch.Generator().manual_seed(m)), alpha=1e-2)
        p.after_step(1)  # fragments 0 and 3 start; they land after step 2
    assert len(ps[0].in_flight) == 2 and len(loop.slots) == 1  # one message for the round
    saved = [p.state_dict() for p in ps]
    copies = []
    for m, p in enumerate(ps):
        fresh = SyncPolicy(cfg, [h.clone() for h in p.held], _Loop().transport(m))
        buffers = {k: [None if t is None else t.clone() for t in v] for k, v in saved[m]["buffers"].items()}
        fresh.load_state_dict({"meta": saved[m]["meta"], "buffers": buffers})
        copies.append(fresh)
    for p in [*ps, *copies]:
        p.finish()
    for p, c in zip(ps, copies):
        for got, want in zip(_state(c), _state(p), strict=True):
            assert torch.equal(got, want)
