"""The compiled HSDP path (compile.enabled=true) against the eager engine (CPU, gloo, inductor).

Each compiled run is one train.py process (one cold compile); the checks share
those runs through module-scoped fixtures to keep the suite's budget.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import SMALL, RunResult, max_param_rel_err, run_train

STEPS = 10
COMPILED = ["compile.enabled=true"]
DILOCO = ["sync.warmup_steps=3", "sync.every=4", "sync.method=diloco", "run.steps=15", "mesh.sync=2", "mesh.shard=2"]
UNITS_NEEDING_WEIGHTS = 2 + 1  # SMALL's blocks and the head; the embedding's backward needs only the ids


def _pair(tmp: Path, name: str, overrides: list[str]) -> tuple[RunResult, RunResult]:
    eager = run_train(tmp, f"{name}-eager", overrides)
    compiled = run_train(tmp, f"{name}-compiled", overrides + COMPILED, timeout=900)
    return eager, compiled


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunResult, RunResult]]:
    tmp = tmp_path_factory.mktemp("compile")
    base = SMALL + [f"run.steps={STEPS}"]
    return {
        "1x2": _pair(tmp, "1x2", base + ["mesh.sync=1", "mesh.shard=2"]),
        "1x4": _pair(tmp, "1x4", base + ["mesh.sync=1", "mesh.shard=4"]),
        "2x2-diloco": _pair(tmp, "diloco", SMALL + DILOCO),
        "1x2-bf16": _pair(tmp, "bf16", base + ["mesh.sync=1", "mesh.shard=2", "precision.param_dtype=bf16",
                                               "precision.reduce_dtype=bf16"]),
    }


def _rel(a: list[float], b: list[float]) -> float:
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize("case", ["1x2", "1x4", "2x2-diloco"])
def test_compiled_equals_eager_fp32(runs, case: str) -> None:
    """Per-step losses and every replica's final params agree to 1e-5 relative."""
    eager, compiled = runs[case]
    assert _rel(compiled.losses, eager.losses) < 1e-5
    for m in range(2 if case == "2x2-diloco" else 1):
        assert max_param_rel_err(compiled.params(m), eager.params(m)) < 1e-5
    assert eager.losses[-1] < eager.losses[0] - 0.1  # it trained


def test_compiled_bf16_like_eager_bf16(runs) -> None:
    """bf16 params and reductions: within the eager bf16 test's 3% of its reference, and trains."""
    eager, compiled = runs["1x2-bf16"]
    assert _rel(compiled.losses, eager.losses) < 0.03
    assert compiled.losses[-1] < compiled.losses[0] - 0.1


@pytest.mark.parametrize("case", ["1x2", "1x4", "2x2-diloco"])
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
    assert runs["1x2"][1].summary["compile_graphs"] == 2
    assert runs["2x2-diloco"][1].summary["compile_graphs"] == 4
    for case, (_, compiled) in runs.items():
        assert compiled.summary["recompiles"] == 0, case
        assert compiled.summary["compile_time_s"] > 0


@pytest.mark.parametrize("case", ["1x2", "2x2-diloco"])
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
