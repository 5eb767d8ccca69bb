"""A finished run as its folder records it (`RunRecord`), and one run of the slow-link benchmark (`LinkRun`).

A RunRecord is read from `<run_dir>/summary.json` (train.py's totals) and, on first use,
`<run_dir>/metrics.jsonl` (one line per logged step; an elastic run's: the replica that logged the most steps).
The sweep's table and plots and the slow-link analysis read runs only through it. A LinkRun is a
RunRecord (or its absence: the run failed) with where it ran and what the benchmark measured around it.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class LoggedStep:
    """One line of metrics.jsonl: a logged step; `val_loss` only where the step ended with an eval."""

    step: int
    tokens: int
    step_time_s: float  # the step's training time (evals and logging excluded)
    sync_bytes: int = 0  # sent per rank on the sync group so far
    val_loss: Optional[float] = None

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> LoggedStep:
        return cls(
            step=line["step"],
            tokens=line["tokens"],
            step_time_s=line["step_time_s"],
            sync_bytes=line.get("sync_bytes", 0),
            val_loss=line.get("val_loss"),
        )


def read_metrics(run_dir: Path) -> list[LoggedStep]:
    """metrics.jsonl of a run folder (a torn last line is skipped); [] if there is none.

    An elastic run has one file per replica: the one that logged the most steps stands for the run (a
    replica never killed: any replica may be, 0 included; the lowest index among equals), with each val
    loss the mean over the replicas that evaluated at that step, as the merged summary's final_val_loss is
    the replicas' mean (each replica evaluates on its own batches: one replica's series may never reach it)."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        return [LoggedStep.from_json(line) for line in _json_lines(path)]
    files = {int(p.name[len("metrics.replica") : -len(".jsonl")]): _json_lines(p) for p in replica_metrics(run_dir)}
    if not files:
        return []
    vals: dict[int, list[float]] = {}
    for lines in files.values():
        for line in lines:
            if line.get("val_loss") is not None:
                vals.setdefault(line["step"], []).append(line["val_loss"])
    measured = max(sorted(files), key=lambda m: len({line["step"] for line in files[m]}))
    steps = []
    for line in files[measured]:
        if line.get("val_loss") is not None:
            line["val_loss"] = statistics.fmean(vals[line["step"]])
        steps.append(LoggedStep.from_json(line))
    return steps


def replica_metrics(run_dir: Path) -> list[Path]:
    """An elastic run's metrics.replica<m>.jsonl files."""
    return [p for p in Path(run_dir).glob("metrics.replica*.jsonl") if p.name[15:-6].isdigit()]


