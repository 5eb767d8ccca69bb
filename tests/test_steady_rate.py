"""summary.json's rates: the steady rate (tokens_per_s, mfu: tokens per step over the median step time) and
the whole-run rate beside it (wall_tokens_per_s, wall_mfu), from recorded step times (no clock read here);
an elastic run's merge; the running median behind the progress bar; and one real run whose first step is
made slow (train.py with the first batch delayed), whose summary must hold the same definitions.

    python tests/test_steady_rate.py [train.py arguments ...]   (that run's script: train.py, first step slow)
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as the slow-first-step train.py (run_train's script): the repo's modules
    sys.path.insert(0, str(REPO))

from hsdp.config.loader import load_config  # noqa: E402
from hsdp.models import gpt  # noqa: E402
from hsdp.run.metrics import RATE_BASIS, RunningMedian, merged_rates, run_rates, steady_rate  # noqa: E402

FIRST_STEP_DELAY_S = 2.0  # what the run below adds to its first step (its batch arrives that much later)

# What a compiled run records: the first step compiles, the third is the memory-probed one, the rest steady.
COMPILED_RUN = [41.7, 0.212, 0.93, 0.101, 0.099, 0.1, 0.102, 0.098, 0.1, 0.1, 0.101, 0.099]


def test_the_steady_rate_is_tokens_per_step_over_the_median_step():
    tokens_per_step = 16 * 1024
    tokens = tokens_per_step * len(COMPILED_RUN)
    rates = run_rates(COMPILED_RUN, tokens_per_step, tokens, sum(COMPILED_RUN), tokens)
    median = statistics.median(COMPILED_RUN)
    assert rates["median_step_time_s"] == median == pytest.approx(0.1005)
    assert rates["tokens_per_s"] == pytest.approx(tokens_per_step / median, rel=1e-12)
    assert rates["tokens_per_step"] == tokens_per_step and rates["rate_basis"]["tokens_per_s"] == RATE_BASIS
    # the whole-run rate counts the compile: ~14x lower here, as the GPU run of the issue (28,895 vs 443,000)
    assert rates["wall_tokens_per_s"] == pytest.approx(tokens_per_step * len(COMPILED_RUN) / sum(COMPILED_RUN))
    assert rates["tokens_per_s"] > 10 * rates["wall_tokens_per_s"]


def test_without_slow_steps_the_two_rates_agree_and_without_steps_there_is_none():
    even = [0.25] * 8
    rates = run_rates(even, 100, 800, sum(even), 800)
    assert rates["tokens_per_s"] == pytest.approx(rates["wall_tokens_per_s"]) == pytest.approx(400.0)
    empty = run_rates([], 100, 0, 0.0, 0)
    assert empty["tokens_per_s"] is None and empty["wall_tokens_per_s"] is None and empty["median_step_time_s"] is None
    assert steady_rate(100, 1, None) is None and steady_rate(100, 1, 0.0) is None and steady_rate(100, 1, 0.5) == 200.0
    assert steady_rate(300, 3, 0.5) == 200.0 and steady_rate(0, 0, 0.5) is None


def test_skipped_steps_train_no_tokens_and_are_not_in_the_median():
    """A paced replica's skipped steps (near-zero time, no tokens) would make the median step 0.2 ms and the
    steady rate millions of tokens a second: only trained steps and their tokens count."""
    trained = [0.2] * 6  # 6 steps trained of 48 nominal, 100 tokens each
    rates = run_rates(trained, 400, 600, 48 * 0.025, 600)
    assert rates["median_step_time_s"] == 0.2 and rates["tokens_per_s"] == pytest.approx(500.0)
    assert rates["wall_tokens_per_s"] == pytest.approx(600 / 1.2)


def test_a_resumed_run_counts_its_earlier_steps_in_both_rates():
    """A resumed run's step times include its checkpoint's; its tokens and train time likewise."""
    before, after = [9.0, 0.2, 0.2, 0.2], [5.0, 0.2, 0.2, 0.2, 0.2]  # two lives, each starts with a compile
    rates = run_rates(before + after, 10, 10 * 9, sum(before + after), 10 * 9)
    assert rates["median_step_time_s"] == 0.2 and rates["tokens_per_s"] == pytest.approx(50.0)
    assert rates["wall_tokens_per_s"] == pytest.approx(90 / 15.4)


def test_mfu_follows_the_steady_rate_and_wall_mfu_the_wall_rate(monkeypatch):
    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.seq_len=32"])
    monkeypatch.setattr(gpt, "peak_flops", lambda device, dtype: 1e12)  # a 1 TFLOP/s device
    out = gpt.throughput(cfg, 2000.0, torch.device("cpu"), 500.0)
    per_token = out["flops_per_token"]
    assert out["mfu"] == round(per_token * 2000.0 / (1e12 * cfg.world_size), 4)
    assert out["wall_mfu"] == round(per_token * 500.0 / (1e12 * cfg.world_size), 4)
    assert gpt.throughput(cfg, 2000.0, torch.device("cpu"))["wall_mfu"] is None  # no wall rate given
    monkeypatch.undo()
    on_cpu = gpt.throughput(cfg, 2000.0, torch.device("cpu"), 500.0)  # no peak for a CPU
    assert on_cpu["mfu"] is None and on_cpu["wall_mfu"] is None


def test_an_elastic_merge_keeps_the_first_replicas_steady_rate_and_scales_the_wall_mfu():
    first = {"tokens_per_s": 400.0, "mfu": 0.4, "wall_tokens_per_s": 100.0}
    merged = merged_rates(first, trained=2200, train_time_s=10.0)
    assert merged == {"tokens_per_s": 400.0, "mfu": 0.4, "wall_tokens_per_s": 220.0, "wall_mfu": 0.22}
    assert merged_rates({"tokens_per_s": None, "mfu": None}, 0, 0.0)["wall_mfu"] is None


def test_the_running_median_is_statistics_median_at_every_count():
    rng = random.Random(0)
    values = [rng.choice([0.1, 0.1, 0.2, 5.0, rng.random()]) for _ in range(301)]
    running = RunningMedian()
    assert running.value is None and len(running) == 0
    for i, v in enumerate(values, 1):
        running.add(v)
        assert running.value == statistics.median(values[:i]) and len(running) == i
    assert RunningMedian(values[:10]).value == statistics.median(values[:10])  # seeded with a resumed run's


# ----------------------------------------------------------------------------- one real run, first step slow


def slow_first_step_worker(cfg, seat=None) -> None:
    """train.train_worker, with the batch of the run's first step FIRST_STEP_DELAY_S late (a slow step 0,
    as a compile makes it, on any machine)."""
    import train
    from hsdp.data.tokens import Data

    real = Data.train_batch

    def train_batch(self: Data, step: int, micro: int):
        if step == 0 and micro == 0:
            time.sleep(FIRST_STEP_DELAY_S)
        return real(self, step, micro)

    Data.train_batch = train_batch
    train.train_worker(cfg, seat)


def test_a_runs_summary_rate_is_tokens_per_step_over_its_median_step(tmp_path):
    from tests.helpers import SMALL, run_train

    steps = 8
    sets = [*SMALL, "run.save_model=false", "mesh.sync=1", "mesh.shard=1", f"run.steps={steps}"]
    # a plain subprocess (env given), not the warm train server: one run, and its start-up is not timed
    run = run_train(tmp_path, "slow-first", sets, script=["tests/test_steady_rate.py"], env={"HSDP_NO_BAR": "1"})
    records, s = run.metrics, run.summary
    times = [r["step_time_s"] for r in records]  # run.log_every=1: every step's time
    assert [r["step"] for r in records] == list(range(steps))
    assert times[0] >= FIRST_STEP_DELAY_S  # the delay is inside the first step's time
    tokens_per_step = 2 * 17  # SMALL: data.batch_size 2, model.seq_len 17, one rank, no accumulation
    assert s["tokens_per_step"] == tokens_per_step and s["tokens"] == steps * tokens_per_step
    assert s["median_step_time_s"] == statistics.median(times)
    assert s["tokens_per_s"] == pytest.approx(tokens_per_step / statistics.median(times), rel=1e-9)
    assert s["rate_basis"] == {"tokens_per_s": RATE_BASIS, "wall_tokens_per_s": "tokens / train_time_s"}
    assert s["wall_tokens_per_s"] == pytest.approx(s["tokens"] / sum(times), rel=1e-9)
    # the slow first step is in the whole-run rate, not in the steady one
    assert times[0] > statistics.median(times) and s["wall_tokens_per_s"] < s["tokens_per_s"]
    # the metrics records carry the steady rate so far (the progress bar's): the last one is the summary's
    assert records[-1]["tokens_per_s"] == pytest.approx(s["tokens_per_s"], rel=1e-9)


if __name__ == "__main__":
    import train

    sys.exit(train.main(sys.argv[1:], worker=slow_first_step_worker))
