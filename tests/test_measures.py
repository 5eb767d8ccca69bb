"""Measurement tools: mesh.backend=fake (no communication), the sweep's exposed-communication
columns built on it, and the step memory probe (summary.json's step_alloc_peak_mb)."""

from __future__ import annotations

import json
import statistics
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
from hsdp.run.metrics import StepMemoryProbe
from hsdp.run.rank import threads_per_rank
from tests.helpers import REPO, SMALL

TINY = str(REPO / "configs" / "tiny.yaml")
# run.checkpoint_every=0: the fake backend refuses saved state, whatever configs/tiny.yaml checkpoints
PAIR = [*SMALL, "run.save_model=false", "run.checkpoint_every=0", "mesh.sync=1", "mesh.shard=2", "run.steps=3"]


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
        load_config(TINY, ["mesh.backend=fake", f"run.out_dir={tmp_path}", "run.checkpoint_every=0", override])
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
    assert clock.stats()["dynamo_graphs"] == 1  # the graph the first call captured
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


def test_compile_clock_synchronizes_the_device_around_its_timed_calls_only(monkeypatch):
    """The first and second call of each variant are timed from an idle device to an idle device (on a GPU the
    second call would otherwise time only its launches); later calls are not synchronized."""
    from hsdp.engines import clock as clock_module

    synced = []
    monkeypatch.setattr(clock_module, "device_synchronize", lambda: synced.append(len(synced)))
    clock = CompileClock()
    for variant in ["a", "a", "b", "a", "b", "b"]:
        with clock.call(variant):
            pass
    assert len(synced) == 2 * 4  # a: calls 1 and 2, b: calls 1 and 2; before and after each
    assert set(clock.first_call_s) == set(clock.second_call_s) == {"a", "b"}


# ----------------------------------------------------------------------------- scripts/gpu_summary.py