def _json_lines(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's records (a torn last line is skipped)."""
    lines = []
    for text in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a torn last line
            lines.append(json.loads(text))
    return lines


def wall_clock(steps: list[LoggedStep]) -> Optional[dict[int, float]]:
    """step → cumulative step_time_s (training seconds, evals excluded), if every step from 0 was logged."""
    if [s.step for s in steps] != list(range(len(steps))):
        return None  # run.log_every > 1: the unlogged steps' times are not in metrics.jsonl
    total, out = 0.0, {}
    for s in steps:
        total += s.step_time_s
        out[s.step] = total
    return out


@dataclass(frozen=True)
class RunRecord:
    """A finished run: summary.json's totals (None where it has no such field) and its metrics.jsonl."""

    dir: Path
    summary: dict[str, Any] = field(repr=False)  # all of summary.json: a sweep's columns may name any field
    steps: Optional[int] = None
    tokens: Optional[int] = None
    median_step_time_s: Optional[float] = None
    train_time_s: Optional[float] = None  # Σ step_time_s
    wall_time_s: Optional[float] = None
    final_val_loss: Optional[float] = None
    sync_bytes: Optional[int] = None  # sent per rank on the sync group
    shard_bytes: Optional[int] = None
    sync_seconds: float = 0.0  # Comm's recorded seconds of the sync group's collectives
    sync_calls: int = 0

    @classmethod
    def from_summary(cls, run_dir: Path, summary: dict[str, Any]) -> RunRecord:
        sync_ops = [v for k, v in summary.get("comm", {}).items() if k.startswith("sync/")]
        return cls(
            dir=Path(run_dir),
            summary=summary,
            steps=summary.get("steps"),
            tokens=summary.get("tokens"),
            median_step_time_s=summary.get("median_step_time_s"),
            train_time_s=summary.get("train_time_s"),
            wall_time_s=summary.get("wall_time_s"),
            final_val_loss=summary.get("final_val_loss"),
            sync_bytes=summary.get("sync_bytes"),
            shard_bytes=summary.get("shard_bytes"),
            sync_seconds=sum(v["seconds"] for v in sync_ops),
            sync_calls=sum(v["calls"] for v in sync_ops),
        )

    @classmethod
    def read(cls, run_dir: Path) -> Optional[RunRecord]:
        """The run in `run_dir`, or None if it left no summary.json (it failed, or never ran)."""
        path = Path(run_dir) / "summary.json"
        if not path.is_file():
            return None
        summary = json.loads(path.read_text())
        return cls.from_summary(run_dir, summary) if summary else None

    def column(self, name: str) -> Any:
        """A summary.json field by name (a sweep table's column); None if absent."""
        return self.summary.get(name)

    @property
    def mean_step_s(self) -> Optional[float]:
        return None if self.train_time_s is None or not self.steps else self.train_time_s / self.steps

    @cached_property
    def metrics(self) -> list[LoggedStep]:
        """metrics.jsonl, read on first use."""
        return read_metrics(self.dir)

    @cached_property
    def sync_free_step_s(self) -> Optional[float]:
        """The median time of this run's steps that sent nothing on the sync group (a logged step whose
        cumulative sync bytes equal the step before's): its compute and shard collectives alone. None if no
        such step was logged (exact HSDP syncs every step; log_every > 1 logs no consecutive pair)."""
        logged = self.metrics
        free = [
            b.step_time_s for a, b in zip(logged, logged[1:]) if b.step == a.step + 1 and b.sync_bytes == a.sync_bytes
        ]
        return statistics.median(free) if free else None


# ------------------------------------------------------------------ the slow-link benchmark's runs


@dataclass(frozen=True)
class Measured:
    """What the benchmark measured around a run it ran; all None for a run it only found in its folder."""

    cmd_wall_s: Optional[float] = None
    returncode: Optional[int] = None  # 124: timed out
    link_bytes: Optional[int] = None  # what the replicas' veths sent during the run
    faults: Optional[dict[str, Any]] = None  # the faults injected (hsdp.bench.faults, elastic.py): when, steps

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Measured:
        return cls(**{f.name: entry.get(f.name) for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class LinkRun:
    """One run at one rate: where it ran, what was measured around it, and its record (None: it failed)."""

    run: str
    rate: str  # the rate's label: 20mbit, unshaped
    rate_bps: Optional[int]  # None: unshaped
    delay_ms: float
    dir: Path
    measured: Measured = field(default_factory=Measured)
    record: Optional[RunRecord] = None

    @classmethod
    def read(
        cls, run: str, rate: str, rate_bps: Optional[int], delay_ms: float, run_dir: Path, measured: Measured
    ) -> LinkRun:
        """The run's entry with its record read from `run_dir` (none if it exited non-zero)."""
        ok = (measured.returncode or 0) == 0
        return cls(run, rate, rate_bps, delay_ms, run_dir, measured, RunRecord.read(run_dir) if ok else None)

    @property
    def rate_mbit(self) -> Optional[float]:
        return None if self.rate_bps is None else self.rate_bps / 1e6

    @property
    def ok(self) -> bool:
        """It finished with a final val loss (what the analysis and the tables need)."""
        return self.record is not None and self.record.final_val_loss is not None

    @property
    def finished(self) -> RunRecord:
        """The record of a run the caller knows is `ok`; a ValueError for one that failed (the caller's bug)."""
        if self.record is None:
            raise ValueError(f"{self.run} at {self.rate} failed: it has no record")
        return self.record

    def to_json(self) -> dict[str, Any]:
        """slowlink.json's entry (without the analysis: hsdp.bench.analysis.Assessed.to_json)."""
        out = {
            "run": self.run,
            "rate": self.rate,
            "rate_bps": self.rate_bps,
            "rate_mbit": self.rate_mbit,
            "delay_ms": self.delay_ms,
            "dir": str(self.dir),
            **self.measured.to_json(),
        }
        r = self.record
        if r is not None:
            out.update(
                steps=r.steps,
                tokens=r.tokens,
                median_step_s=r.median_step_time_s,
                mean_step_s=r.mean_step_s,
                train_time_s=r.train_time_s,
                wall_time_s=r.wall_time_s,
                final_val_loss=r.final_val_loss,
                sync_bytes=r.sync_bytes,
                shard_bytes=r.shard_bytes,
                sync_seconds=r.sync_seconds,
                sync_calls=r.sync_calls,
            )
        return out
