"""Summaries that tell the truth: one definition per field across elastic and plain runs (round 3, item 4).

Unit tests of the definitions (given numbers, no wall clock), and one pair of small real runs: an elastic
run without failures reports the plain run's final losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsdp.config.loader import load_config, save_config
from hsdp.models.optim import lr_at
from hsdp.run.checkpoint import COMPLETE, FORMAT
from hsdp.run.lives import life_index, lives_of, over_lives
from hsdp.run.metrics import carried_counters, last_record, read_records
from hsdp.run.preflight import config_notes, resume_schedule_note
from hsdp.run.replicas import merge_replica_summaries
from hsdp.sync.elastic.transport import lost_in_touched_steps
from tests.helpers import REPO, SMALL, run_train

TINY = str(REPO / "configs/tiny.yaml")


def test_survivor_lost_time_from_its_own_step_times() -> None:
    """Σ over the failure-touched steps of (step time − the median of the steps that held a round): a 9.2 s
    step against a 0.26 s median loses 8.94 s; local steps (no round) and untouched sync steps count nothing,
    and the median is the sync steps' (a param sync's usual cost is not a loss)."""
    times = [0.1, 0.26, 0.1, 0.27, 0.1, 9.2, 0.1, 0.25, 0.1, 0.26]
    held = [False, True] * 5
    touched = [False] * 5 + [True] + [False] * 4
    assert lost_in_touched_steps(times, held, touched) == pytest.approx(9.2 - 0.26)
    assert lost_in_touched_steps(times, held, [False] * 10) == 0.0
    faster = [False] * 7 + [True, False, False]  # a touched step faster than usual (0.25 s) loses nothing
    assert lost_in_touched_steps(times, held, faster) == 0.0
    assert lost_in_touched_steps([], [], []) == 0.0


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_merged_summary_means_finished_replicas_and_counts_trained_tokens(tmp_path: Path) -> None:
    """Final losses: the mean over the replicas that finished (a given-up replica's stale summary is not
    one); tokens: Σ of what each replica trained (a given-up one's from its last record); wall_tokens_per_s =
    tokens / the longest train time; survivor_lost_s from the never-failed replicas' elastic_lost_s."""
    base = {"tokens_per_s": 100.0, "mfu": 0.1, "wall_time_s": 10.0, "heals": 0, "dropped_syncs": 0}
    _write(
        tmp_path / "summary.replica0.json",
        {
            **base,
            "final_loss": 2.0,
            "final_val_loss": 3.0,
            "trained_tokens": 1000,
            "train_time_s": 8.0,
            "elastic_lost_s": 8.94,
            "elastic_touched_rounds": 2,
        },
    )
    _write(
        tmp_path / "summary.replica1.json",
        {
            **base,
            "final_loss": 2.2,
            "final_val_loss": 3.4,
            "trained_tokens": 900,
            "train_time_s": 10.0,
            "heals": 1,
            "elastic_lost_s": 0.0,
        },
    )
    _write(
        tmp_path / "summary.replica2.json",
        {**base, "final_loss": 9.0, "final_val_loss": 9.0, "trained_tokens": 10**6, "train_time_s": 99.0},
    )  # stale: replica 2 was given up this time
    (tmp_path / "metrics.replica2.jsonl").write_text(
        json.dumps({"step": 3, "trained_tokens": 300}) + "\n" + '{"step": 4, "trained_tok'  # a torn last line
    )
    merge_replica_summaries(tmp_path, {0: 0, 1: 1, 2: 2}, {0: 0, 1: 1, 2: 1}, given_up={2})
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["final_loss"] == pytest.approx(2.1) and s["final_val_loss"] == pytest.approx(3.2)
    assert s["finished_replicas"] == [0, 1]
    assert s["tokens"] == 1000 + 900 + 300
    # the steady rate stays the first finished replica's; the whole-run rate is Σ trained / longest train time
    assert s["train_time_s"] == 10.0 and s["wall_tokens_per_s"] == pytest.approx(220.0)
    assert s["tokens_per_s"] == 100.0 and s["mfu"] == 0.1
    assert s["wall_mfu"] == pytest.approx(0.1 * 220.0 / 100.0)
    assert s["survivor_lost_s"] == 8.94 and s["survivor_touched_rounds"] == 2
    assert s["heals"] == 1 and s["replica_failures"] == 3


def test_a_restarted_replica_continues_its_counters_from_its_last_record(tmp_path: Path) -> None:
    """The counters a restarted replica carries: its previous life's last whole record's (missing: 0)."""
    path = tmp_path / "metrics.replica1.jsonl"
    records = [
        {"step": 4, "elapsed_s": 2.0, "sync_bytes": 10, "shard_bytes": 5, "tokens": 80, "trained_tokens": 40},
        {
            "step": 5,
            "elapsed_s": 2.5,
            "sync_bytes": 12,
            "shard_bytes": 6,
            "replicate_bytes": 3,
            "tokens": 96,
            "trained_tokens": 48,
            "merged_tokens": 32,
            "train_time_s": 1.5,
            "sync_wait_s": 0.75,
            "skipped_steps": 2,
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "elap')
    carried = carried_counters(last_record(path))
    assert carried == {
        "elapsed_s": 2.5,
        "sync_bytes": 12,
        "shard_bytes": 6,
        "replicate_bytes": 3,
        "train_time_s": 1.5,
        "tokens": 96,
        "trained_tokens": 48,
        "merged_tokens": 32,
        "sync_wait_s": 0.75,
        "skipped_steps": 2,
    }
    assert set(carried_counters(None).values()) == {0}
    assert last_record(tmp_path / "none.jsonl") is None


def _life(life: int, steps: range, share: int, merged_steps: int, base: dict[str, int]) -> list[dict]:
    """A life's records, one per step: its own counts (`life_*`) from 0, the cumulative ones from `base` (the
    counters it continues), merged_steps of its steps merged by its last record."""
    out = []
    for i, step in enumerate(steps):
        trained, merged = (i + 1) * share, min(i + 1, merged_steps) * share
        out.append(
            {
                "step": step,
                "life": life,
                "life_trained_tokens": trained,
                "life_merged_tokens": merged,
                "trained_tokens": base["trained"] + trained,
                "merged_tokens": base["merged"] + merged,
                "sync_wait_s": 0.5 * (life + 1),
                "elapsed_s": 10.0 * (life + 1),
                "skipped_steps": life,
            }
        )
    return out


def test_a_replicas_lives_sum_to_its_ledger() -> None:
    """Synthetic lives (no processes): life 0 trains steps 0..6 and merges 4 of them before it dies; life 1
    (healed, continuing its counters) trains 12..23, all merged. Each life's entry is its own counts; the
    replica's are the sums (what its last record's cumulative counters say); restarts counts every start."""
    share = 128
    life0 = _life(0, range(0, 7), share, 4, {"trained": 0, "merged": 0})
    life1 = _life(1, range(12, 24), share, 12, {"trained": 7 * share, "merged": 4 * share})
    lives = lives_of([{"step": -1, "loss": 1.0}, *life0, *life1], 1)  # a record from before lives: skipped
    assert lives == [
        {"life": 0, "first_step": 0, "last_step": 6, "trained_tokens": 7 * share, "merged_tokens": 4 * share,
         "ended": "restarted"},
        {"life": 1, "first_step": 12, "last_step": 23, "trained_tokens": 12 * share, "merged_tokens": 12 * share,
         "ended": "finished"},
    ]  # fmt: skip
    entry = over_lives({"sync_wait_s": 1.0, "skipped_steps": 0}, lives, restarts=1)
    last = life1[-1]
    assert (entry["trained_tokens"], entry["merged_tokens"]) == (last["trained_tokens"], last["merged_tokens"])
    assert entry["trained_tokens"] == 19 * share and entry["restarts"] == 1 and entry["sync_wait_s"] == 1.0
    # a third start that logged nothing (healed at the close): life 1 was restarted too
    assert [x["ended"] for x in lives_of([*life0, *life1], 2)] == ["restarted", "restarted"]
    # a life's index: the launcher's start count, after the life whose records it continues (a resumed launch
    # counts the launcher's starts from 0 again), never below the launcher's (a life that logged nothing)
    assert life_index(0, None) == 0 and life_index(2, None) == 2
    assert life_index(1, life0[-1]) == 1 and life_index(0, life1[-1]) == 2 and life_index(3, life0[-1]) == 3
    assert life_index(0, {"step": 5, "loss": 1.0}) == 0  # a record from before lives were logged


def test_a_given_up_replicas_lives_are_in_the_merged_ledger(tmp_path: Path) -> None:
    """Replica 1 died twice and was given up (no summary): the merged `replica_ledger` still has it, from its
    metrics file (a torn last line skipped), its last life `given_up`; Σ of the ledger's trained tokens is the
    run's `tokens`, and goodput counts the tokens its lives trained and never merged."""
    share = 100
    own = {"trained_tokens": 2400, "merged_tokens": 2400, "sync_wait_s": 1.0, "wait_fraction": 0.1}
    life = {"life": 0, "first_step": 0, "last_step": 23, "trained_tokens": 2400, "merged_tokens": 2400}
    own.update(skipped_steps=0, restarts=0, lives=[{**life, "ended": "finished"}])
    base = {"final_loss": 2.0, "trained_tokens": 2400, "train_time_s": 8.0, "wall_time_s": 9.0}
    _write(tmp_path / "summary.replica0.json", {**base, "replica_ledger": {"0": own}})
    life0 = _life(0, range(0, 7), share, 4, {"trained": 0, "merged": 0})
    life1 = _life(1, range(12, 15), share, 0, {"trained": 700, "merged": 400})
    text = "".join(json.dumps(r) + "\n" for r in [*life0, *life1])
    (tmp_path / "metrics.replica1.jsonl").write_text(text + '{"step": 15, "li')
    assert [r["step"] for r in read_records(tmp_path / "metrics.replica1.jsonl")] == [*range(7), *range(12, 15)]
    merge_replica_summaries(tmp_path, {0: 0, 1: 2}, {0: 0, 1: 1}, given_up={1})
    s = json.loads((tmp_path / "summary.json").read_text())
    gone = s["replica_ledger"]["1"]
    assert [(x["life"], x["first_step"], x["last_step"], x["ended"]) for x in gone["lives"]] == [
        (0, 0, 6, "restarted"),
        (1, 12, 14, "given_up"),
    ]
    assert (gone["trained_tokens"], gone["merged_tokens"], gone["restarts"]) == (1000, 400, 1)
    assert gone["sync_wait_s"] == 1.0 and gone["wait_fraction"] == 0.05 and gone["skipped_steps"] == 1
    assert s["tokens"] == 2400 + 1000 == sum(e["trained_tokens"] for e in s["replica_ledger"].values())
    assert s["goodput"] == round((2400 + 400) / 3400, 4)
    # a finished replica whose counter falls short of its lives (resumed, then healed past its checkpoint): the
    # run's tokens are Σ over the lives, as its ledger says
    _write(tmp_path / "summary.replica0.json", {**base, "trained_tokens": 2000, "replica_ledger": {"0": own}})
    merge_replica_summaries(tmp_path, {0: 0, 1: 2}, {0: 0, 1: 1}, given_up={1})
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] == 2400 + 1000
    # its third start (restart 2) died before it logged: the last life that logged was restarted, not given up
    merge_replica_summaries(tmp_path, {0: 0, 1: 3}, {0: 0, 1: 2}, given_up={1})
    gone = json.loads((tmp_path / "summary.json").read_text())["replica_ledger"]["1"]
    assert [x["ended"] for x in gone["lives"]] == ["restarted", "restarted"] and gone["restarts"] == 2


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["sync.warmup_steps=null", "sync.quantize=int8"], "sync.quantize=int8"),  # exact HSDP
        (["sync.warmup_steps=100", "run.steps=50", "sync.topk=0.1"], "sync.topk=0.1"),
        (
            ["mesh.engine=fsdp2", "sync.warmup_steps=null", "sync.quantize=int4", "sync.error_feedback=true"],
            "sync.error_feedback=true",
        ),
    ],
)
def test_a_codec_every_step_ignores_is_named(overrides: list[str], named: str) -> None:
    """sync.quantize / sync.topk / error feedback with every step syncing grads: one warning line."""
    notes = config_notes(load_config(TINY, ["mesh.sync=2", *overrides]))
    assert len(notes) == 1 and named in notes[0] and "ignored" in notes[0] and "\n" not in notes[0], notes