def _gpu_work(work: Path, *, fsdp2_rc: int = 0, bf16_loss_shift: float = 1e-3) -> None:
    """A gpu_check.sh work folder as an H200 run leaves it (made-up numbers): every stage, the run folders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "scripts" / "gpu_summary.py")
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    stages = ["parity", "d-fp32-triton", "d-fp32-torch", "d-bf16-int8-triton", "d-bf16-int8-torch", "bench"]
    stages += ["c-hsdp-eager", "c-hsdp-compiled", "c-fsdp2-compiled", "c-hsdp-step"]
    (work / "runs").mkdir(parents=True)
    lines = [
        {"stage": s, "rc": fsdp2_rc if s == "c-fsdp2-compiled" else 0, "seconds": 10.0, "limit_s": 60} for s in stages
    ]
    (work / "stages.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (work / "env.txt").write_text("NVIDIA H200, 143771 MiB, 580.159.04\ntorch 2.11.0 triton 3.6.0\n")
    row = {"output": "out", "equal": True, "max_rel": 0.0}
    kernels = {
        k: {"elements": 1000, "bound": "out: bitwise", "cpu": [row], "cuda": [row], "ok": True} for k in gs.DENSE
    }
    parity = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "kernels": kernels}
    (work / "parity.json").write_text(json.dumps(parity))
    bench = ["device: NVIDIA H200; copy bandwidth 4,210 GB/s; torch 2.11.0", ""]
    bench += [
        "| kernel | size | time (ms) | GB/s | % of copy | torch ref (ms) | speedup |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    bench += [
        f"| {k} | N=25.2M | 0.050 | {3000 if k != 'quantize' else 2500} | 71% | 0.060 | 1.20x |" for k in gs.DENSE
    ]
    (work / "bench.md").write_text("\n".join(bench) + "\n")

    def run(name: str, times: list[float], losses: list[float], **extra) -> None:
        folder = work / "runs" / name
        folder.mkdir()
        per_step = 16384
        records = [{"step": i, "loss": x, "step_time_s": t} for i, (t, x) in enumerate(zip(times, losses))]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        median = statistics.median(times)
        summary = {
            "final_loss": losses[-1],
            "steps": len(times),
            "tokens": per_step * len(times),
            "tokens_per_step": per_step,
            "tokens_per_s": per_step / median,
            "median_step_time_s": median,
            "wall_tokens_per_s": per_step * len(times) / sum(times),
            "rate_basis": "tokens_per_step / median_step_time_s",
            "mfu": round(0.4 * 0.04 / median, 4),
            "wall_mfu": 0.02,
            "peak_mem_mb": 20000.0,
            **extra,
        }
        (folder / "summary.json").write_text(json.dumps(summary))

    losses = [10.0 - 0.1 * i for i in range(30)]
    run("c-hsdp-eager", [3.0] + [0.05] * 29, losses)
    blocks = {"compile_time_s": 33.0, "recompiles": 0, "dynamo_graphs": 1, "dynamo_graphs_all": 1}
    run("c-hsdp-compiled", [35.0] + [0.04] * 29, losses, **blocks, compile_first_call_s=35.0)
    if not fsdp2_rc:
        run("c-fsdp2-compiled", [40.0] + [0.045] * 29, losses, compile_time_s=38.0, recompiles=0)
    run("c-hsdp-step", [60.0] + [0.045] * 29, losses, compile_time_s=58.2, recompiles=0)
    engine = [5.5 - 0.05 * i for i in range(60)]
    run("d-fp32-triton", [0.01] * 60, engine)
    run("d-fp32-torch", [0.01] * 60, engine)
    run("d-bf16-int8-triton", [0.01] * 60, [x * (1 + bf16_loss_shift * (i > 17)) for i, x in enumerate(engine)])
    run("d-bf16-int8-torch", [0.01] * 60, engine)


def _gpu_summary(work: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_summary.py"), str(work), str(out), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((out / "summary.json").read_text())


def test_gpu_summary_passes_a_good_gpu_run_and_writes_two_files(tmp_path):
    _gpu_work(tmp_path / "work")
    proc, s = _gpu_summary(tmp_path / "work", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["summary.json", "summary.md"]
    assert s["result"] == "PASS", proc.stdout
    statuses = {r["check"]: r["status"] for r in s["checks"]}
    assert set(statuses.values()) == {"PASS"} and len(statuses) == 18, statuses
    lines = proc.stdout.splitlines()
    assert lines[-1] == "gpu_check: PASS" and all(ln.split()[0] in ("PASS", "FAIL", "SKIP") for ln in lines[:-1])
    hc = s["runs"]["c-hsdp-compiled"]["steady"]
    assert hc["steady_tokens_per_s"] == pytest.approx(16384 / 0.04) and hc["steady_mfu"] == 0.4
    assert s["engine"]["fp32"]["bitwise"] and s["engine"]["bf16-int8"]["max_rel_loss_diff"] == pytest.approx(1e-3)
    md = (tmp_path / "out" / "summary.md").read_text()
    for heading in ["## Checks", "## (a)", "## (b)", "## (c)", "## (d)", "## Stages"]:
        assert heading in md
    assert "| c-hsdp-compiled | 409,600 | 0.4 |" in md and "| quantize | N=25.2M |" in md


def test_gpu_summary_fails_what_is_off_its_bound_and_skips_what_did_not_run(tmp_path):
    _gpu_work(tmp_path / "work", fsdp2_rc=137, bf16_loss_shift=0.05)
    with (tmp_path / "work" / "stages.jsonl").open("a") as f:  # the budget ran out before the bench
        f.write(json.dumps({"stage": "bench", "skipped": "out of time (12 s left)"}) + "\n")
    (tmp_path / "work" / "bench.md").unlink()
    proc, s = _gpu_summary(tmp_path / "work", tmp_path / "out", "--quiet")
    assert proc.stdout == "" and s["result"] == "FAIL"
    statuses = {r["check"]: (r["status"], r["note"]) for r in s["checks"]}
    assert (
        statuses["(c) c-fsdp2-compiled finishes"][0] == "FAIL"
        and "timed out" in statuses["(c) c-fsdp2-compiled finishes"][1]
    )
    assert statuses["(d) engine triton vs torch, bf16 params, int8 DiLoCo"][0] == "FAIL"  # 5e-2 > 2^-6
    assert statuses["(b) copy bandwidth"][0] == "SKIP"
    assert statuses["(d) engine triton vs torch, fp32 params, DiLoCo unquantized"][0] == "PASS"
