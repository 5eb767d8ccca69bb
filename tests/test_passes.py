"""Our scheduling passes on hand-built FX graphs: exact placement of starts and waits (no processes)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from hsdp.compile.census import saved_gathered
from hsdp.compile.passes import (
    INVOKE_SUBGRAPH,
    max_gathered_alive,
    pipeline_reduce_waits,
    prefetch_gathers,
    route_region_saves_to_inputs,
    schedule_of_code,
)

C = torch.ops._c10d_functional
aten = torch.ops.aten


def _forward_graph(units: int = 4) -> fx.Graph:
    """held_i → all_gather → wait → view (unpack) → compute_i(x, params), like the compiled forward."""
    g = fx.Graph()
    helds = [g.placeholder(f"held{i}") for i in range(units)]
    x = g.placeholder("x")
    for i, h in enumerate(helds):
        ag = g.call_function(C.all_gather_into_tensor.default, (h, 2, "shard"), name=f"ag{i}")
        w = g.call_function(C.wait_tensor.default, (ag,), name=f"w{i}")
        p = g.call_function(aten.view.default, (w, [-1]), name=f"p{i}")
        x = g.call_function(aten.mul.Tensor, (x, p), name=f"c{i}")
    g.output(x)
    return g


def _order(g: fx.Graph) -> str:
    return " ".join(n.name for n in g.nodes if n.op == "call_function")


@pytest.mark.parametrize(
    "k,expected",
    [
        (0, "ag0 w0 p0 c0 ag1 w1 p1 c1 ag2 w2 p2 c2 ag3 w3 p3 c3"),
        (1, "ag0 w0 ag1 p0 c0 w1 ag2 p1 c1 w2 ag3 p2 c2 w3 p3 c3"),
        (2, "ag0 ag1 w0 ag2 p0 c0 w1 ag3 p1 c1 w2 p2 c2 w3 p3 c3"),
    ],
)
def test_prefetch_places_each_gather_k_ahead(k: int, expected: str) -> None:
    g = _forward_graph()
    prefetch_gathers(g, k)
    g.lint()
    assert _order(g) == expected
    assert max_gathered_alive(g) <= k + 1  # at most k+1 units' full params at once


def test_prefetch_from_the_unscheduled_order() -> None:
    """Gathers issued all at the top (what a naive trace can give) are pulled down to k ahead."""
    g = _forward_graph()
    top = next(n for n in g.nodes if n.op == "call_function")
    for n in [n for n in g.nodes if n.name.startswith("ag")][1:]:
        top.prepend(n)
    prefetch_gathers(g, 1)
    assert _order(g) == "ag0 w0 ag1 p0 c0 w1 ag2 p1 c1 w2 ag3 p2 c2 w3 p3 c3"


def _backward_graph(units: int = 3, sync: bool = True) -> fx.Graph:
    """grad_i → reduce_scatter → wait → [all_reduce → wait] → cast → output, like the compiled backward."""
    g = fx.Graph()
    dy = g.placeholder("tangents_1")
    outs = []
    for i in range(units):
        gi = g.call_function(aten.mul.Tensor, (dy, float(i + 1)), name=f"g{i}")
        rs = g.call_function(C.reduce_scatter_tensor.default, (gi, "sum", 2, "shard"), name=f"rs{i}")
        r = g.call_function(C.wait_tensor.default, (rs,), name=f"r{i}")
        if sync:
            ar = g.call_function(C.all_reduce.default, (r, "sum", "sync"), name=f"ar{i}")
            r = g.call_function(C.wait_tensor.default, (ar,), name=f"a{i}")
        outs.append(g.call_function(aten._to_copy.default, (r,), name=f"o{i}"))
    g.output(tuple(outs))
    return g


def test_reduce_waits_pipelined_one_unit_later() -> None:
    g = _backward_graph(sync=False)
    pipeline_reduce_waits(g)
    g.lint()
    assert _order(g) == "g0 rs0 g1 r0 o0 rs1 g2 r1 o1 rs2 r2 o2"


def test_sync_all_reduce_starts_after_its_reduce_scatter_and_waits_late() -> None:
    g = _backward_graph(sync=True)
    pipeline_reduce_waits(g)
    g.lint()
    assert _order(g) == "g0 rs0 g1 r0 ar0 rs1 g2 r1 a0 o0 ar1 rs2 r2 a1 o1 ar2 a2 o2"


def _region_graph() -> fx.GraphModule:
    """A unit run as a nested compile region, as AOTAutograd stitches one into the joint graph: the forward
    region returns (output, saved...) with a saved weight sliced and transposed out of its gathered input
    and the input activation saved as is; the backward region reads both."""
    sub = fx.Graph()
    gathered, x = sub.placeholder("gathered"), sub.placeholder("x")
    weight = sub.call_function(aten.slice.Tensor, (gathered, 0, 0, 4), name="weight")
    weight_t = sub.call_function(aten.t.default, (weight,), name="weight_t")
    out = sub.call_function(aten.mm.default, (x, weight_t), name="out")
    sub.output((out, weight_t, x))
    root = torch.nn.Module()
    root.fw_region = fx.GraphModule(torch.nn.Module(), sub)
    g = fx.Graph()
    held, x_in, tangent = g.placeholder("held"), g.placeholder("x"), g.placeholder("tangents_1")
    ag = g.call_function(C.all_gather_into_tensor.default, (held, 2, "shard"), name="ag")
    w = g.call_function(C.wait_tensor.default, (ag,), name="w")
    region = g.call_function(INVOKE_SUBGRAPH, (g.get_attr("fw_region"), "fw_region", w, x_in), name="region")
    outs = [g.call_function(operator.getitem, (region, k), name=f"out{k}") for k in range(3)]
    grad = g.call_function(aten.mm.default, (tangent, outs[1]), name="grad_x")  # stands in for the bw region
    grad_w = g.call_function(aten.mm.default, (outs[2], tangent), name="grad_w")
    g.output((outs[0], grad, grad_w))
    return fx.GraphModule(root, g)


def test_region_saves_are_rebuilt_from_the_regions_inputs() -> None:
    """The backward reads the weight view rebuilt on the gather's result (so it can be re-gathered) and the
    activation from the region's input; the region's saved outputs are no longer read."""
    gm = _region_graph()
    route_region_saves_to_inputs(gm.graph)
    gm.graph.lint()
    nodes = {n.name: n for n in gm.graph.nodes}
    weight_t = nodes["grad_x"].args[1]
    assert weight_t.target is aten.t.default and weight_t.args[0].target is aten.slice.Tensor
    assert weight_t.args[0].args[0] is nodes["w"]  # the slice of the gathered buffer, outside the region
    assert nodes["grad_w"].args[0] is nodes["x"]
    assert "out1" not in nodes and "out2" not in nodes and "out0" in nodes


def test_census_sees_full_params_saved_through_a_region() -> None:
    """A forward graph that outputs (saves) a region's view of its gathered input saves full params; after
    the rewiring only the region's real output leaves it."""
    gm = _region_graph()
    out1 = next(n for n in gm.graph.nodes if n.name == "out1")
    assert saved_gathered(gm.graph) == []  # the saved view feeds an op, not the graph's outputs
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((*output.args[0], out1),)
    assert saved_gathered(gm.graph) == [out1]


