"""Muon for the block matrices, AdamW for the rest, on params whose rows are sharded (docs/design.md §6.2).

Muon (torch.optim.Muon's algorithm, torch's own Newton–Schulz and LR adjustment) needs each matrix whole,
and a rank of a shard group holds only its dim-0 rows of it (hsdp/core/layout.py: rank r holds rows
[r·rows, min(d0, (r+1)·rows)), rows = ⌈d0/S⌉). One step of one matrix:

    momentum   buf ← μ·buf + (1−μ)·g; u = nesterov ? lerp(g, buf, μ) : buf    elementwise: on the held rows
    to_owner   u's rows in bf16 (what torch's Newton–Schulz casts to first) → the matrix's owner rank
    orthogonalize  the owner stacks the S pieces into the whole matrix and runs Newton–Schulz once
    from_owner the result's rows back to the ranks that hold them (bf16: torch adds the bf16 result too)
    apply      p ← p·(1 − lr·wd) − adjusted_lr(full shape)·O                    elementwise: on the held rows

Each matrix has one owner (greedy by Newton–Schulz cost, largest first), so a shard group runs the
iterations once, spread over its ranks; the two exchanges are one `all_to_all` each per step for all
matrices. `exchange="gather"` is the alternative that was measured against it: every rank all-gathers
every matrix and orthogonalizes all of them (S× the FLOPs; bytes (S−1)·M against owner's 2·(S−1)·M/S, for
M the bytes of one rank's pieces). Both give torch's result bit for bit: the pieces are exact bf16 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from hsdp.comm.groups import Comm
from hsdp.torch_compat import adamw_group_step, muon_adjusted_lr, muon_orthogonalize

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
NS_EPS = 1e-7
EXCHANGES = ("owner", "gather")


def is_muon_matrix(name: str, ndim: int) -> bool:
    """A 2-D weight inside a transformer block (attention and MLP projections): what Muon updates."""
    return ndim == 2 and (".attn." in name or ".mlp." in name)


@dataclass(frozen=True)
class RowSharding:
    """How the params given to the optimizer are split: dim-0 rows over a group of `size` ranks.

    `full_shapes` names each param's whole shape; size 1 (or no comm) means every param is whole."""

    full_shapes: dict[str, torch.Size]
    comm: Optional[Comm] = None
    group: str = "shard"
    size: int = 1
    rank: int = 0


@dataclass(frozen=True)
class Matrix:
    """One Muon matrix as this rank sees it: its whole shape, padded rows per rank and its owner."""

    shape: torch.Size
    rows: int  # ⌈d0 / S⌉: each rank's piece, padded to this many rows
    owner: int

    @property
    def piece_numel(self) -> int:
        return self.rows * self.shape[1]


def assign_owners(shapes: Sequence[torch.Size], size: int) -> list[int]:
    """Each matrix's owner rank: largest Newton–Schulz cost first, to the least-loaded rank (ties: lowest)."""
    load = [0] * size
    owners = [0] * len(shapes)
    cost = [s[0] * s[1] * min(s[0], s[1]) for s in shapes]  # ~ the iteration's matmul FLOPs
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += cost[i]
    return owners


class MuonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over its AdamW groups and Muon over its Muon groups (`group["muon"]`), in one optimizer:
    one state dict, one set of param groups (set_lr, checkpoints and the elastic heal see one optimizer)."""

    def __init__(
        self,
        adamw_groups: list[dict[str, Any]],
        muon_groups: list[dict[str, Any]],
        sharding: RowSharding,
        names: dict[nn.Parameter, str],
        *,
        betas: tuple[float, float],
        eps: float,
        exchange: str = "owner",
    ) -> None:
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
        for g in adamw_groups:
            g.setdefault("muon", False)
        for g in muon_groups:
            g["muon"] = True
        super().__init__([*adamw_groups, *muon_groups], betas=betas, eps=eps)
        self.sharding, self.exchange = sharding, exchange
        params = [p for g in muon_groups for p in g["params"]]
        shapes = [sharding.full_shapes[names[p]] for p in params]
        S = sharding.size
        owners = assign_owners(shapes, S)
        self.matrices: dict[nn.Parameter, Matrix] = {
            p: Matrix(shape, -(-shape[0] // S), owner) for p, shape, owner in zip(params, shapes, owners)
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """load_state_dict's last step: Adam's reads every param's `step`, which a Muon matrix does not keep
        (its state is torch.optim.Muon's, `momentum_buffer` alone): Adam's runs over the AdamW groups only."""
        groups = state["param_groups"]
        super().__setstate__({**state, "param_groups": [g for g in groups if not g.get("muon")]})
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """AdamW's groups as torch.optim.AdamW steps them; then every Muon matrix, orthogonalized whole."""
        assert closure is None, "MuonAdamW.step takes no closure"
        for group in self.param_groups:
            if not group["muon"]:
                adamw_group_step(self, group)
        muon = [(p, g) for g in self.param_groups if g["muon"] for p in g["params"]]
        if not muon:
            return
        pieces = [pad_rows(momentum_update(p, self.state[p], g), self.matrices[p].rows) for p, g in muon]
        if self.sharding.size == 1:  # whole matrices (one rank, ddp; fsdp2's DTensors: torch's DTensor math)
            updates = [self._orthogonalize(piece, self.matrices[p], g) for piece, (p, g) in zip(pieces, muon)]
        elif self.exchange == "owner":
            updates = self._orthogonalize_at_owners([self.matrices[p] for p, _ in muon], pieces, muon[0][1])
        else:
            updates = self._orthogonalize_everywhere([self.matrices[p] for p, _ in muon], pieces, muon[0][1])
        for (p, g), update in zip(muon, updates):
            held = update if update.shape[0] == p.shape[0] else update[: p.shape[0]]  # a short last piece's rows
            apply_update(p, held, g, self.matrices[p].shape)

    # ------------------------------------------------------------ the two exchanges
    def _orthogonalize_at_owners(
        self, matrices: list[Matrix], pieces: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """Each matrix's pieces to its owner, Newton–Schulz there once, the result's pieces back."""
        S, me = self.sharding.size, self.sharding.rank
        owned = [i for i, m in enumerate(matrices) if m.owner == me]
        # to_owner: send, for each destination rank, its matrices' pieces in matrix order
        by_owner = [[i for i, m in enumerate(matrices) if m.owner == d] for d in range(S)]
        send = torch.cat([pieces[i].reshape(-1) for d in range(S) for i in by_owner[d]])
        in_splits = [sum(matrices[i].piece_numel for i in by_owner[d]) for d in range(S)]
        mine = in_splits[me]
        received = torch.empty(S * mine, dtype=send.dtype, device=send.device)
        self._all_to_all(received, send, [mine] * S, in_splits)
        # orthogonalize: stack the S ranks' pieces of each owned matrix (source-major in `received`)
        from_sources = received.view(S, mine)
        results: list[torch.Tensor] = []
        offset = 0
        for i in owned:
            m = matrices[i]
            whole = from_sources[:, offset : offset + m.piece_numel].reshape(S * m.rows, m.shape[1])
            results.append(self._orthogonalize(whole[: m.shape[0]], m, group))
            offset += m.piece_numel
        # from_owner: each rank gets its rows of every matrix this rank owns, and sends back in the same order
        back = torch.cat([r.reshape(S, -1) for r in results], dim=1) if results else send.new_empty(S, 0)
        returned = torch.empty_like(send)
        self._all_to_all(returned, back.reshape(-1), in_splits, [mine] * S)
        out: list[Optional[torch.Tensor]] = [None] * len(matrices)
        offset = 0
        for d in range(S):
            for i in by_owner[d]:
                m = matrices[i]
                out[i] = returned[offset : offset + m.piece_numel].view(m.rows, m.shape[1])
                offset += m.piece_numel
        return [o for o in out if o is not None]

    def _orthogonalize_everywhere(
        self, matrices: list[Matrix], pieces: list[torch.Tensor], group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """Every rank all-gathers every matrix and orthogonalizes all of them; it keeps its own rows."""
        S, me = self.sharding.size, self.sharding.rank
        send = torch.cat([p.reshape(-1) for p in pieces])
        gathered = torch.empty(S * send.numel(), dtype=send.dtype, device=send.device)
        if S == 1:
            gathered.copy_(send)
        else:
            assert self.sharding.comm is not None
            self.sharding.comm.all_gather(gathered, send, self.sharding.group)
        by_rank = gathered.view(S, send.numel())
        out, offset = [], 0
        for m in matrices:
            whole = by_rank[:, offset : offset + m.piece_numel].reshape(S * m.rows, m.shape[1])
            result = self._orthogonalize(whole[: m.shape[0]], m, group)
            out.append(result[me * m.rows : (me + 1) * m.rows])
            offset += m.piece_numel
        return out

    def _orthogonalize(self, whole: torch.Tensor, m: Matrix, group: dict[str, Any]) -> torch.Tensor:
        """torch's Newton–Schulz of one whole matrix, padded back to S·rows rows (bf16)."""
        # contiguous, as torch's own input is (a fresh bf16 copy of the update): the same matmuls, bit for bit
        result = muon_orthogonalize(whole.contiguous(), group["ns_coefficients"], group["ns_steps"], group["ns_eps"])
        pad = self.sharding.size * m.rows - m.shape[0]
        return torch.cat([result, result.new_zeros(pad, m.shape[1])]) if pad else result

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        if self.sharding.size == 1:
            out.copy_(inp)
            return
        assert self.sharding.comm is not None
        self.sharding.comm.all_to_all(out, inp, out_splits, in_splits, self.sharding.group)


# ---------------------------------------------------------------- the elementwise steps (on held rows)
def momentum_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
    """Update the momentum buffer of p's held rows; return this rank's piece of the update, padded, in bf16."""
    grad = p.grad
    assert grad is not None, "a Muon matrix without a grad"
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    return update.bfloat16()


def pad_rows(piece: torch.Tensor, rows: int) -> torch.Tensor:
    """`piece` with zero rows appended up to `rows` (a rank holding fewer rows of a matrix than ⌈d0/S⌉)."""
    missing = rows - piece.shape[0]
    return torch.cat([piece, piece.new_zeros(missing, *piece.shape[1:])]) if missing else piece


def apply_update(p: torch.Tensor, update: torch.Tensor, group: dict[str, Any], shape: torch.Size) -> None:
    """Decoupled weight decay, then the orthogonalized update at the LR torch adjusts for the whole shape."""
    lr = group["lr"]
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(update, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], shape))
