"""Our scheduling passes with buckets (prefetch 0) and FSDP2 with compiled blocks, against the eager engine
(CPU, gloo, inductor).

A module of its own (the compiled-vs-eager pairs are in tests/test_compile.py, whose runs also cover our
passes at prefetch 1 and 2, inductor's passes and a warm compile) so the suite's workers compile the two
fixtures' runs side by side instead of one after the other.
"""

from __future__ import annotations

import pytest

from tests.helpers import STEP_SCOPE, RunResult, assert_prefetch, max_param_rel_err, run_train
from tests.test_compile import BASE, _rel

# Three train.py processes, two of them cold compiles: on a loaded 2-core box they may take minutes.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """A compiled 1x2 run scheduled by our passes (prefetch 0, small units bucketed), the FSDP2 baseline
    with its blocks compiled, and the eager run both compute."""
    tmp = tmp_path_factory.mktemp("passes")
    variants = {
        "ours0": ["compile.passes=ours", "compile.prefetch=0", "compile.bucket_mb=0.1"],
        "fsdp2": ["mesh.engine=fsdp2"],
    }
    runs = {name: run_train(tmp, name, BASE + STEP_SCOPE + extra, timeout=900) for name, extra in variants.items()}
    return runs | {"eager": run_train(tmp, "eager", BASE)}


@pytest.mark.parametrize("name", ["ours0", "fsdp2"])
def test_compiled_variant_computes_the_eager_run(scheduled, name: str) -> None:
    """Reordering and bucketing collectives (our passes) or compiling FSDP2's blocks changes nothing computed:
    losses and params equal the eager run's to 1e-5 (the compiled-vs-eager bound of tests/test_compile.py,
    which SGD's linear update justifies), no recompile."""
    eager = scheduled["eager"]
    assert _rel(scheduled[name].losses, eager.losses) < 1e-5
    assert max_param_rel_err(scheduled[name].params(0), eager.params(0)) < 1e-5
    assert scheduled[name].summary["recompiles"] == 0
    if name != "fsdp2":  # exact HSDP: one forward+backward graph pair (FSDP2 compiles each block on its own)
        assert scheduled[name].summary["compile_graphs"] == 2


def test_fsdp2_compiled_baseline_reports_its_compile(scheduled) -> None:
    assert scheduled["fsdp2"].summary["compile_time_s"] > 0


def test_generated_code_keeps_our_prefetch(scheduled) -> None:
    """compile.prefetch=0: no gather in flight during compute in the generated forward code (see assert_prefetch;
    k = 1, 2 in tests/test_compile.py)."""
    assert_prefetch(scheduled["ours0"], 0)


def test_buckets_pair_small_units(scheduled) -> None:
    """bucket_mb=0.1: the 40-64 KB units pair up (embedding+block, block+head): 2 all-gathers per forward."""
    summary = scheduled["ours0"].summary
    assert summary["buckets"] == [[0, 1], [2, 3]]
    for g in summary["compiled"]:
        assert g["all_gathers"] == 2 and (g["graph"] == "forward" or g["reduce_scatters"] == 2)
