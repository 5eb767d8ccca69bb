"""Graph passes of the compiled path (docs/design.md §10).

`recompute_gathers` (joint graph, before the partitioner): release.
    Tags every all-gather, its wait, the cast feeding it and the unpacking
    views/copies that follow it as MUST_RECOMPUTE. Without this the min-cut
    partitioner saves collective outputs for backward, i.e. every unit's full
    params stay alive from forward to backward. With it, backward starts each
    unit with its own all-gather, and only shards, inputs and activations are
    saved. A unit whose backward needs no weights (the embedding) saves nothing
    derived from its gather, so its gather is not recomputed at all.

`OurPasses` (post-grad, compile.passes=ours): prefetch gathers, pipeline
    reduce waits, then the byte census (`hsdp.compile.census`).

Every pass is an inductor `CustomGraphPass` whose uuid is the hash of this file
and census.py plus its settings, so inductor's FX graph and AOTAutograd caches
hold compiled graphs across processes (a warm compile loads instead of compiling).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

import kernels.pack  # noqa: F401  (registers hsdp_kernels::cast_shard, named below)
from hsdp.torch_compat import (
    ATEN_TO_COPY,
    ATEN_UNSAFE_VIEW,
    C10D_FUNCTIONAL,
    C10D_FUNCTIONAL_PREFIX,
    CustomGraphPass,
    get_hash_for_files,
)

C = C10D_FUNCTIONAL
aten = torch.ops.aten
prims = torch.ops.prims

# Ops that only cast, view or copy what the all-gather produced: recomputing them is as cheap as the gather.
_UNPACK_OPS = {
    aten.view.default,
    ATEN_UNSAFE_VIEW,
    aten.reshape.default,
    aten.split_with_sizes.default,
    aten.split.Tensor,
    aten.slice.Tensor,
    aten.clone.default,
    aten.alias.default,
    aten.t.default,
    aten.permute.default,
    aten.transpose.int,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    ATEN_TO_COPY,
    prims.convert_element_type.default,
    operator.getitem,
    aten.cat.default,
}
# The pack feeding an all-gather (kernels/pack.py's cast as an op): recomputed with the gather.
PACK_OPS = _UNPACK_OPS | {torch.ops.hsdp_kernels.cast_shard.default}
# A bucket's gathered output is split per unit before the usual unpacking.
BUCKET_VIEW_OPS = _UNPACK_OPS | {aten.split_with_sizes_copy.default, aten.narrow.default}
COLLECTIVES = {
    C.all_gather_into_tensor.default: "all_gather",
    C.reduce_scatter_tensor.default: "reduce_scatter",
    C.all_reduce.default: "all_reduce",
}


# What a pass does is its source: a change to this file, census.py or the torch patches that change what inductor
# generates (hsdp/torch_compat.py) changes every uuid (a cache miss): a graph cached before a patch was added is
# not loaded after it (the patch that keeps region inputs undonated fixed graphs that a cache held wrong).
SOURCE_HASH = get_hash_for_files(
    (__file__, str(Path(__file__).with_name("census.py")), str(Path(__file__).parents[1] / "torch_compat.py"))
).hex()[:16]


class CacheablePass(CustomGraphPass):
    """A graph pass inductor can cache around: uuid = our source hash + the pass's name and settings."""

    def __init__(self, fn: Callable[[fx.Graph], None], *settings: object) -> None:
        self.fn, self.settings = fn, settings

    def __call__(self, graph: fx.Graph) -> None:
        self.fn(graph)

    def uuid(self) -> Any:
        return f"{self.fn.__name__}-{self.settings}-{SOURCE_HASH}"


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """In a joint graph, the backward nodes: those that descend from a tangent (incoming grad) input."""
    found: set[fx.Node] = set()
    for n in graph.nodes:  # topological order
        if (n.op == "placeholder" and "tangent" in n.name) or any(i in found for i in n.all_input_nodes):
            found.add(n)
    return found


INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def region_input_views(node: fx.Node) -> dict[int, tuple[int, list[fx.Node]]]:
    """For a nested compile region's call (invoke_subgraph): output index → (operand index, the view/copy
    ops inside the region that make the output from that operand, first to last), for each output
    computed from one region input by unpacking ops alone (e.g. a weight sliced out of the gathered
    buffer, which the region's own partition saved for its backward)."""
    owner = node.graph.owning_module
    if owner is None or not isinstance(node.args[0], fx.Node):
        return {}
    sub = getattr(owner, str(node.args[0].target), None)
    if not isinstance(sub, fx.GraphModule):
        return {}
    placeholders = {p: i for i, p in enumerate(sub.graph.find_nodes(op="placeholder"))}
    found: dict[int, tuple[int, list[fx.Node]]] = {}
    for k, out in enumerate(sub.graph.find_nodes(op="output")[0].args[0]):
        chain: list[fx.Node] = []
        n = out
        while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _UNPACK_OPS:
            if len(n.all_input_nodes) != 1:
                break
            chain.append(n)
            n = n.all_input_nodes[0]
        if isinstance(n, fx.Node) and n in placeholders:
            found[k] = (placeholders[n], chain[::-1])
    return found


def route_region_saves_to_inputs(graph: fx.Graph) -> None:
    """A region's backward reads its saved views of the region's inputs from the caller's side.

    AOTAutograd partitions a nested compile region on its own: the views of the unit's gathered params
    that its backward needs (and its input activation) come out of the forward region as saved
    outputs, and the outer partitioner would keep those (the full params) alive from forward to
    backward. Each such output is rebuilt outside the region by the same view ops on the region's
    input, and the backward reads that instead (the same values): on a gather's result those views are
    tagged for recomputation by `recompute_gathers`, so backward re-gathers, and release holds for
    regions as for inlined units.
    """
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
            continue
        views = region_input_views(node)
        operands = node.args[2:]
        for user in list(node.users):
            if user.target is not operator.getitem or user.args[1] not in views:
                continue
            operand, chain = views[user.args[1]]
            value, anchor = operands[operand], node
            for op in chain:  # the region's view ops, on the caller's tensor, in order after the call
                with graph.inserting_after(anchor):
                    value = anchor = graph.node_copy(op, _to_constant(value))
            user.replace_all_uses_with(value)
            graph.erase_node(user)


def _to_constant(value: fx.node.Argument) -> Callable[[fx.Node], fx.node.Argument]:
    """A `node_copy` arg_transform that maps every node the copied op reads to `value`."""
    return lambda _: value


def recompute_gathers(graph: fx.Graph) -> None:
    """Tag forward all-gathers, their waits, casts and unpacking as MUST_RECOMPUTE (see module doc)."""
    route_region_saves_to_inputs(graph)
    backward = backward_nodes(graph)
    gathers = [
        n
        for n in graph.nodes
        if n.op == "call_function" and n.target == C.all_gather_into_tensor.default and n not in backward
    ]
    tagged: set[fx.Node] = set()

    def tag(n: fx.Node) -> None:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        n.meta["ac_graph_id"] = 0
        tagged.add(n)

    for ag in gathers:
        tag(ag)
        src = ag.args[0]  # the cast of the held shard (its input is a graph input)
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target in PACK_OPS:
            tag(src)
    # Downstream: waits and unpacking ops whose every tensor input is already tagged.
    for n in graph.nodes:
        if n in tagged or n in backward or n.op != "call_function":
            continue
        if n.target is C.wait_tensor.default or n.target in _UNPACK_OPS:
            inputs = n.all_input_nodes
            if inputs and all(i in tagged for i in inputs):
                tag(n)


