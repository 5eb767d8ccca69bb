"""Run outputs: metrics.jsonl, summary.json, wandb (imported lazily), a tqdm bar.

Only rank 0 writes. wandb is imported only when `wandb.mode != disabled`, so a
machine without wandb runs with `--set wandb.mode=disabled`. wandb never ends a
run: `wandb.init` is bounded by `HSDP_WANDB_TIMEOUT_S` seconds (default 60;
online mode without network otherwise retries for a long time), and any wandb
failure prints one warning line and the run goes on with metrics.jsonl alone. wandb itself prints
nothing (`silent`: its banner and offline epilogue would bury the run's closing line); the run says
once, on stderr, where wandb's files are (`wandb_line`).

A write of metrics.jsonl or summary.json that fails (a full disk, most often) ends the run with one
line naming the file and the bytes free (`SaveFailed`, as a failed checkpoint save), not a
traceback; what was written before stays (summary.json is replaced atomically).

One run folder is one wandb run: its id is kept in `wandb.id` in the run folder, so a resumed run
and a restarted elastic replica 0 continue the same wandb run (`resume="allow"`) instead of opening
a second one; steps wandb already has are not sent again (wandb refuses a step that goes backwards).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import resource
import secrets
import statistics
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, cast

import torch
from tqdm import tqdm

from hsdp.config.schema import Config, to_dict
from hsdp.core.atomic import temp_name, write_text
from hsdp.run.checkpoint.integrity import finite_or_none
from hsdp.run.checkpoint.store import free_bytes, save_failure
from hsdp.run.guard import SaveFailed

if TYPE_CHECKING:
    from wandb import Run

WANDB_TIMEOUT_ENV = "HSDP_WANDB_TIMEOUT_S"
WANDB_TIMEOUT_S = 60.0  # default bound on wandb.init (login + run creation)
WANDB_ID_FILE = "wandb.id"  # the run folder's wandb run id, so every process of the run logs to one wandb run


def wandb_timeout_s() -> float:
    """The wandb.init bound in seconds: $HSDP_WANDB_TIMEOUT_S if it is a positive number, else the default."""
    try:
        value = float(os.environ.get(WANDB_TIMEOUT_ENV, WANDB_TIMEOUT_S))
    except ValueError:
        return WANDB_TIMEOUT_S
    return value if value > 0 else WANDB_TIMEOUT_S


def _one_line(e: BaseException) -> str:
    """The first line of an error's message (wandb's errors append multi-line advice), at most 200 chars."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return text if len(text) <= 200 else text[:197] + "..."


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class StepMemoryProbe:
    """The most tensor memory that one step's forward+backward allocates and holds at once.

    Measured once, on step `at`, from torch.profiler's allocation events (every c10 allocation on the
    run's device, eager or inductor-generated code alike): the same measure on CPU and GPU, and
    unlike peak RSS it leaves out the interpreter, libraries and compiler, and memory that glibc
    keeps after a free. What it sees is what a step adds: full params gathered, activations,
    full-size grads, collective buffers; the persistent shards and optimizer state (allocated
    before the step) are not in it.
    """

    def __init__(self, device: torch.device, at: int) -> None:
        self.device, self.at = device, at
        self.peak_mb: Optional[float] = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the step's forward+backward: measured when `step` is the probed one, else a no-op."""
        if step != self.at:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] if self.device.type == "cuda" else [ProfilerActivity.CPU]
        with _native_stderr_silenced(), profile(activities=activities, profile_memory=True) as prof:
            yield
        self.peak_mb = peak_allocated(prof, self.device) / 2**20


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """fd 2 → /dev/null for the block: the profiler's native start/stop lines and its warning about
    frees of blocks allocated before it started (those frees are simply not counted) would
    otherwise print on every rank. Python exceptions still propagate and are reported as usual."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocated(prof: Any, device: torch.device) -> int:
    """The running sum of the profile's allocation (+) and free (−) events on `device`, at its highest."""
    kind = "CUDA" if device.type == "cuda" else "CPU"
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type().name == kind
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------- rates: steady and whole-run
# The steady rate is what the run sustains once compiled and warm: the tokens trained over the time their steps
# take at the median trained step's pace. The median leaves out the compile step(s), the warm-up and the
# memory-probed step as long as they are fewer than half of the steps, needs no choice of how many steps to
# skip, and is summary.json's median_step_time_s, which hsdp.plan calibrates from. It also leaves out rare slow
# steps (a periodic param sync of a DiLoCo run every H > 2 steps): the whole-run rate, which counts every
# step's time, is kept beside it as wall_tokens_per_s. Steps a replica skipped (a paced period's rest, a
# straggler's cut) trained nothing: they count neither tokens nor a trained step.
RATE_BASIS = "tokens / (trained steps x median_step_time_s)"
WALL_RATE_BASIS = "tokens / train_time_s"


