"""SparseLoCo-style sync (docs/design.md §8.5): decayed error feedback, int2 values, packed indices,
topk_mean all | chosen — the engine's SyncPolicy against the independent reference in sparseloco_reference.py.

The engine side is the real `SyncPolicy` (schedule, codec, outer optimizer, residuals) of M = 3 replicas in
one process, one thread each, over an in-process transport whose all-gather completes once every replica
issued it (tests/loopback.py); between syncs every replica's params take a seeded random "local step". Units of
5000, 4100, 300 and 9 elements with C = 4096 (k = 64: 12-bit indices, a short last chunk, units smaller
than a chunk and one smaller than k). Both sides run 4 syncs of each fragment; after every step the params
of every replica, θ_g and the residuals agree to 1e-6 (relative to the tensor's largest element), and each
replica sent exactly the reference's byte formula. A run on the 2×2 mesh checks the bytes Comm counts.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError, SyncConfig
from hsdp.models.gpt import build_model
from hsdp.sync.policy import SyncPolicy
from tests.helpers import SMALL, run_train
from tests.loopback import ThreadedLoopback, run_in_threads
from tests.sparseloco_reference import SparseReference, SparseSpec, int2_roundtrip, payload_bytes, select
from tests.sync_reference import fragment_due, held_numel

SIZES = [5000, 4100, 300, 9]
M = 3
EVERY, SYNCS = 4, 4


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max()) / scale
    assert err <= 1e-6, f"{what}: {err:.2e}"


CASES = {
    # SparseLoCo: the residual is the only momentum (μ 0, η 1)
    "sparseloco-int2-chosen-P1": dict(quantize="int2", mean="chosen", fragments=1, momentum=0.0, lr=1.0, decay=0.95),
    "sparseloco-int2-all-P2": dict(quantize="int2", mean="all", fragments=2, momentum=0.0, lr=1.0, decay=0.9),
    "sparseloco-fp32-all-P1": dict(quantize="none", mean="all", fragments=1, momentum=0.0, lr=1.0, decay=0.95),
    # MuLoCo: Nesterov outer momentum on top of a decayed residual
    "muloco-fp32-chosen-P2": dict(quantize="none", mean="chosen", fragments=2, momentum=0.9, lr=0.7, decay=0.9),
    "muloco-int2-all-P1": dict(quantize="int2", mean="all", fragments=1, momentum=0.9, lr=0.7, decay=0.9),
}


def _configs(case: dict) -> tuple[SyncConfig, SparseSpec]:
    cfg = SyncConfig(
        warmup_steps=0,
        every=EVERY,
        method="diloco",
        outer_lr=case["lr"],
        outer_momentum=case["momentum"],
        fragments=case["fragments"],
        quantize=case["quantize"],
        quant_block=64,
        topk=64 / 4096,
        topk_chunk=4096,
        error_feedback=True,
        error_feedback_decay=case["decay"],
        topk_mean=case["mean"],
    )
    spec = SparseSpec(
        cfg.topk, 4096, case["quantize"], 64, case["decay"], True, case["mean"], case["lr"], case["momentum"]
    )
    assert spec.k == 64
    return cfg, spec


@pytest.mark.parametrize("name", list(CASES))
def test_policy_matches_reference(name: str):
    torch.set_num_threads(1)
    cfg, spec = _configs(CASES[name])
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=g) for n in SIZES]
    thetas = [[t.clone() for t in init] for _ in range(M)]  # the engine's held shards
    ref_thetas = [[t.clone() for t in init] for _ in range(M)]
    group = ThreadedLoopback(M, gather_only=True)
    policies = [SyncPolicy(cfg, thetas[m], group.transport(m)) for m in range(M)]
    ref = SparseReference(spec, init, M)
    P = cfg.fragments
    want_sent = 0
    syncs = 0
    for step in range(EVERY * SYNCS):
        for m in range(M):  # a local step: the same seeded change on both sides
            for u, n in enumerate(SIZES):
                step_u = torch.randn(n, generator=g) * 1e-2
                thetas[m][u].add_(step_u)
                ref_thetas[m][u].add_(step_u)
        run_in_threads([lambda p=p, s=step: p.after_step(s) for p in policies])
        for f in range(P):
            if fragment_due(step, f, 0, EVERY, P):
                syncs += 1
                for u in range(f, len(SIZES), P):
                    ref.sync_unit(u, ref_thetas)
                    want_sent += payload_bytes(SIZES[u], spec)
        for u in range(len(SIZES)):
            for m in range(M):
                _close(thetas[m][u], ref_thetas[m][u], f"step {step} replica {m} unit {u} θ_m")
                if policies[m].state.error[u] is not None:
                    _close(policies[m].state.error[u], ref.err[m][u], f"step {step} replica {m} unit {u} e_m")
            _close(policies[0].outer[u].global_params, ref.theta_g[u], f"step {step} unit {u} θ_g")
    assert syncs == SYNCS * P
    assert group.sent == [want_sent] * M
    # residuals carried something (fp32 values: only where a unit has more than k elements)
    assert all(float(e.abs().max()) > 0 for e, n in zip(policies[0].state.error, SIZES) if n > 64)


def test_reference_pieces_by_hand():
    """The reference's own pieces on values worked by hand (it must be right for the comparison to mean
    anything): ties to the lowest index, −0 ties 0, int2's levels and threshold tie, the byte formula."""
    assert select(torch.tensor([1.0, -3.0, 3.0, 0.5, -0.0, 0.0]), 3, 2) == [1, 2, 3, 4]
    v = torch.tensor([1.0, -2.0, 3.0, -5.0, 4.0, 4.0, -4.0, 4.0])
    # block 1: lo 1, hi 5, d 2, t 3: levels 2 and 4 (|3| ≥ t takes the upper); block 2: one magnitude, exact
    assert int2_roundtrip(v, 4).tolist() == [2.0, -2.0, 4.0, -4.0, 4.0, 4.0, -4.0, 4.0]
    spec = SparseSpec(64 / 4096, 4096, "int2", 64, 0.9, True, "all", 1.0, 0.0)
    # 5000 elements: chunks of 4096 and 904, 64 + 64 = 128 selected: 128·12 bits = 192 bytes, 32 + 8·2
    assert payload_bytes(5000, spec) == 192 + 32 + 16
    assert payload_bytes(9, spec) == math.ceil(9 * 12 / 8) + 3 + 8


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("error_feedback_decay", 1.5),
        ("topk_mean", "some"),
        ("quant_block", 6),
    ],
)
def test_bad_values_are_refused(key: str, value):
    overrides = ["sync.warmup_steps=0", "sync.topk=0.01", "sync.quantize=int2", "sync.error_feedback=true"]
    with pytest.raises(ConfigError, match=f"sync.{key}"):
        load_config(None, [*overrides, f"sync.{key}={value}"])  # loading validates


