"""train.py with a fault injected by wrapping the worker (the training loop carries no test hooks).

    python tests/faulty_train.py RANK STEP [train.py arguments ...]

Rank RANK raises `RuntimeError("injected fault on rank RANK at step STEP")` when it
asks for its training batch of step STEP; everything else is the real train.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from hsdp.config.schema import Config  # noqa: E402
from hsdp.data.tokens import Data  # noqa: E402


def faulty_worker(rank: int, step: int, cfg: Config) -> None:
    """train.train_worker, except that `rank` fails at `step`."""
    real_batch = Data.train_batch

    def train_batch(self: Data, s: int, micro: int):
        if dist.get_rank() == rank and s == step:
            raise RuntimeError(f"injected fault on rank {rank} at step {step}")
        return real_batch(self, s, micro)

    Data.train_batch = train_batch
    train.train_worker(cfg)


if __name__ == "__main__":
    sys.exit(train.main(sys.argv[3:], worker=functools.partial(faulty_worker, int(sys.argv[1]), int(sys.argv[2]))))
