"""`python -m hsdp.plan`: the step model's closed forms against the DiLoCo scaling-laws paper, its bytes
against what the engine counts, and bad input.

The paper (Charles et al., "Communication-Efficient Language Model Training Scales Reliably and
Robustly: Scaling Laws for DiLoCo", arXiv 2503.09799, Appendix A) models a run of T steps of D tokens
on R replicas of Q FLOP/s each as

    T_comp  = 6ND / (R·Q)
    T_inter = [(2N/W)(1 − 1/R) + ε] · T/H

N parameters sent per sync (W: parameters per second of the link, here rate / 32 for fp32), ε the
latency of one all-reduce, nothing overlapped. Our model has no overlap when a param sync blocks
(τ = 0) or when the model is one unit (grads exist only at the end of backward); ε is then a ring
all-reduce's 2(R − 1) one-way hops.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hsdp.plan.__main__ as plan_cli
from hsdp.comm.groups import Comm
from hsdp.comm.transport import GroupTransport
from hsdp.config.loader import load_config
from hsdp.config.schema import SyncConfig
from hsdp.plan.__main__ import main
from hsdp.plan.calibrate import read_fake_run
from hsdp.plan.collectives import measure_shard_collectives
from hsdp.plan.model import Compute, Link, MeasuredIntra, predict
from hsdp.plan.project import projected_compute
from hsdp.plan.workload import Unit, Workload, build_workload, codec_messages
from hsdp.sync.codec import build_codec
from hsdp.sync.schedule import fragments_due
from tests.helpers import SMALL, run_train

FAKE_RUN = [
    *[o for o in SMALL if o != "run.save_model=true"],
    "mesh.backend=fake",
    "mesh.sync=2",
    "mesh.shard=2",
    "run.steps=10",
    "sync.warmup_steps=2",
    "sync.every=4",
    "sync.fragments=2",
    "sync.method=diloco",
    "sync.quantize=int8",
    "sync.quant_block=64",
]


def one_unit_workload(N: int, R: int, sync: SyncConfig, tokens_per_step: int) -> Workload:
    return Workload(
        units=(Unit(held=N, flops_share=1.0, embedding=False),),
        M=R,
        S=1,
        A=1,
        param_bytes=4,
        reduce_bytes=4,
        prefetch=True,
        sync=sync,
        tokens_per_step=tokens_per_step,
        flops_per_token=6 * N,
        params=N,
    )


@pytest.mark.parametrize("H, warmup", [(1, None), (1, 0), (8, 0), (100, 0)])
def test_no_overlap_closed_forms_equal_the_scaling_laws_paper(H: int, warmup):
    """Exact HSDP (warmup None: grads every step) and blocking DiLoCo every H, fp32, one unit."""
    N, R, Q = 1_000_000_000, 4, 400e12  # parameters, replicas, FLOP/s per replica (one GPU each)
    rate_bps, latency_s = 10e9, 0.025
    steps, tokens_per_step = 800, 4 * 2**20
    D = steps * tokens_per_step
    sync = SyncConfig(warmup_steps=warmup, every=H, method="diloco")
    w = one_unit_workload(N, R, sync, tokens_per_step)
    compute = projected_compute(w, Q, 1.0)
    p = predict(w, Link(rate_bps, latency_s, None, overhead=1.0), compute, steps)

    W = rate_bps / 32  # fp32 parameters per second
    eps = 2 * (R - 1) * latency_s
    t_comp = 6 * N * D / (R * Q)
    t_inter = ((2 * N / W) * (1 - 1 / R) + eps) * steps / H
    assert p.compute_s * steps == pytest.approx(t_comp, rel=1e-12)
    assert p.time_to_tokens_s == pytest.approx(t_comp + t_inter, rel=1e-12)
    assert p.compute_utilization == pytest.approx(t_comp / (t_comp + t_inter), rel=1e-12)


def test_overlap_only_where_the_engine_overlaps():
    """Per-unit grad all-reduces overlap later units' backward; a delayed sync hides behind τ steps."""
    N, R = 10**8, 2
    units = tuple(Unit(held=N // 4, flops_share=0.25, embedding=i == 0) for i in range(4))
    hsdp = dataclasses.replace(one_unit_workload(N, R, SyncConfig(), 1), units=units)
    compute = Compute(step_s=1.0)
    link = Link(10e9, 0.0, None, 1.0)
    ar = 2 * (R - 1) * 4 * (N // 4) // R * 8 / 10e9  # one unit's all-reduce, s
    step = predict(hsdp, link, compute, 10).step_time_s
    assert 1.0 + ar < step < 1.0 + 4 * ar  # the first three overlap backward, the last cannot
    blocking = dataclasses.replace(hsdp, sync=SyncConfig(warmup_steps=0, every=8, method="diloco"))
    delayed = dataclasses.replace(blocking, sync=dataclasses.replace(blocking.sync, delay=1))
    assert predict(blocking, link, compute, 16).step_time_s == pytest.approx(1.0 + 4 * ar / 8)
    assert predict(delayed, link, compute, 16).step_time_s == pytest.approx(1.0)  # 4·ar < one step


@pytest.fixture
def fake_group():
    """An in-process fake process group of 3 ranks: Comm counts what the codec sends, nothing moves."""
    from hsdp.torch_compat import register_fake_backend

    assert not dist.is_initialized()
    register_fake_backend()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    yield Comm({"sync": dist.group.WORLD})
    dist.destroy_process_group()


CODECS = {
    "fp32": SyncConfig(method="diloco"),
    "int8": SyncConfig(quantize="int8", quant_block=64),
    "int4": SyncConfig(quantize="int4", quant_block=32),
    "topk-fp32": SyncConfig(topk=0.05, topk_chunk=64),
    "topk-int4": SyncConfig(topk=0.05, topk_chunk=128, quantize="int4", quant_block=32),
    "topk-int8-int16idx": SyncConfig(topk=0.05, topk_chunk=512, quantize="int8", quant_block=16),
    "topk-8192": SyncConfig(topk=0.01, topk_chunk=8192),
}


@pytest.mark.parametrize("codec", list(CODECS))
def test_codec_bytes_equal_what_comm_counts(fake_group: Comm, codec: str):
    """Each codec's start() through the engine's transport and Comm; sizes with short last blocks and chunks."""
    sync = CODECS[codec]
    transport = GroupTransport(fake_group)
    for n in (4968, 7812, 1001, 50_001):
        before = dict(fake_group.bytes), dict(fake_group.calls)
        build_codec(sync).start(torch.randn(n), transport, async_op=False)
        sent = sum(fake_group.bytes.values()) - sum(before[0].values())
        calls = sum(fake_group.calls.values()) - sum(before[1].values())
        messages = codec_messages(sync, n, 3)
        assert sum(m.nbytes for m in messages) == sent, (codec, n)
        assert len(messages) == calls, (codec, n)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory) -> Path:
    """A 2×2 fake-backend run: warmup 2, then DiLoCo every 4 in 2 fragments, int8; every step logged."""
    return run_train(tmp_path_factory.mktemp("plan"), "fake", FAKE_RUN).run_dir


def test_schedule_bytes_equal_a_fake_runs_counted_bytes(fake_run: Path):
    """Per step: shard bytes (§4.2) and sync bytes (grads in the warmup, then each due fragment's codec)."""
    cfg = load_config(None, FAKE_RUN)
    w = build_workload(cfg)
    records = [json.loads(line) for line in (fake_run / "metrics.jsonl").read_text().splitlines()]
    shard = [r["shard_bytes"] for r in records]
    sync = [r["sync_bytes"] for r in records]
    assert [b - a for a, b in zip([0, *shard], shard)] == [w.shard_bytes_per_step()] * cfg.run.steps
    expected = [
        w.grad_sync_bytes() if s < 2 else sum(w.fragment_sync_bytes(f) for f in fragments_due(s, cfg.sync))
        for s in range(cfg.run.steps)
    ]
    assert [b - a for a, b in zip([0, *sync], sync)] == expected
    assert sum(1 for e in expected[2:] if e) == 4  # both fragments synced twice: the int8 path was exercised


def test_plan_reads_a_fake_run_and_prints_json(fake_run: Path, capsys):
    argv = [str(fake_run / "config.yaml"), "--inter", "20mbit,1gbit", "--calibrate", str(fake_run), "--json"]
    assert main([*argv, "--intra", "free"]) == 0
    slow, fast = json.loads(capsys.readouterr().out)
    assert slow["rate_bps"] == 20e6 and fast["rate_bps"] == 1e9
    assert slow["compute_s"] == pytest.approx(fast["compute_s"])  # compute does not depend on the link
    assert slow["step_time_s"] > fast["step_time_s"] >= fast["compute_s"] > 0
    assert 0 < slow["compute_utilization"] < fast["compute_utilization"] <= 1


def test_calibration_splits_plain_and_sync_steps(tmp_path: Path):
    (tmp_path / "summary.json").write_text(json.dumps({"backend": "fake"}))
    steps = [{"step": s, "step_time_s": 0.2 + (0.05 if s % 4 == 3 else 0.0), "synced": s % 4 == 3} for s in range(12)]
    steps[0]["step_time_s"] = steps[2]["step_time_s"] = 9.0  # allocation and the memory probe: skipped
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps))
    compute = read_fake_run(str(tmp_path))
    assert compute.step_s == pytest.approx(0.2) and compute.sync_s == pytest.approx(0.05)


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_bad_input_exits_2_with_one_line(fake_run: Path, tmp_path: Path, capsys):
    config = str(fake_run / "config.yaml")
    assert "--inter" in one_line_error(capsys, [config, "--inter", "20mbps"])
    assert "--latency" in one_line_error(capsys, [config, "--inter", "20mbit", "--latency", "-5"])
    gloo = tmp_path / "gloo"
    shutil.copytree(fake_run, gloo)
    summary = json.loads((gloo / "summary.json").read_text())
    (gloo / "summary.json").write_text(json.dumps({**summary, "backend": "gloo"}))
    line = one_line_error(capsys, [config, "--inter", "20mbit", "--calibrate", str(gloo)])
    assert "not a mesh.backend=fake run" in line
    line = one_line_error(capsys, [config, "--inter", "20mbit", "--calibrate", str(tmp_path / "nothing")])
    assert "--calibrate" in line
    line = one_line_error(
        capsys, [config, "--inter", "20mbit", "--calibrate", str(fake_run), "--set", "model.n_layer=3"]
    )
    assert "model" in line


