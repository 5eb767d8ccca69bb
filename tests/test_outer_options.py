"""sync.schedule, sync.eager and the per-round outer lr / momentum (docs/design.md §8.9–§8.11).

The policy alone: M = 2 replicas' SyncPolicy objects in one process, one thread each, over a transport whose
i-th collective completes once both replicas issued theirs (so blocking rounds run as the c10d group's do).
Checked here: the refusals (one line naming the key), torchft's timing, η_r and μ_r by hand, the torchft α
merge at τ = 0 and the eager step by hand, and for each option with every codec that a state_dict taken
mid-run (syncs in flight, eager estimates held) → torch.save/load → a fresh policy continues bit for bit.
One train.py run resumes from a checkpoint with eager estimates in flight and ends as the straight run.
The whole runs against the single-process reference are tests/test_sync.py's cases (torchft_*, eager*,
outer_sched); the parity with torchft's own DiLoCo is tests/test_torchft_parity.py.
"""

from __future__ import annotations

import dataclasses
import io
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError, SyncConfig
from hsdp.config.validate import validate
from hsdp.sync.outer import OuterOptimizer
from hsdp.sync.policy import SyncPolicy
from hsdp.sync.schedule import fragments_due, slots_due, steps_after_last_sync
from tests.helpers import SMALL, run_train

M = 2
SIZES = [300, 37, 515, 64]  # held elements per unit: short last blocks and chunks


# ---------------------------------------------------------------- M replicas in threads
class _Done:
    def wait(self) -> None:
        pass


