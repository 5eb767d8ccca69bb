"""The sync policy's state: everything it carries from one step to the next, as one object.

Per unit of the held layout (each a flat fp32 tensor the size of the unit's held shard):

    θ_g   global_params   where the method keeps a global copy (uses_global_copy)
    b     momentum        DiLoCo's outer momentum, from the first outer step on
    r     rounds          the unit's outer steps so far (the round of per-round η, μ: §8.11)
    e     error           this replica's error-feedback residual, from its first sync on
    θ̂     eager           this replica's eager estimate of θ_g while its unit's sync is in flight (§8.10)
    Δ     in flight       a started sync's mean Δ per unit of its fragment (τ > 0)

`state_dict()` is that state in one form, used as it is by every reader: the checkpoint
(hsdp/run/checkpoint/), a healing peer (hsdp/sync/elastic/heal.py) and torch.save:

    {"meta":    {"format", "fragments", "has_global", "momentum_units", "error_units",
                 "rounds": [r per unit], "eager_units",
                 "in_flight": [{"fragment", "start", "land"}, …]},          JSON: the structure
     "buffers": {"global": [...], "momentum": [...], "error": [...], "eager": [...],
                 "in_flight0": [...], …}}                                   one flat tensor (or None) per unit

`meta` alone says which buffers exist, so a load can allocate them before reading
(`empty_state_dict(meta)`). Buffers named in `REPLICA_BUFFERS` differ between replicas
(each saves its own); the rest are identical on every replica. Format 1 (before `rounds` and
`eager`) still loads: no eager estimates, and r = 1 where b exists, else 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch

from hsdp.sync.codec import Reduction

FORMAT = 2  # bump when the state_dict's layout changes (saved checkpoints' meta.json holds it)
READS = (1, 2)  # the formats load_state_dict reads (1: without rounds and eager estimates)
REPLICA_BUFFERS = frozenset({"error", "eager"})  # buffers that differ between replicas (the rest: identical on all)
Buffers = dict[str, list[Optional[torch.Tensor]]]  # buffer name → one flat tensor (or None) per unit
_MaybeTensor = TypeVar("_MaybeTensor", torch.Tensor, None)  # a tensor in, a tensor out; None in, None out


@dataclass
class OuterState:
    """θ_g and outer momentum b for one unit's held shard."""

    global_params: torch.Tensor
    momentum: Optional[torch.Tensor] = None  # allocated on the first outer step
    rounds: int = 0  # outer steps applied so far (per-round η, μ: hsdp/sync/outer.py)


@dataclass
class PendingSync:
    """A fragment's sync started after the update of step `start`; it lands after step `land` (τ = 0: the same)."""

    fragment: int
    start: int
    land: int
    reductions: list[Reduction]  # one per unit of the fragment, in `fragments[fragment]` order
    own_steps: int = 0  # the steps this replica trained into its Δ (its weight; merged if the round counts it)


