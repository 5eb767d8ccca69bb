"""Exactness as a property: generated configurations, each trained by every path that should agree with another.

A configuration (`Case`) is drawn by Hypothesis (`cases()`) over the shapes a user reaches (seq_len, batch,
d_model, heads, layers, vocab, mesh, warmup → DiLoCo, grad_accum, SGD or Muon + AdamW), with extra weight on the
coincidences where two of the step's buffers have one size (tokens per rank = vocab: the shape at which torch
2.13 lowered a nested compile region's backward over a live buffer and trained another model, hsdp/torch_compat.py
`keep_region_inputs_undonated`). `check_case` trains it with the eager hsdp engine and compares, per step's loss
and the final params of every replica:

- compiled ≡ eager, both compile scopes (compile.scope=step with its nested compile region, and blocks; the suite's
  one compiled draw the step scope only, the scope that trained another model);
- sharded ≡ unsharded: exact HSDP (no DiLoCo phase) against tests/reference.py's one-process plain-torch run on
  the concatenated batch; with a DiLoCo phase, against tests/sync_reference.py's one-process plain-torch
  simulation of the M replicas (each on its shard group's rows);
- the engines ≡ each other: fsdp2 and ddp (exact HSDP only: they have no periodic sync) against hsdp.

tests/test_exactness.py runs a few cases in the suite; scripts/exactness_sweep.py runs many and writes
docs/results/exactness.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from hypothesis import strategies as st

from tests.helpers import RunResult, max_param_rel_err, run_train
from tests.reference import reference_run
from tests.sync_reference import sync_reference_run

# SGD with momentum: its update is linear in the grad, so two paths' params differ by what fp32 reordering puts
# into the grads (AdamW turns the sign of a near-zero grad's rounding noise into lr-sized steps: tests/test_compile.py).
SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.3", "optim.min_lr=0.03", "optim.lr_warmup=1"]
COMMON = [
    "data.source=synthetic",
    "run.log_every=1",
    "run.eval_every=0",
    "run.eval_batches=1",
    "run.checkpoint_every=0",
    "run.save_model=true",
    "wandb.mode=disabled",
    "model.bias=false",  # the attention key bias's grad is zero up to rounding: noise, not a difference of paths
    "optim.grad_clip=1.0",
]
# Muon (hsdp/models/muon.py) for the blocks' matrices and AdamW for the rest: Newton–Schulz runs in bf16, so two
# paths whose grads differ by fp32 reordering may round an element of its input the other way, and AdamW turns
# rounding noise into lr-sized steps; its cases compare every step's loss, to MUON_TOLERANCE.
MUON = ["optim.name=muon", "optim.lr_warmup=1"]
TOLERANCE = 1e-5  # relative, per step's loss and per param (max |a-b| / max |b|)
MUON_TOLERANCE = 1e-4  # relative, per step's loss
MESHES = [(2, 2), (1, 1), (1, 2), (2, 1), (1, 4), (4, 1)]  # (sync, shard): at most 4 processes


@dataclass(frozen=True)
class Case:
    """One generated configuration."""

    seq_len: int
    batch: int
    heads: int
    head_dim: int
    layers: int
    vocab: int
    sync: int
    shard: int
    warmup: Optional[int]  # sync.warmup_steps (None: exact HSDP every step)
    every: int  # sync.every (the DiLoCo rounds after the warmup)
    accum: int  # optim.grad_accum
    steps: int
    optim: str = "sgd"  # sgd | muon

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    def overrides(self) -> list[str]:
        warmup = "null" if self.warmup is None else str(self.warmup)
        return [
            *COMMON,
            *(MUON if self.optim == "muon" else SGD),
            f"model.seq_len={self.seq_len}",
            f"data.batch_size={self.batch}",
            f"model.n_head={self.heads}",
            f"model.d_model={self.d_model}",
            f"model.n_layer={self.layers}",
            f"model.vocab_size={self.vocab}",
            f"mesh.sync={self.sync}",
            f"mesh.shard={self.shard}",
            f"sync.warmup_steps={warmup}",
            "sync.method=diloco",
            f"sync.every={self.every}",
            f"optim.grad_accum={self.accum}",
            f"run.steps={self.steps}",
        ]

    @property
    def exact_hsdp(self) -> bool:
        """Grads averaged across replicas every step (no periodic phase): one model, like one process's."""
        return self.warmup is None or self.sync == 1