class _Group:
    """The i-th collective of every replica completes once all M issued theirs (sums in replica order)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.slots: dict[int, list[Optional[torch.Tensor]]] = {}

    def transport(self, m: int, may_fail: bool = False) -> Any:
        group, issued = self, [0]

        class Transport:
            counted, size, contributors = True, M, list(range(M))

            def __init__(self) -> None:
                self.may_fail = may_fail

            def contributed_rows(self, gathered: torch.Tensor) -> torch.Tensor:
                return gathered.view(M, -1)

            def begin_round(self) -> None:
                pass

            def commit_round(self) -> bool:
                return True

            def _all(self, t: torch.Tensor) -> list[torch.Tensor]:
                i = issued[0]
                issued[0] += 1
                with group.cond:
                    slot = group.slots.setdefault(i, [None] * M)
                    slot[m] = t.clone()
                    group.cond.notify_all()
                    assert group.cond.wait_for(lambda: all(s is not None for s in slot), timeout=60)
                return [s for s in slot if s is not None]

            def all_reduce_sum(self, t: torch.Tensor, async_op: bool) -> _Done:
                parts = self._all(t)
                t.copy_(sum(parts[1:], parts[0].clone()))
                return _Done()

            def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> _Done:
                out.copy_(torch.cat(self._all(inp)))
                return _Done()

        return Transport()


def in_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def initial_held() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in SIZES]


def fake_update(held: list[torch.Tensor], step: int, m: int) -> None:
    """Stands in for an optimizer step: every replica moves its own way."""
    for u, h in enumerate(held):
        g = torch.Generator().manual_seed(1000 * step + 10 * u + m)
        h.add_(torch.randn(h.numel(), generator=g), alpha=0.01)


def policy_tensors(p: SyncPolicy) -> list[torch.Tensor]:
    """θ_m, θ_g, b, e and θ̂ of every unit (what must agree bit for bit), and the round counts as a tensor."""
    out = list(p.held)
    for s in p.outer:
        assert s is not None
        out += [s.global_params] + ([s.momentum] if s.momentum is not None else [])
    out += [t for t in p.state.error if t is not None] + [t for t in p.state.eager if t is not None]
    out.append(torch.tensor([s.rounds for s in p.outer if s is not None]))
    return out


def train(cfg: SyncConfig, steps: int, stop_after: Optional[int] = None) -> tuple[list[list[torch.Tensor]], list[dict]]:
    """`steps` fake steps of M replicas; with `stop_after`, each replica's policy is saved after that step
    (torch.save / torch.load) and replaced by a fresh one loaded from it. Returns each replica's final
    policy_tensors and the saved metas."""
    group, metas = _Group(), [{} for _ in range(M)]

    def replica(m: int) -> list[torch.Tensor]:
        held, transport = initial_held(), group.transport(m)
        policy = SyncPolicy(cfg, held, transport)
        for step in range(steps):
            fake_update(held, step, m)
            policy.after_step(step)
            if step == stop_after:
                buf = io.BytesIO()
                torch.save(policy.state_dict(), buf)
                buf.seek(0)
                held = [h.clone() for h in held]  # the engine restores its held shards from its own state
                policy = SyncPolicy(cfg, held, transport)  # the collectives go on in order
                state = torch.load(buf)  # weights_only: plain containers and tensors
                metas[m] = state["meta"]
                policy.load_state_dict(state)
        policy.finish()
        assert not policy.in_flight
        return policy_tensors(policy)

    return in_threads([lambda m=m: replica(m) for m in range(M)]), metas


# ---------------------------------------------------------------- refusals: one line naming the key
BAD: list[tuple[list[str], str]] = [
    (["sync.schedule=streaming"], "sync.schedule"),
    (["sync.schedule=torchft", "sync.every=4", "sync.fragments=2", "sync.delay=2"], "sync.delay"),
    (["sync.alpha=0.5"], "sync.alpha"),  # schedule hsdp: α needs τ >= 1
    (["sync.eager=true"], "sync.eager"),  # needs τ >= 1
    (["sync.eager=true", "sync.delay=1", "sync.alpha=0.5"], "sync.eager"),
    (["sync.eager=true", "sync.delay=1", "elastic.enabled=true", "mesh.sync=2"], "sync.eager"),
    (["sync.method=average", "sync.outer_momentum_warmup=2"], "sync.outer_momentum_warmup"),
    (["sync.method=average", "sync.outer_lr_warmup=2"], "sync.outer_lr_warmup"),
    (["sync.outer_momentum_warmup=-1"], "sync.outer_momentum_warmup"),
    (["sync.outer_lr_schedule=step"], "sync.outer_lr_schedule"),
    (["sync.outer_lr_schedule=cosine"], "sync.outer_lr_rounds"),  # the decay's length is not guessed
    (["sync.outer_lr_schedule=linear", "sync.outer_lr_warmup=3", "sync.outer_lr_rounds=4"], "sync.outer_lr_rounds"),
    (["sync.outer_lr_rounds=10"], "sync.outer_lr_rounds"),  # constant: no decay
    (["sync.outer_min_lr=0.1"], "sync.outer_min_lr"),
    (["sync.outer_lr_schedule=cosine", "sync.outer_lr_rounds=10", "sync.outer_min_lr=0.8"], "sync.outer_min_lr"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[k + ":" + ",".join(o) for o, k in BAD])
def test_bad_combinations_are_refused_with_one_line_naming_the_key(overrides: list[str], key: str):
    base = ["sync.warmup_steps=0", "sync.method=diloco", "sync.every=4"]
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [*base, *overrides]))
    msg = str(err.value)
    assert msg.startswith(key + ":") and "\n" not in msg, msg


def test_good_combinations_pass():
    base = ["sync.warmup_steps=0", "sync.method=diloco", "sync.every=6", "sync.fragments=3"]
    for extra in (
        ["sync.schedule=torchft", "sync.alpha=0.3"],  # α at τ = 0: torchft mixes at every sync
        ["sync.schedule=torchft", "sync.delay=1", "sync.alpha=0.3"],
        ["sync.schedule=torchft", "sync.delay=1", "sync.eager=true"],
        ["sync.delay=4", "sync.eager=true"],  # schedule hsdp: τ < H
        ["sync.outer_momentum_warmup=3", "sync.outer_lr_warmup=2", "sync.outer_lr_schedule=cosine"]
        + ["sync.outer_lr_rounds=10", "sync.outer_min_lr=0.07"],
        ["sync.outer_lr_warmup=2"],  # a warmup alone, then constant
    ):
        validate(load_config(None, [*base, *extra]))


def test_eager_refused_on_a_transport_that_may_fail():
    cfg = SyncConfig(warmup_steps=0, every=4, method="diloco", delay=1, eager=True)
    with pytest.raises(ConfigError, match="^sync.eager:"):
        SyncPolicy(cfg, initial_held(), _Group().transport(0, may_fail=True))


# ---------------------------------------------------------------- timing, η_r, μ_r
def test_torchft_schedule_starts_tau_before_the_slot_and_lands_at_it():
    """P=3, H=6 (slots: fragment 0 after 1, 7, 13; 1 after 3, 9; 2 after 5, 11). torchft's DiLoCo: prepare_sync
    after local step K − τ of each K = H/P, perform_sync after local step K."""
    hsdp = SyncConfig(warmup_steps=0, every=6, fragments=3, method="diloco", delay=1)
    torchft = dataclasses.replace(hsdp, schedule="torchft")
    starts = lambda cfg: {s: fragments_due(s, cfg) for s in range(15) if fragments_due(s, cfg)}  # noqa: E731
    assert starts(hsdp) == {1: [0], 3: [1], 5: [2], 7: [0], 9: [1], 11: [2], 13: [0]}
    assert starts(torchft) == {0: [0], 2: [1], 4: [2], 6: [0], 8: [1], 10: [2], 12: [0], 14: [1]}
    assert all(slots_due(s + 1, torchft) == due for s, due in starts(torchft).items())
    # the tail after fragment 0's last sync (after step 7) of a 12-step run: counted from the start, torchft's
    # Δ was taken a step earlier
    assert steps_after_last_sync(12, hsdp) == 4 and steps_after_last_sync(12, torchft) == 5
    assert steps_after_last_sync(12, dataclasses.replace(torchft, delay=0)) == 4


def test_landing_steps_follow_the_schedule():
    cfg = SyncConfig(warmup_steps=1, every=4, fragments=2, method="diloco", delay=1, schedule="torchft", alpha=0.5)
    group, log = _Group(), [[] for _ in range(M)]

    def replica(m: int) -> None:
        held = initial_held()
        policy = SyncPolicy(cfg, held, group.transport(m))
        for step in range(9):
            fake_update(held, step, m)
            started = policy.after_step(step)
            log[m].append((step, started, list(policy.landed)))

    in_threads([lambda m=m: replica(m) for m in range(M)])
    # w = 1, K = 2: slots 2, 6 (fragment 0) and 4, 8 (fragment 1); torchft starts 1 before each
    assert [s for s, started, _ in log[0] if started] == [1, 3, 5, 7]
    assert {s: landed for s, _, landed in log[0] if landed} == {2: [0], 4: [1], 6: [0], 8: [1]}


def test_outer_lr_and_momentum_per_round_by_hand():
    opt = OuterOptimizer(0.8, 0.9, True, momentum_warmup=2, lr_warmup=2, lr_schedule="cosine", lr_rounds=6, min_lr=0.1)
    got = [opt.at(r) for r in range(8)]
    mus = [0.0, 0.45, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    lrs = [0.4, 0.8, 0.8, 0.1 + 0.35 * (1 + math.cos(math.pi / 3)), 0.1 + 0.35 * (1 + math.cos(2 * math.pi / 3))]
    lrs += [0.1, 0.1, 0.1]  # round 6 (counted from 1) reaches outer_min_lr and stays
    assert [mu for _, mu in got] == pytest.approx(mus) and [lr for lr, _ in got] == pytest.approx(lrs)
    linear = dataclasses.replace(opt, lr_schedule="linear")
    assert [linear.at(r)[0] for r in range(2, 7)] == pytest.approx([0.8, 0.8 - 0.7 / 3, 0.8 - 1.4 / 3, 0.1, 0.1])
    assert not OuterOptimizer(0.7, 0.9, True).per_round and OuterOptimizer(0.7, 0.9, True).at(5) == (0.7, 0.9)
    assert OuterOptimizer(0.7, 0.9, True, lr_warmup=3).at(1) == pytest.approx((0.7 * 2 / 3, 0.9))


# ---------------------------------------------------------------- the merges by hand
def _two_replicas(cfg: SyncConfig, steps: int, probe: Callable[[int, int, SyncPolicy], None]) -> None:
    group = _Group()

    def replica(m: int) -> None:
        held = initial_held()
        policy = SyncPolicy(cfg, held, group.transport(m))
        for step in range(steps):
            probe(m, step, policy)
            fake_update(held, step, m)
            policy.after_step(step)
        probe(m, steps, policy)

    in_threads([lambda m=m: replica(m) for m in range(M)])


def _nesterov(g: torch.Tensor, d: torch.Tensor, lr: float, mu: float) -> torch.Tensor:
    """θ_g after a unit's first outer step (b = Δ): θ_g − η·(Δ + μ·Δ)."""
    return g - lr * (d + mu * d)