def test_a_codec_that_runs_is_not_named() -> None:
    cfg = load_config(TINY, ["mesh.sync=2", "sync.warmup_steps=0", "sync.every=4", "sync.quantize=int8"])
    assert config_notes(cfg) == []
    assert config_notes(load_config(TINY, ["mesh.sync=2"])) == []  # nothing set, nothing ignored


def _fake_checkpoint(folder: Path, steps: int, step: int) -> Path:
    """A checkpoint folder as far as resume_schedule_note reads it: meta.json, config.yaml, the marker."""
    folder.mkdir(parents=True)
    save_config(load_config(TINY, [f"run.steps={steps}"]), folder / "config.yaml")
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step}))
    (folder / COMPLETE).write_text(json.dumps({"step": step}))
    return folder


def test_raising_run_steps_on_resume_names_the_lr_jump(tmp_path: Path) -> None:
    """A finished 40-step run resumed with run.steps=100: one note with both run.steps and the LR at
    step 40 under the new schedule and the old one; the same run.steps or no resume: no note."""
    ckpt = _fake_checkpoint(tmp_path / "step_39", steps=40, step=39)
    cfg = load_config(TINY, ["run.steps=100"])
    note = resume_schedule_note(cfg, ckpt)
    new, old = lr_at(40, cfg.optim, 100), lr_at(40, cfg.optim, 40)
    assert new != old
    assert note is not None and "\n" not in note
    assert "40 -> 100" in note and f"{new:.3g}" in note and f"{old:.3g}" in note, note
    assert resume_schedule_note(load_config(TINY, ["run.steps=40"]), ckpt) is None
    assert resume_schedule_note(cfg, None) is None


