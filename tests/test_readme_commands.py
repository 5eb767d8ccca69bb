"""Every command the README shows runs as written on a fresh clone.

The README's run command (`<!-- run -->`) and the indented command lines under each
`### \\`python ...\\`` heading of its Commands section are read from README.md and run, in
README order, by bash in a fresh copy of the checkout (its tracked and not-ignored files: no
`runs/`, `data/` or `out/`), each with a hang guard; each must exit 0. They are shortened, and
only shortened (the whole takes about 2 minutes and 2 CPU minutes on the 2-core box: every
interpreter spends seconds importing torch):

- `python train.py ...` gets `--set` overrides appended (SHORT: SHORT_STEPS steps of 2 sequences
  per rank, evaluated once at the end on one batch; wandb off), and the step counts of the
  config's cycle shrink with it (a sync warmup to WARMUP steps, a param sync every EVERY steps, a
  checkpoint every CHECKPOINT steps), each only where the config (with the command's own `--set`s)
  has one, so a run keeps its shape: tiny.yaml still warms up, syncs with DiLoCo and checkpoints
  its last step; tiny-bpe.yaml stays exact HSDP;
- other configs' train.py runs and the sweep's run train in one worker (`mesh.sync=1`,
  `mesh.shard=1`); the default job keeps its 2x2 mesh;
- the export command's `step_<run.steps - 1>` is the shortened run's last checkpoint;
- `hsdp.prepare` reads one package of the stdlib (STDLIB_PACKAGE) instead of all of it (its BPE
  on 31 MB takes minutes), with the command's own options and output folder;
- `hsdp.sample` prints a few tokens (`--tokens`); `hsdp.sweep` runs one of its runs (`--only`)
  shortened as train.py's (SHORT, one worker); `hsdp.plan` is given its compute (`--compute-s`,
  `--intra free`) instead of measuring it with a fake-backend run (tests/test_plan.py plans
  from one);
- `hsdp.slowlink` needs root and network namespaces and trains for half an hour, so its
  `--help` runs instead, and its spec is planned in process (every run's config checked).

After the run command, `python -m hsdp.sample runs/tiny` (the next thing a user does) must find
the default run's checkpoint.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from hsdp.config.loader import load_config
from hsdp.run.checkpoint import COMPLETE
from tests.helpers import REPO

README = REPO / "README.md"
SHORT_STEPS = 8
WARMUP, EVERY, CHECKPOINT = 4, 2, 4  # the default run's 100 / 20 / 100 of 600 steps, in 8
# every shortened run: few steps of 2 sequences per rank, evaluated once at the end on one batch
SHORT = [f"run.steps={SHORT_STEPS}", "data.batch_size=2", "run.eval_every=0", "run.eval_batches=1"]
# the other configs' runs in one worker (each interpreter costs seconds of CPU on importing torch alone);
# the default job keeps its 2x2 mesh: its warmup, DiLoCo syncs and θ_g's checkpoint are what it shows
DEFAULT_CONFIG = "configs/tiny.yaml"
ONE_WORKER = ["mesh.sync=1", "mesh.shard=1"]
STDLIB_PACKAGE = "email"  # hsdp.prepare reads this package of the stdlib (0.4 MB), not all of it (31 MB: minutes)
COMPUTE_S = 0.2  # hsdp.plan: the tiny job's step on an idle 2-core box (docs/results/tiny.md), given, not measured
TIMEOUT_S = 300  # the hang guard of each command (a shortened one takes seconds, on a loaded box a minute)


def readme_commands(text: str) -> list[str]:
    """The run command, then each Commands heading's indented lines joined into commands (README order)."""
    run = re.search(r"^<!-- run -->`(.+)`$", text, re.M)
    assert run, "README has no <!-- run --> command"
    commands = [run.group(1)]
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    for block in re.split(r"^### `python [^`]+`.*$", section, flags=re.M)[1:]:
        lines: list[str] = []
        for line in block.splitlines():
            if line.startswith("    "):
                lines.append(line[4:])
            elif lines and line.strip():
                break  # the prose after the block
        joined = "\n".join(lines).replace("\\\n", " ")
        commands += [c.strip() for c in joined.splitlines() if c.strip()]
    return commands


def train_config(argv: list[str], cwd: Path):
    """The config a `train.py` command line resolves to (its --config and --set, read in `cwd`)."""
    config = argv[argv.index("--config") + 1]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    return load_config(str(cwd / config), sets)


