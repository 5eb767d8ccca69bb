"""Rejoin: a replica that was cut off (a partition, a lost lighthouse) and got a quorum again, mid-run.

FTTransport pauses a replica at its sync while no quorum answers (transport.py `_quorum_or_pause`). The
others committed rounds without it meanwhile, so its torchft step is behind theirs and the quorum that
answers once the link is back heals it from a live replica, inside the round this replica began as its own
sync. At a param sync that heal is out of band (an offer, heal.py): the round runs with this replica
spectating, and what is left is done here, after it, as a restarted replica does it (join.py `catch_up`):
fetch the peer's state and continue at the step it leads to, later than this replica's own next one (the
training loop takes it from `steps`). The same holds for a replica that fell a round behind its peers
(its heal was slower than their period). docs/design.md §11.2.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Optional

from hsdp.sync.elastic.heal import HealState
from hsdp.sync.elastic.join import Join


class Rejoin:
    """This replica's rejoins after a cut: when one heals it, the step the training loop continues at."""

    def __init__(self, joining: Join, heal: HealState) -> None:
        self.joining, self.heal = joining, heal
        self.resume_at: Optional[int] = None  # the step to train next, after a rejoin
        self.heals_seen = 0
        self.rejoins = 0  # times this replica was cut off mid-run and healed from a live one when back
        self.paused_s = 0.0  # the quorum waits of the rounds it rejoined in: paused at its sync, cut off

    def stats(self) -> dict[str, Any]:
        """A replica summary's fields on cuts (docs/design.md §11, Partitions)."""
        t = self.joining.transport
        return {
            "rejoins": self.rejoins,
            "rejoin_paused_s": round(self.paused_s, 3),
            "quorum_failures": t.quorum_failures,
            "quorum_failed_s": round(t.quorum_failed_s, 3),
        }

    def steps(self, start: int, end: int) -> Iterator[int]:
        """`start`, `start + 1`, ... before `end`; after a rejoin, the step it healed to instead of the next."""
        self.heals_seen = self.heal.heals  # the join's heal (a restarted replica) is not a rejoin
        step = start
        while step < end:
            yield step
            step, self.resume_at = (step + 1 if self.resume_at is None else self.resume_at), None

    def after_sync(self, step: int, policy: Any) -> None:
        """After `step`'s sync: if its round healed this replica (it was cut off), finish that heal."""
        heal = self.heal
        if heal.offer is not None:  # healed out of band: the round it came in is over (spectated)
            self.paused_s += self.joining.transport.quorum_waits[-1]  # that round's quorum: the pause
            policy.finish()  # τ > 0: that round lands now, as a restarted replica's spectated round does
            self.resume_at = self.joining.catch_up(policy, spectated=True)
            self.heals_seen, self.rejoins = heal.heals, self.rejoins + 1
            print(
                f"elastic: rejoined after a cut: healed from a live replica at its step {heal.healed_to}, "
                f"training on from step {self.resume_at} (this replica was at {step + 1})",
                file=sys.stderr,
                flush=True,
            )
        elif heal.heals > self.heals_seen:
            # Healed inside a grad-sync round (the warmup): the peer's state replaced this replica's in the
            # middle of its own step. Rare (a cut inside the warmup) and not worth a second path: a restart
            # heals it cleanly.
            raise RuntimeError(
                f"rejoined after a cut inside a grad-sync round (step {step}, the warmup): restarting to heal"
            )