# ---------------------------------------------------------------- scheduling passes (compile.passes=ours)
def _is(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target == target


WAITS = {C.wait_tensor.default}


def _is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in WAITS


def _is_gather(node: fx.Node) -> bool:
    return _is(node, C.all_gather_into_tensor.default)


def _wait_of(node: fx.Node) -> fx.Node:
    """The wait_tensor of a collective start."""
    return next(u for u in node.users if _is_wait(u))


def _index(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _first_user(node: fx.Node) -> fx.Node:
    pos = _index(node.graph)
    return min(node.users, key=pos.__getitem__)


def _move_before(node: fx.Node, anchor: fx.Node) -> None:
    """Put `node` as close before `anchor` as its inputs allow, bringing along any cast/view inputs that
    sit later (they are cheap); users left above it are pushed down behind it, so the graph stays in
    topological order."""
    if node is anchor:
        return
    for i in node.all_input_nodes:
        pos = _index(node.graph)
        if i.op == "call_function" and pos[i] >= pos[anchor]:
            _move_before(i, anchor)
    pos = _index(node.graph)
    latest_input = max(node.all_input_nodes, key=pos.__getitem__, default=None)
    if latest_input is not None and pos[latest_input] >= pos[anchor]:
        anchor = latest_input.next  # an input that could not move above the anchor (e.g. it is the anchor)
    if node is not anchor:
        anchor.prepend(node)
    _push_users_below(node)


def _push_users_below(node: fx.Node) -> None:
    pos = _index(node.graph)
    late = sorted((u for u in node.users if pos[u] < pos[node]), key=pos.__getitem__)
    after = node
    for u in late:
        after.append(u)
        after = u
        _push_users_below(u)


def gathered_nodes(gather: fx.Node) -> set[fx.Node]:
    """An all-gather and everything that only waits on, views or copies its result (the unit's full params)."""
    found = {gather}
    for n in gather.graph.nodes:
        if (
            n.op == "call_function"
            and (n.target in WAITS or n.target in BUCKET_VIEW_OPS)
            and n.all_input_nodes
            and any(i in found for i in n.all_input_nodes)
        ):
            found.add(n)
    return found


def release_point(gather: fx.Node) -> fx.Node:
    """The last node that reads the unit's full params: after it, they can be freed."""
    pos = _index(gather.graph)
    derived = gathered_nodes(gather)
    return max((u for n in derived for u in n.users), key=pos.__getitem__)


def prefetch_gathers(graph: fx.Graph, prefetch: int) -> None:
    """Start each all-gather `prefetch` gathers ahead of its use; wait right before the first use.

    Gathers are numbered in graph order (forward: units 0..L-1; backward: the re-gathers,
    last unit first). With prefetch k, gather i starts right after wait i-k (when unit i-k
    begins computing), or at the top of the graph for i < k, but never before unit i-k-1's
    full params are released (its last reader), so at most k+1 units' full params are alive:

        before (k=0):  ag0 w0 compute0  ag1 w1 compute1  ag2 w2 compute2
        after  (k=1):  ag0 w0 ag1 compute0  w1 ag2 compute1  w2 compute2
        after  (k=2):  ag0 ag1 w0 ag2 compute0  w1 compute1  w2 compute2

    A gather's input is a cast of a graph input, so it can always move up to there.
    """
    # Numbered in the order the units use them (the first reader of each wait), not issue order.
    pos = _index(graph)
    gathers = sorted((n for n in graph.nodes if _is_gather(n)), key=lambda g: pos[_first_user(_wait_of(g))])
    waits = [_wait_of(g) for g in gathers]
    for w in waits:
        _move_before(w, _first_user(w))
    top = next(n for n in graph.nodes if n.op != "placeholder")
    for i, g in enumerate(gathers):
        if prefetch == 0:
            _move_before(g, waits[i])
            continue
        if i - prefetch < 0:  # the first k gathers go back to back at the top, in order
            anchor = gathers[i - 1].next if i > 0 else top
        else:
            anchor = waits[i - prefetch].next
        if i - prefetch - 1 >= 0:
            pos = _index(graph)
            released = release_point(gathers[i - prefetch - 1])
            if pos[released] >= pos[anchor]:
                anchor = released.next
        _move_before(g, anchor)


def max_gathered_alive(graph: fx.Graph) -> int:
    """Most units' full params alive at once: from a gather's start to its release point."""
    pos = _index(graph)
    spans = [(pos[g], pos[release_point(g)]) for g in graph.nodes if _is_gather(g)]
    return max((sum(1 for a, b in spans if a <= t <= b) for t, _ in spans), default=0)


def pipeline_reduce_waits(graph: fx.Graph) -> None:
    """Wait each reduce-scatter (and its sync all-reduce) late: one unit later, as the eager engine does.

    The wait of reduce-scatter i moves to right before reduce-scatter i+1 starts (so it overlaps
    unit i+1's backward), the sync all-reduce starts right after it, and the all-reduce's wait and
    the final cast into the grad shard move to before the next all-reduce starts / the output:

        before:  rs0 w0 [ar0 v0] out0  compute1  rs1 w1 [ar1 v1] out1
        after:   rs0  compute1  w0 [ar0] rs1  ... [v0] out0 ... w1 [ar1 v1] out1  output

    "As late as the first user allows" is capped at one unit later: a reduce-scatter's input is the
    unit's full-size grad, which stays alive until the wait, so waiting later piles them up.
    """
    reduces = [n for n in graph.nodes if _is(n, C.reduce_scatter_tensor.default)]
    output = next(n for n in graph.nodes if n.op == "output")
    all_reduces = []
    for i, rs in enumerate(reduces):
        w = _wait_of(rs)
        _move_before(w, reduces[i + 1] if i + 1 < len(reduces) else output)
        ar = next((u for u in w.users if _is(u, C.all_reduce.default)), None)
        if ar is not None:
            w.append(ar)
            all_reduces.append(ar)
    for i, ar in enumerate(all_reduces):
        _move_before(_wait_of(ar), all_reduces[i + 1] if i + 1 < len(all_reduces) else output)


@dataclass
class OurPasses(CustomGraphPass):
    """compile.passes=ours: prefetch all-gathers, pipeline reduce waits, then record the census.

    (Bucketing happens before tracing: `hsdp.compile.graph.plan_buckets` gathers a bucket of units
    with one collective, so the graph the passes see already has one all-gather per bucket.)"""

    census: Callable[[fx.Graph], None]  # hsdp.compile.census.CollectiveCensus (it imports this module)
    prefetch: int

    def __call__(self, graph: fx.Graph) -> None:
        prefetch_gathers(graph, self.prefetch)
        pipeline_reduce_waits(graph)
        graph.lint()  # still in topological order
        self.census(graph)

    def uuid(self) -> Any:
        return f"ours-prefetch{self.prefetch}-{SOURCE_HASH}"


def inductor_overlap_options(bucket_mb: float) -> dict[str, object]:
    """compile.passes=inductor: inductor's own comm reordering (and bucketing), the ablation of ours."""
    options: dict[str, object] = {
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": [
            "reorder_communication_preserving_peak_memory",
            "sink_waits_iterative",
            "reorder_communication_preserving_peak_memory",
        ],
    }
    if bucket_mb > 0:
        options.update(
            bucket_all_gathers_fx="all",
            bucket_reduce_scatters_fx="all",
            bucket_all_gathers_fx_bucket_size_determinator=lambda _: bucket_mb,
            bucket_reduce_scatters_fx_bucket_size_determinator=lambda _: bucket_mb,
        )
    return options


# ---------------------------------------------------------------- the schedule, read off the generated code
_COLLECTIVE_CALLS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
}