def shortened(command: str, cwd: Path, steps_of: dict[str, int]) -> str:
    """The command with the shortening the module docstring lists appended (or substituted)."""
    argv = shlex.split(command)
    if argv[:2] == ["python", "train.py"]:
        cfg = train_config(argv, cwd)
        sets = [*SHORT, "wandb.mode=disabled"]
        if argv[argv.index("--config") + 1] != DEFAULT_CONFIG:
            sets += ONE_WORKER
        if cfg.sync.warmup_steps is not None:
            sets += [f"sync.warmup_steps={min(cfg.sync.warmup_steps, WARMUP)}", f"sync.every={EVERY}"]
        if cfg.run.checkpoint_every:
            sets.append(f"run.checkpoint_every={CHECKPOINT}")
        steps_of[cfg.run.name] = cfg.run.steps
        return command + "".join(f" --set {s}" for s in sets)
    if argv[:3] == ["python", "-m", "hsdp.export"]:
        run = Path(argv[3]).parts[1]  # runs/<name>/checkpoints/step_N
        return command.replace(f"/step_{steps_of[run] - 1}", f"/step_{SHORT_STEPS - 1}")
    if argv[:3] == ["python", "-m", "hsdp.sample"]:
        return command + " --tokens 8"
    if argv[:3] == ["python", "-m", "hsdp.plan"]:
        return command + f" --compute-s {COMPUTE_S} --intra free"
    if argv[:3] == ["python", "-m", "hsdp.prepare"]:
        short = command.replace(""")')" """, f""")')/{STDLIB_PACKAGE}" """, 1)
        assert short != command, f"no stdlib folder to narrow in {command!r}"
        return short
    if argv[:3] == ["python", "-m", "hsdp.sweep"]:
        return command + " --only hsdp" + "".join(f" --set {s}" for s in [*SHORT, *ONE_WORKER])
    if argv[:3] == ["python", "-m", "hsdp.slowlink"]:
        return "python -m hsdp.slowlink --help"
    return command


def fresh_clone(dest: Path) -> Path:
    """The checkout's tracked and not-ignored files (the working tree, as a clone of it would have them)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src = REPO / name
        if src.is_file():  # (a file deleted from the working tree but still in the index is left out)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)  # copy2: the mtime that keeps the bytecode below valid
    for package in ("hsdp", "kernels"):  # bytecode only: a fresh interpreter need not compile the sources again
        for cache in (REPO / package).rglob("__pycache__"):
            target = dest / cache.relative_to(REPO)
            if target.parent.is_dir():
                shutil.copytree(cache, target, dirs_exist_ok=True)
    return dest


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HSDP_NO_BAR": "1"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_readme_lists_each_command_once_with_its_block():
    commands = readme_commands(README.read_text(encoding="utf-8"))
    assert commands[0] == "python train.py --config configs/tiny.yaml"
    for module in ("train.py", "hsdp.prepare", "hsdp.sample", "hsdp.export", "hsdp.sweep", "hsdp.slowlink"):
        assert any(module in c for c in commands[1:]), f"no command block for {module}"
    assert any(c.startswith("python -m hsdp.plan") for c in commands)


@pytest.mark.timeout(1800)
def test_every_readme_command_runs_on_a_fresh_clone(tmp_path):
    clone = fresh_clone(tmp_path / "clone")
    assert not any((clone / d).exists() for d in ("runs", "data", "out"))
    steps_of: dict[str, int] = {}
    done = []
    for command in readme_commands(README.read_text(encoding="utf-8")):
        short = shortened(command, clone, steps_of)
        t0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = run(short, clone)
        t1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"{t1.ru_utime + t1.ru_stime - t0.ru_utime - t0.ru_stime:6.1f} CPU s  {short}")
        assert proc.returncode == 0, f"{short}\n(README: {command})\nexit {proc.returncode}:\n{proc.stderr[-3000:]}"
        done.append(short)
        if command == "python train.py --config configs/tiny.yaml":
            # the default run keeps its last step's checkpoint, so sampling it works right away
            assert (clone / "runs" / "tiny" / "checkpoints" / f"step_{SHORT_STEPS - 1}" / COMPLETE).exists()
            sample = run("python -m hsdp.sample runs/tiny --tokens 8", clone)
            assert sample.returncode == 0, sample.stderr[-3000:]
    assert (clone / "out" / "tiny-hf" / "config.json").is_file()
    assert any("hsdp.slowlink --help" in c for c in done)


def test_slowlink_spec_of_the_readme_plans(tmp_path, monkeypatch):
    """The slow-link command's spec (run above only as --help): every run's config loads and checks."""
    from hsdp.bench.plan import LinkOptions, make_plan

    monkeypatch.chdir(tmp_path)  # its run.out_dir (runs/) is relative to where the command starts
    command = next(c for c in readme_commands(README.read_text(encoding="utf-8")) if "hsdp.slowlink" in c)
    spec = next(a for a in shlex.split(command) if a.endswith(".yaml"))
    plan = make_plan(LinkOptions(spec=str(REPO / spec)))
    assert "hsdp" in plan.runs and plan.target == "hsdp"