def test_bandwidth_for_a_utilization_reaches_it(fake_run: Path, capsys):
    """--for-utilization's rate gives that utilisation (±1%), with compute given as --compute-s."""
    config = str(fake_run / "config.yaml")
    assert main([config, "--inter", "1gbit", "--compute-s", "0.1", "--intra", "free", "--for-utilization", "0.9"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 90% |"))
    value, unit = row.split("|")[2].split()
    bps = float(value) * {"kbit/s": 1e3, "Mbit/s": 1e6, "Gbit/s": 1e9}[unit]
    assert main([config, "--inter", f"{bps / 1e6}mbit", "--compute-s", "0.1", "--intra", "free", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compute_utilization"] == pytest.approx(0.9, abs=0.01)
    line = one_line_error(capsys, [config, "--inter", "1gbit", "--compute-s", "0.1", "--calibrate", str(fake_run)])
    assert "one source of compute" in line


def test_measured_shard_collectives_are_used():
    """Measured intra times replace the rate: on a CPU (shares_compute) every gather and reduce-scatter
    of the step lands on the compute clock; off it, the prefetched gathers hide behind compute."""
    units = tuple(Unit(held=1000, flops_share=1 / 3, embedding=i == 0) for i in range(3))
    w = dataclasses.replace(one_unit_workload(3000, 2, SyncConfig(warmup_steps=0, every=4), 1), units=units, S=2)
    took = {"all_gather": 0.010, "reduce_scatter": 0.003}
    seen = []

    def time_of(m) -> float:
        seen.append(m)
        return took[m.op]

    free_inter, compute = Link(float("inf"), 0.0, None, 1.0), Compute(step_s=1.0)
    step = lambda intra: predict(w, dataclasses.replace(free_inter, intra_measured=intra), compute, 8).step_time_s  # noqa: E731
    assert step(None) == pytest.approx(1.0)
    on_cpu = step(MeasuredIntra(time_of, shares_compute=True))
    # forward gathers all 3 units, backward re-gathers the 2 non-embedding ones, each unit is reduce-scattered
    assert on_cpu == pytest.approx(1.0 + 5 * took["all_gather"] + 3 * took["reduce_scatter"])
    assert {m.op for m in seen} == set(took) and {m.nbytes for m in seen} == {1000 * 4}  # (S − 1)·held·4 bytes
    beside = step(MeasuredIntra(time_of, shares_compute=False))
    assert 1.0 < beside < on_cpu  # the first gather and the last reduce-scatter cannot be hidden


def test_plan_times_the_shard_group_unless_intra_is_given(fake_run: Path, capsys, monkeypatch):
    """The default intra link is the collectives timed on the mesh (an injected timing here), said in the
    output; --intra RATE, --intra free and projections (--gpu) do not time it."""
    calls = []

    def fake_measure(cfg):
        calls.append((cfg.mesh.sync, cfg.mesh.shard))
        return MeasuredIntra(lambda m: 0.002, shares_compute=True, source="injected")

    monkeypatch.setattr(plan_cli, "measure_shard_collectives", fake_measure)
    config = str(fake_run / "config.yaml")
    base = [config, "--inter", "1000000gbit", "--compute-s", "0.1", "--json"]
    assert main(base) == 0
    measured = json.loads(capsys.readouterr().out)
    assert calls == [(2, 2)] and measured["intra"] == "measured: injected; on the cores that compute: not overlapped"
    assert main([*base, "--intra", "free"]) == 0
    free = json.loads(capsys.readouterr().out)
    assert free["intra"] == "free (--intra free)" and len(calls) == 1
    units = len(build_workload(load_config(config)).units)
    per_step = (3 * units - 1) * 0.002  # U gathers forward, U − 1 re-gathers backward, U reduce-scatters
    assert measured["step_time_s"] - free["step_time_s"] == pytest.approx(per_step, rel=1e-6)
    assert main([*base, "--intra", "10gbit"]) == 0
    assert json.loads(capsys.readouterr().out)["intra"] == "rate: --intra 10gbit" and len(calls) == 1
    assert main([config, "--inter", "1gbit", "--gpu", "H100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["intra"] == "free (projection)" and len(calls) == 1


@pytest.mark.timeout(120)
def test_shard_collectives_are_timed_on_a_real_gloo_group(fake_run: Path):
    """A 1×2 mesh on loopback gloo times each distinct gather and reduce-scatter of the config's units."""
    cfg = load_config(str(fake_run / "config.yaml"), ["mesh.sync=1"])
    intra = measure_shard_collectives(cfg, reps=2)
    w = build_workload(cfg)
    wanted = {
        (m.op, m.nbytes) for u in range(len(w.units)) for m in (w.gather_messages(u), w.reduce_scatter_message(u))
    }
    assert {(r["op"], r["nbytes"]) for r in intra.table["times"]} == wanted
    assert intra.shares_compute and intra.table["backend"] == "gloo" and intra.table["mesh"] == [1, 2]
    assert all(intra.time_of(w.gather_messages(u)) > 0 for u in range(len(w.units)))
