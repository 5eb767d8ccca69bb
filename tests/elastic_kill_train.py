"""train.py for the elastic kill tests: the order of a kill, the survivors' sync alone and the rejoin, by events.

    python tests/elastic_kill_train.py REPLICA KILL_STEP HOLD_STEP MARKERS [train.py arguments ...]

The test SIGKILLs every process of replica REPLICA from outside once its metrics log KILL_STEP. Nothing
here is timed; each wait is for something another replica did (the training loop carries no test hooks:
these wrap ElasticMembership's methods):

- REPLICA's first start stops after KILL_STEP (it waits, heartbeating, in step KILL_STEP+1's after_sync
  until it is killed), so it takes part in no round past KILL_STEP+1 however late the kill comes;
- its restart waits until replica 0 has logged a sync without it before it joins (the survivors' short
  round comes first), then leaves a marker per shard rank in MARKERS once its manager heartbeats; healed
  at a param sync, its last shard rank reads its peer's pace as 1 µs a step (a whole period behind) and the
  others read the real one: the replica's ranks must agree to skip the most steps (join.py), train one step
  and count in the next round;
- every other replica waits before step HOLD_STEP's sync until that marker is there: from then on the
  lighthouse holds each quorum for the restarted replica, so it is back, heals and trains before the end.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.sync.elastic.heal import HealState  # noqa: E402
from hsdp.sync.elastic.membership import ElasticMembership  # noqa: E402
from hsdp.sync.membership import ReplicaSeat  # noqa: E402

POLL_S = 0.05


def _synced_without_a_replica(metrics: Path, replicas: int) -> bool:
    """Whether replica 0's metrics record a sync that fewer than `replicas` replicas counted in."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("replicas", replicas) < replicas:
                return True
        except ValueError:  # a line being written
            pass
    return False


def kill_order_worker(replica: int, kill_step: int, hold_step: int, markers: str, cfg: Config, seat: ReplicaSeat):
    """train.train_worker with the waits above (by `seat`: which replica this worker is, which start of it)."""
    marker_dir = Path(markers)
    load_state_dict = HealState.load_state_dict
    build_mesh, before_sync, after_sync = (
        ElasticMembership.build_mesh,
        ElasticMembership.before_sync,
        ElasticMembership.after_sync,
    )

    if seat.replica == replica and seat.restart == 0:  # the first start: stop after kill_step, until killed

        def stop_after_kill_step(self: ElasticMembership, step: int) -> None:
            after_sync(self, step)
            while step == kill_step + 1:
                time.sleep(POLL_S)

        ElasticMembership.after_sync = stop_after_kill_step
    elif seat.replica == replica:  # the restart: join after the survivors synced alone, then say so

        def build_mesh_after_a_short_sync(self: ElasticMembership, device):
            while not _synced_without_a_replica(cfg.run_dir / "metrics.replica0.jsonl", cfg.mesh.sync):
                time.sleep(POLL_S)
            mesh = build_mesh(self, device)  # its manager heartbeats from here: quorums wait for it
            (marker_dir / f"rank{mesh.shard_rank}").touch()
            return mesh

        def load_state_dict_last_rank_far_behind(self: HealState, state: dict) -> None:
            if "step_s" in state and dist.get_rank() == cfg.mesh.shard - 1:
                state = {**state, "step_s": 1e-6}  # its peer's pace says it is a whole period behind
            load_state_dict(self, state)

        ElasticMembership.build_mesh = build_mesh_after_a_short_sync
        HealState.load_state_dict = load_state_dict_last_rank_far_behind
    else:  # a survivor: before step hold_step's sync, wait until the restarted replica heartbeats

        def build_mesh_noting_rank(self: ElasticMembership, device):
            mesh = build_mesh(self, device)
            self.shard_rank = mesh.shard_rank
            return mesh

        def hold_for_the_restart(self: ElasticMembership, step: int) -> None:
            while step == hold_step and not (marker_dir / f"rank{self.shard_rank}").exists():
                time.sleep(POLL_S)
            before_sync(self, step)

        ElasticMembership.build_mesh = build_mesh_noting_rank
        ElasticMembership.before_sync = hold_for_the_restart
    train.train_worker(cfg, seat)


if __name__ == "__main__":
    replica, kill_step, hold_step = (int(a) for a in sys.argv[1:4])
    worker = functools.partial(kill_order_worker, replica, kill_step, hold_step, sys.argv[4])
    sys.exit(train.main(sys.argv[5:], worker=worker))
