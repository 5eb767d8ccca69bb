"""The compiled HSDP path's step scope (compile.scope=step) against the eager engine (CPU, gloo, inductor).

Each compiled run is one train.py process (one cold compile); the checks share
those runs through module-scoped fixtures to keep the suite's budget.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import SMALL, STEP_SCOPE, RunResult, assert_prefetch, max_param_rel_err, run_train, schedules

# The module's fixtures run 7 train.py processes (4 compiled) once for all its checks; on a loaded 2-core box
# that setup alone can pass pytest's default 600 s, so this module gets more.
pytestmark = pytest.mark.timeout(1800)

STEPS = 10
# Every run here trains with SGD (momentum 0.9): its update is linear in the gradient, so two runs' params
# differ by lr·Σ δgrad, what fp32 reordering puts into the grads. AdamW instead scales each coordinate's
# update to about lr whatever the gradient's size, so on rarely hit coordinates (embedding rows) whose tiny,
# cancellation-dominated grads differ in sign between two summation orders it turns reordering noise into
# lr-sized param differences that depend on the CPU's vector width (2e-5 of a tensor's max on one AMD CPU,
# under 1e-5 on another). The compiled graph computes the grads; the optimizer is the same torch code in both.
SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.3", "optim.min_lr=0.03"]
DILOCO = ["sync.warmup_steps=3", "sync.every=4", "sync.method=diloco", "run.steps=15", "mesh.sync=2", "mesh.shard=2"]
UNITS_NEEDING_WEIGHTS = 2 + 1  # SMALL's blocks and the head; the embedding's backward needs only the ids


def _pair(tmp: Path, name: str, overrides: list[str], compiled: list[str]) -> tuple[RunResult, RunResult]:
    eager = run_train(tmp, f"{name}-eager", overrides)
    compiled = run_train(tmp, f"{name}-compiled", overrides + compiled, timeout=900)
    return eager, compiled


BASE = SMALL + SGD + [f"run.steps={STEPS}", "mesh.sync=1", "mesh.shard=2"]
BF16 = ["precision.param_dtype=bf16", "precision.reduce_dtype=bf16"]
ACCUM = "optim.grad_accum=2"
# the step scope is what this module tests; bf16 at prefetch 1
COMPILED_BF16 = [*STEP_SCOPE, "compile.passes=ours", "compile.prefetch=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunResult, RunResult]]:
    """(eager, compiled) pairs, each compiled with another scheduling: our passes at prefetch 2 and 1,
    inductor's passes (the ablation). compile.passes=none (the traced order) is tests/test_llama.py's compiled
    run; our passes with buckets at prefetch 0 are tests/test_compile_passes.py's."""
    tmp = tmp_path_factory.mktemp("compile")
    return {
        # A shard group of 4 with gradient accumulation (one compile for both): non-final micro-steps
        # reduce nothing (the interface's set_reduce_grads).
        "1x4-accum": _pair(
            tmp,
            "1x4-accum",
            SMALL + SGD + [f"run.steps={STEPS}", "mesh.sync=1", "mesh.shard=4", ACCUM],
            compiled=[*STEP_SCOPE, "compile.passes=ours", "compile.prefetch=2"],
        ),
        # The whole step traced inline (compile.regional=false), scheduled by inductor's passes.
        "2x2-diloco": _pair(
            tmp,
            "diloco",
            SMALL + SGD + DILOCO,
            compiled=[*STEP_SCOPE, "compile.passes=inductor", "compile.regional=false"],
        ),
        # bf16 runs with our passes (prefetch 1): the passes do not change numerics (checked below in fp32).
        "1x2-bf16": _pair(tmp, "bf16", BASE + BF16, compiled=COMPILED_BF16),
    }


