"""train.py for the last-round heal test: two replicas die and heal from the third in the run's last round.

    python tests/elastic_last_round_train.py KILL_STEP MARKERS [train.py arguments ...]

Replicas 0 and 1, first start, die (os._exit(1): the launcher restarts them) after step KILL_STEP's sync; while a
replica is down (a `down.r<m>` marker, from its death until its restart's manager heartbeats) the others wait
before each sync, so both restarts are in the quorum of the next round: with KILL_STEP two steps before the end,
the run's last. The restarts fetch replica 2's state only once it is leaving (a `leaving` marker from its
shutdown): it has finished the run. Each rank saves its held shards and sync state when it leaves
(`state.r<m>.pt`). The training loop carries no test hooks: these wrap ElasticReplica's and HealState's methods.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.sync.elastic.heal import HealState  # noqa: E402
from hsdp.sync.elastic.replica import ElasticReplica  # noqa: E402
from hsdp.sync.schedule import fragments_due  # noqa: E402
from hsdp.sync.seam import ReplicaSeat  # noqa: E402
from tests.elastic_heal_train import others_down, save_replica_state, wait_for  # noqa: E402

DYING = (0, 1)


def last_round_worker(kill_step: int, markers: Path, cfg: Config, seat: ReplicaSeat) -> None:
    """train.train_worker with the deaths and waits above."""
    me, start = seat.replica, seat.restart
    build_mesh, before_sync, after_sync, shutdown = (
        ElasticReplica.build_mesh,
        ElasticReplica.before_sync,
        ElasticReplica.after_sync,
        ElasticReplica.shutdown,
    )
    fetch = HealState.fetch

    def build_mesh_then_up(self: ElasticReplica, device):
        mesh = build_mesh(self, device)  # its manager heartbeats from here: quorums wait for it
        (markers / f"down.r{me}").unlink(missing_ok=True)
        return mesh

    def hold_while_a_replica_is_down(self: ElasticReplica, step: int) -> None:
        if fragments_due(step, cfg.sync):
            wait_for(lambda: not others_down(markers, me), "a restart")
        before_sync(self, step)

    def after_sync_or_die(self: ElasticReplica, step: int) -> None:
        after_sync(self, step)
        if me in DYING and start == 0 and step == kill_step:
            (markers / f"down.r{me}").touch()
            os._exit(1)

    def fetch_once_the_source_leaves(self: HealState, offer, step: int, wait_s: float, timeout):
        wait_for((markers / "leaving").exists, "the source's leaving")
        return fetch(self, offer, step, wait_s, timeout)

    def save_state(self: ElasticReplica) -> None:
        save_replica_state(self, markers / f"state.r{me}.pt")
        if me not in DYING:
            (markers / "leaving").touch()
        shutdown(self)

    ElasticReplica.build_mesh = build_mesh_then_up
    ElasticReplica.before_sync = hold_while_a_replica_is_down
    ElasticReplica.after_sync = after_sync_or_die
    ElasticReplica.shutdown = save_state
    if me in DYING and start > 0:
        HealState.fetch = fetch_once_the_source_leaves
    train.train_worker(cfg, seat)


if __name__ == "__main__":
    worker = functools.partial(last_round_worker, int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(train.main(sys.argv[3:], worker=worker))
