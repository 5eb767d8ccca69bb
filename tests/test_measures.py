"""Measurement tools: mesh.backend=fake (no communication), the sweep's exposed-communication
columns built on it, and the step memory probe (summary.json's step_alloc_peak_mb)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsdp import sweep
from hsdp.bench.plan import with_nocomm_twins
from hsdp.bench.records import RunRecord
from hsdp.bench.report import sweep_table
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.engines.clock import CompileClock, graphs_captured
from hsdp.run.launch import threads_per_rank
from hsdp.run.metrics import StepMemoryProbe
from tests.helpers import REPO, SMALL

TINY = str(REPO / "configs" / "tiny.yaml")
PAIR = [*SMALL, "run.save_model=false", "mesh.sync=1", "mesh.shard=2", "run.steps=3"]


@pytest.mark.parametrize(
    "override, key",
    [
        ("run.checkpoint_every=5", "run.checkpoint_every"),
        ("run.save_model=true", "run.save_model"),
        ("run.resume=runs/x/checkpoints/step_4", "run.resume"),
    ],
)
def test_fake_backend_refuses_saving_or_loading_state(tmp_path, override, key):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["mesh.backend=fake", f"run.out_dir={tmp_path}", override])
    msg = str(info.value)
    assert msg.startswith(key) and "mesh.backend=fake" in msg and "\n" not in msg


def test_threads_per_rank_respects_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_rank(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert threads_per_rank(4) == 2 and threads_per_rank(16) == 1


def test_nocomm_twins_and_table_columns():
    runs = {"a": ["x.y=1"], "b": []}
    assert with_nocomm_twins(runs) == {
        "a": ["x.y=1"],
        "a-nocomm": ["x.y=1", "mesh.backend=fake"],
        "b": [],
        "b-nocomm": ["mesh.backend=fake"],
    }
    spec = {"columns": ["median_step_time_s"], "runs": runs, "nocomm": True, "relative": ["median_step_time_s", "b"]}
    summaries = {
        "a": {"median_step_time_s": 0.30},
        "a-nocomm": {"median_step_time_s": 0.20},
        "b": {"median_step_time_s": 0.40},
        "b-nocomm": {},  # a twin that failed: its row shows "–", the others are unaffected
    }
    records = {run: RunRecord.from_summary(Path(run), s) if s else None for run, s in summaries.items()}
    lines = sweep_table(spec, records).splitlines()
    assert lines[0] == "| run | median_step_time_s | nocomm_step_time_s | exposed_comm_s | median_step_time_s vs b |"
    assert lines[2] == "| a | 0.3000 | 0.2000 | 0.1000 | 0.75× |"
    assert lines[3] == "| b | 0.4000 | – | – | 1.00× |"
    assert len(lines) == 4  # the twins fold into their runs' rows


@pytest.mark.parametrize(
    "extra, words",
    [
        ("relative: [median_step_time_s, nope]\n", ["relative", "'nope' is not one of the runs"]),
        ("relative: median_step_time_s\n", ["relative", "expected [summary.json field, run name]"]),
        ("nocomm: yes please\n", ["nocomm", "expected true or false"]),
    ],
)
def test_bad_relative_or_nocomm_exit_2(tmp_path, capsys, extra, words):
    path = tmp_path / "sw.yaml"
    path.write_text(f"base: configs/tiny.yaml\ncolumns: [steps]\nruns: {{a: []}}\n{extra}")
    assert sweep.main([str(path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and all(w in err[0] for w in words), err


@pytest.fixture(scope="module")
def fake_twin_sweep(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One real sweep, shared: a 1x2 run (gloo) and its no-comm twin (mesh.backend=fake); the process and out_dir."""
    tmp_path = tmp_path_factory.mktemp("sweep")
    path = tmp_path / "sw.yaml"
    sets_ = ", ".join([*PAIR, f"run.out_dir={tmp_path / 'out'}"])
    path.write_text(
        f"base: {TINY}\nset: [{sets_}]\ncolumns: [median_step_time_s, shard_bytes]\nnocomm: true\n"
        "relative: [median_step_time_s, hsdp]\nruns:\n  hsdp: []\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "hsdp.sweep", str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    return proc, tmp_path / "out"


def test_sweep_measures_exposed_communication_with_a_fake_twin(fake_twin_sweep):
    """Real runs: each run and its no-comm twin; the twin sends the same bytes on paper but waits on none."""
    proc, out = fake_twin_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads((out / "sw-hsdp" / "summary.json").read_text())
    bare = json.loads((out / "sw-hsdp-nocomm" / "summary.json").read_text())
    assert real["backend"] == "gloo" and bare["backend"] == "fake"
    assert bare["shard_bytes"] == real["shard_bytes"] > 0  # the same collectives were issued
    assert "compute only" in proc.stderr  # the fake run says what its numbers are
    row = next(ln for ln in (out / "sw.md").read_text().splitlines() if ln.startswith("| hsdp |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) == pytest.approx(float(cells[1]) - float(cells[3]), abs=2e-4)  # exposed = step − bare
    assert cells[-1] == "1.00×"


def test_step_memory_probe_sees_the_peak_of_what_the_step_allocates():
    probe = StepMemoryProbe(torch.device("cpu"), at=3)
    kept = torch.ones(1000)  # allocated before the step: not counted, and neither is its free
    with probe.step(2):
        torch.ones(2**20)  # 4 MiB in an unprobed step: not measured
    assert probe.peak_mb is None  # only step 3 is measured
    with probe.step(3):
        del kept
        a = torch.ones(2**20)  # 4 MiB
        b = torch.ones(3 * 2**20)  # +12 MiB → 16 MiB live: the peak
        del a, b
        c = torch.ones(2**19)  # 2 MiB, still live at the end
    assert 16 <= probe.peak_mb < 16.5, probe.peak_mb
    assert c.numel() == 2**19


def test_step_memory_is_in_the_summary_of_a_run(fake_twin_sweep):
    """A 1x2 run reports its probed step's peak, with either backend (gloo's own staging buffers count too):
    the sweep's run (gloo) and its twin (fake), plain train.py runs of PAIR."""
    proc, out = fake_twin_sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = {}
    for backend, run in (("gloo", "sw-hsdp"), ("fake", "sw-hsdp-nocomm")):
        summary = json.loads((out / run / "summary.json").read_text())
        assert summary["backend"] == backend and summary["world"] == 2
        peaks[backend] = summary["step_alloc_peak_mb"]
    assert peaks["gloo"] > 0 and peaks["fake"] > 0


def test_compile_clock_times_first_calls_and_counts_recompiles():
    """A new input shape under dynamic=False is a recompile; a variant's first call less its second is its
    compile time."""
    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager", fullgraph=True, dynamic=False)
    clock = CompileClock()
    before = graphs_captured()
    with clock.call("a") as first:
        assert first
        fn(torch.ones(3))
    assert graphs_captured() == before + 1 and clock.recompiles == 0 and clock.compile_time_s > 0
    first_call = clock.compile_time_s
    with clock.call("a") as first:
        assert not first
        fn(torch.ones(3))  # cached: nothing captured
    assert clock.recompiles == 0
    # compile time = first call − second call (the step's own work is not compile time)
    assert clock.compile_time_s == pytest.approx(first_call - clock.second_call_s["a"])
    assert clock.stats()["compile_first_call_s"] == round(first_call, 2)
    with clock.call("a"):
        fn(torch.ones(5))  # another shape: dynamo captures a new graph
    assert clock.recompiles == 1
    assert clock.stats()["recompiles"] == 1