@pytest.fixture(scope="module")
def triton_kernels(runs, tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The compiled 1x2-bf16 run again with kernels.backend=triton: its graph's pack and reduction ops run
    the Triton kernels (the interpreter here: tests/conftest.py sets TRITON_INTERPRET=1). The kernel backend
    is not part of the graph, so this is also a warm compile of that job, loaded from inductor's caches
    (tests/conftest.py gives the suite its own cache folder, so the bf16 run compiled cold)."""
    overrides = BASE + BF16 + COMPILED_BF16
    return run_train(tmp_path_factory.mktemp("triton"), "bf16-triton", overrides + ["kernels.backend=triton"])


def _rel(a: list[float], b: list[float]) -> float:
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("case", ["1x4-accum", "2x2-diloco"])
def test_compiled_equals_eager_fp32(runs, case: str) -> None:
    """Per-step losses and every replica's final params agree to 1e-5 relative: reordering collectives (our
    passes, inductor's) changes nothing computed."""
    eager, compiled = runs[case]
    assert _rel(compiled.losses, eager.losses) < 1e-5
    for m in range(2 if case == "2x2-diloco" else 1):
        assert max_param_rel_err(compiled.params(m), eager.params(m)) < 1e-5
    assert eager.losses[-1] < eager.losses[0] - 0.05  # it trained


def test_compiled_bf16_like_eager_bf16(runs) -> None:
    """bf16 params and reductions: within the eager bf16 test's 3% of its reference, and trains."""
    eager, compiled = runs["1x2-bf16"]
    assert _rel(compiled.losses, eager.losses) < 0.03
    assert compiled.losses[-1] < compiled.losses[0] - 0.05


@pytest.mark.parametrize("case", ["1x4-accum", "2x2-diloco", "1x2-bf16"])
def test_bytes_equal_eager(runs, case: str) -> None:
    """shard_bytes / sync_bytes of every logged step equal the eager engine's (counted from the graphs)."""
    eager, compiled = runs[case]
    for e, c in zip(eager.metrics, compiled.metrics, strict=True):
        assert (c["shard_bytes"], c["sync_bytes"], c["synced"]) == (e["shard_bytes"], e["sync_bytes"], e["synced"])
    for key, counts in eager.summary["comm"].items():
        assert compiled.summary["comm"][key]["calls"] == counts["calls"], key


def test_graphs_and_recompiles(runs) -> None:
    """One forward+backward graph pair per reduce variant, never a recompile.

    Exact HSDP uses one variant; the DiLoCo run two (warmup steps all-reduce grads across replicas,
    local steps do not)."""
    assert runs["1x2-bf16"][1].summary["compile_graphs"] == 2
    assert runs["2x2-diloco"][1].summary["compile_graphs"] == 4
    for case, (_, compiled) in runs.items():
        assert compiled.summary["recompiles"] == 0, case
        assert compiled.summary["compile_time_s"] > 0


def test_grad_accumulation_reduces_once_per_step(runs) -> None:
    """With optim.grad_accum=2 the first micro-step's backward reduce-scatters nothing (it accumulates),
    the second reduces every unit once: two graph pairs, like the eager engine's one reduction per step."""
    graphs = runs["1x4-accum"][1].summary["compiled"]
    backwards = [g for g in graphs if g["graph"] == "backward"]
    assert len(graphs) == 4 and len(backwards) == 2
    assert sorted(g["reduce_scatters"] for g in backwards) == [0, UNITS_NEEDING_WEIGHTS + 1]


def test_graphs_name_the_groups_by_role(runs) -> None:
    """The 2x2 graphs call the shard and sync groups 'hsdp.shard' and 'hsdp.sync' (each rank registers its own
    groups under them), not c10d's per-group names: both shard groups' ranks trace the same graphs, so one rank
    on the machine compiles them and the others load them (hsdp/compile/turns.py)."""
    compiled = runs["2x2-diloco"][1]
    code = "".join(p.read_text() for p in sorted((compiled.run_dir / "compiled").glob("graph*.py")))
    groups = set(re.findall(r"torch\.ops\._c10d_functional\.\w+\.default\([^)]*'([^']+)'\)", code))
    assert groups == {"hsdp.shard", "hsdp.sync"}, groups


@pytest.mark.parametrize("case", ["1x2-bf16", "2x2-diloco"])
def test_release_in_the_compiled_graphs(runs, case: str) -> None:
    """Forward saves no full param for backward; backward re-gathers exactly the units that need weights."""
    graphs = runs[case][1].summary["compiled"]
    forwards = [g for g in graphs if g["graph"] == "forward"]
    backwards = [g for g in graphs if g["graph"] == "backward"]
    assert forwards and len(forwards) == len(backwards)
    for g in forwards:
        assert g["saved_full_params"] == 0
        assert g["all_gathers"] == UNITS_NEEDING_WEIGHTS + 1  # every unit, the embedding included
    for g in backwards:
        assert g["all_gathers"] == UNITS_NEEDING_WEIGHTS
        assert g["reduce_scatters"] == UNITS_NEEDING_WEIGHTS + 1
    if case == "2x2-diloco":  # the grad-sync variant all-reduces every unit's grad shard across replicas
        assert sorted(g["all_reduces"] for g in backwards) == [0, UNITS_NEEDING_WEIGHTS + 1]


@pytest.mark.parametrize("case", ["1x2-bf16", "1x4-accum", "2x2-diloco"])
def test_blocks_share_one_compiled_region(runs, case: str) -> None:
    """compile.regional (the default): the forward graph's code defines the block's code once and calls it
    for every block; compile.regional=false (2x2-diloco) traces every block inline."""
    n_layer = int(next(o for o in SMALL if o.startswith("model.n_layer=")).split("=")[1])
    forward = (runs[case][1].run_dir / "compiled" / "graph0.py").read_text()
    defined = re.findall(r"^def (partitioned_fw_subgraph\w*)\(", forward, flags=re.M)
    calls = re.findall(r"= (partitioned_fw_subgraph\w*)\(partitioned", forward)
    if case == "2x2-diloco":
        assert defined == [] and calls == []
    else:
        assert len(defined) == 1 and calls == defined * n_layer, (defined, calls)


@pytest.mark.parametrize("case,k", [("1x2-bf16", 1), ("1x4-accum", 2)])
def test_generated_code_keeps_our_prefetch(runs, case: str, k: int) -> None:
    """compile.prefetch=k: in inductor's generated forward code compute runs with up to k gathers in flight and
    reaches k; at most k+1 units' full params alive at once (tests/test_compile_passes.py: k = 0)."""
    assert_prefetch(runs[case][1], k)


def test_generated_backward_waits_reduce_scatters_late(runs) -> None:
    """With our passes, each reduce-scatter overlaps compute: some compute runs before its wait."""
    for lines in schedules(runs["1x2-bf16"][1])["backward"]:
        pending: set[str] = set()
        overlapped = 0
        for line in lines:
            if line.startswith("start reduce_scatter"):
                pending.add(line.split()[2])
            elif line.startswith("wait") and line.split()[1] in pending:
                pending.discard(line.split()[1])
            elif line.startswith("compute") and pending:
                overlapped += 1
        assert overlapped >= 2, lines


KERNEL_OPS = ["hsdp_kernels.cast_shard", "hsdp_kernels.scale_grad", "hsdp_kernels.scaled_grad_shard"]


def test_kernels_in_the_compiled_graph(runs, triton_kernels) -> None:
    """The graph packs (cast) and finishes the reduction (cast, 1/pre, 1/post) with the project's kernel
    ops; kernels.backend=triton runs the Triton kernels in that same graph (loaded from the cache) and
    computes what the torch-reference backend computed, bit for bit."""
    reference = runs["1x2-bf16"][1]  # the same job, kernels.backend=auto: the torch references on CPU
    code = "".join(p.read_text() for p in sorted((triton_kernels.run_dir / "compiled").glob("graph*.py")))
    for op in KERNEL_OPS:
        assert f"torch.ops.{op}.default(" in code, op
    assert triton_kernels.summary["compile_cache_hits"] == 2
    assert triton_kernels.losses == reference.losses
    params, ref_params = triton_kernels.params(0), reference.params(0)
    assert params.keys() == ref_params.keys()
    for name in params:
        assert torch.equal(params[name], ref_params[name]), name


def test_warm_compile_loads_the_same_graphs(runs, triton_kernels) -> None:
    """A second run of the same job loads both graphs from inductor's caches: nothing compiled, the census
    (bytes) from its sidecar, and the same generated code, schedule, bytes and losses, bit for bit."""
    cold, warm = runs["1x2-bf16"][1], triton_kernels
    assert cold.summary["compile_cache_hits"] == 0 and warm.summary["compile_cache_hits"] == 2
    assert warm.summary["compiled"] == cold.summary["compiled"] and warm.summary["recompiles"] == 0
    assert warm.losses == cold.losses
    assert [(m["shard_bytes"], m["sync_bytes"]) for m in warm.metrics] == [
        (m["shard_bytes"], m["sync_bytes"]) for m in cold.metrics
    ]
    for name in ["schedule.txt", "compiled/graph0.py", "compiled/graph1.py"]:
        assert (warm.run_dir / name).read_text() == (cold.run_dir / name).read_text(), name
