"""Compute-only times for the model, from a run made with `mesh.backend=fake` (no communication).

A fake-backend run issues every collective (Comm counts their bytes) but each returns at once, so its
step times are the step's compute: packs, kernels, optimizer, codec and outer step (README, sweeps).
From the run's own per-step times:

    every step logged (run.log_every=1, as `measure_fake_run` runs it): from metrics.jsonl,
      step_s   median step time of the steps without a param sync
      sync_s   median step time of the steps with one (τ = 0: codec + outer step), less step_s (≥ 0)
      the first `SKIP` steps left out (allocations, and the step summary.json's memory probe profiles);
    else summary.json's `median_step_time_s` (the median of every step, train.py's) for step_s, and the
      logged steps with a param sync for sync_s. The logged records alone are a few chosen steps
      (log_every, evals, the last) and no estimate of a step: never used for step_s.

Fewer than `FEW` timed steps give a warning (`Compute.warning`, one line the command prints on stderr).
`measure_fake_run` makes such a run on the spot (train.py, a temporary folder) when no folder is given.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from hsdp.config.loader import load_config
from hsdp.config.schema import Config, ConfigError
from hsdp.plan.model import Compute

SKIP = 3  # train.py profiles step 2's memory (StepMemoryProbe); steps 0–1 allocate
FEW = 10  # fewer timed steps than this: the calibration warns
REPO = Path(__file__).resolve().parents[2]
# what must agree between the calibration run and the config to plan for its compute to apply
SAME_SHAPE = (
    ("model", None),
    ("data", "batch_size"),
    ("mesh", "sync"),
    ("mesh", "shard"),
    ("mesh", "engine"),
    ("mesh", "prefetch"),
    ("precision", None),
    ("optim", "grad_accum"),
    ("optim", "name"),
    ("compile", None),
    ("kernels", None),
)


def read_fake_run(run_dir: str, cfg: Optional[Config] = None) -> Compute:
    """The compute-only times of a fake-backend run folder; ConfigError (one line) if it is not one,
    or if its model, mesh or batch differ from `cfg`'s."""
    folder = Path(run_dir).expanduser()
    summary_path, metrics_path = folder / "summary.json", folder / "metrics.jsonl"
    if not summary_path.is_file() or not metrics_path.is_file():
        raise ConfigError(f"--calibrate: {run_dir} is not a finished run folder (no summary.json / metrics.jsonl)")
    try:
        summary = json.loads(summary_path.read_text())
        records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    except ValueError as e:
        raise ConfigError(f"--calibrate: {run_dir}: unreadable run outputs ({e})") from e
    if summary.get("backend") != "fake":
        raise ConfigError(
            f"--calibrate: {run_dir} is not a mesh.backend=fake run (its summary.json says backend "
            f"{summary.get('backend')!r}); calibrate on a compute-only run"
        )
    if cfg is not None and (folder / "config.yaml").is_file():
        check_same_shape(load_config(str(folder / "config.yaml")), cfg, run_dir)
    return compute_of(summary, records, f"fake-backend run {folder}")


def compute_of(summary: dict, records: list[dict], source: str) -> Compute:
    """step_s and sync_s from the run's own per-step times (the module's docstring), with a warning when few."""
    logged = [r for r in records if "step_time_s" in r and "step" in r]
    steps = summary.get("steps")
    every = sorted(r["step"] for r in logged) == list(range(steps if steps else len(logged)))
    median = summary.get("median_step_time_s")
    timed = [r for r in logged if r["step"] >= SKIP]
    synced = [r["step_time_s"] for r in timed if r.get("synced")]
    if every and logged:
        plain = [r["step_time_s"] for r in timed if not r.get("synced")]
        if not plain:
            raise ConfigError(f"--calibrate: {source}: no step after step {SKIP - 1} without a param sync")
        step_s, n, how = statistics.median(plain), len(timed), f"every step's time, {len(timed)} steps ≥ {SKIP}"
    elif median is not None and steps:
        step_s, n, how = float(median), int(steps), f"summary.json's median of {steps} steps"
    else:
        raise ConfigError(
            f"--calibrate: {source}: neither every step's time (run.log_every=1) nor summary.json's "
            "median_step_time_s; rerun it with run.log_every=1"
        )
    sync_s = max(0.0, statistics.median(synced) - step_s) if synced else 0.0
    warning = ""
    if n < FEW:
        warning = (
            f"warning: --calibrate: only {n} step times in {source}; its compute of {step_s:.3g} s/step is "
            f"uncertain (a run of {FEW + SKIP} or more steps gives a steadier one)"
        )
    return Compute(step_s=step_s, sync_s=sync_s, source=f"{source} ({how})", warning=warning)


def check_same_shape(run: Config, cfg: Config, run_dir: str) -> None:
    """The calibration run must compute what the config to plan computes (the sync may differ)."""
    for section, key in SAME_SHAPE:
        a, b = getattr(run, section), getattr(cfg, section)
        if key is not None:
            a, b = getattr(a, key), getattr(b, key)
        if section == "compile" and not (a.enabled or b.enabled):
            continue  # neither compiles: the other compile.* keys change nothing computed
        if a != b:
            name = section if key is None else f"{section}.{key}"
            raise ConfigError(f"--calibrate: {run_dir} has another {name} than the config to plan ({a} vs {b})")


def measure_fake_run(config: Optional[str], overrides: list[str], steps: int, keep: Optional[str] = None) -> Compute:
    """Run `steps` steps of the config with mesh.backend=fake now (train.py) and read them; the run folder
    goes under `keep` (kept) or a temporary folder (removed)."""
    if keep is not None:
        return _measure_into(config, overrides, steps, keep)
    with tempfile.TemporaryDirectory(prefix="hsdp-plan-") as out:
        return _measure_into(config, overrides, steps, out)


def _measure_into(config: Optional[str], overrides: list[str], steps: int, out: str) -> Compute:
    args = [sys.executable, str(REPO / "train.py")]
    if config:
        args += ["--config", config]
    fake = [
        *overrides,
        "mesh.backend=fake",
        f"run.steps={steps}",
        "run.log_every=1",
        "run.eval_every=0",
        "run.eval_batches=1",
        "run.checkpoint_every=0",
        "run.save_model=false",
        "wandb.mode=disabled",
        f"run.out_dir={out}",
        "run.name=calibration",
        "run.overwrite=true",
    ]
    for o in fake:
        args += ["--set", o]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HSDP_NO_BAR": "1"})
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise ConfigError(f"calibration run failed: {tail[0]}")
    folder = Path(out) / "calibration"
    summary = json.loads((folder / "summary.json").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return compute_of(summary, records, f"{steps} fake-backend steps measured now")
