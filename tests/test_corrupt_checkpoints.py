"""A damaged newest checkpoint falls back: run.resume=auto resumes from the newest intact one.

The damaged one (truncated, bytes changed, a metadata file gone or garbage) is moved to
checkpoints/corrupt/, never deleted, with one warning line naming it and why; metrics.jsonl is cut
back to the resumed step as on any resume, so no step is logged twice, and on the same mesh the
re-trained steps equal the first run's bit for bit. A checkpoint named by path stays an error, as
does a folder none of whose checkpoints is intact, and a checkpoint that does not fit the config is
never skipped for an older one (that is the config's problem, not the disk's). Real runs of
train.py, each with a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.run.checkpoint import choose_resume, complete_checkpoints, step_of
from tests.helpers import SMALL, RunResult, run_train
from tests.test_finished_runs import lines, state_of

ONE = SMALL + ["mesh.sync=1", "mesh.shard=2", "run.save_model=false"]
# 6 steps, a checkpoint after steps 1, 3 and 5, all kept
RUN = ONE + ["run.steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=5"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corrupt")


@pytest.fixture(scope="module")
def ref(out: Path) -> RunResult:
    return run_train(out, "ref", RUN)


def interrupted_copy(ref: RunResult, name: str) -> Path:
    """The reference as a run killed after its last checkpoint: no summary, no completion record."""
    run = ref.run_dir.parent / name
    shutil.copytree(ref.run_dir, run)
    (run / "summary.json").unlink()
    (run / "finished.json").unlink()
    return run


def damage(step: Path, how: str) -> str:
    """Damage checkpoint `step` as `how` says; returns what the warning line should say of it."""
    victim = step / "__1_0.distcp"
    if how == "truncated":  # the case: truncate -s 1000
        size = victim.stat().st_size
        os.truncate(victim, 1000)
        return f"__1_0.distcp is truncated (1000 of {size} bytes)"
    if how == "flipped":  # same size, other bytes: only the checksum sees it
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        return "__1_0.distcp does not match its checksum (the file is corrupt)"
    if how == "metadata":
        (step / ".metadata").write_bytes(b"not a pickle")
        return ".metadata is missing or corrupt"
    if how == "meta-json":
        (step / "meta.json").write_text("{")
        return "meta.json is missing or corrupt (JSONDecodeError)"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "flipped", "metadata", "meta-json"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(out: Path, ref: RunResult, how: str) -> None:
    run = interrupted_copy(ref, f"fallback-{how}")
    says = damage(run / "checkpoints" / "step_5", how)
    res = run_train(out, run.name, RUN, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    warnings = [line for line in lines(res.stderr) if line.startswith("warning:")]
    assert len(warnings) == 1, res.stderr
    moved = run / "checkpoints" / "corrupt" / "step_5"
    assert warnings[0].startswith("warning: resuming from step_3: step_5 is damaged (") and says in warnings[0]
    assert warnings[0].endswith(f"; moved to {moved}"), warnings[0]
    assert (moved / "__1_0.distcp").is_file() and (moved / ".complete").is_file()  # moved, not deleted
    assert res.summary["resumed_from"] == str(run / "checkpoints" / "step_3")
    # metrics cut back to step 3, steps 4 and 5 trained again: each step once, bit for bit the reference's
    assert [m["step"] for m in res.metrics] == list(range(6))
    assert [m["loss"] for m in res.metrics] == [m["loss"] for m in ref.metrics]
    assert [step_of(p) for p in complete_checkpoints(run)] == [1, 3, 5]  # step_5 saved anew


def test_two_damaged_checkpoints_are_named_on_one_line(out: Path, ref: RunResult) -> None:
    run = interrupted_copy(ref, "fallback-two")
    damage(run / "checkpoints" / "step_5", "truncated")
    damage(run / "checkpoints" / "step_3", "metadata")
    res = run_train(out, run.name, RUN)
    warnings = [line for line in lines(res.stderr) if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: resuming from step_1: step_5 is damaged"), warnings
    assert "step_3 is damaged (.metadata is missing or corrupt" in warnings[0]
    assert sorted(p.name for p in (run / "checkpoints" / "corrupt").iterdir()) == ["step_3", "step_5"]
    assert [m["step"] for m in res.metrics] == list(range(6))


def test_a_named_damaged_checkpoint_stays_an_error(out: Path, ref: RunResult) -> None:
    run = interrupted_copy(ref, "named")
    step = run / "checkpoints" / "step_5"
    says = damage(step, "truncated")
    before = state_of(run)
    for resume in (step, run):  # a checkpoint folder, or a run folder (its newest)
        res = run_train(out, run.name, RUN + [f"run.resume={resume}"], check=False)
        assert res.returncode == 2, res.stderr[-3000:]
        assert lines(res.stderr) == [f"config error: run.resume: {step}/{says}"], res.stderr
    assert state_of(run) == before


def test_no_intact_checkpoint_is_an_error_and_changes_nothing(out: Path, ref: RunResult) -> None:
    run = interrupted_copy(ref, "none-intact")
    for step in (1, 3, 5):
        damage(run / "checkpoints" / f"step_{step}", "truncated")
    before = state_of(run)
    res = run_train(out, run.name, RUN, check=False)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = lines(res.stderr)
    assert line.startswith(f"config error: run.resume: no intact checkpoint in {run / 'checkpoints'} (step_5: ")
    assert "nothing was changed" in line
    assert state_of(run) == before


def test_a_checkpoint_that_does_not_fit_is_not_skipped(out: Path, ref: RunResult) -> None:
    """Another model in the config is the config's problem: an error naming the key, with nothing skipped; and a
    same-size change of the checkpoint's config.yaml that reads as another model is found by its checksum."""
    run = interrupted_copy(ref, "fit")
    cfg = load_config(None, [*RUN, f"run.out_dir={out}", f"run.name={run.name}", "model.d_model=40"])
    with pytest.raises(ConfigError, match=r"^model.d_model: checkpoint .*step_5 has 36, config has 40$"):
        choose_resume(cfg)
    saved = run / "checkpoints" / "step_5" / "config.yaml"
    saved.write_text(saved.read_text().replace("d_model: 36", "d_model: 37"))  # same size
    plan = choose_resume(load_config(None, [*RUN, f"run.out_dir={out}", f"run.name={run.name}"]))
    assert plan.path == run / "checkpoints" / "step_3"
    assert [(p.name, why) for p, why in plan.skipped] == [
        ("step_5", "config.yaml does not match its checksum (the file is corrupt)")
    ]
    assert (run / "checkpoints" / "step_5").is_dir()  # choosing moves nothing: set_aside does, after every check


def test_the_moved_checkpoint_keeps_its_files(tmp_path: Path) -> None:
    """move_aside picks a free name when the same step was set aside before."""
    from hsdp.run.checkpoint import move_aside

    root = tmp_path / "checkpoints"
    for n in range(2):
        (root / "step_5").mkdir(parents=True)
        (root / "step_5" / "x").write_text(str(n))
        move_aside(root / "step_5")
    assert sorted(p.name for p in (root / "corrupt").iterdir()) == ["step_5", "step_5.1"]
    assert json.loads((root / "corrupt" / "step_5.1" / "x").read_text()) == 1
