"""hsdp.slowlink (hsdp.bench): shaped veths between namespaces, a probe through them, a 2-replica run, plots.

Namespace tests need root and iproute2 (CI here has both) and are skipped otherwise. Every
subprocess has a timeout, and every test removes what it (or the slowlink it started) created,
also when it fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hsdp import slowlink, sweep
from hsdp.bench import analysis, netns, plot, probe
from hsdp.bench.plan import LinkPlan
from hsdp.bench.records import LinkRun, LoggedStep, Measured
from hsdp.bench.spec import LinkRunSpec, parse_rate
from hsdp.config.schema import ConfigError

REPO = Path(__file__).resolve().parents[1]
needs_netns = pytest.mark.skipif(netns.missing_requirements() is not None, reason=netns.missing_requirements() or "")
# A small job: 2 replicas x 1 shard, synthetic data, a 2-layer GPT (a step is ~10 ms of compute).
SMOKE = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "model.seq_len=64",
    "data.source=synthetic",
    "data.batch_size=4",
    "mesh.sync=2",
    "mesh.shard=1",
    "run.steps=10",
    "run.log_every=1",
    "run.eval_every=5",
    "run.eval_batches=1",
    "wandb.mode=disabled",
    "mesh.timeout_s=60",
    # configs/tiny.yaml's default run warms up and then syncs with DiLoCo: the runs below are exact HSDP
    # unless they set sync.warmup_steps, and plain averaging when they do
    "sync.warmup_steps=null",
    "sync.method=average",
    "sync.every=1",
]


@pytest.fixture
def removes_leftovers():
    """Yields a list; every prefix appended to it has its namespaces removed at the end, pass or fail."""
    prefixes: list[str] = []
    yield prefixes
    for prefix in prefixes:
        for ns in netns.list_namespaces():
            if ns.startswith(prefix) and ns[len(prefix) :][:1].isalpha():  # hsl<pid> must not match hsl<pid>7...
                for pid in netns.namespace_pids(ns):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 9)
                subprocess.run(["ip", "netns", "del", ns], timeout=30)


def test_parse_rate():
    assert parse_rate("20mbit") == ("20mbit", 20_000_000)
    assert parse_rate("1gbit") == ("1gbit", 10**9)
    assert parse_rate("unshaped") == ("unshaped", None)
    for bad in ("20", "fast", "-1mbit", "0mbit"):
        with pytest.raises(ConfigError):
            parse_rate(bad)


def test_time_to_target_uses_cumulative_step_times():
    records = [{"step": s, "step_time_s": 0.5, "tokens": (s + 1) * 10, "sync_bytes": s} for s in range(6)]
    records[2]["val_loss"], records[5]["val_loss"] = 3.0, 2.0
    records = [LoggedStep.from_json(r) for r in records]
    assert dataclasses.asdict(analysis.time_to_target(records, 2.5)) == {
        "step_to_target": 5,
        "tokens_to_target": 60,
        "sync_bytes_to_target": 5,
        "time_to_target_s": 3.0,
    }
    assert analysis.time_to_target(records, 1.0).step_to_target is None
    assert analysis.time_to_target(records[::2], 2.5).time_to_target_s is None  # not every step logged


def test_exit_2_without_ip_or_tc(tmp_path, monkeypatch, capsys):
    """No `ip`/`tc` on PATH (or no root): one line on stderr, exit 2, nothing started (the command's main)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: neither ip nor tc
    assert slowlink.main(["--rate", "20mbit", "--runs", "a="]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "iproute2" in err
    assert out == ""


@needs_netns
@pytest.mark.parametrize("replicas", [2, 3])  # 3: one veth per replica into a bridge in its own namespace
def test_namespaces_shaping_probe_and_teardown(tmp_path, removes_leftovers, replicas):
    """Build the network, see the qdisc, time an all_reduce through it (bytes/rate), remove it all."""
    link = netns.SlowLink(replicas, 40_000_000)
    removes_leftovers.append(link.prefix)
    try:
        link.up()
        assert set(link.namespaces) <= set(netns.list_namespaces())
        assert "tbf" in link.qdiscs() and "40Mbit" in link.qdiscs()
        assert (link.bridge_ns in netns.list_namespaces()) == (replicas > 2)
        result = probe.run_probe(
            link, shard=1, seconds=0.4, reps=2, port=29391, log_dir=tmp_path, label="40mbit", timeout_s=90
        )
        assert result.expected_s == pytest.approx(result.ring_bytes * 8 / 40e6)
        # The fastest rep is the link's own time: a busy box only adds to it (the suite's 3 workers on 2 cores
        # once made a rep 1.6x, the mean 1.4x). Not faster than 0.7x bytes/rate: the shaping holds; under 3x:
        # the rate is not off by a unit (an unshaped veth is ~100x faster, a kbit/Mbit slip 1000x slower).
        assert 0.7 <= min(result.sync_s) / result.expected_s <= 3.0, result
    finally:
        left = link.down()
    assert left == []
    assert not [ns for ns in netns.list_namespaces() if ns.startswith(link.prefix)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    assert link.prefix not in links


@needs_netns
def test_smoke_run_through_shaped_link(tmp_path, removes_leftovers):
    """2 replicas x 1 shard, 10 steps, through a 100 Mbit/s link: slowlink.json with the run, no namespace left."""
    cmd = [
        sys.executable,
        "-m",
        "hsdp.slowlink",
        "--rate",
        "100mbit",
        "--no-probe",
        "--timeout-s",
        "120",
        "--set",
        f"run.out_dir={tmp_path / 'runs'}",
        "--out",
        str(tmp_path / "out"),
        "--name",
        "smoke",
        "--runs",
        "hsdp=",
        "periodic=sync.warmup_steps=0,sync.every=5",
    ]
    for o in SMOKE:
        cmd[3:3] = ["--set", o]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    removes_leftovers.append(f"{netns.PREFIX}{proc.pid}")  # (a pid prefix: only its own names match)
    try:
        out, _ = proc.communicate(timeout=300)  # the hang guard: two runs of at most --timeout-s 120 each
    finally:
        if proc.poll() is None:
            proc.terminate()  # its handler removes the namespaces; the fixture makes sure
            proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    report = json.loads((tmp_path / "out" / "slowlink.json").read_text())
    runs = {r["run"]: r for r in report["runs"]}
    assert set(runs) == {"hsdp", "periodic"}
    for r in runs.values():
        assert r["rate"] == "100mbit" and r["steps"] == 10 and r["final_val_loss"] > 0
        assert r["sync_bytes"] > 0 and r["mean_step_s"] > 0
        # everything the sync group sent crossed the veths (plus headers, rendezvous and logging)
        assert 1.0 <= r["link_over_sync"] < 1.5, r
    assert runs["periodic"]["sync_bytes"] < runs["hsdp"]["sync_bytes"] / 4
    assert runs["hsdp"]["time_to_target_s"] == pytest.approx(runs["hsdp"]["train_time_s"], rel=1e-6)
    assert (tmp_path / "runs" / "smoke-hsdp-100mbit" / "summary.json").is_file()
    assert "| hsdp | 100 Mbit/s | 10 |" in out
    assert netns.names_of_pid(proc.pid) == []


def _fake_run(run_dir: Path, steps: int, sync_per_step: int, loss0: float, log_every: int = 1) -> None:
    """A run folder as train.py leaves it (config.yaml, metrics.jsonl, summary.json), without training."""
    from hsdp.config.loader import load_config, save_config

    run_dir.mkdir(parents=True)
    cfg = load_config(
        str(REPO / "configs" / "tiny.yaml"),
        [f"run.steps={steps}", f"run.log_every={log_every}", "run.eval_every=4", f"run.name={run_dir.name}"],
    )
    save_config(cfg, run_dir / "config.yaml")
    records = []
    for s in range(steps):
        if s % log_every and (s + 1) % 4 and s != steps - 1:
            continue
        r = {
            "step": s,
            "loss": loss0 - 0.1 * s,
            "tokens": (s + 1) * 4096,
            "step_time_s": 0.25,
            "sync_bytes": (s + 1) * sync_per_step,
        }
        if (s + 1) % 4 == 0 or s == steps - 1:
            r["val_loss"] = loss0 - 0.1 * s
        records.append(r)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "final_val_loss": records[-1]["val_loss"],
                "sync_bytes": steps * sync_per_step,
                "steps": steps,
                "tokens": steps * 4096,
                "median_step_time_s": 0.25,
                "train_time_s": 0.25 * steps,
                "wall_time_s": 3.0,
                "shard_bytes": 0,
                "comm": {},
            }
        )
    )