@st.composite
def cases(draw: Callable[..., Any]) -> Case:
    """A configuration over the shapes users reach; a third of them with vocab = tokens per rank.

    Each list's first value is what Hypothesis draws first and shrinks towards, so its first (simplest) case
    is a meaningful one: 2x2, two identical blocks, vocab = tokens per rank (the size coincidence above).
    """
    seq_len = draw(st.sampled_from([16, 8, 12, 17, 24, 32, 64]))
    batch = draw(st.sampled_from([2, 1, 3, 4, 5, 8]))
    heads = draw(st.sampled_from([2, 1, 4]))
    head_dim = draw(st.sampled_from([8, 4, 16, 32]))
    layers = draw(st.sampled_from([2, 1, 3]))  # ≥ 2 identical blocks: compile.regional's shared region
    sync, shard = draw(st.sampled_from(MESHES))
    tokens = seq_len * batch
    vocab = draw(st.one_of(st.just(tokens), st.integers(17, 600))) if tokens >= 17 else draw(st.integers(17, 600))
    diloco = sync > 1 and draw(st.booleans())
    warmup = draw(st.integers(0, 2)) if diloco else None
    every = draw(st.integers(1, 2))
    accum = draw(st.sampled_from([1, 2]))
    steps = (warmup or 0) + 2 * every if diloco else 3
    optim = draw(st.sampled_from(["sgd", "muon"]))
    return Case(seq_len, batch, heads, head_dim, layers, vocab, sync, shard, warmup, every, accum, steps, optim)


def losses(run: RunResult) -> list[float]:
    return [m["loss"] for m in run.metrics]


def loss_gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' per-step losses."""
    assert len(a) == len(b), f"{len(a)} steps against {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def params_gap(a: RunResult, b: RunResult, replicas: int, case: Optional[Case] = None) -> float:
    """The largest relative difference of any param of any replica (model.replica{m}.pt); 0 for Muon (compared by
    its losses)."""
    if case is not None and case.optim == "muon":
        return 0.0
    return max(max_param_rel_err(a.params(m), b.params(m)) for m in range(replicas))


def reference_gap(run: RunResult, case: Case) -> float:
    """hsdp (exact HSDP) against the one-process plain-torch run on the concatenated batch: losses and params."""
    world = case.sync * case.shard
    ref_losses, ref_params = reference_run([*case.overrides(), "mesh.sync=1", "mesh.shard=1"], world)
    mine = {k.removeprefix("units."): v for k, v in run.params(0).items()}
    ref = {k.removeprefix("units."): v for k, v in ref_params.items()}
    params = 0.0 if case.optim == "muon" else max_param_rel_err(mine, ref)
    return max(loss_gap(losses(run), ref_losses), params)


def sync_reference_gap(run: RunResult, case: Case) -> float:
    """hsdp with a DiLoCo phase against the one-process plain-torch simulation of its M replicas: per-step loss
    (the replicas' mean) and every replica's final params."""
    ref = sync_reference_run(case.overrides(), case.sync, case.shard)
    gap = loss_gap(losses(run), ref.losses)
    for m in range(case.sync if case.optim != "muon" else 0):
        mine = {k.removeprefix("units."): v for k, v in run.params(m).items()}
        gap = max(gap, max_param_rel_err(mine, {k.removeprefix("units."): v for k, v in ref.params[m].items()}))
    return gap


def check_case(
    case: Case,
    out: Path,
    compiled: bool = True,
    record: Optional[Path] = None,
    scopes: tuple[str, ...] = ("step", "blocks"),
) -> dict[str, float]:
    """Train `case` on every path that must agree with eager hsdp (compiled: on each of `scopes`); each gap
    (relative) by path name.

    Raises AssertionError naming the case and the path whose gap passes TOLERANCE.
    """
    name = "-".join(str(v) for v in asdict(case).values())
    overrides = case.overrides()
    eager = run_train(out, f"{name}-eager", overrides)
    gaps: dict[str, float] = {}

    def against(path: str, extra: list[str]) -> None:
        other = run_train(out, f"{name}-{path}", overrides + extra, timeout=900)
        gaps[path] = max(loss_gap(losses(other), losses(eager)), params_gap(other, eager, case.sync, case))

    for scope in scopes if compiled else ():
        against(scope, ["compile.enabled=true", f"compile.scope={scope}"])
    if case.exact_hsdp:
        gaps["unsharded"] = reference_gap(eager, case)
        against("fsdp2", ["mesh.engine=fsdp2"])
        against("ddp", ["mesh.engine=ddp"])
    else:  # periodic sync: tests/sync_reference.py's M plain-torch replicas, each on its shard group's rows
        gaps["unsharded"] = sync_reference_gap(eager, case)
    if record is not None:
        with record.open("a") as f:
            f.write(json.dumps({"case": asdict(case), "gaps": gaps}) + "\n")
    tolerance = MUON_TOLERANCE if case.optim == "muon" else TOLERANCE
    worst = {p: g for p, g in gaps.items() if not g <= tolerance}  # NaN fails too
    assert not worst, f"{case}: {worst} > {tolerance} (eager hsdp's losses {losses(eager)})"
    return gaps