def test_decay_without_error_feedback_and_chosen_without_topk_are_refused():
    with pytest.raises(ConfigError, match="sync.error_feedback_decay"):
        load_config(None, ["sync.topk=0.01", "sync.error_feedback_decay=0.9"])
    with pytest.raises(ConfigError, match="sync.topk_mean"):
        load_config(None, ["sync.quantize=int8", "sync.topk_mean=chosen"])


# ---------------------------------------------------------------- the bytes Comm counts on the 2×2 mesh
SPARSE_RUN = [
    "sync.warmup_steps=3",
    "sync.every=4",
    "run.steps=7",
    "sync.method=diloco",
    "sync.outer_lr=1.0",
    "sync.outer_momentum=0",
    "sync.topk=0.03",
    "sync.topk_chunk=1024",
    "sync.quantize=int2",
    "sync.quant_block=32",
    "sync.error_feedback=true",
    "sync.error_feedback_decay=0.95",
    "sync.topk_mean=chosen",
    "sync.fragments=2",
]


def test_sync_bytes_on_the_wire_equal_the_formula(tmp_path):
    """train.py on 2 replicas × 2 shard ranks: each step's sync_bytes (Comm's count) is the formula exactly."""
    run = run_train(tmp_path, "sparse", [*SMALL, *SPARSE_RUN, "mesh.sync=2", "mesh.shard=2"])
    cfg = load_config(None, [*SMALL, *SPARSE_RUN])
    sc = cfg.sync
    spec = SparseSpec(sc.topk, sc.topk_chunk, sc.quantize, sc.quant_block, sc.error_feedback_decay, True, "", 1, 0)

    sizes = [sum(held_numel(p.shape, 2) for p in unit.parameters()) for unit in build_model(cfg.model, 0).units]
    want = []
    for _ in range(sc.warmup_steps):
        want.append(sum(2 * (2 - 1) * 4 * n // 2 for n in sizes))  # fp32 grad all-reduce during the warmup
    for s in range(sc.warmup_steps, cfg.run.steps):
        b = 0
        for f in range(sc.fragments):
            if fragment_due(s, f, sc.warmup_steps, sc.every, sc.fragments):
                b += sum((2 - 1) * payload_bytes(sizes[u], spec) for u in range(f, len(sizes), sc.fragments))
        want.append(b)
    cum = [m["sync_bytes"] for m in run.metrics]
    assert [b - a for a, b in zip([0, *cum], cum)] == want
    assert sum(1 for m in run.metrics if m["synced"]) == 2  # fragment 0 after step 4, fragment 1 after step 6
    assert all(math.isfinite(m["loss"]) for m in run.metrics)


# ---------------------------------------------------------------- elastic: residuals of dropped / spectated rounds
class _Scripted(ThreadedLoopback):
    """The loopback as a transport that may fail: round r commits iff commits[r], and counts this replica's
    part iff counted[r] (False: it spectates)."""

    def __init__(self, M: int, commits: list[bool], counted: list[bool]) -> None:
        super().__init__(M, gather_only=True)
        self.commits, self.counted_script = commits, counted

    def transport(self, m: int):
        inner, script = super().transport(m), self
        rounds = [-1]

        class Transport(type(inner)):
            may_fail = True
            counted = True

            def begin_round(self) -> None:
                rounds[0] += 1
                self.counted = script.counted_script[rounds[0]]

            def commit_round(self) -> bool:
                return script.commits[rounds[0]]

        return Transport()


def test_elastic_residuals_change_only_in_rounds_that_applied_them():
    """A dropped round leaves every residual bitwise as before it (θ_g too); a committed round this replica
    spectated applies the peers' mean (θ_g moves) and leaves its residual as before; a counted round updates it."""
    torch.set_num_threads(1)
    cfg, _ = _configs(CASES["sparseloco-int2-chosen-P1"])
    commits = [True, False, True, True]
    counted = [True, True, False, True]
    group = _Scripted(2, commits, counted)
    g = torch.Generator().manual_seed(1)
    thetas = [[torch.randn(n, generator=g) for n in SIZES[:2]] for _ in range(2)]
    thetas[1] = [t.clone() for t in thetas[0]]
    policies = [SyncPolicy(cfg, thetas[m], group.transport(m)) for m in range(2)]
    for r in range(4):
        for m in range(2):
            for t in thetas[m]:
                t.add_(torch.randn(t.numel(), generator=g) * 1e-2)
        before_e = [[None if e is None else e.clone() for e in p.state.error] for p in policies]
        before_g = [s.global_params.clone() for s in policies[0].outer]
        step = EVERY * (r + 1) - 1
        run_in_threads([lambda p=p, s=step: p.after_step(s) for p in policies])
        for m, p in enumerate(policies):
            same_e = all(b is not None and torch.equal(e, b) for e, b in zip(p.state.error, before_e[m]))
            zero_e = all(float(e.abs().max()) == 0 for e in p.state.error)
            moved_g = not all(torch.equal(s.global_params, b) for s, b in zip(p.outer, before_g))
            if r == 0:  # the first round: residuals allocated and filled
                assert not zero_e and moved_g
            elif not commits[r]:
                assert same_e and not moved_g, r
            elif not counted[r]:
                assert same_e and moved_g, r
            else:
                assert not same_e and moved_g, r
        assert policies[0].dropped == (0 if r < 1 else 1)


def test_a_healed_replica_gets_no_residual_from_its_peer():
    """HealState sends a peer's params, optimizer and θ_g / momentum, not its residuals: a restarted
    replica's residuals are zero from its next sync (docs/design.md §9)."""
    from types import SimpleNamespace

    from hsdp.sync.elastic.heal import HealState
    from hsdp.sync.elastic.phase import Phase
    from hsdp.sync.seam import ReplicaState

    cfg, _ = _configs(CASES["sparseloco-int2-chosen-P1"])
    helds = [torch.randn(n) for n in SIZES[:2]]
    policy = SyncPolicy(cfg, helds, ThreadedLoopback(1, gather_only=True).transport(0))
    for h in helds:
        h.add_(torch.randn(h.numel()) * 1e-2)  # a local step
    policy.after_step(EVERY - 1)  # one sync (M = 1): residuals now non-zero
    assert all(e is not None and float(e.abs().max()) > 0 for e in policy.state.error)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    life = SimpleNamespace(phase=Phase.TRAINING, has_trained=True)
    source = HealState(life)
    source.state = ReplicaState(helds, opt, policy)
    state = source.full_state()
    assert state["policy"]["buffers"]["error"] == [None, None] and state["policy"]["meta"]["error_units"] == []
    assert policy.state.error[0] is not None  # the peer keeps its own
    fresh = SyncPolicy(cfg, [torch.zeros(n) for n in SIZES[:2]], ThreadedLoopback(1, gather_only=True).transport(0))
    fresh.state.error = [torch.ones(n) for n in SIZES[:2]]  # whatever it held before it died
    target = HealState(life)
    target.state = ReplicaState(
        [torch.zeros(n) for n in SIZES[:2]], torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), fresh
    )
    target.load_full(state)
    assert fresh.state.error == [None, None]
    assert all(torch.equal(a.global_params, b.global_params) for a, b in zip(fresh.outer, policy.outer))


SPARSELOCO = [
    "sync.outer_lr=1.0",
    "sync.outer_momentum=0",
    "sync.topk=0.0156",
    "sync.topk_chunk=4096",
    "sync.quantize=int2",
    "sync.quant_block=64",
    "sync.error_feedback=true",
    "sync.error_feedback_decay=0.95",
    "sync.topk_mean=chosen",
]


def test_elastic_sparseloco_run_survives_a_killed_replica(tmp_path):
    """tests/test_elastic.py's kill case (2 replicas × 1, replica 1 SIGKILLed at its round 2, restarted, healed
    at a param sync) with SparseLoCo's codec: the run finishes, the replicas end bitwise equal (they adopt θ_g
    at the final sync), and the survivor dropped no round."""
    from tests.test_elastic import (
        ELASTIC,
        KILL,
        KILL_RUN_STEPS,
        _finish,
        _params,
        _records,
        _replicas,
        _start,
        kill_faults,
    )

    run_dir = tmp_path / "sparse"
    overrides = ELASTIC + KILL + SPARSELOCO + ["mesh.sync=2", "mesh.shard=1", f"run.steps={KILL_RUN_STEPS}"]
    proc = _start(run_dir, overrides + kill_faults(2, 2))
    code, err = _finish(proc)
    assert code == 0, err[-3000:]
    assert _replicas(run_dir)["1"]["restarts"] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 1 and summary["heals"] >= 1
    assert summary["dropped_syncs"]["0"] == 0
    assert all(math.isfinite(r["loss"]) for m in (0, 1) for r in _records(run_dir, m))
    a, b = _params(run_dir, 0), _params(run_dir, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
