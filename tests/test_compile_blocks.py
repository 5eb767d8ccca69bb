"""compile.scope=blocks (each block compiled in place, collectives eager) against the eager engine.

One eager and one compiled train.py run on a 1x2 mesh, shared by the checks (one cold compile).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers import SMALL, RunResult, max_param_rel_err, run_train
from tests.test_engine import _run_check, check_release

pytestmark = pytest.mark.timeout(900)

# SGD with momentum, as tests/test_compile.py uses: the update is linear in the grad, so fp32 reordering in the
# compiled block stays at reordering size in the params.
SGD = ["optim.name=sgd", "optim.momentum=0.9", "optim.lr=0.3", "optim.min_lr=0.03"]
BASE = SMALL + SGD + ["run.steps=10", "mesh.sync=1", "mesh.shard=2"]
BLOCKS = ["compile.enabled=true", "compile.scope=blocks"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, RunResult]:
    tmp = tmp_path_factory.mktemp("blocks")
    eager = run_train(tmp, "eager", BASE)
    compiled = run_train(tmp, "blocks", BASE + BLOCKS, timeout=600)
    return eager, compiled


def test_blocks_compiled_equals_eager(pair) -> None:
    """Per-step losses and the final params agree with the eager engine's to 1e-5 relative."""
    eager, compiled = pair
    losses_e = np.array([m["loss"] for m in eager.metrics])
    losses_c = np.array([m["loss"] for m in compiled.metrics])
    assert float(np.max(np.abs(losses_c - losses_e) / np.abs(losses_e))) < 1e-5
    assert max_param_rel_err(compiled.params(0), eager.params(0)) < 1e-5
    assert losses_e[-1] < losses_e[0] - 0.05  # it trained


def test_blocks_compile_once_and_never_again(pair) -> None:
    """SMALL's two blocks share one dynamo graph (their params are graph inputs), no later step recompiles,
    and the eval forward compiles nothing (it runs eagerly); the compile is timed as FSDP2 compiled's is."""
    _, compiled = pair
    s = compiled.summary
    assert s["dynamo_graphs"] == 1
    assert s["final_val_loss"] is not None and s["dynamo_graphs_all"] == 1  # the final eval ran eagerly
    assert s["recompiles"] == 0
    assert s["compile_time_s"] > 0


def test_blocks_release_and_regather_as_eager(pair) -> None:
    """The same collectives and bytes as the eager engine, step by step: backward re-gathers every unit that
    needs its weights (what stays alive is test_compiled_blocks_release_their_full_params's)."""
    eager, compiled = pair
    for e, c in zip(eager.metrics, compiled.metrics, strict=True):
        assert (c["shard_bytes"], c["sync_bytes"]) == (e["shard_bytes"], e["sync_bytes"])
    for key, counts in eager.summary["comm"].items():
        assert compiled.summary["comm"][key]["calls"] == counts["calls"], key


def test_compiled_blocks_release_their_full_params(tmp_path: Path) -> None:
    """tests/test_engine.py's release check on the blocks engine: full params freed after each unit's forward
    and backward, the compiled blocks' saved full params turned into markers, no saved copy of a weight."""
    check_release(_run_check("release_compiled_blocks", 2, tmp_path, timeout=300))


def test_unknown_compile_scope_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run_train(tmp_path, "bad", [*BASE, "compile.enabled=true", "compile.scope=layers"], check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if "compile.scope" in line]
    assert lines and "layers" in lines[-1] and "blocks" in lines[-1], result.stderr[-500:]