def test_elastic_without_failures_reports_the_plain_runs_final_losses(tmp_path: Path) -> None:
    """2x1, 12 steps, eval at the end: the elastic run's merged final_loss and final_val_loss (the mean over
    its replicas) are the plain run's (the world mean) within 1e-4, and so are its tokens."""
    base = SMALL + ["mesh.sync=2", "mesh.shard=1", "run.steps=12", "sync.warmup_steps=4", "sync.every=4"]
    base += ["sync.method=diloco", "run.save_model=false"]
    plain = run_train(tmp_path, "plain", base, timeout=240)
    elastic = run_train(tmp_path, "elastic", base + ["elastic.enabled=true"], timeout=300)
    p, e = plain.summary, elastic.summary
    assert p["final_val_loss"] is not None and e["finished_replicas"] == [0, 1]
    assert abs(e["final_val_loss"] - p["final_val_loss"]) <= 1e-4, (e["final_val_loss"], p["final_val_loss"])
    assert abs(e["final_loss"] - p["final_loss"]) <= 1e-4, (e["final_loss"], p["final_loss"])
    assert e["tokens"] == p["tokens"] == p["trained_tokens"]
    for m in (0, 1):  # each replica's records count the run's tokens, and its own half
        last = json.loads((elastic.run_dir / f"metrics.replica{m}.jsonl").read_text().splitlines()[-1])
        assert last["tokens"] == p["tokens"] and 2 * last["trained_tokens"] == p["tokens"]