def steady_rate(tokens: float, trained_steps: int, median_step_s: Optional[float]) -> Optional[float]:
    """Tokens per second at the median trained step's time (None before any step, or for a zero step time)."""
    return tokens / (trained_steps * median_step_s) if median_step_s and trained_steps else None


def ledger_entry(
    ledger: dict[str, Any],
    tokens_per_step: int,
    wall_s: float,
    quorum_s: float = 0.0,
    earlier: tuple[float, float] = (0, 0),
) -> dict[str, Any]:
    """One replica's round ledger for summary.json (docs/design.md §8.12): the tokens it trained, those that
    reached the global model, and its seconds waiting at syncs for the last replica (an elastic run's
    quorums, `quorum_s`, and a weighted run's weight exchange) with their share of its wall time. `earlier`:
    the tokens it trained and merged in its earlier lives (a restarted replica's), which its policy's ledger
    does not hold."""
    wait = float(ledger.get("wait_s") or 0.0) + quorum_s
    return {
        "trained_tokens": int(ledger["trained"]) * tokens_per_step + int(earlier[0]),
        "merged_tokens": round(float(ledger["merged"]) * tokens_per_step + earlier[1]),
        "sync_wait_s": round(wait, 3),
        "wait_fraction": round(wait / wall_s, 4) if wall_s > 0 else None,
    }


def ledger_totals(per_replica: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """summary.json's `replica_ledger` (per replica) and the run's `goodput` (merged ÷ trained tokens over
    every replica) and `wait_fraction` (the most any replica waited)."""
    trained = sum(e["trained_tokens"] for e in per_replica.values())
    merged = sum(e["merged_tokens"] for e in per_replica.values())
    waits = [e["wait_fraction"] for e in per_replica.values() if e.get("wait_fraction") is not None]
    return {
        "replica_ledger": dict(sorted(per_replica.items(), key=lambda kv: int(kv[0]))),
        "goodput": round(merged / trained, 4) if trained else None,
        "wait_fraction": max(waits) if waits else None,
    }


def run_rates(
    trained_times: Sequence[float], tokens_per_step: float, tokens: float, train_s: float, rate_tokens: float
) -> dict[str, Any]:
    """summary.json's rates (hsdp/run/ledger.py has each count's definition):

    tokens_per_s        the steady rate: `rate_tokens` (those trained in the `trained_times` steps) over
                        len(trained_times) x median_step_time_s (RATE_BASIS); mfu comes from it
    tokens_per_step     the run's nominal tokens per step (every rank's), what a step trains when none skips
    median_step_time_s  the median of the trained steps' times
    wall_tokens_per_s   tokens / train_time_s (WALL_RATE_BASIS): every step's time counted (compile,
                        warm-up, syncs, waits); eval, checkpoints and start-up are outside the steps
    rate_basis          how each rate is computed
    """
    median = statistics.median(trained_times) if trained_times else None
    return {
        "tokens_per_s": steady_rate(rate_tokens, len(trained_times), median),
        "tokens_per_step": tokens_per_step,
        "median_step_time_s": median,
        "wall_tokens_per_s": tokens / train_s if train_s > 0 else None,
        "rate_basis": {"tokens_per_s": RATE_BASIS, "wall_tokens_per_s": WALL_RATE_BASIS},
    }


def merged_rates(first: dict[str, Any], trained: float, train_time_s: float) -> dict[str, Any]:
    """An elastic run's rates, from its first finished replica's summary and the run's totals.

    tokens_per_s and mfu stay the first replica's: its tokens_per_step is the run's (one share per replica
    counted in its syncs), over its median step, so the steady rate is defined as a plain run's. The
    whole-run rate is Σ of what each replica trained over the longest replica's train time, and wall_mfu
    scales with it (MFU is linear in the rate: same model, same devices).
    """
    wall = trained / train_time_s if train_time_s > 0 else None
    rate, mfu = first.get("tokens_per_s"), first.get("mfu")
    return {
        "tokens_per_s": rate,
        "mfu": mfu,
        "wall_tokens_per_s": wall,
        "wall_mfu": round(mfu * wall / rate, 4) if mfu and rate and wall else None,
    }


class RunningMedian:
    """The median of the values added so far (statistics.median's), in O(log n) a value: two heaps, the lower
    half's largest on top of one (negated), the upper half's smallest on top of the other. For the progress
    bar and the metrics records, which show the steady rate as the run goes without sorting every step's
    time again at every logged step."""

    def __init__(self, values: Iterable[float] = ()) -> None:
        self._lo: list[float] = []  # the lower half, negated (a max-heap); one more than _hi when n is odd
        self._hi: list[float] = []  # the upper half (a min-heap)
        for v in values:
            self.add(v)

    def __len__(self) -> int:
        return len(self._lo) + len(self._hi)

    def add(self, value: float) -> None:
        if self._lo and value > -self._lo[0]:
            heapq.heappush(self._hi, value)
        else:
            heapq.heappush(self._lo, -value)
        if len(self._lo) > len(self._hi) + 1:
            heapq.heappush(self._hi, -heapq.heappop(self._lo))
        elif len(self._hi) > len(self._lo):
            heapq.heappush(self._lo, -heapq.heappop(self._hi))

    @property
    def value(self) -> Optional[float]:
        """The median (the mean of the two middle values for an even count), or None before any value."""
        if not self._lo:
            return None
        if len(self._lo) > len(self._hi):
            return -self._lo[0]
        return (-self._lo[0] + self._hi[0]) / 2


def open_metrics(path: Path, continue_after: Optional[int]) -> Any:
    """metrics.jsonl for writing: fresh, or (resuming) keeping the records of steps <= continue_after."""
    if continue_after is None or not path.is_file():
        return open(path, "w")
    kept = [line for line in path.read_text().splitlines(keepends=True) if _step_of(line) <= continue_after]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)  # a crash here leaves the old file or the new one, never half of one
    return open(path, "a")


