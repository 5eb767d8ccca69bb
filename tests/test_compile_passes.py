"""The compiled path's scheduling passes (ours at prefetch 0 and 2, inductor's), a warm compile and FSDP2 with
compiled blocks, against the eager engine (CPU, gloo, inductor).

A module of its own (the compiled-vs-eager pairs are in tests/test_compile.py) so the suite's two workers
compile the two fixtures' runs side by side instead of one after the other.
"""

from __future__ import annotations

import pytest

from tests.helpers import RunResult, assert_prefetch, max_param_rel_err, run_train
from tests.test_compile import BASE, _rel

# Six train.py processes, five of them cold compiles: on a loaded 2-core box more than pytest's default 600 s.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    """Compiled 1x2 runs scheduled by our passes (prefetch 0 and 2) and by inductor's (the ablation),
    the FSDP2 baseline with its blocks compiled, and the eager run they all compute."""
    tmp = tmp_path_factory.mktemp("passes")
    variants = {
        "ours0": ["compile.passes=ours", "compile.prefetch=0", "compile.bucket_mb=0.1"],
        "ours2": ["compile.passes=ours", "compile.prefetch=2"],
        # the same job again: a warm compile, loaded from inductor's caches (tests/conftest.py gives
        # this process its own cache folder, so the first ours2 compiled cold)
        "ours2-warm": ["compile.passes=ours", "compile.prefetch=2"],
        "inductor": ["compile.passes=inductor"],
        "fsdp2": ["mesh.engine=fsdp2"],
    }
    runs = {
        name: run_train(tmp, name, BASE + ["compile.enabled=true"] + extra, timeout=900)
        for name, extra in variants.items()
    }
    return runs | {"eager": run_train(tmp, "eager", BASE)}


@pytest.mark.parametrize("name", ["ours0", "ours2", "inductor", "fsdp2"])
def test_compiled_variant_computes_the_eager_run(scheduled, name: str) -> None:
    """Reordering collectives (our passes, inductor's) or compiling FSDP2's blocks changes nothing computed:
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


@pytest.mark.parametrize("name,k", [("ours0", 0), ("ours2", 2)])
def test_generated_code_keeps_our_prefetch(scheduled, name: str, k: int) -> None:
    """compile.prefetch=k: up to k gathers in flight in the generated forward code (see assert_prefetch)."""
    assert_prefetch(scheduled[name], k)


def test_buckets_pair_small_units(scheduled) -> None:
    """bucket_mb=0.1: the 40-64 KB units pair up (embedding+block, block+head): 2 all-gathers per forward."""
    summary = scheduled["ours0"].summary
    assert summary["buckets"] == [[0, 1], [2, 3]]
    for g in summary["compiled"]:
        assert g["all_gathers"] == 2 and (g["graph"] == "forward" or g["reduce_scatters"] == 2)


def test_warm_compile_loads_the_same_graphs(scheduled) -> None:
    """A second run of the same job loads both graphs from inductor's caches: nothing compiled, the census
    (bytes) from its sidecar, and the same generated code, schedule, bytes and losses, bit for bit."""
    cold, warm = scheduled["ours2"], scheduled["ours2-warm"]
    assert cold.summary["compile_cache_hits"] == 0 and warm.summary["compile_cache_hits"] == 2
    assert warm.summary["compiled"] == cold.summary["compiled"] and warm.summary["recompiles"] == 0
    assert warm.losses == cold.losses
    assert [(m["shard_bytes"], m["sync_bytes"]) for m in warm.metrics] == [
        (m["shard_bytes"], m["sync_bytes"]) for m in cold.metrics
    ]
    for name in ["schedule.txt", "compiled/graph0.py", "compiled/graph1.py"]:
        assert (warm.run_dir / name).read_text() == (cold.run_dir / name).read_text(), name
