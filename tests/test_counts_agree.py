"""One definition per count and rate (hsdp/run/ledger.py): summary.json, metrics.jsonl's last record and the
closing line count the same tokens (trained, not nominal), for a plain, a paced and an elastic run; an elastic
replica's ledger is the sum over its lives (hsdp/run/lives.py; a killed replica's lives: tests/test_elastic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SMALLER, RunResult, run_train

pytestmark = pytest.mark.timeout(600)

TINY = "configs/tiny.yaml"
BASE = [*SMALLER, "run.eval_every=0", "run.checkpoint_every=0", "run.log_every=5", "wandb.mode=disabled"]
DILOCO = ["sync.warmup_steps=2", "sync.every=6", "run.steps=20"]  # rounds after steps 7, 13, 19


def _last(run: RunResult, suffix: str = "") -> dict:
    import json

    lines = (run.run_dir / f"metrics{suffix}.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def _closing_rate(stderr_and_out: RunResult) -> None:
    """train.py prints its closing line on stdout; the warm server hands back stderr only, so the line is
    rebuilt from the summary the same way (train.closing_line) and its rate must be the summary's."""
    import train

    line = train.closing_line(19, stderr_and_out.run_dir / "summary.json")
    assert line is not None
    rate = float(line.split(" tok/s")[0].rsplit(", ", 1)[1].replace(",", ""))
    assert rate == pytest.approx(stderr_and_out.summary["tokens_per_s"], rel=1e-3)


def test_a_plain_run_counts_every_step(tmp_path: Path) -> None:
    run = run_train(tmp_path, "plain", [*BASE, *DILOCO], config=TINY)
    s, last = run.summary, _last(run)
    assert s["tokens"] == last["tokens"] == 20 * s["tokens_per_step"]
    assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["median_step_time_s"], rel=1e-9)
    assert s["wall_tokens_per_s"] == pytest.approx(s["tokens"] / s["train_time_s"], rel=1e-9)
    assert sum(e["trained_tokens"] for e in s["replica_ledger"].values()) == s["tokens"]
    _closing_rate(run)


def test_a_paced_run_counts_what_each_replica_trained(tmp_path: Path) -> None:
    """Replica 1 at 20x the step time behind a window that fits a few of its steps: the replicas train unequal
    steps. The last record, the summary and Σ of the replicas' ledgers agree, below the nominal count."""
    paced = ["sync.every_s=1.0", "run.slowdown=20", "run.slow_replica=1"]
    run = run_train(tmp_path, "paced", [*BASE, *DILOCO, *paced], config=TINY)
    s, last = run.summary, _last(run)
    ledgers = s["replica_ledger"]
    trained = {m: e["trained_tokens"] for m, e in ledgers.items()}
    assert trained["0"] > trained["1"], ledgers  # the slow replica trained fewer steps
    assert s["tokens"] == last["tokens"] == sum(trained.values()) < 20 * s["tokens_per_step"]
    assert s["trained_tokens"] == s["tokens"]
    assert s["wall_tokens_per_s"] == pytest.approx(s["tokens"] / s["train_time_s"], rel=1e-9)
    _closing_rate(run)


def test_an_elastic_run_counts_each_replicas_own_and_the_sum(tmp_path: Path) -> None:
    run = run_train(tmp_path, "elastic", [*BASE, *DILOCO, "elastic.enabled=true"], config=TINY, timeout=300)
    s = run.summary
    own = []
    for m in range(2):
        rs = RunResult(0, "", run.run_dir)
        last = _last(rs, f".replica{m}")
        import json

        mine = json.loads((run.run_dir / f"summary.replica{m}.json").read_text())
        assert mine["tokens"] == last["tokens"] and mine["trained_tokens"] == last["trained_tokens"]
        entry = s["replica_ledger"][str(m)]
        assert entry["trained_tokens"] == mine["trained_tokens"]  # one replica's share
        # one life (no restart), which trained every step and is the whole replica's
        assert entry["restarts"] == 0 and [x["life"] for x in entry["lives"]] == [0], entry
        life = entry["lives"][0]
        assert (life["first_step"], life["last_step"], life["ended"]) == (0, 19, "finished")
        assert (life["trained_tokens"], life["merged_tokens"]) == (entry["trained_tokens"], entry["merged_tokens"])
        assert last["life_trained_tokens"] == last["trained_tokens"] == life["trained_tokens"]
        own.append(mine["trained_tokens"])
    assert s["tokens"] == sum(own) == 20 * s["tokens_per_step"]
    assert s["tokens"] == sum(e["trained_tokens"] for e in s["replica_ledger"].values())
