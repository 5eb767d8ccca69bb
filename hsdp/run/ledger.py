"""The run's accounting: what each step trained and took, and every count and rate made from them (§12).

One definition each, used by the metrics records, the progress bar, summary.json and the closing line:

    tokens             the tokens the run trained (every replica's), as this rank knows them: a step every
                       replica trains is counted at once; a paced period's steps (replicas train unequal
                       counts) at the round that ends it, from the counts the replicas exchange there
                       (hsdp/sync/policy.py `replicas_local_steps`). Never nominal: a step skipped is 0.
    trained_tokens     of those, the tokens of the ranks whose files this process writes (an elastic
                       replica's own; the whole run's otherwise)
    train_time_s       the seconds of the loop's steps (compile, syncs and waits included; start-up, eval and
                       checkpoints not)
    tokens_per_s       the steady rate: tokens / (trained steps x the median trained step's time), i.e. the
                       tokens over the time their steps take at the median pace (leaves out the compile
                       and rare slow syncs; a plain run's is tokens per step / median step)
    wall_tokens_per_s  tokens / train_time_s: every step's time counted

An elastic replica's records also carry its life's own counts, and its `replica_ledger` entry sums them over its
lives (hsdp/run/lives.py has those definitions).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from hsdp.comm.mesh import Mesh
from hsdp.config.schema import Config
from hsdp.run.checkpoint import Progress
from hsdp.run.lives import life_index, lives_of, over_lives
from hsdp.run.metrics import (
    RunningMedian,
    carried_counters,
    ledger_entry,
    ledger_totals,
    peak_memory_mb,
    run_rates,
    steady_rate,
)
from hsdp.sync.membership import Membership
from hsdp.sync.pace import Pacer
from hsdp.sync.policy import Sync


class StepLedger:
    """One rank's counts of the run: `after_step` per step, `record` per logged step, `summary` at the end."""

    def __init__(
        self,
        cfg: Config,
        mesh: Mesh,
        members: Membership,
        policy: Sync,
        pacer: Optional[Pacer],
        run: Progress,
        previous: Optional[dict[str, Any]],
        replica: int,
        restart: int,
        t_start: float,
    ) -> None:
        """`run`: the loop's progress (a resumed run's counts restored); `previous`: the last metrics record kept
        from before this process: a replica restarted within the run (healed, not resumed) continues its earlier
        life's counters from it, so none goes backwards; `restart`: the launcher's start count of this replica
        (an elastic replica's lives, hsdp/run/lives.py)."""
        self.cfg, self.mesh, self.members, self.policy, self.pacer, self.run = cfg, mesh, members, policy, pacer, run
        self.replica, self.t_start = replica, t_start
        # Every rank's tokens in one nominal step (an elastic replica's mesh counts the whole run's ranks too)
        # and one replica's (one site's, on a three-level mesh) share of them.
        self.tokens_per_step = mesh.world * cfg.data.batch_size * cfg.model.seq_len * cfg.optim.grad_accum
        self.replica_tokens = self.tokens_per_step // cfg.mesh.sync
        self.carried = carried_counters(previous if run.resumed_from is None and run.start_step > 0 else None)
        if run.resumed_from is not None and run.tokens is None:  # a checkpoint from before tokens were saved
            run_share, own_share = members.step_tokens(self.tokens_per_step)
            run.tokens, run.trained_tokens = len(run.step_times) * run_share, len(run.step_times) * own_share
        run.tokens = run.tokens or int(self.carried["tokens"])
        self.tokens_before = int(self.carried["tokens"])  # an earlier life's: trained in steps not timed here
        run.trained_tokens = run.trained_tokens or int(self.carried["trained_tokens"])
        if run.trained_times is None:  # a checkpoint from before cut steps were told apart: every step trained
            run.trained_times = list(run.step_times)
        self.train_s = self.carried["train_time_s"] + sum(run.step_times)
        self.median = RunningMedian(run.trained_times)  # the steady rate's step time so far
        # A paced run: the steps that every replica trains (warmup rounds, the tail), counted at once.
        self.lockstep = 0 if pacer is None else sum(pacer.every_replica_trains(s) for s in range(run.start_step))
        # This life's index and its counts at its start (restored or carried): a life's own counts are the
        # difference, so each life's records say what it trained and merged, a resumed one's too.
        self.life = life_index(restart, previous)
        self.trained_at_start, self.merged_at_start = run.trained_tokens or 0, self.merged_tokens()

    # ------------------------------------------------------------ each step
    def after_step(self, step: int, step_s: float, trained: bool) -> None:
        """Count `step`: its time, and the tokens trained in it (none on this replica when `trained` is False)."""
        run = self.run
        run.step_times.append(step_s)
        self.train_s += step_s
        run_share, own_share = self.members.step_tokens(self.tokens_per_step)  # a given-up replica's: none
        if trained:
            assert run.trained_times is not None
            run.trained_times.append(step_s)
            self.median.add(step_s)
            run.trained_tokens = (run.trained_tokens or 0) + own_share
        if self.pacer is not None and not self.own_files:
            self.lockstep += self.pacer.every_replica_trains(step)
            run.tokens = run.trained_tokens = self.paced_tokens()  # this process's files are the whole run's
        elif trained:
            run.tokens = (run.tokens or 0) + run_share

    def paced_tokens(self) -> int:
        """A paced run's tokens so far: the steps every replica trained, and what every replica trained in the
        periods up to the last round (the counts the replicas exchanged there)."""
        local = self.policy.ledger().get("replicas_local") or 0.0  # none before the first round
        return int(self.replica_tokens * (self.cfg.mesh.sync * self.lockstep + local))

    @property
    def rate(self) -> Optional[float]:
        """The steady rate so far (summary.json's tokens_per_s, from the running median)."""
        run = self.run
        assert run.trained_times is not None
        return steady_rate((run.tokens or 0) - self.tokens_before, len(run.trained_times), self.median.value)

    def rates(self) -> dict[str, Any]:
        run = self.run
        assert run.trained_times is not None
        tokens = run.tokens or 0
        return run_rates(run.trained_times, self.tokens_per_step, tokens, self.train_s, tokens - self.tokens_before)

    def elapsed_s(self) -> float:
        """The run's wall time so far: earlier lives' and processes' (a resume's) and this one's."""
        return self.carried["elapsed_s"] + self.run.prior_wall_s + time.perf_counter() - self.t_start

    def group_bytes(self) -> dict[str, int]:
        """Bytes each group moved, earlier lives' included."""
        comm = self.mesh.comm
        return {f"{g}_bytes": int(self.carried[f"{g}_bytes"]) + comm.group_bytes(g) for g in GROUPS}

    # ------------------------------------------------------------ logged steps
    def record(self, step: int, loss: float, lr: float, synced: bool) -> dict[str, Any]:
        """The metrics record of `step` (after_step has counted it)."""
        run = self.run
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens": run.tokens,
            "trained_tokens": run.trained_tokens,
            "step_time_s": run.step_times[-1],
            "train_time_s": self.train_s,
            "tokens_per_s": self.rate,
            **self.group_bytes(),
            "peak_mem_mb": peak_memory_mb(self.mesh.device),
            "synced": synced,
            "elapsed_s": self.elapsed_s(),  # wall-clock, for time-to-loss
            **self.members.step_record(),  # e.g. the replicas counted in the last sync
            **(self.own_counts() if self.own_files else {}),
        }

    def own_counts(self) -> dict[str, Any]:
        """An elastic replica's own record fields: tokens merged, waits and skips over its lives, and this life's
        index and counts (hsdp/run/lives.py reads its lives from them)."""
        merged = self.merged_tokens()
        return {
            "merged_tokens": merged,
            "sync_wait_s": self.carried["sync_wait_s"] + self.wait_s(),
            "skipped_steps": int(self.carried["skipped_steps"]) + self.skipped(),
            "life": self.life,
            "life_trained_tokens": (self.run.trained_tokens or 0) - self.trained_at_start,
            "life_merged_tokens": merged - self.merged_at_start,
        }

    def wait_s(self) -> float:
        """This process's seconds waiting at syncs: its quorums' and its policy's weight exchange's."""
        return self.members.sync_wait_s() + float(self.policy.ledger().get("wait_s") or 0.0)

    def skipped(self) -> int:
        """The nominal steps this process skipped: a paced period's rest, or a straggler bound's cut."""
        if self.pacer is not None:
            return self.pacer.cut_steps
        return int(self.members.step_record().get("cut_steps", 0))

    @property
    def own_files(self) -> bool:
        """Whether this process's files are its replica's own (an elastic replica's), not the whole run's."""
        return self.members.metrics_suffix != ""

    def merged_tokens(self) -> int:
        """This replica's tokens that reached the global model, its earlier lives' included."""
        merged = float(self.policy.ledger()["merged"]) * self.replica_tokens
        return round(merged + self.carried["merged_tokens"])

    # ------------------------------------------------------------ the end
    def replica_totals(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Every replica's ledger (tokens trained and merged, waits; goodput), gathered from every rank.
        `records`: this process's metrics file's (an elastic replica's logging rank: every life's)."""
        # an elastic run's quorums (the policy adds its weight exchange's), earlier lives' included
        waited = self.members.sync_wait_s() + self.carried["sync_wait_s"]
        own = {
            # a restarted replica's earlier lives: what its metrics carried over (its policy counts this life's)
            **ledger_entry(self.policy.ledger(), self.replica_tokens, self.elapsed_s(), waited, self.earlier()),
            **(self.pacer.stats() if self.pacer else {}),
            "skipped_steps": self.skipped() + int(self.carried["skipped_steps"]),
        }
        if self.own_files and records:  # its logging rank: its trained and merged tokens are Σ over its lives
            own = over_lives(own, lives_of(records, self.life), self.life)
        ledgers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ledgers, (str(self.replica), own))
        first: dict[str, Any] = {}
        for replica, entry in ledgers:  # a replica's first rank's entry: its logging rank read the earlier lives
            first.setdefault(replica, entry)
        return ledger_totals(first)

    def earlier(self) -> tuple[float, float]:
        """(trained, merged) tokens of this replica's earlier lives, from its metrics; (0, 0) unless restarted."""
        if not self.own_files:
            return 0, 0
        return self.carried["trained_tokens"], self.carried["merged_tokens"]

    def summary(self) -> dict[str, Any]:
        """summary.json's counts: tokens, rates, times and bytes (the same counts as the last record)."""
        run = self.run
        return {
            "tokens": run.tokens,
            "trained_tokens": run.trained_tokens,  # of the ranks whose files these are (an elastic replica's)
            **self.rates(),  # tokens_per_s (steady), tokens_per_step, median_step_time_s, wall_tokens_per_s
            "train_time_s": self.train_s,
            "wall_time_s": self.elapsed_s(),
            **self.group_bytes(),
        }


GROUPS = ("shard", "replicate", "sync")  # the mesh's groups whose bytes a record counts (replicate: in-site)


def peak_memory(mesh: Mesh, probed_mb: Optional[float]) -> tuple[float, Optional[float]]:
    """(the run's peak memory, the largest step's tensor peak) over every rank (MB)."""
    peak = torch.tensor([peak_memory_mb(mesh.device), probed_mb or 0.0], device=mesh.device)  # nccl: GPU
    mesh.comm.all_reduce(peak, "world", op=dist.ReduceOp.MAX)
    return float(peak[0]), (round(float(peak[1]), 2) if probed_mb is not None else None)