def test_schedule_counts_a_region_call_as_compute() -> None:
    code = """
def call(args):
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_1, 2, '0')
    partitioned_fw_subgraph_0_0_args = [buf2, buf3]
    buf5 = partitioned_fw_subgraph_0_0(partitioned_fw_subgraph_0_0_args)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
"""
    assert schedule_of_code(code) == ["start all_gather buf0 <- primals_1", "compute ×1", "wait buf0"]


def test_schedule_read_from_generated_code() -> None:
    code = """
def call(args):
    primals_1, = args
    # Topologically Sorted Source Nodes: [all_gather_into_tensor]
    buf0 = torch.ops._c10d_functional.all_gather_into_tensor.default(primals_1, 2, '0')
    assert_size_stride(buf0, (8, ), (1, ))
    cpp_fused_add_0(buf1)
    extern_kernels.mm(buf1, buf2, out=buf3)
    torch.ops._c10d_functional.wait_tensor.default(buf0)
    buf4 = torch.ops._c10d_functional.reduce_scatter_tensor.default(buf3, 'sum', 2, '0')
    torch.ops._c10d_functional.wait_tensor.default(buf4)
    return (buf4, )
"""
    assert schedule_of_code(code) == [
        "start all_gather buf0 <- primals_1",
        "compute ×2",
        "wait buf0",
        "start reduce_scatter buf4 <- buf3",
        "wait buf4",
    ]


def test_buckets_respect_bucket_mb_and_never_hold_the_whole_model() -> None:
    """plan_buckets: consecutive units up to bucket_mb (gathered bytes), 0 = one unit each, never all units."""
    import torch.nn as nn

    from hsdp.compile.graph import plan_buckets
    from hsdp.core.layout import plan_layout

    sizes = [1000, 3000, 3000, 500, 500, 4000]  # fp32 elements per unit
    layouts = [plan_layout(nn.Linear(n, 1, bias=False), 2) for n in sizes]  # gathered: 2·n fp32 = 8·n bytes
    gathered = [2 * lay.N * 4 for lay in layouts]
    mb = 32000 / 2**20
    buckets = plan_buckets(layouts, torch.float32, mb)
    assert [u for b in buckets for u in b] == list(range(len(sizes)))  # every unit once, in order
    for b in buckets:
        assert sum(gathered[u] for u in b) <= 32000 or len(b) == 1
    assert buckets == [[0, 1], [2, 3, 4], [5]]
    assert plan_buckets(layouts, torch.float32, 0) == [[u] for u in range(len(sizes))]
    assert plan_buckets(layouts, torch.float32, 1e6) == [[0, 1, 2], [3, 4, 5]]  # never one whole-model bucket