def test_torchft_alpha_mixes_at_a_blocking_sync():
    """schedule torchft, τ = 0, α = 0.3: after the sync (step 1), θ_m = θ_g + α·(θ_m − θ_g), θ_g the outer step's."""
    cfg = SyncConfig(warmup_steps=0, every=2, method="diloco", schedule="torchft", alpha=0.3)
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}
    _two_replicas(cfg, 2, lambda m, step, p: seen.__setitem__((m, step), [h.clone() for h in p.held]))
    init = initial_held()
    for m in range(M):
        for u in range(len(SIZES)):
            local = [seen[(k, 1)][u].clone() for k in range(M)]
            for k in range(M):
                fake_update_one(local[k], 1, u, k)
            mean_delta = sum(init[u] - x for x in local) / M
            g = _nesterov(init[u], mean_delta, 0.7, 0.9)
            torch.testing.assert_close(seen[(m, 2)][u], g + 0.3 * (local[m] - g), rtol=1e-6, atol=1e-6)


def fake_update_one(h: torch.Tensor, step: int, u: int, m: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + 10 * u + m)
    h.add_(torch.randn(h.numel(), generator=g), alpha=0.01)


def test_eager_steps_with_its_own_delta_then_swaps_in_the_mean():
    """τ = 2, H = 4: the sync starts after step 3 and lands after step 5. At the start θ_m ← θ̂_m (the outer
    step with Δ_m for the mean); at the land θ_m ← θ_m + (θ_g − θ̂_m), keeping steps 4 and 5."""
    cfg = SyncConfig(warmup_steps=0, every=4, method="diloco", delay=2, eager=True)
    seen: dict[tuple[int, int], list[torch.Tensor]] = {}
    _two_replicas(cfg, 6, lambda m, step, p: seen.__setitem__((m, step), [h.clone() for h in p.held]))
    init = initial_held()
    for u in range(len(SIZES)):
        before = []  # θ_m after step 3's update, before the sync started
        for m in range(M):
            x = seen[(m, 3)][u].clone()
            fake_update_one(x, 3, u, m)
            before.append(x)
        estimates = [_nesterov(init[u], init[u] - before[m], 0.7, 0.9) for m in range(M)]
        g = _nesterov(init[u], sum(init[u] - x for x in before) / M, 0.7, 0.9)
        for m in range(M):
            torch.testing.assert_close(seen[(m, 4)][u], estimates[m], rtol=1e-6, atol=1e-6)  # trains on from θ̂_m
            local = seen[(m, 5)][u].clone()
            fake_update_one(local, 5, u, m)  # θ̂_m + the updates of steps 4 and 5
            torch.testing.assert_close(seen[(m, 6)][u], local + (g - estimates[m]), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- resume bit for bit: each option × every codec
OPTIONS: dict[str, dict[str, Any]] = {
    "torchft": dict(schedule="torchft", delay=1, alpha=0.5),
    "torchft_tau0": dict(schedule="torchft", alpha=0.3),
    "eager": dict(delay=2, eager=True),
    "eager_torchft": dict(schedule="torchft", delay=1, eager=True),
    "per_round": dict(
        delay=1,
        outer_momentum_warmup=2,
        outer_lr_warmup=1,
        outer_lr_schedule="cosine",
        outer_lr_rounds=4,
        outer_min_lr=0.1,
    ),
}
CODECS: dict[str, dict[str, Any]] = {
    "fp32": dict(),
    "int8": dict(quantize="int8", quant_block=64),
    "int4": dict(quantize="int4", quant_block=64),
    "int2": dict(quantize="int2", quant_block=16),
    "topk": dict(topk=0.1, topk_chunk=100),
    "int8_ef": dict(quantize="int8", quant_block=64, error_feedback=True),
    "sparseloco": dict(
        topk=0.05, topk_chunk=64, quantize="int2", quant_block=16, error_feedback=True, error_feedback_decay=0.9
    ),
}
STEPS = 14  # w = 2, H = 4, P = 2: slots 3, 7, 11 (fragment 0) and 5, 9, 13 (fragment 1)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_resume_mid_run_is_bitwise(option: str, codec: str):
    cfg = SyncConfig(warmup_steps=2, every=4, fragments=2, method="diloco", **OPTIONS[option], **CODECS[codec])
    validate(load_config(None, [f"sync.{k}={v}" for k, v in dataclasses.asdict(cfg).items() if v is not None]))
    straight, _ = train(cfg, STEPS)
    assert not all(torch.equal(a, b) for a, b in zip(straight[0], straight[1])), "the replicas differ"
    start = next(s for s in range(6, STEPS) if fragments_due(s, cfg))  # τ >= 1: a sync in flight after it
    for stop in (0, start, start + 1):  # in the warmup (no θ_g yet); after a start; after the next step
        resumed, metas = train(cfg, STEPS, stop_after=stop)
        for m in range(M):
            assert len(resumed[m]) == len(straight[m])
            assert all(torch.equal(a, b) for a, b in zip(resumed[m], straight[m])), (option, codec, stop, m)
        meta = metas[0]
        if stop != start:
            continue
        assert meta["format"] == 2 and all(r >= 1 for r in meta["rounds"]), meta
        if cfg.delay:
            assert meta["in_flight"], meta
        assert bool(meta["eager_units"]) == cfg.eager, meta


def test_rounds_and_eager_estimates_in_the_state_dict():
    """After step 6 (schedule torchft, τ 1, P 2, w 2): fragment 0 (units 0, 2) synced once (slot 3) and is in
    flight again (started after 6, lands after 7); fragment 1 (units 1, 3) synced once (slot 5)."""
    cfg = SyncConfig(warmup_steps=2, every=4, fragments=2, method="diloco", schedule="torchft", delay=1, eager=True)
    _, metas = train(cfg, 8, stop_after=6)
    meta = metas[0]
    assert meta["rounds"] == [1, 1, 1, 1] and meta["eager_units"] == [0, 2]
    assert meta["in_flight"] == [{"fragment": 0, "start": 6, "land": 7}]


def test_check_resume_refuses_what_it_cannot_continue(tmp_path: Path):
    eager = SyncConfig(warmup_steps=0, every=4, method="diloco", delay=1, eager=True)
    plain = dataclasses.replace(eager, eager=False)
    meta: dict[str, Any] = {
        "format": 2,
        "fragments": 1,
        "has_global": True,
        "momentum_units": [0],
        "error_units": [],
        "rounds": [1],
        "eager_units": [0],
        "in_flight": [{"fragment": 0, "start": 7, "land": 8}],
    }
    with pytest.raises(ConfigError, match="^sync.eager:"):
        SyncPolicy.check_resume(meta, 7, eager, plain, tmp_path)
    with pytest.raises(ConfigError, match="^sync.eager:"):
        SyncPolicy.check_resume({**meta, "eager_units": []}, 7, plain, eager, tmp_path)
    SyncPolicy.check_resume(meta, 7, eager, eager, tmp_path)
    old = {k: v for k, v in meta.items() if k not in ("rounds", "eager_units")} | {"format": 1, "in_flight": []}
    warm = dataclasses.replace(plain, outer_momentum_warmup=3)
    with pytest.raises(ConfigError, match="^sync.outer_momentum_warmup:"):
        SyncPolicy.check_resume(old, 7, plain, warm, tmp_path)
    SyncPolicy.check_resume(old, 7, plain, plain, tmp_path)  # format 1 without per-round options: fine


def test_a_format_1_state_loads():
    """A sync state saved before `rounds` and `eager` (format 1): r = 1 where b exists, no eager estimates."""
    cfg = SyncConfig(warmup_steps=0, every=2, method="diloco", fragments=2, delay=1)
    group = _Group()
    policies = in_threads([lambda m=m: SyncPolicy(cfg, initial_held(), group.transport(m)) for m in range(M)])

    def two_steps(m: int) -> dict:
        for step in range(2):
            fake_update(policies[m].held, step, m)
            policies[m].after_step(step)
        return policies[m].state_dict()

    state = in_threads([lambda m=m: two_steps(m) for m in range(M)])[0]
    meta = {k: v for k, v in state["meta"].items() if k not in ("rounds", "eager_units")} | {"format": 1}
    buffers = {k: v for k, v in state["buffers"].items() if k != "eager"}
    fresh = SyncPolicy(cfg, initial_held(), _Group().transport(0))
    fresh.load_state_dict({"meta": meta, "buffers": buffers})
    assert [s.rounds for s in fresh.outer if s is not None] == [1, 0, 1, 0]  # fragment 0 landed after step 1
    assert all(e is None for e in fresh.state.eager) and len(fresh.in_flight) == 1


# ---------------------------------------------------------------- a train.py checkpoint with eager estimates in flight
RESUME = [
    *SMALL,
    "mesh.sync=2",
    "mesh.shard=2",
    "run.steps=12",
    "sync.warmup_steps=2",
    "sync.every=4",
    "sync.fragments=2",
    "sync.method=diloco",
    "sync.schedule=torchft",
    "sync.delay=1",
    "sync.eager=true",
    "sync.outer_momentum_warmup=2",
    "sync.outer_lr_schedule=cosine",
    "sync.outer_lr_rounds=3",
    "sync.outer_min_lr=0.2",
    "run.checkpoint_every=7",  # saves after step 6: fragment 0 in flight (started after 6, lands after 7)
]


def test_train_resumes_with_eager_estimates_in_flight_bit_for_bit(tmp_path: Path):
    import json

    ref = run_train(tmp_path, "ref", RESUME)
    step_6 = ref.run_dir / "checkpoints" / "step_6"
    sync = json.loads((step_6 / "meta.json").read_text())["engine_meta"]["sync"]
    assert sync["in_flight"] == [{"fragment": 0, "start": 6, "land": 7}], sync
    assert sync["eager_units"] == [0, 2] and sync["rounds"] == [1, 1, 1, 1], sync
    resumed = run_train(tmp_path, "resumed", [*RESUME, f"run.resume={step_6}"])
    assert [m["step"] for m in resumed.metrics] == list(range(7, 12))
    ref_loss = {m["step"]: m["loss"] for m in ref.metrics}
    assert [m["loss"] for m in resumed.metrics] == [ref_loss[s] for s in range(7, 12)]
    for m in range(2):
        a, b = resumed.params(m), ref.params(m)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), m
