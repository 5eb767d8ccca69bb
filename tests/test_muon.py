"""Muon on row-sharded matrices (hsdp/models/muon.py) against torch.optim.Muon + torch.optim.AdamW.

- The optimizer alone, on a simulated shard group (S optimizers in threads, their exchanges done in memory):
  over generated matrix shapes, group sizes and both exchanges, every rank's rows equal torch's, bit for bit.
- Whole runs, exact HSDP on 1×1, 2×2, 1×4 and 4×1 (and ddp; fsdp2, where the same optimizer is torch's math on
  DTensors): every step's loss equals a one-process run of
  torch's own optimizers on the same batches (tests/reference.py) to 1e-4 relative; the compiled step equals
  eager; the checkpoint carries the momentum (bitwise continuation; another shard size resumes it).
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsdp.config.schema import ConfigError, OptimConfig
from hsdp.models.muon import MuonAdamW, RowSharding, assign_owners
from hsdp.models.optim import build_optimizer
from hsdp.run.preflight import load_checked_config
from tests.exactness import COMMON as EXACTNESS_COMMON
from tests.exactness import loss_gap, losses
from tests.helpers import RunResult, max_param_rel_err, run_train
from tests.reference import reference_run
from tests.sync_reference import sync_reference_run
from tests.test_checkpoint import assert_same_run
from tests.test_outer_options import in_threads

pytestmark = pytest.mark.timeout(900)


# ---------------------------------------------------------------- the optimizer on a simulated shard group
class ThreadGroup:
    """S ranks as threads: each collective waits for all S, then hands every rank its share (Comm's two calls)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.inputs: list[Any] = [None] * size

    def comm(self, rank: int) -> Any:
        group = self

        class RankComm:
            def all_to_all(self, out, inp, out_splits, in_splits, name):  # noqa: ANN001, ARG002
                group.inputs[rank] = (inp.clone(), list(in_splits))
                group.barrier.wait()
                pieces = []
                for src in range(group.size):
                    sent, splits = group.inputs[src]
                    start = sum(splits[:rank])
                    pieces.append(sent[start : start + splits[rank]])
                out.copy_(torch.cat(pieces))
                assert [p.numel() for p in pieces] == list(out_splits)
                group.barrier.wait()

            def all_gather(self, out, inp, name):  # noqa: ANN001, ARG002
                group.inputs[rank] = inp.clone()
                group.barrier.wait()
                out.copy_(torch.cat(group.inputs))
                group.barrier.wait()

        return RankComm()


MUON = OptimConfig(name="muon", lr=3e-3, muon_lr=0.02)


@settings(max_examples=25, deadline=None, database=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 24)), min_size=1, max_size=5),
    size=st.integers(1, 4),
    exchange=st.sampled_from(["owner", "gather"]),
    nesterov=st.booleans(),
    adjust=st.sampled_from(["original", "match_rms_adamw"]),
    seed=st.integers(0, 2**16),
)
def test_sharded_rows_equal_torch_muon(
    shapes: list[tuple[int, int]], size: int, exchange: str, nesterov: bool, adjust: str, seed: int
) -> None:
    """Three steps of S ranks, each holding its ⌈d0/S⌉ rows of every matrix, give torch's params bit for bit."""
    g = torch.Generator().manual_seed(seed)
    names = [f"units.1.mlp.w{i}.weight" for i in range(len(shapes))]
    full = [torch.randn(*s, generator=g) for s in shapes]
    grads = [[torch.randn(*s, generator=g) for s in shapes] for _ in range(3)]
    cfg = OptimConfig(name="muon", lr=3e-3, muon_nesterov=nesterov, muon_adjust_lr=adjust, muon_exchange=exchange)

    ref = [torch.nn.Parameter(t.clone()) for t in full]
    torch_muon = torch.optim.Muon(
        ref, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust
    )
    for step_grads in grads:
        for p, gr in zip(ref, step_grads):
            p.grad = gr.clone()
        torch_muon.step()

    group = ThreadGroup(size)
    held: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def rank_work(r: int) -> None:
        def rows(t: torch.Tensor) -> torch.Tensor:
            n = -(-t.shape[0] // size)
            return t[r * n : (r + 1) * n].clone()

        params = [torch.nn.Parameter(rows(t)) for t in full]
        sharding = RowSharding(dict(zip(names, (torch.Size(s) for s in shapes))), group.comm(r), "shard", size, r)
        opt = build_optimizer(list(zip(names, params)), cfg, sharding)
        assert isinstance(opt, MuonAdamW)
        for step_grads in grads:
            for p, gr in zip(params, step_grads):
                p.grad = rows(gr)
            opt.step()
        held[r] = [p.detach() for p in params]

    in_threads([functools.partial(rank_work, r) for r in range(size)])
    for i, p in enumerate(ref):
        assert torch.equal(torch.cat([held[r][i] for r in range(size)]), p.detach()), f"matrix {i} {shapes[i]}"


def test_owners_spread_the_iterations() -> None:
    """Largest first to the least-loaded rank: four equal matrices on 4 ranks, one each; one big and three
    small on 2 ranks, the big one alone."""
    square = torch.Size([8, 8])
    assert sorted(assign_owners([square] * 4, 4)) == [0, 1, 2, 3]
    assert assign_owners([torch.Size([4, 4]), torch.Size([32, 32]), torch.Size([4, 4]), torch.Size([4, 4])], 2) == [
        1,
        0,
        1,
        1,
    ]


# ---------------------------------------------------------------- whole runs against torch's own optimizers
COMMON = [
    *EXACTNESS_COMMON,  # synthetic data, a record every step, the final params saved
    "model.n_layer=2",
    "model.d_model=32",
    "model.n_head=2",
    "model.seq_len=16",
    "model.vocab_size=96",
    "data.batch_size=2",
    "run.steps=6",
    "optim.name=muon",
    "optim.lr_warmup=2",
]
LOSS_TOLERANCE = 1e-4  # relative, per step (Newton–Schulz runs in bf16: one rounding flip moves the loss ~1e-6)


def reference_losses(world: int, extra: list[str]) -> list[float]:
    ref, _ = reference_run([*COMMON, *extra, "mesh.sync=1", "mesh.shard=1"], world)
    return ref


@pytest.mark.parametrize(
    "sync,shard,engine",
    [(1, 1, "hsdp"), (2, 2, "hsdp"), (1, 4, "hsdp"), (4, 1, "hsdp"), (2, 1, "ddp"), (1, 2, "fsdp2")],
)
def test_exact_hsdp_muon_equals_torch(sync: int, shard: int, engine: str, tmp_path: Path) -> None:
    extra = ["optim.muon_adjust_lr=match_rms_adamw"] if shard == 4 else []
    mesh = [f"mesh.sync={sync}", f"mesh.shard={shard}", f"mesh.engine={engine}"]
    run = run_train(tmp_path, "m", [*COMMON, *extra, *mesh])
    ref = reference_losses(sync * shard, extra)
    gap = loss_gap(losses(run), ref)
    assert gap <= LOSS_TOLERANCE, f"{sync}x{shard} {engine}: {losses(run)} vs torch {ref} (gap {gap:.2e})"
    if shard > 1 and engine == "hsdp":  # the extra exchanges are counted in the shard group's bytes
        assert run.summary["comm"]["shard/all_to_all"]["bytes"] > 0


def test_gather_exchange_trains_the_same_model(tmp_path: Path) -> None:
    """optim.muon_exchange=gather (every rank orthogonalizes every matrix) gives owner's params bit for bit."""
    mesh = ["mesh.sync=1", "mesh.shard=4"]
    owner = run_train(tmp_path, "owner", [*COMMON, *mesh])
    gather = run_train(tmp_path, "gather", [*COMMON, *mesh, "optim.muon_exchange=gather"])
    assert losses(owner) == losses(gather)
    assert max_param_rel_err(owner.params(0), gather.params(0)) == 0.0
    assert "shard/all_to_all" not in gather.summary["comm"]


# ---------------------------------------------------------------- checkpoints, the heal's state
# (Compiled ≡ eager with Muon: tests/exactness.py draws optim.name=muon among its configurations.)
@pytest.fixture(scope="module")
def eager_2x2(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """6 Muon steps on 2x2, a checkpoint after steps 2 and 5: the reference of the runs below."""
    out = tmp_path_factory.mktemp("muon")
    return run_train(out, "eager", [*COMMON, *MESH_2X2, "run.checkpoint_every=3", "run.keep_checkpoints=5"])


MESH_2X2 = ["mesh.sync=2", "mesh.shard=2"]


def test_checkpoint_carries_the_momentum(eager_2x2: RunResult) -> None:
    """Resumed after step 2 on the same mesh: bit for bit; on 2x1 (another shard size, the same global batch):
    within the tolerance of a resharded run (the grads sum in another order)."""
    out, step_2 = eager_2x2.run_dir.parent, eager_2x2.run_dir / "checkpoints" / "step_2"
    same = run_train(out, "same", [*COMMON, *MESH_2X2, f"run.resume={step_2}"])
    assert_same_run(same, eager_2x2, from_step=3)
    other = run_train(out, "2x1", [*COMMON, "mesh.sync=2", "mesh.shard=1", "data.batch_size=4", f"run.resume={step_2}"])
    assert loss_gap(losses(other), losses(eager_2x2)[3:]) <= LOSS_TOLERANCE


def test_the_heal_state_carries_the_momentum() -> None:
    """An elastic heal sends `optimizer.state_dict()` and the healed replica loads it (hsdp/sync/elastic/heal.py):
    a fresh MuonAdamW loading a trained one's state continues it bit for bit."""
    torch.manual_seed(0)
    shapes = {"units.1.attn.qkv.weight": (12, 4), "units.1.ln1.weight": (4,), "units.2.lm_head.weight": (5, 4)}

    def params() -> list[tuple[str, torch.nn.Parameter]]:
        g = torch.Generator().manual_seed(1)
        return [(n, torch.nn.Parameter(torch.randn(*s, generator=g))) for n, s in shapes.items()]

    def step(opt: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()

    a, b = params(), params()
    opt_a = build_optimizer(a, MUON)
    for s in range(3):
        step(opt_a, a, s)
    assert "momentum_buffer" in opt_a.state[a[0][1]]
    with torch.no_grad():
        for (_, pa), (_, pb) in zip(a, b):
            pb.copy_(pa)
    opt_b = build_optimizer(b, MUON)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    step(opt_a, a, 7)
    step(opt_b, b, 7)
    assert all(torch.equal(pa, pb) for (_, pa), (_, pb) in zip(a, b))


@pytest.mark.parametrize(
    "overrides,names",
    [
        (["optim.muon_lr=0.05"], "optim.muon_lr: only used by optim.name=muon"),
        (["optim.muon_exchange=gather", "optim.name=sgd"], "optim.muon_exchange: only used by optim.name=muon"),
        (["optim.name=muon", "optim.muon_momentum=1.0"], "optim.muon_momentum: expected a value in [0, 1)"),
        (["optim.name=muon", "optim.muon_ns_steps=0"], "optim.muon_ns_steps: expected an integer >= 1"),
        (["optim.name=muon", "optim.muon_adjust_lr=rms"], "optim.muon_adjust_lr: expected one of"),
    ],
)
def test_what_does_not_apply_is_refused_in_one_line(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_checked_config(None, overrides)
    assert str(e.value).startswith(names) and "\n" not in str(e.value), str(e.value)


def test_muloco_with_int4_error_feedback_and_streaming_equals_torch(tmp_path: Path) -> None:
    """MuLoCo on 2x1: Muon inner, DiLoCo outer on two streamed fragments with int4 Δ and error feedback and a cosine
    outer LR, against tests/sync_reference.py's plain-torch replicas (torch.optim.Muon + AdamW each). One rank per
    replica: its grads are the reference's bit for bit, so a quantizer's level is never chosen the other way by a
    bf16 rounding flip of the Newton–Schulz input (sharding's own exactness: the exact-HSDP tests above)."""
    overrides = [
        *COMMON,
        "mesh.sync=2",
        "mesh.shard=1",
        "sync.warmup_steps=1",
        "sync.method=diloco",
        "sync.every=2",
        "sync.fragments=2",
        "sync.quantize=int4",
        "sync.error_feedback=true",
        "sync.outer_lr_schedule=cosine",
        "sync.outer_lr_rounds=4",
        "run.steps=9",
    ]
    run = run_train(tmp_path, "muloco", overrides)
    ref = sync_reference_run(overrides, 2, 1)
    gap = loss_gap(losses(run), ref.losses)
    assert gap <= LOSS_TOLERANCE, f"{losses(run)} vs the reference's {ref.losses} (gap {gap:.2e})"


def test_a_killed_muon_replica_heals_with_its_momentum_and_ends_equal(tmp_path: Path) -> None:
    """An elastic MuLoCo run: replica 1 dies before its second round, restarts and heals from replica 0 (the
    optimizer's state_dict with the Muon matrices' momentum crosses, MuonAdamW.__setstate__), and the run ends on
    one model: both replicas' final params bitwise equal."""
    overrides = [
        *COMMON,
        "mesh.sync=2",
        "mesh.shard=1",
        "elastic.enabled=true",
        "elastic.timeout_s=3",
        "elastic.restart_delay_s=0.5",
        "sync.warmup_steps=0",
        "sync.method=diloco",
        "sync.every=4",
        "run.steps=16",
        "elastic.faults=1@2:before_quorum:die",
    ]
    run = run_train(tmp_path, "elastic", overrides, timeout=300)
    replicas = json.loads((run.run_dir / "replicas.json").read_text())
    assert replicas["1"]["restarts"] == 1, replicas
    assert json.loads((run.run_dir / "summary.replica1.json").read_text())["heals"] >= 1
    a, b = run.params(0), run.params(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
