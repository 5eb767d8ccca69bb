"""Graph passes of the compiled path (docs/design.md §6).

`recompute_gathers` (joint graph, before the partitioner): release.
    Tags every all-gather, its wait, the cast feeding it and the unpacking
    views/copies that follow it as MUST_RECOMPUTE. Without this the min-cut
    partitioner saves collective outputs for backward, i.e. every unit's full
    params stay alive from forward to backward. With it, backward starts each
    unit with its own all-gather, and only shards, inputs and activations are
    saved. A unit whose backward needs no weights (the embedding) saves nothing
    derived from its gather, so its gather is not recomputed at all.

`CollectiveCensus` (post-grad, once on the forward and once on the backward
    graph): records every collective the graph issues (group, op, bytes), so
    byte counters stay true on replay, when no Python code of ours runs.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from hsdp.comm import ring_bytes_of

C = torch.ops._c10d_functional
aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only cast, view or copy what the all-gather produced: recomputing them is as cheap as the gather.
_UNPACK_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.split_with_sizes.default,
    aten.split.Tensor, aten.slice.Tensor, aten.clone.default, aten.alias.default, aten.t.default,
    aten.permute.default, aten.transpose.int, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten._to_copy.default, prims.convert_element_type.default, operator.getitem,
}
_COLLECTIVES = {
    C.all_gather_into_tensor.default: "all_gather",
    C.reduce_scatter_tensor.default: "reduce_scatter",
    C.all_reduce.default: "all_reduce",
}


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """In a joint graph, the backward nodes: those that descend from a tangent (incoming grad) input."""
    found: set[fx.Node] = set()
    for n in graph.nodes:  # topological order
        if (n.op == "placeholder" and "tangent" in n.name) or any(i in found for i in n.all_input_nodes):
            found.add(n)
    return found


def recompute_gathers(graph: fx.Graph) -> None:
    """Tag forward all-gathers, their waits, casts and unpacking as MUST_RECOMPUTE (see module doc)."""
    backward = backward_nodes(graph)
    gathers = [n for n in graph.nodes if n.op == "call_function" and n.target == C.all_gather_into_tensor.default
               and n not in backward]
    tagged: set[fx.Node] = set()

    def tag(n: fx.Node) -> None:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = 0
        tagged.add(n)

    for ag in gathers:
        tag(ag)
        src = ag.args[0]  # the cast of the held shard (its input is a graph input)
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target in _UNPACK_OPS:
            tag(src)
    # Downstream: waits and unpacking ops whose every tensor input is already tagged.
    for n in graph.nodes:
        if n in tagged or n in backward or n.op != "call_function":
            continue
        if n.target is C.wait_tensor.default or n.target in _UNPACK_OPS:
            inputs = n.all_input_nodes
            if inputs and all(i in tagged for i in inputs):
                tag(n)


@dataclass
class CollectiveCensus:
    """Collectives per compiled graph, keyed by the variant being compiled (set with `recording`)."""

    labels: dict[str, str]  # process-group name → our label ("shard", "sync", "world")
    graphs: dict[object, list[list[tuple[str, str, int]]]] = field(default_factory=lambda: defaultdict(list))
    current: object = None

    def __call__(self, graph: fx.Graph) -> None:
        found = []
        for n in graph.nodes:
            op = _COLLECTIVES.get(n.target) if n.op == "call_function" else None
            if op is None:
                continue
            t = n.args[0].meta["val"]  # the collective's input (a fake tensor)
            group = n.args[-1]
            n_ranks = n.args[1] if op == "all_gather" else n.args[2] if op == "reduce_scatter" else _group_size(group)
            nbytes = t.numel() * t.element_size() // (n_ranks if op == "reduce_scatter" else 1)
            found.append((self.labels.get(group, "other"), op, ring_bytes_of(op, n_ranks, nbytes)))
        self.graphs[self.current].append(found)

    def per_call(self, key: object) -> list[tuple[str, str, int]]:
        """What one forward+backward of variant `key` sends: all its graphs' collectives."""
        return [c for g in self.graphs.get(key, []) for c in g]


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()
