"""The slow-link benchmark's compute utilisation: the plan's sync-free step time ÷ each run's mean step time."""

from __future__ import annotations

import json
from pathlib import Path

from hsdp.bench import analysis, report
from hsdp.bench.plan import LinkPlan, LinkRunSpec
from hsdp.bench.records import LinkRun, Measured


def _run(run_dir: Path, step_times: list[float], synced: list[bool]) -> None:
    """A run folder with one metrics line per step (cumulative sync bytes grow on the synced steps)."""
    run_dir.mkdir(parents=True)
    sent, lines = 0, []
    for s, (t, sync) in enumerate(zip(step_times, synced, strict=True)):
        sent += 1000 if sync else 0
        lines.append({"step": s, "loss": 5.0 - 0.1 * s, "tokens": (s + 1) * 64, "step_time_s": t, "sync_bytes": sent})
    lines[-1]["val_loss"] = 4.0
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"final_val_loss": 4.0, "sync_bytes": sent, "steps": len(lines), "tokens": len(lines) * 64}
    summary |= {"median_step_time_s": sorted(step_times)[len(step_times) // 2], "train_time_s": sum(step_times)}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "wall_time_s": 9.0, "shard_bytes": 0, "comm": {}}))


def test_compute_utilization_is_the_sync_free_step_over_each_runs_mean_step(tmp_path: Path) -> None:
    # hsdp syncs every step (1.0 s); diloco's local steps take 0.2 s and every 4th, with its sync, 1.4 s
    _run(tmp_path / "u-hsdp-20mbit", [1.0] * 8, [True] * 8)
    _run(tmp_path / "u-diloco-20mbit", [0.2, 0.2, 0.2, 1.4] * 2, [False, False, False, True] * 2)
    plan = LinkPlan(
        name="u",
        base="",
        shared=[],
        rates=[("20mbit", 20_000_000)],
        default_rates=["20mbit"],
        delay_ms=0,
        target="hsdp",
        timeout_s=1,
        probe_s=1,
        runs={"hsdp": LinkRunSpec([]), "diloco": LinkRunSpec([])},
        out=tmp_path / "out",
        out_dir=tmp_path,
        mesh=(2, 1),
    )
    runs = [
        LinkRun.read(run, "20mbit", 20_000_000, 0, tmp_path / f"u-{run}-20mbit", Measured())
        for run in ("hsdp", "diloco")
    ]
    assert runs[0].record.sync_free_step_s is None  # every step synced: no step of its own to measure compute by
    assert runs[1].record.sync_free_step_s == 0.2  # steps 1, 2, 5, 6 (step 4 follows a synced step 3: it sent 0)
    assessed = analysis.evaluate_results(plan, runs)
    hsdp, diloco = assessed[("hsdp", "20mbit")], assessed[("diloco", "20mbit")]
    assert abs(hsdp.compute_utilization - 0.2 / 1.0) < 1e-12
    assert abs(diloco.compute_utilization - 0.2 / 0.5) < 1e-12  # mean step (3 · 0.2 + 1.4) / 4 = 0.5
    assert diloco.to_json()["compute_utilization"] == diloco.compute_utilization
    table = "\n".join(report.runs_table(plan, runs, assessed))
    assert "compute util." in table and "| 0.40 |" in table and "| 0.20 |" in table, table