class SyncState:
    """θ_g, b, e per unit and the syncs in flight, over `held` (each unit's flat fp32 held shard)."""

    def __init__(self, held: list[torch.Tensor], fragments: list[list[int]]) -> None:
        self.held = held
        self.fragments = fragments  # the units of each fragment
        self.outer: list[Optional[OuterState]] = [None] * len(held)
        self.error: list[Optional[torch.Tensor]] = [None] * len(held)
        self.eager: list[Optional[torch.Tensor]] = [None] * len(held)  # θ̂_m while the unit's sync is in flight
        self.in_flight: list[PendingSync] = []  # in start order, so every rank waits in the same order

    @property
    def has_global(self) -> bool:
        return any(s is not None for s in self.outer)

    def start_global_copy(self) -> None:
        """θ_g ← θ_m for every unit."""
        self.outer = [OuterState(global_params=h.clone()) for h in self.held]

    def error_of(self, u: int) -> torch.Tensor:
        """Unit u's error-feedback residual (zero on its first use)."""
        error = self.error[u]
        if error is None:
            error = self.error[u] = torch.zeros_like(self.held[u])
        return error

    # ------------------------------------------------------------ the one serialised form
    def state_dict(self) -> dict[str, Any]:
        """{"meta", "buffers"} (module docstring). The in-flight reductions must be finished (the policy's
        `state_dict` waits for them); the tensors alias the live buffers (save or clone before training on)."""
        meta = {
            "format": FORMAT,
            "fragments": len(self.fragments),
            "has_global": self.has_global,
            "momentum_units": [u for u, s in enumerate(self.outer) if s is not None and s.momentum is not None],
            "error_units": [u for u, e in enumerate(self.error) if e is not None],
            "rounds": [s.rounds if s is not None else 0 for s in self.outer],
            "eager_units": [u for u, e in enumerate(self.eager) if e is not None],
            "in_flight": [{"fragment": s.fragment, "start": s.start, "land": s.land} for s in self.in_flight],
        }
        buffers: Buffers = {
            "global": [s.global_params if s is not None else None for s in self.outer],
            "momentum": [s.momentum if s is not None else None for s in self.outer],
            "error": list(self.error),
            "eager": list(self.eager),
        }
        for i, s in enumerate(self.in_flight):
            buffers[f"in_flight{i}"] = self._per_unit(s.fragment, [r.delta for r in s.reductions])
        return {"meta": meta, "buffers": buffers}

    def empty_state_dict(self, meta: dict[str, Any]) -> dict[str, Any]:
        """A state_dict shaped after a saved `meta`, its buffers zeroed (load targets: padding stays zero)."""
        zeros = torch.zeros_like
        buffers: Buffers = {
            "global": [zeros(h) if meta["has_global"] else None for h in self.held],
            "momentum": [zeros(h) if u in meta["momentum_units"] else None for u, h in enumerate(self.held)],
            "error": [zeros(h) if u in meta.get("error_units", ()) else None for u, h in enumerate(self.held)],
            "eager": [zeros(h) if u in meta.get("eager_units", ()) else None for u, h in enumerate(self.held)],
        }
        for i, s in enumerate(meta["in_flight"]):
            buffers[f"in_flight{i}"] = self._per_unit(
                s["fragment"], [zeros(self.held[u]) for u in self.fragments[s["fragment"]]]
            )
        return {"meta": meta, "buffers": buffers}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (tensors are copied onto the held shards' device)."""
        meta, buffers = state["meta"], state["buffers"]
        if meta.get("format") not in READS:
            raise ValueError(f"SyncState.load_state_dict: expected format {READS}, got {meta.get('format')}")
        if meta["fragments"] != len(self.fragments) or len(buffers["global"]) != len(self.held):
            raise ValueError(
                f"SyncState.load_state_dict: state of {len(buffers['global'])} units in {meta['fragments']} "
                f"fragments, policy has {len(self.held)} in {len(self.fragments)}"
            )

        def own(t: _MaybeTensor, u: int, what: str) -> _MaybeTensor:
            if t is None:
                return None
            if t.shape != self.held[u].shape:
                raise ValueError(
                    f"SyncState.load_state_dict: {what}[{u}] has shape {tuple(t.shape)}, "
                    f"expected {tuple(self.held[u].shape)}"
                )
            return torch.empty_like(self.held[u]).copy_(t)

        momentum = buffers["momentum"]
        # format 1 has no round counts: r = 1 where b exists (exact up to the second outer step), else 0
        rounds = meta.get("rounds") or [int(b is not None) for b in momentum]
        self.outer = [
            OuterState(own(g, u, "global"), own(momentum[u], u, "momentum"), int(rounds[u]))
            if meta["has_global"]
            else None
            for u, g in enumerate(buffers["global"])
        ]
        errors = buffers.get("error") or [None] * len(self.held)
        self.error = [own(e, u, "error") for u, e in enumerate(errors)]
        eager = buffers.get("eager") or [None] * len(self.held)
        self.eager = [own(e, u, "eager") for u, e in enumerate(eager)]
        self.in_flight = []
        for i, s in enumerate(meta["in_flight"]):
            units = self.fragments[s["fragment"]]
            deltas = buffers[f"in_flight{i}"]
            if any(deltas[u] is None for u in units):
                raise ValueError(f"SyncState.load_state_dict: in_flight{i} lacks a unit of fragment {s['fragment']}")
            reds = [Reduction(own(deltas[u], u, f"in_flight{i}"), done=True) for u in units]
            self.in_flight.append(PendingSync(s["fragment"], s["start"], s["land"], reds))

    def _per_unit(self, fragment: int, tensors: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """A fragment's per-unit tensors placed at their units' indices (None for the other units)."""
        per_unit: list[Optional[torch.Tensor]] = [None] * len(self.held)
        for u, t in zip(self.fragments[fragment], tensors, strict=True):
            per_unit[u] = t
        return per_unit
