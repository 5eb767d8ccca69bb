"""Two helpers engines use to expose their state to torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

from typing import Any

import torch

from hsdp.torch_compat import DTensor, Shard


def shard_dtensor(local: torch.Tensor, full_shape: torch.Size, shard_mesh: Any) -> DTensor:
    """`local` (this rank's dim-0 rows, torch.chunk's split) as a Shard(0) DTensor of `full_shape`.

    No communication; DCP reads the global offset from the mesh coordinate, so a
    checkpoint saved on S ranks loads onto any other number of shard ranks.
    """
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(
        local, shard_mesh, [Shard(0)], run_check=False, shape=torch.Size(full_shape), stride=stride
    )


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (so DCP can load into them) by a step with lr = 0.

    The grads must be zero: AdamW's update is then exactly zero (decay ×(1 − 0·wd),
    step 0·m/(√v + ε)), so params are bit-for-bit unchanged; the loaded state
    replaces the moments and step count.
    """
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