def _step_of(line: str) -> float:
    """A record's step; infinity for a line a killed writer left torn (so it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


# The cumulative counters of a metrics record that a replica restarted within the run (healed, not resumed
# from a checkpoint) continues from its previous life's last record, so that none goes backwards.
CARRIED = (
    "elapsed_s",
    "sync_bytes",
    "shard_bytes",
    "replicate_bytes",
    "train_time_s",
    "tokens",
    "trained_tokens",
    "merged_tokens",  # an elastic replica's own (hsdp/run/ledger.py), and so are these two
    "sync_wait_s",
    "skipped_steps",
)


def carried_counters(previous: Optional[dict[str, Any]]) -> dict[str, float]:
    """The CARRIED counters of `previous` (a metrics record; missing or null fields 0), or all 0."""
    return {k: (previous or {}).get(k) or 0 for k in CARRIED}


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a metrics file, in order (a torn line, a killed writer's, is skipped); [] if none."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def last_record(path: Path) -> Optional[dict[str, Any]]:
    """The last whole record of a metrics file, or None."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                return record
    return None


def write_failure(path: Path, error: OSError) -> str:
    """The one line for a failed write of run-folder file `path`: checkpoints' wording (`save_failure`), so a full
    disk reads "saving runs/x/metrics.jsonl: the disk is full (N bytes free on /mnt)"."""
    line = save_failure(str(path), error, path.parent, free_bytes(path.parent))
    return line or f"saving {path} failed: {type(error).__name__}: {error}"


def wandb_line(run: Any) -> Optional[str]:
    """The one line that says where a wandb run went (its folder offline, its page online), or None if unknown."""
    if getattr(run, "offline", False):
        folder = getattr(run, "sync_dir", None)
        return f"wandb: offline run in {folder} (upload it with: wandb sync {folder})" if folder else None
    url = getattr(run, "url", None)
    return f"wandb: {url}" if isinstance(url, str) and url else None


