"""The commands' usage and what they print: `python -m hsdp.<name>`, every argument explained, train.py's config
keys listed; bad input one line with exit 2 (hsdp.plan's --plot, hsdp.plan.validate, hsdp.export's output); a
failed export write one line with exit 1; a resumed run's line; wandb offline quiet but for one line."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hsdp.plan.__main__ as plan_cli
import hsdp.plan.validate as plan_validate
from hsdp import export, prepare, sample
from hsdp.config.loader import load_config
from hsdp.config.schema import ConfigError
from hsdp.run.checkpoint import ResumePlan
from hsdp.run.checkpoint.store import mount_point
from hsdp.run.preflight import resume_line
from tests.helpers import QUIET_ENV, REPO


@pytest.mark.parametrize("name,module", [("prepare", prepare), ("sample", sample), ("export", export)])
def test_usage_names_the_module_command(name: str, module, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m hsdp.{name} ") and ".py" not in out.splitlines()[0]


def test_sample_explains_its_path_and_seed(capsys) -> None:
    with pytest.raises(SystemExit):
        sample.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a run folder (its newest complete checkpoint or final model)" in out
    assert "--seed SEED the sampling generator's seed" in out


def test_prepare_help_states_the_split_rule(capsys) -> None:
    with pytest.raises(SystemExit):
        prepare.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "val is the last F of the last document's text" in out
    assert f"pre-tokens are cut to {prepare.MAX_PRETOKEN_BYTES} bytes" in out


def test_train_help_lists_every_config_key(capsys) -> None:
    """`python train.py --help` names every SECTION.KEY that --set takes, with its default."""
    import dataclasses

    import train
    from hsdp.config.schema import Config

    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    for section in dataclasses.fields(Config):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{section.name}:"))
        for key in dataclasses.fields(getattr(Config(), section.name)):
            assert f"{key.name}=" in line, (section.name, key.name)


# ---------------------------------------------------------------- bad input: one line, exit 2
def exit_code(main, argv: list[str]) -> object:
    """A command's exit code, whether main returns it or argparse raises it."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--report-only", "--out", "{tmp}/none"], "--report-only: {tmp}/none holds no measured runs"),
        (["--report-only", "--hsdp-steps", "0"], "--hsdp-steps: expected at least 1 step"),
        (["--nosuchflag"], "unrecognized arguments: --nosuchflag"),
    ],
)
def test_plan_validate_bad_input_is_one_line_exit_2(tmp_path: Path, capsys, args: list[str], needle: str) -> None:
    assert exit_code(plan_validate.main, [a.format(tmp=tmp_path) for a in args]) == 2
    line = one_line(capsys)
    assert line.startswith("validate: ") and needle.format(tmp=tmp_path) in line, line


@pytest.mark.parametrize("plot,needle", [("{tmp}/missing/u.png", "is not a folder"), ("/proc/u.png", "cannot write")])
def test_plan_plot_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path, capsys, plot, needle) -> None:
    argv = [str(REPO / "configs/tiny.yaml"), "--inter", "1gbit", "--compute-s", "0.2", "--intra", "free"]
    assert exit_code(plan_cli.main, [*argv, "--plot", plot.format(tmp=tmp_path)]) == 2
    line = one_line(capsys)
    assert line.startswith("plan: --plot: ") and needle in line, line


def test_export_refuses_a_kernel_file_system() -> None:
    with pytest.raises(ConfigError, match=r"out: /proc/model.pt is under /proc, a kernel file system"):
        export.check_out_path(Path("/proc/model.pt"))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_export_on_a_full_disk_is_one_line_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """A write cut short (torch.save's errno-less error, or ENOSPC) says the disk is full, with the bytes free, in
    checkpoints' words; the file is not left half-written (a previous export of that name stays)."""
    import torch

    out = tmp_path / f"model.{fmt}"
    out.write_bytes(b"the previous export")
    pos = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"

    def full(_state, path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        if fmt == "pt":
            raise RuntimeError(pos)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr("safetensors.torch.save_file", full)
    monkeypatch.setattr(export, "free_bytes", lambda path: 4096)
    state = {"w": torch.zeros(4)}
    cfg = load_config(None, [])
    with pytest.raises(Exception) as failed:
        export.write_export(state, cfg, out, fmt)
    line = export.write_failure(out, failed.value, export.state_bytes(state))
    assert line == f"saving {out}: the disk is full (4096 bytes free on {mount_point(tmp_path)})", line
    assert out.read_bytes() == b"the previous export" and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_export_failure_that_is_no_write_failure_is_not_hidden() -> None:
    assert export.write_failure(Path("/tmp/x.pt"), ValueError("a bug"), 0) is None


# ---------------------------------------------------------------- what a run prints
def test_a_resumed_run_says_from_which_step_and_checkpoint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoints" / "step_99"
    assert resume_line(ResumePlan(checkpoint, 99)) == f"resuming from step 99 ({checkpoint})"
    assert resume_line(ResumePlan()) is None  # a fresh start says nothing


WANDB_SCRIPT = """
import sys
from hsdp.config.loader import load_config
from hsdp.run.metrics import MetricsLogger
cfg = load_config(None, ["wandb.mode=offline", "run.out_dir=" + sys.argv[1], "run.name=w"])
cfg.run_dir.mkdir(parents=True)
log = MetricsLogger(cfg, cfg.run_dir, enabled=True)
log.log({"step": 0, "loss": 1.0})
log.summary({"final_loss": 1.0})
log.close()
print("done: the closing line")
"""


def test_wandb_offline_prints_one_line_naming_its_folder(tmp_path: Path) -> None:
    """wandb's own banner and offline epilogue (~36 lines: history, summary, "wandb sync ...") are silenced; the
    logger prints one line on stderr naming the run's wandb folder, so a run's closing line stays its last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # wandb's settings, not the box's
    proc = subprocess.run(
        [sys.executable, "-c", WANDB_SCRIPT, str(tmp_path)],
        cwd=REPO,
        env={**env, **QUIET_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["done: the closing line"], proc.stdout
    (folder,) = (tmp_path / "w" / "wandb").glob("offline-run-*")
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        f"wandb: offline run in {folder} (upload it with: wandb sync {folder})"
    ], proc.stderr