def schedule_of_code(code: str) -> list[str]:
    """The order of collective starts/waits and compute in inductor's generated `call` function.

    One line per collective event (`start all_gather buf3 <- primals_3`, `wait buf3`), runs of kernel
    calls collapsed into `compute ×n`. Comments and asserts of the generated code are skipped.
    """
    body = code.split("def call(", 1)[-1].split("\ndef ", 1)[0]
    lines: list[str] = []
    run = 0
    for raw in body.splitlines():
        line = raw.strip()
        event = _collective_event(line)
        if event is None:
            run += _is_kernel_call(line)
            continue
        if run:
            lines.append(f"compute ×{run}")
            run = 0
        lines.append(event)
    if run:
        lines.append(f"compute ×{run}")
    return lines


def _collective_event(line: str) -> str | None:
    if C10D_FUNCTIONAL_PREFIX not in line or line.startswith(("#", "assert")):
        return None
    call = line.split(C10D_FUNCTIONAL_PREFIX, 1)[1]
    name, args = call.split(".default(", 1)
    first = args.split(",", 1)[0].split(")", 1)[0]
    if name == "wait_tensor":
        return f"wait {first}"
    out = line.split("=", 1)[0].strip() if "=" in line.split("(", 1)[0] else first
    return f"start {_COLLECTIVE_CALLS.get(name, name)} {out} <- {first}"


def _is_kernel_call(line: str) -> bool:
    """A kernel launch, or a call of a nested compile region's code (a whole block's kernels)."""
    region_call = "= partitioned_" in line and "_args" not in line.split("=", 1)[0]
    return line.startswith(("cpp_fused", "extern_kernels.", "triton_", "aten.")) or ".run(" in line or region_call