def wandb_run_id(run_dir: Path) -> str:
    """The run folder's wandb run id: the one kept in `wandb.id`, or a new one (then kept there)."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)  # wandb ids are short [a-z0-9] strings
    write_text(path, run_id + "\n")
    return run_id


class MetricsLogger:
    """Writes one JSON object per logged step; mirrors it to wandb and the progress bar."""

    def __init__(
        self, cfg: Config, run_dir: Path, enabled: bool, continue_after: Optional[int] = None, suffix: str = ""
    ) -> None:
        """`continue_after`: a resumed run's checkpoint step; records of later steps are dropped and new
        ones appended, so every step is in metrics.jsonl once. `suffix`: an elastic replica's own files
        (metrics<suffix>.jsonl, summary<suffix>.json; wandb only for replica 0)."""
        self.enabled = enabled
        self.run_dir = run_dir
        self.suffix = suffix
        self._wandb: Optional[Run] = None
        self._wandb_after = -1  # the last step the wandb run already holds (a resumed run's earlier life)
        self._bar: Optional[tqdm] = None
        self.previous: Optional[dict[str, Any]] = None  # the last record kept from before this process
        if not enabled:
            return
        self._path = path = run_dir / f"metrics{suffix}.jsonl"
        with self._writing(path):
            self._file = open_metrics(path, continue_after)
        if continue_after is not None:
            self.previous = last_record(path)
        if cfg.wandb.mode != "disabled" and suffix in ("", ".replica0"):
            self._wandb = self._init_wandb(cfg, run_dir)
        # tqdm's default lock is a multiprocessing semaphore, registered with the launcher's resource
        # tracker: a worker stopped by SIGTERM cannot unregister it and the tracker then warns of a
        # leak. One bar in one process needs only a thread lock.
        tqdm.set_lock(threading.RLock())
        # An elastic run's replicas each draw a bar, one terminal line each (replica m on line m), named
        # after the replica: two bars on one line overwrite each other.
        replica = int(suffix.removeprefix(".replica")) if suffix.startswith(".replica") else 0
        self._bar = tqdm(
            total=cfg.run.steps,
            initial=0 if continue_after is None else continue_after + 1,
            desc=cfg.run.name + (f" replica {replica}" if suffix else ""),
            position=replica,
            dynamic_ncols=True,
            disable=os.environ.get("HSDP_NO_BAR") == "1",
        )

    def _init_wandb(self, cfg: Config, run_dir: Path) -> Optional[Run]:
        """A wandb run, or None (with one warning line) if wandb cannot start within the timeout."""
        timeout = wandb_timeout_s()
        try:
            import wandb  # lazy: a GPU box without wandb can still run with mode=disabled

            # silent: no banner, no per-run history/summary epilogue (~36 lines after the run's closing line);
            # `wandb_line` says where the run went instead, in one line
            settings = wandb.Settings(init_timeout=timeout, login_timeout=timeout, silent=True)
            run = wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                name=cfg.run.name,
                id=wandb_run_id(run_dir),
                resume="allow",  # the same id again (a resume, a restarted replica 0) continues that run
                mode=cast(Literal["online", "offline", "disabled"], cfg.wandb.mode),  # validate.py's choices
                dir=str(run_dir),
                config=to_dict(cfg),
                settings=settings,
            )
            self._wandb_after = int(getattr(run, "step", 0) or 0) - 1
            return run
        except Exception as e:  # no network, no API key, a broken install: the run matters more
            print(
                f"warning: wandb.init ({cfg.wandb.mode}, timeout {timeout:g} s, ${WANDB_TIMEOUT_ENV}) failed: "
                f"{type(e).__name__}: {_one_line(e)}; continuing without wandb (metrics in "
                f"{run_dir / 'metrics.jsonl'})",
                file=sys.stderr,
                flush=True,
            )
            return None

    def _to_wandb(self, what: str, call: Callable[[Run], object]) -> None:
        """Run one wandb call on the run; on failure warn once and stop using wandb (metrics.jsonl has everything)."""
        if self._wandb is None:
            return
        try:
            call(self._wandb)
        except Exception as e:
            self._wandb = None
            print(
                f"warning: wandb {what} failed: {type(e).__name__}: {_one_line(e)}; continuing without wandb",
                file=sys.stderr,
                flush=True,
            )

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """Around a write of `path`: an OSError (a full disk) ends the run as SaveFailed's one line."""
        try:
            yield
        except OSError as e:
            if self._bar is not None:
                self._bar.close()  # the error line starts on a line of its own
            file = getattr(self, "_file", None)
            if file is not None:
                with contextlib.suppress(OSError):  # its buffer cannot be flushed either: drop it, no second error
                    file.close()
            raise SaveFailed(write_failure(path, e)) from None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = finite_or_none(record)  # JSON has no NaN: a diverged step logs null
        with self._writing(self._path):
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        step = record["step"]
        if step > self._wandb_after:  # a step the wandb run holds from an earlier life is not resent
            self._to_wandb("log", lambda run: run.log({k: v for k, v in record.items() if k != "step"}, step=step))

    def progress(self, step: int, loss: float, tokens_per_s: Optional[float]) -> None:
        """The bar at `step`; `tokens_per_s`: the steady rate so far (`steady_rate` of the running median)."""
        if self._bar is not None:
            self._bar.n = step + 1
            rate = "–" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=rate, refresh=False)
            self._bar.refresh()

    def summary(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        summary = finite_or_none(summary)
        path = self.run_dir / f"summary{self.suffix}.json"
        try:
            with self._writing(path):
                # atomically: a failed write leaves the previous summary (a resumed run's) or none, never half of one
                write_text(path, json.dumps(summary, indent=2, allow_nan=False) + "\n")
        finally:
            temp_name(path).unlink(missing_ok=True)  # what a failed write left under its temp name
        self._to_wandb("summary", lambda run: run.summary.update(summary))

    def records(self) -> list[dict[str, Any]]:
        """The records of metrics<suffix>.jsonl so far (earlier lives' and this process's); [] if it writes none."""
        if not self.enabled:
            return []
        self._file.flush()
        return read_records(self._path)

    def close(self) -> None:
        if not self.enabled:
            return
        with self._writing(self._path):
            self._file.close()
        if self._bar is not None:
            self._bar.close()
        run = self._wandb
        self._to_wandb("finish", lambda r: r.finish())
        line = wandb_line(run) if self._wandb is not None else None  # None: wandb failed and said so
        if line:
            print(line, file=sys.stderr, flush=True)
