"""train.py with an elastic replica that dies inside a sync round (the training loop carries no test hooks).

    python tests/elastic_faulty_train.py REPLICA ROUND [train.py arguments ...]

Every process of replica REPLICA, in its first start only, exits (os._exit(1), as a crash would) right
after the quorum of its ROUND-th sync round formed with it in it, before the round's collectives: its
peers' collectives then fail after elastic.timeout_s and the round must be dropped, not half applied.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.sync.elastic.transport import FTTransport  # noqa: E402
from hsdp.sync.membership import ReplicaSeat  # noqa: E402


def faulty_worker(replica: int, round_: int, cfg: Config, seat: ReplicaSeat) -> None:
    """train.train_worker, except that `replica` dies inside its round `round_` (first start only: its seat
    says which replica this worker is and which start of it)."""
    if seat.replica == replica and seat.restart == 0:
        real_begin = FTTransport.begin_round

        def begin_round(self: FTTransport) -> None:
            real_begin(self)
            if self.rounds == round_:
                os._exit(1)

        FTTransport.begin_round = begin_round
    train.train_worker(cfg, seat)


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[3:], worker=functools.partial(faulty_worker, int(sys.argv[1]), int(sys.argv[2]))))
