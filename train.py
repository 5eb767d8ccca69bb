"""Train a GPT with hybrid-sharded data parallelism and periodic sync.

    python train.py --config configs/tiny.yaml [--set section.key=value ...]

config → launch (torchrun or local workers) → mesh → engine → loop, read top to bottom.
Outputs go to <run.out_dir>/<run.name>/: config.yaml, metrics.jsonl, summary.json, and last finished.json
(the completion record: the same command again has nothing to do). The run's last line on stdout is
its closing line: "done: step N, loss …, val …, … tok/s (median step), <summary.json>".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed as dist

from hsdp.comm.mesh import Mesh
from hsdp.config.loader import save_config
from hsdp.config.schema import Config, ConfigError, to_dict
from hsdp.core import timeline
from hsdp.data.tokens import Data
from hsdp.engines.base import Batch, Engine
from hsdp.engines.registry import build_engine
from hsdp.faults.slowdown import SlowSpell
from hsdp.models.gpt import loss_fn, throughput
from hsdp.models.optim import build_optimizer, lr_at, set_lr
from hsdp.run.checkpoint import (
    Checkpoints,
    Part,
    Progress,
    ResumePlan,
    choose_resume,
    free_bytes,
    remove_failed_saves,
    save_failure,
    state_bytes,
)
from hsdp.run.guard import SaveFailed, check_finite
from hsdp.run.launch import Interrupted, WorkerError, launch, torchrun_seat, under_torchrun
from hsdp.run.ledger import StepLedger, peak_memory
from hsdp.run.lock import hold_run_lock
from hsdp.run.metrics import MetricsLogger, StepMemoryProbe
from hsdp.run.preflight import config_notes, load_checked_config, resume_line, resume_schedule_note
from hsdp.run.rundir import clear_finished, finished_line, owns_run_dir, prepare_run_dir, write_finished
from hsdp.sync.membership import Membership, build_membership
from hsdp.sync.pace import Pacer, build_pacer
from hsdp.sync.schedule import steps_after_last_sync
from hsdp.sync.seam import ReplicaPolicy, ReplicaSeat, ReplicaState
from kernels.backend import set_backend


def train_worker(cfg: Config, seat: Optional[ReplicaSeat] = None) -> None:
    """One rank's whole run (`seat`: which replica of a run on torchft this rank is, from its launcher)."""
    t_start = time.perf_counter()
    members = build_membership(cfg, seat)  # this rank's place among the replicas: its mesh, join, duties
    mesh = members.build_mesh(_device())  # with its sync transport, which the engine's policy syncs through
    set_backend(cfg.kernels.backend)
    data = Data(cfg, mesh.rank, mesh.world)
    engine = build_engine(cfg, mesh)
    optimizer = build_optimizer(engine.named_parameters(), cfg.optim, engine.row_sharding())
    policy = engine.policy
    pacer = build_pacer(cfg, mesh)  # sync.every_s: rounds paced by wall time (None: by steps)
    # What a checkpoint carries besides the engine, the RNG and the loop's progress: this replica's round
    # ledger (tokens trained and merged) and its paced periods.
    parts = {"ledger": Part(policy.ledger, policy.load_ledger)}
    if pacer is not None:
        parts["pace"] = Part(pacer.state_dict, pacer.load_state_dict)
    checkpoints = Checkpoints(cfg, mesh, engine, optimizer, t_start, seat, parts)
    run = checkpoints.resume()  # the checkpoint run.resume names (every part restored), or a fresh start
    timeline.mark("model")  # a restart's phases (hsdp/core/timeline.py)
    # What a heal may read and write (an elastic run's engine is hsdp, check_engine_config: its policy a SyncPolicy).
    state = ReplicaState(engine.held_buffers(), optimizer, cast(ReplicaPolicy, policy))
    run.start_step = members.join(state, run.start_step)  # a restarted replica heals: a later step
    replica = seat.replica if seat is not None else mesh.sync_rank
    spell = SlowSpell(cfg.run, replica)  # run.slowdown's
    logger = MetricsLogger(
        cfg,
        cfg.run_dir,
        enabled=members.logs(mesh),
        continue_after=run.start_step - 1,  # a resumed (or healed) run's earlier records are kept
        suffix=members.metrics_suffix,
    )
    # The run's counts and rates, one definition each (hsdp/run/ledger.py); a replica restarted within the run
    # (healed, not resumed) continues its previous life's counters, so none goes backwards in its metrics.
    restart = seat.restart if seat is not None else 0  # which start of this replica (its lives, hsdp/run/lives.py)
    ledger = StepLedger(cfg, mesh, members, policy, pacer, run, logger.previous, replica, restart, t_start)
    memory = StepMemoryProbe(mesh.device, at=min(run.start_step + 2, cfg.run.steps - 1))  # past compile and warm-up

    last_trained_s: Optional[float] = None
    compute_s: Optional[float] = None  # the last trained step's time without its sync
    own_replica = pacer is not None  # a paced replica logs its own loss (it must not wait for the others)
    for step in members.steps(run.start_step, cfg.run.steps):  # batches and LR are functions of the step
        t0 = time.perf_counter()
        lr = lr_at(step, cfg.optim, cfg.run.steps)
        # A replica too slow for elastic.round_timeout_s skips the rest of its period (no batch, no update)
        # and goes on to the sync, arriving within the bound (docs/design.md §9.5); a paced one skips the
        # rest of its window's period and reads on from its own position later (§8.12).
        cut = members.cut(step, last_trained_s) or (pacer is not None and pacer.cut(step, compute_s))
        compute_s = None
        if not cut:
            batches = micro_batches(data, step if pacer is None else pacer.position(step), cfg, mesh.device)
            set_lr(optimizer, lr)
            engine.begin_step(step)  # the sync policy: are grads averaged across replicas this step?
            with memory.step(step):  # one step's forward+backward is profiled for its tensor memory
                step_loss = engine.forward_backward(batches)
            update = engine.commit_grads()  # False: the step's grad round across replicas failed; dropped whole
            grad_norm = engine.clip_grad_norm_(cfg.optim.grad_clip)
            check_finite(step, float(step_loss), float(grad_norm), mesh.rank, checkpoints.last_good)  # or Diverged
            if update:
                optimizer.step()
            policy.note_trained(step, update)  # the round ledger: its weight in the next round, goodput
            engine.zero_grad()
            spell.after_step(step, time.perf_counter() - t0)  # run.slowdown: fault injection (benchmarks, tests)
            compute_s = time.perf_counter() - t0  # the step without its sync: what a paced window estimates
        synced = sync_params(step, cfg, engine, members, pacer)
        step_s = time.perf_counter() - t0
        ledger.after_step(step, step_s, trained=not cut)
        if not cut:
            timeline.mark("trained")  # the first trained step's end (kept once): a restart is training again
        last_trained_s = None if cut else step_s
        log_step(step, step_loss, lr, synced, cfg, engine, data, ledger, logger, run, own_replica)
        if checkpoints.due(step):  # every run.checkpoint_every steps, after the update, sync and log
            checkpoints.save(step, run)

    checkpoints.finish()  # the last save in flight written (its failure raised here)
    peak_mb, step_peak_mb = peak_memory(mesh, memory.peak_mb)
    member_stats = members.stats(run.step_times)
    # per replica: tokens trained and merged (an elastic replica's over its lives), waits; goodput (§8.12)
    totals = ledger.replica_totals(logger.records() if ledger.own_files else [])
    counts = ledger.summary()  # the same counts as the last record: tokens, rates, times, bytes (docs/design.md §12)
    logger.summary(
        {
            "final_loss": run.loss,
            "final_val_loss": run.val_loss,
            "steps": cfg.run.steps,
            **counts,
            **throughput(cfg, counts["tokens_per_s"], mesh.device, counts["wall_tokens_per_s"]),  # FLOPs/token, MFU
            "peak_mem_mb": peak_mb,
            "step_alloc_peak_mb": step_peak_mb,
            "comm": mesh.comm.report(),  # this process's calls (a restarted replica's: since its restart)
            "engine": cfg.mesh.engine,
            "init_from": cfg.model.init_from or None,  # the weights the run started from (null: the seeded init)
            "backend": dist.get_backend(),
            "world": mesh.world,
            **engine.stats(),
            **checkpoints.stats(),
            **member_stats,
            **totals,
        }
    )
    logger.close()
    members.shutdown()
    for name, text in engine.artifacts().items():
        if mesh.rank == 0:
            (cfg.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (cfg.run_dir / name).write_text(text)
    if cfg.run.save_model:  # after the summary, so its byte counts are the training traffic only
        save_replicas(cfg, engine, mesh)


def micro_batches(data: Data, position: int, cfg: Config, device: torch.device) -> list[Batch]:
    """This rank's optim.grad_accum micro-batches at the data stream's `position` (steps trained), on the device."""
    batches = (data.train_batch(position, micro) for micro in range(cfg.optim.grad_accum))
    return [(x.to(device), y.to(device)) for x, y in batches]


def sync_params(step: int, cfg: Config, engine: Engine, members: Membership, pacer: Optional[Pacer]) -> bool:
    """After `step`'s update: the sync policy's param sync if one is due (True if one happened), with what the
    replicas' membership does around it; at the last step a sync still in flight lands (before the final eval)."""
    members.before_sync(step)  # what a peer healing at this step's sync gets
    synced = engine.end_step(step)
    if step == cfg.run.steps - 1:
        engine.finish()
    members.after_sync(step)  # serve a peer that healed from this replica its state, once the round closed
    if pacer is not None:
        pacer.met(step)  # a round began after this step: the next period's window starts now
    if engine.mesh.device.type == "cuda":
        torch.cuda.synchronize(engine.mesh.device)
    return synced


def log_step(
    step: int,
    step_loss: torch.Tensor,
    lr: float,
    synced: bool,
    cfg: Config,
    engine: Engine,
    data: Data,
    ledger: StepLedger,
    logger: MetricsLogger,
    run: Progress,
    own_replica: bool,
) -> None:
    """Every run.log_every steps a metrics record (and the progress bar); every run.eval_every and at the end,
    with the val loss. Losses are world means (a paced run's: its own replica's, `world_mean`)."""
    last = step == cfg.run.steps - 1
    eval_now = last or (cfg.run.eval_every > 0 and (step + 1) % cfg.run.eval_every == 0)
    if not eval_now and step % cfg.run.log_every != 0:
        return
    mesh = engine.mesh
    record = ledger.record(step, world_mean(mesh, step_loss, own_replica), lr, synced)
    if eval_now:
        val = evaluate(engine, data, cfg.run.eval_batches, mesh.device)
        record["val_loss"] = run.val_loss = world_mean(mesh, val, own_replica)
    run.loss = record["loss"]
    logger.log(record)
    logger.progress(step, run.loss, record["tokens_per_s"])


def world_mean(mesh: Mesh, value: torch.Tensor, own_replica: bool = False) -> float:
    """Average a scalar over all ranks (for logging; counted under the "world" group), or with `own_replica`
    over this replica's (its shard and replicate groups): a paced replica must not wait for the others at a
    logged step, so a paced run logs the logging replica's own loss (docs/design.md §8.12)."""
    t = value.detach().float().reshape(1).clone()
    groups = ("shard", "replicate") if own_replica else ("world",)
    n = 1
    for group in groups:
        if mesh.comm.size(group) > 1:
            mesh.comm.all_reduce(t, group)
            n *= mesh.comm.size(group)
    return float(t) / n  # a replica on torchft: "world" is its own world


@torch.no_grad()
def evaluate(engine: Engine, data: Data, batches: int, device: torch.device) -> torch.Tensor:
    """Mean val loss of this rank's val batches."""
    losses = []
    for i in range(batches):
        x, y = data.val_batch(i)
        losses.append(loss_fn(engine(x.to(device)), y.to(device)))
    return torch.stack(losses).mean()


def save_replicas(cfg: Config, engine: Engine, mesh: Mesh) -> None:
    """Each replica's full params → model.replica{m}.pt (written by its shard-rank 0; on a three-level mesh
    m is the site, written by its first in-site replica's). A failed write leaves no
    partial file and is one line (SaveFailed), which says so when the disk is full."""
    state = engine.full_state_dict()
    if mesh.shard_rank == 0 and mesh.replicate_rank == 0:
        path = cfg.run_dir / f"model.replica{mesh.sync_rank}.pt"
        try:
            torch.save(state, path)
        except Exception as e:
            free = free_bytes(path.parent)  # before the partial file's space comes back
            path.unlink(missing_ok=True)
            line = save_failure(path.name, e, path.parent, free, state_bytes(state))
            if line is None:
                raise
            raise SaveFailed(line) from None
    dist.barrier()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def warn_unsynced_end(cfg: Config) -> None:
    """Say so when the run does not end on a param sync: its final model is then not θ_g."""
    tail = steps_after_last_sync(cfg.run.steps, cfg.sync) if cfg.mesh.sync > 1 else 0
    if tail:
        of = " of a fragment" if cfg.sync.fragments > 1 else ""
        hint = "" if of else " (run.steps = warmup_steps + a multiple of sync.every ends on a sync)"
        print(
            f"note: the last {tail} steps come after the last param sync{of}, so the final val loss is the "
            f"mean of the replicas' local models, not θ_g{hint}",
            file=sys.stderr,
        )


def config_keys() -> str:
    """Every SECTION.KEY --set takes, with its default, one section per line (README: the config reference)."""
    lines = ["config keys (default), README.md has what each means:"]
    for section, values in to_dict(Config()).items():
        lines.append(f"  {section}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[1], formatter_class=argparse.RawTextHelpFormatter, epilog=config_keys()
    )
    p.add_argument("--config", help="YAML config (default: built-in defaults)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)"
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="only check the config and prepare the run folder (config.yaml; run.overwrite, run.resume), then exit:\n"
        "run once before the replicas of an elastic run under torchrun start (docs/usage.md, scripts/slurm/)",
    )
    return p.parse_args(argv)


def record_owner(seat: Optional[ReplicaSeat]) -> tuple[bool, Optional[int]]:
    """Whether this process writes the run's completion record and closing line, and whose (None: the run's; m: an
    elastic replica's under torchrun, where no launcher merges the replicas): the launcher (local workers, an
    elastic run's replicas), or rank 0 of a torchrun world."""
    if not under_torchrun():
        return True, None
    if os.environ.get("RANK") != "0":
        return False, None
    return True, (seat.replica if seat is not None else None)


def finish_run(cfg: Config, replica: Optional[int]) -> Optional[str]:
    """After a run that trained all its steps: write its completion record (last, after summary.json) and return
    its closing line; None if it left no summary (a worker that did not train: nothing finished)."""
    name = "summary.json" if replica is None else f"summary.replica{replica}.json"
    summary = cfg.run_dir / name
    if not summary.is_file():
        return None
    try:
        write_finished(cfg, name, replica)
    except OSError as e:  # the run trained, but is not recorded as finished: a re-run would train its tail again
        line = save_failure("the completion record", e, cfg.run_dir, free_bytes(cfg.run_dir))
        raise WorkerError(line or f"writing the completion record failed: {e}") from None
    return closing_line(cfg.run.steps - 1, summary)


def closing_line(last_step: int, summary: Path) -> Optional[str]:
    """'done: step 49, loss 2.596, val 2.54, 4,135 tok/s (median step), runs/fin/summary.json': the final train and
    val loss, summary.json's steady rate (its tokens_per_s: the tokens trained over their steps at the median
    step's pace, hsdp/run/ledger.py) and the summary."""
    try:
        s: dict[str, Any] = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None

    def num(x: Any) -> str:
        return f"{x:.4g}" if isinstance(x, (int, float)) else "n/a"

    steady, mean = s.get("tokens_per_s"), s.get("wall_tokens_per_s")
    if s.get("median_step_time_s") and steady:
        rate = f"{steady:,.0f} tok/s (median step)"
    else:  # a summary without step times (written before they were kept): its whole-run rate
        rate = f"{mean:,.0f} tok/s (mean)" if mean else "tok/s n/a"
    loss, val = num(s.get("final_loss")), num(s.get("final_val_loss"))
    return f"done: step {last_step}, loss {loss}, val {val}, {rate}, {summary}"


def already_done(cfg: Config, plan: ResumePlan) -> Optional[str]:
    """The line for a run whose checkpoint already holds all its steps but that left no completion record (one
    killed after its last save, or finished before records were written), or None."""
    if not plan.finished(cfg.run.steps):
        return None
    summary = cfg.run_dir / "summary.json"
    return f"finished at step {cfg.run.steps - 1}, nothing to do ({summary if summary.is_file() else plan.path})"


def main(argv: Optional[list[str]] = None, worker: Optional[Callable[..., None]] = None) -> int:
    """The command line: config → run folder → launch `worker` (train_worker; tests pass a wrapper)."""
    args = parse_args(argv)
    cfg = None
    try:
        # the torchrun world is checked here, once, before anything in the run folder changes
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
        if args.prepare and world is not None:
            raise ConfigError("--prepare: run it once on its own (not under torchrun), before the replicas start")
        # the preparation comes before the lighthouse (whose host it may run on): it needs none to answer yet
        sets = [*args.set, "elastic.lighthouse="] if args.prepare else args.set
        cfg = load_checked_config(args.config, sets, world_size=world)
        seat = torchrun_seat(cfg)  # under torchrun, a replica on torchft's: its index, restart count, lighthouse
        owner = owns_run_dir(seat)
        records, replica = record_owner(seat)
        with hold_run_lock(cfg) if owner else contextlib.nullcontext():  # one launch per run folder
            # Every check that can refuse the run comes before anything in the run folder changes.
            done = finished_line(cfg)  # its completion record: a finished run (or a shorter run.steps: refused)
            # the checkpoint run.resume names, intact and a fit for this config (auto: the newest intact one)
            plan = ResumePlan() if done else choose_resume(cfg, seat)
            done = done or already_done(cfg, plan)
            if done:
                print(done, flush=True)
                return 0
            prepare_run_dir(cfg, seat)  # refuses to clobber a previous run unless run.overwrite=true
            if records:  # it trains again: not finished until it finishes
                clear_finished(cfg, replica)
            set_aside = plan.set_aside() if owner else None  # damaged newer checkpoints, moved to checkpoints/corrupt
            if owner:  # under torchrun, rank 0 only: another rank's copy would look like an old run
                save_config(cfg, cfg.run_dir / "config.yaml")
            if args.prepare:  # the replicas (torchrun agents, each its own world) start into this folder
                print(f"prepared {cfg.run_dir}", flush=True)
                return 0
            warn_unsynced_end(cfg)
            for line in [set_aside, resume_line(plan), *config_notes(cfg), resume_schedule_note(cfg, plan.path)]:
                if line:
                    print(line, file=sys.stderr)
            if cfg.mesh.backend == "fake":
                print(
                    "note: mesh.backend=fake: collectives move no data (each rank keeps its own), so step times "
                    "are compute only and the losses are not a training result",
                    file=sys.stderr,
                )
            launch(cfg, worker or train_worker, seat)
            closing = finish_run(cfg, replica) if records else None
            if closing:
                print(closing, flush=True)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        if cfg is not None:  # a rank that died mid-save cannot clean up after itself
            remove_failed_saves(cfg.run_dir)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as e:  # launch() has stopped every worker
        if cfg is not None:
            remove_failed_saves(cfg.run_dir)
        stop = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        workers = f"; stopped {stop.workers} workers" if stop.workers else ""
        metrics = cfg.run_dir / "metrics.jsonl" if cfg is not None else None
        kept = f"; metrics so far in {metrics}" if metrics is not None and metrics.is_file() else ""
        print(f"interrupted by {stop}{workers}{kept}", file=sys.stderr)
        return stop.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
