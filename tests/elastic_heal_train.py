"""train.py for the heal tests: kills during a heal, on either side, ordered by events (nothing is timed).

    python tests/elastic_heal_train.py KILL_STEP MARKERS [train.py arguments ...]

Replica 1 is the one that heals; every death is os._exit(1) (a crash: the launcher restarts the replica).
The training loop carries no test hooks: these wrap ElasticReplica's and HealState's methods.

- replica 1, first start: dies after step KILL_STEP;
- replica 1, second start: heals, and dies at its first step after the heal (the healing side killed);
- replica 1, third start: heals, but fetches the state only once the replica serving it is dead;
- the replica (not 1, first start) that served replica 1's third start dies at the step after it published
  that state (the serving side killed): replica 1 heals again from the third replica;
- while a replica is down (a `down.r<m>` marker, from its death until its restart's manager heartbeats) the
  others wait before each sync, so every restart is back, heals and trains before the end;
- each rank saves its held shards and sync state at the end (`state.r<m>.pt`), and a restarted one its
  error-feedback residuals right after its heal (`healed.r<m>.s<start>.pt`).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.sync.elastic.heal import HealState  # noqa: E402
from hsdp.sync.elastic.replica import ElasticReplica  # noqa: E402
from hsdp.sync.schedule import fragments_due  # noqa: E402
from hsdp.sync.seam import ReplicaSeat  # noqa: E402

POLL_S = 0.05
HEALING = 1  # the replica whose restarts heal


def _die(markers: Path, replica: int, *also: str) -> None:
    """Crash this replica, leaving `down.r<replica>` (and the `also` markers) behind."""
    for name in (f"down.r{replica}", *also):
        (markers / name).touch()
    os._exit(1)


def wait_for(condition, what: str, limit_s: float = 200.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:  # the test's hang guard would fire anyway; say what never came
            raise RuntimeError(f"heal harness: {what} never happened")
        time.sleep(POLL_S)


def others_down(markers: Path, me: int) -> list[Path]:
    """The `down.r<m>` markers of the replicas other than `me` (each down from its death to its restart's mesh)."""
    return [p for p in markers.glob("down.r*") if p.name != f"down.r{me}"]


def save_replica_state(replica: ElasticReplica, path: Path) -> None:
    """The rank's held shards and sync state (θ_g, momentum, residuals) at the end, for the tests to compare."""
    policy = replica.heal.seam.policy.state_dict()["buffers"]
    held = [h.detach().clone() for h in replica.heal.seam.held]
    torch.save({"held": held, **policy}, path)


def heal_worker(kill_step: int, markers: Path, cfg: Config, seat: ReplicaSeat) -> None:
    """train.train_worker with the deaths and waits above (`seat`: which replica and which start of it)."""
    me, start = seat.replica, seat.restart
    build_mesh, join, before_sync, after_sync, shutdown = (
        ElasticReplica.build_mesh,
        ElasticReplica.join,
        ElasticReplica.before_sync,
        ElasticReplica.after_sync,
        ElasticReplica.shutdown,
    )
    serve, fetch = HealState.serve, HealState.fetch
    dying = {"next_step": False}

    def build_mesh_then_up(self: ElasticReplica, device):
        mesh = build_mesh(self, device)  # its manager heartbeats from here: quorums wait for it
        (markers / f"down.r{me}").unlink(missing_ok=True)
        if me == HEALING and start == 2:
            (markers / "third_start_up").touch()
        return mesh

    def join_and_note(self: ElasticReplica, state, start_step: int) -> int:
        step = join(self, state, start_step)
        if start > 0:  # the residuals it starts from after its heal
            torch.save(state.policy.state_dict()["buffers"]["error"], markers / f"healed.r{me}.s{start}.pt")
        return step

    def hold_while_a_replica_is_down(self: ElasticReplica, step: int) -> None:
        if me == HEALING and start == 1:
            _die(markers, me)  # its first step after the heal
        if dying["next_step"]:
            _die(markers, me, "server_dead")
        if fragments_due(step, cfg.sync):
            wait_for(lambda: not others_down(markers, me), "a restart")
        before_sync(self, step)

    def after_sync_or_die(self: ElasticReplica, step: int) -> None:
        after_sync(self, step)
        if me == HEALING and start == 0 and step == kill_step:
            _die(markers, me)

    def serve_and_mark(self: HealState, step: int, transport, timeout) -> None:
        asked = self.asked_at
        serve(self, step, transport, timeout)
        published = asked is not None and self.asked_at is None
        if published and (markers / "third_start_up").exists() and not (markers / "server_dead").exists():
            dying["next_step"] = True

    def fetch_after_the_server_died(self: HealState, offer, step: int, wait_s: float, timeout):
        if self.fetches == 0:
            wait_for((markers / "server_dead").exists, "the serving replica's death")
        return fetch(self, offer, step, wait_s, timeout)

    def save_state(self: ElasticReplica) -> None:
        save_replica_state(self, markers / f"state.r{me}.pt")
        shutdown(self)

    ElasticReplica.build_mesh = build_mesh_then_up
    ElasticReplica.join = join_and_note
    ElasticReplica.before_sync = hold_while_a_replica_is_down
    ElasticReplica.after_sync = after_sync_or_die
    ElasticReplica.shutdown = save_state
    if me != HEALING and start == 0:
        HealState.serve = serve_and_mark
    if me == HEALING and start == 2:
        HealState.fetch = fetch_after_the_server_died
    train.train_worker(cfg, seat)


if __name__ == "__main__":
    worker = functools.partial(heal_worker, int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(train.main(sys.argv[3:], worker=worker))