def test_sweep_plot_from_existing_run_folders(tmp_path, monkeypatch, capsys):
    """`python -m hsdp.sweep SPEC --plot --no-run` (its main, run from the folder) draws the four PNGs from run
    folders already there."""
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    _fake_run(runs / "s-hsdp", 8, 1000, 5.0)
    _fake_run(runs / "s-periodic", 16, 50, 5.2)
    _fake_run(runs / "s-sparse", 16, 50, 5.3, log_every=4)  # no wall-clock curve: not every step logged
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\nset: [run.out_dir={runs}]\n"
        "columns: [final_val_loss, sync_bytes]\nruns:\n  hsdp: []\n  periodic: []\n  sparse: []\n"
    )
    monkeypatch.chdir(tmp_path)
    code = sweep.main([str(spec), "--plot", "--no-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    pngs = sorted(p.name for p in runs.glob("*.png"))
    assert pngs == ["s-pareto.png", "s-sync_bytes.png", "s-tokens.png", "s-wall.png"], (pngs, out)
    for name in pngs:
        assert (runs / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sparse" in out  # named as left out of the wall-clock plot
    assert "| hsdp |" in out  # the table is still printed


def test_slowlink_plots_from_results(tmp_path):
    """The slowlink tool's plots: one set per rate, from its run folders."""
    pytest.importorskip("matplotlib")
    _fake_run(tmp_path / "sl-hsdp-20mbit", 8, 1000, 5.0)
    _fake_run(tmp_path / "sl-periodic-20mbit", 16, 50, 5.2)
    plan = LinkPlan(
        name="sl",
        base="",
        shared=[],
        rates=[("20mbit", 20_000_000)],
        default_rates=["20mbit"],
        delay_ms=0,
        target="hsdp",
        timeout_s=1,
        probe_s=1,
        runs={"hsdp": LinkRunSpec([]), "periodic": LinkRunSpec([])},
        out=tmp_path / "out",
        out_dir=tmp_path,
        mesh=(2, 2),
    )
    results = [
        LinkRun.read(run, "20mbit", 20_000_000, 0, tmp_path / f"sl-{run}-20mbit", Measured())
        for run in ("hsdp", "periodic")
    ]
    periodic = analysis.evaluate_results(plan, results)[("periodic", "20mbit")]
    # target 5.0 - 0.7 = 4.3 (hsdp, 8 steps); periodic: 5.2 - 0.1·s <= 4.3 from s = 9, first eval there at s = 11
    assert periodic.reached.step_to_target == 11 and periodic.time_to_target_s == pytest.approx(12 * 0.25)
    written = plot.plot_rates(plan, results)
    assert sorted(p.name for p in written) == [
        "sl-20mbit-pareto.png",
        "sl-20mbit-sync_bytes.png",
        "sl-20mbit-tokens.png",
        "sl-20mbit-wall.png",
    ]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_slowlink_no_run_tables_and_plots_from_outputs(tmp_path, monkeypatch, capsys):
    """`--no-run --plot` (no root needed; the command's main): slowlink.json/.md and the PNGs from run folders
    already there."""
    pytest.importorskip("matplotlib")
    runs = tmp_path / "runs"
    _fake_run(runs / "sl-hsdp-20mbit", 8, 1000, 5.0)
    _fake_run(runs / "sl-periodic-20mbit", 16, 50, 5.2)
    spec = tmp_path / "sl.yaml"
    spec.write_text(
        f"base: {REPO / 'configs' / 'tiny.yaml'}\nset: [run.out_dir={runs}]\nrates: [20mbit]\n"
        "runs:\n  hsdp: []\n  periodic: [sync.warmup_steps=0, sync.every=4]\n"
    )
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip/tc: --no-run does not need them
    code = slowlink.main([str(spec), "--no-run", "--plot"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((runs / "sl" / "slowlink.json").read_text())
    periodic = report["runs"][1]
    assert periodic["run"] == "periodic" and periodic["step_to_target"] == 11
    assert periodic["sync_bytes_to_target"] == 12 * 50
    assert sorted(p.name for p in (runs / "sl").glob("*.png")) == [
        "sl-20mbit-pareto.png",
        "sl-20mbit-sync_bytes.png",
        "sl-20mbit-tokens.png",
        "sl-20mbit-wall.png",
    ]
    assert "| periodic | 20 Mbit/s | 16 |" in out


@pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2")
def test_no_leftovers_from_this_module():
    """Nothing named by this test process is left (the fixtures above clean up on failure too)."""
    assert netns.names_of_pid(os.getpid()) == []


def test_pareto_front_keeps_the_runs_nothing_beats() -> None:
    from hsdp.bench.plot import pareto_front

    points = {"a": (10.0, 3.0), "b": (100.0, 2.5), "c": (50.0, 2.9), "d": (200.0, 2.6), "e": (10.0, 3.5)}
    assert pareto_front(points) == ["a", "c", "b"]  # d costs more than b and is worse; e ties a on bytes, worse


def test_kill_flag_is_checked_before_anything_runs(tmp_path):
    """`--kill` / a run's `kill:`: REPLICA@STEP (a fraction of run.steps below 1; REPLICA@STEP:kill in the fault
    grammar), only for elastic runs, at a step, on any replica of mesh.sync (0 too: no replica holds the lighthouse or
    the run folder), before run.steps; each refusal names the key."""
    from hsdp.bench.faults import flag_fault
    from hsdp.bench.plan import LinkOptions, make_plan
    from hsdp.config.loader import load_config
    from hsdp.faults.spec import parse_fault

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["elastic.enabled=true", "sync.warmup_steps=0"])
    assert flag_fault("kill", "1@0.3", cfg, "--kill") == parse_fault(f"1@{int(0.3 * cfg.run.steps)}:kill")
    assert flag_fault("kill", "1@77", cfg, "--kill") == parse_fault("1@77:kill")
    assert flag_fault("kill", "0@3", cfg, "--kill") == parse_fault("0@3:kill")
    for text, why in [("1", "REPLICA@STEP"), ("x@3", "REPLICA@STEP"), ("2@3", "replica 2 is not one of 0..1"),
                      ("1@t30", "places a kill at a step"), ("1@3.5", "a STEP is a whole number")]:  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            flag_fault("kill", text, cfg, "--kill")
    with pytest.raises(ConfigError, match="before run.steps"):
        flag_fault("kill", f"1@{cfg.run.steps}", cfg, "--kill")
    plain = load_config(str(REPO / "configs" / "tiny.yaml"), [])
    with pytest.raises(ConfigError, match="elastic.enabled=true"):
        flag_fault("kill", "1@3", plain, "runs.x.kill")

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "base: tiny.yaml\nrates: [20mbit]\nruns:\n  plain: []\n"
        "  el: {set: [elastic.enabled=true, sync.warmup_steps=0], kill: '1@0.5'}\n"
    )
    shutil.copy(REPO / "configs" / "tiny.yaml", tmp_path / "tiny.yaml")
    plan = make_plan(LinkOptions(spec=str(spec), shared=[f"run.out_dir={tmp_path}"]))
    assert plan.kills == {"el": parse_fault(f"1@{cfg.run.steps // 2}:kill")}
    with pytest.raises(ConfigError, match="--kill: no run is elastic"):
        make_plan(LinkOptions(rate="20mbit", runs=["plain="], kill="1@3", shared=[f"run.out_dir={tmp_path}"]))
    spec.write_text("base: tiny.yaml\nrates: [20mbit]\nruns:\n  plain: {set: [], kill: '1@3'}\n")
    with pytest.raises(ConfigError, match="runs.plain.kill: a kill needs an elastic run"):
        make_plan(LinkOptions(spec=str(spec), shared=[f"run.out_dir={tmp_path}"]))


KILL_RUN_STEPS = 48  # the kill is at step 8


@needs_netns
def test_elastic_run_through_the_link_survives_a_killed_node(tmp_path, removes_leftovers, capsys):
    """An elastic run (tiny model, 2 replicas x 1 shard) across the shaped link with replica 1's node
    SIGKILLed at its step 8: the lighthouse runs on a host (namespace) of its own, a replacement node heals
    from replica 0, the run exits 0, and the report reads replica 0's metrics (every step once) and the
    merged summary's failure and heal. (The run is long enough for the replacement to start and join: 40
    steps after the kill, each made 3× as long by run.slowdown's sleep, leave it the time 120 steps at full
    speed would, for a third of their CPU.)
    The command's main runs in this process (the CLI itself: test_smoke_run_through_shaped_link); its
    nodes are bounded by --timeout-s, and it removes its namespaces (the fixture makes sure)."""
    argv = ["--rate", "100mbit", "--no-probe", "--timeout-s", "400"]
    argv += ["--config", str(REPO / "configs" / "tiny.yaml"), "--out", str(tmp_path / "out"), "--name", "kill"]
    argv += ["--kill", "1@8"]
    settings = ["mesh.sync=2", "mesh.shard=1", f"run.steps={KILL_RUN_STEPS}", "run.log_every=1", "run.eval_every=16"]
    settings += ["run.slowdown=3"]
    settings += ["run.eval_batches=1", "wandb.mode=disabled", f"run.out_dir={tmp_path / 'runs'}", "elastic.timeout_s=3"]
    for o in settings:
        argv += ["--set", o]
    argv += ["--runs", "el=sync.warmup_steps=0,sync.every=8,sync.method=diloco,elastic.enabled=true"]
    before = set(netns.names_of_pid(os.getpid()))
    removes_leftovers.append(f"{netns.PREFIX}{os.getpid()}")  # (only names of this process's pid match)
    code = slowlink.main(argv)
    out, err = capsys.readouterr()
    assert code == 0, (out + err)[-3000:]
    assert "killed replica 1's node at its step" in out
    run_dir = tmp_path / "runs" / "kill-el-100mbit"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["replica_failures"] == 1 and summary["heals"] >= 1, summary
    steps0 = [json.loads(line)["step"] for line in (run_dir / "metrics.replica0.jsonl").read_text().splitlines()]
    assert steps0 == list(range(KILL_RUN_STEPS))
    steps1 = [json.loads(line)["step"] for line in (run_dir / "metrics.replica1.jsonl").read_text().splitlines()]
    assert steps1 == sorted(set(steps1)) and steps1[-1] == KILL_RUN_STEPS - 1  # each step once, trained to the end
    report = {r["run"]: r for r in json.loads((tmp_path / "out" / "slowlink.json").read_text())["runs"]}
    assert report["el"]["steps"] == KILL_RUN_STEPS and report["el"]["train_time_s"] > 0
    assert set(netns.names_of_pid(os.getpid())) <= before


def test_pin_cores_comes_from_the_spec_or_the_flag_and_needs_a_core_per_node(tmp_path, monkeypatch):
    """`pin_cores: true` in the spec or `--pin-cores`; refused in one line when there are more nodes than cores,
    and a non-boolean spec value names the key."""
    from hsdp.bench import plan as plan_module
    from hsdp.bench.plan import LinkOptions, make_plan

    shutil.copy(REPO / "configs" / "tiny.yaml", tmp_path / "tiny.yaml")
    spec = tmp_path / "spec.yaml"
    shared = [f"run.out_dir={tmp_path}", "mesh.sync=2"]
    spec.write_text("base: tiny.yaml\nrates: [20mbit]\nruns:\n  a: []\n")
    assert not make_plan(LinkOptions(spec=str(spec), shared=shared)).pin_cores
    assert make_plan(LinkOptions(spec=str(spec), shared=shared, pin_cores=True)).pin_cores
    spec.write_text("base: tiny.yaml\nrates: [20mbit]\npin_cores: true\nruns:\n  a: []\n")
    assert make_plan(LinkOptions(spec=str(spec), shared=shared)).pin_cores
    monkeypatch.setattr(plan_module.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ConfigError, match="--pin-cores: 2 nodes need a CPU core each, this process may use 1"):
        make_plan(LinkOptions(spec=str(spec), shared=shared))
    spec.write_text("base: tiny.yaml\nrates: [20mbit]\npin_cores: 'yes'\nruns:\n  a: []\n")
    with pytest.raises(ConfigError, match="pin_cores: .*expected true or false"):
        make_plan(LinkOptions(spec=str(spec), shared=shared))


@needs_netns
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning two replicas needs two cores")
def test_a_pinned_replica_runs_on_its_own_core(removes_leftovers):
    """With pin_cores, what replica m's namespace runs may use the m-th core only (as if a machine of its own)."""
    link = netns.SlowLink(2, 40_000_000, pin_cores=True)
    removes_leftovers.append(link.prefix)
    cores = sorted(os.sched_getaffinity(0))
    try:
        link.up()
        for m in range(2):
            cmd = [*link.exec_prefix(m), sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
            assert json.loads(out) == [cores[m]]
    finally:
        assert link.down() == []


def test_an_elastic_runs_val_series_is_the_replicas_mean(tmp_path):
    """An elastic run's metrics: replica 0's steps, each val loss the mean over the replicas that evaluated at
    that step (what the merged final_val_loss is), so the time to the target is read off the same quantity;
    a torn last line is skipped."""
    from hsdp.bench.records import read_metrics

    def line(step: int, val: object) -> str:
        return json.dumps({"step": step, "step_time_s": 0.1, "tokens": 8 * (step + 1), "val_loss": val})

    (tmp_path / "metrics.replica0.jsonl").write_text("\n".join([line(0, None), line(1, 2.4), line(2, 2.2)]) + "\n")
    # replica 1 was down at step 1 (no val there) and has a torn last line
    (tmp_path / "metrics.replica1.jsonl").write_text(line(0, None) + "\n" + line(2, 2.0) + '\n{"step": 3, "val')
    steps = read_metrics(tmp_path)
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.val_loss for s in steps] == [None, 2.4, pytest.approx(2.1)]
    (tmp_path / "metrics.jsonl").write_text(line(0, 3.0) + "\n")  # a plain run: its own file, as it is
    assert [s.val_loss for s in read_metrics(tmp_path)] == [3.0]
