"""The byte census of the compiled graphs, kept true when inductor's caches skip compiling.

`CollectiveCensus` is a post-grad pass: on each forward and backward graph it
records every collective (group, op, bytes), so byte counters stay true on
replay, when no Python code of ours runs. It is a cacheable inductor pass (a
stable uuid), so a warm compile loads the graph from inductor's FX graph and
AOTAutograd caches and the pass does not run. For that case the census of every
graph it saw is kept in a sidecar beside inductor's cache, keyed by the SHA-256
of the graph's generated code (which inductor hands out on a hit as on a
compile): `<inductor cache dir>/hsdp-census/<sha>.json`.

Sidecars hold what the graph says (group name, op, group size, input bytes);
our labels and the ring-bytes formula are applied on reading, so a change to
either needs no cache flush.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch.fx as fx

from hsdp.comm.groups import ring_bytes_of
from hsdp.compile.passes import (
    BUCKET_VIEW_OPS,
    COLLECTIVES,
    INVOKE_SUBGRAPH,
    SOURCE_HASH,
    WAITS,
    C,
    max_gathered_alive,
    region_input_views,
)
from hsdp.core.atomic import write_json
from hsdp.torch_compat import CustomGraphPass, inductor_cache_dir, resolve_process_group


@dataclass
class GraphRecord:
    """What one graph's collectives are, as the graph states them (the sidecar's content)."""

    kind: str  # "forward" | "backward"
    collectives: list[tuple[str, str, Optional[int], int]]  # (group name, op, group size or None, input bytes)
    saved_gathered: int  # forward only: outputs kept for backward that are (views of) gathered params
    max_alive: int  # most units' full params alive at once (FX graph liveness)


@dataclass
class GraphCensus:
    """What one compiled graph (a forward or a backward) does with collectives."""

    kind: str  # "forward" | "backward"
    collectives: list[tuple[str, str, int]]  # (group label, op, bytes sent by this rank), in graph order
    saved_gathered: int
    max_alive: int

    def count(self, op: str) -> int:
        return sum(1 for _, o, _ in self.collectives if o == op)


def record_graph(graph: fx.Graph) -> GraphRecord:
    """The census of one post-grad graph."""
    backward = any(n.op == "placeholder" and "tangent" in n.name for n in graph.nodes)
    found: list[tuple[str, str, Optional[int], int]] = []
    for n in graph.nodes:
        op = COLLECTIVES.get(n.target) if n.op == "call_function" else None
        if op is None:
            continue
        t = n.args[0].meta["val"]  # the collective's input (a fake tensor)
        n_ranks = n.args[1] if op == "all_gather" else n.args[2] if op == "reduce_scatter" else None
        found.append((n.args[-1], op, n_ranks, t.numel() * t.element_size()))
    saved = 0 if backward else len(saved_gathered(graph))
    return GraphRecord("backward" if backward else "forward", found, saved, max_gathered_alive(graph))


def label_record(record: GraphRecord, labels: dict[str, str]) -> GraphCensus:
    """A record with our group labels and the bytes this rank sends (ring formulas)."""
    out = []
    for group, op, n_ranks, in_bytes in record.collectives:
        n = n_ranks if n_ranks is not None else _group_size(group)
        nbytes = in_bytes // n if op == "reduce_scatter" else in_bytes
        out.append((labels.get(group, "other"), op, ring_bytes_of(op, n, nbytes)))
    return GraphCensus(record.kind, out, record.saved_gathered, record.max_alive)


def saved_gathered(graph: fx.Graph) -> list[fx.Node]:
    """Forward-graph outputs that are an all-gather's result or a cast/view/copy of it (full params saved),
    a nested compile region's output that is a view of its gathered input included."""
    gathered: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is operator.getitem and _region_view_of_gathered(n, gathered):
            gathered.add(n)
        elif n.target == C.all_gather_into_tensor.default or (
            (n.target in WAITS or n.target in BUCKET_VIEW_OPS) and any(i in gathered for i in n.all_input_nodes)
        ):
            gathered.add(n)
    output = next(n for n in graph.nodes if n.op == "output")
    return [n for n in output.all_input_nodes if n in gathered]


def _region_view_of_gathered(getitem: fx.Node, gathered: set[fx.Node]) -> bool:
    """Is this output of a region's call a view the region made of a gathered input?"""
    region = getitem.args[0]
    if not isinstance(region, fx.Node) or region.target is not INVOKE_SUBGRAPH:
        return False
    view = region_input_views(region).get(int(getitem.args[1]))  # type: ignore[arg-type]
    return view is not None and region.args[2 + view[0]] in gathered


def _group_size(group_name: str) -> int:
    return resolve_process_group(group_name).size()


def sidecar_dir() -> Path:
    return Path(inductor_cache_dir()) / "hsdp-census"


class MissingCensus(RuntimeError):
    """Inductor's cache returned a graph whose census sidecar is gone."""


@dataclass
class CollectiveCensus(CustomGraphPass):
    """Post-grad pass: the census of every compiled graph, by the variant being compiled.

    The engine sets `current` to the variant around the calls that compile, and hands each graph's
    generated code to `on_code` (inductor's save_output_code hook, called on a compile and on a
    cache hit alike): after a compile the pass's record is pending and is written to the sidecar;
    after a hit there is none and the sidecar is read.
    """

    labels: dict[str, str]  # process-group name → our label ("shard", "sync", "world")
    graphs: dict[object, list[GraphCensus]] = field(default_factory=lambda: defaultdict(list))
    current: object = None
    pending: Optional[GraphRecord] = None
    cache_hits: int = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.pending = record_graph(graph)

    def uuid(self) -> Any:
        return f"hsdp-census-{SOURCE_HASH}"

    def on_code(self, code: str) -> None:
        """One graph's generated code arrived: file its census (from the pass or from the sidecar)."""
        path = sidecar_dir() / f"{hashlib.sha256(code.encode()).hexdigest()}.json"
        if self.pending is not None:
            record, self.pending = self.pending, None
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, asdict(record))  # ranks write the same sidecar at once: a temp name per process
        else:
            if not path.is_file():
                raise MissingCensus(
                    f"inductor's cache returned a compiled graph whose byte census {path} is missing; "
                    f"remove {path.parent.parent} (or set TORCHINDUCTOR_FX_GRAPH_CACHE=0) and run again"
                )
            raw = json.loads(path.read_text())
            collectives = [tuple(c) for c in raw["collectives"]]
            record = GraphRecord(raw["kind"], collectives, raw["saved_gathered"], raw["max_alive"])
            self.cache_hits += 1
        self.graphs[self.current].append(label_record(record, self.labels))

    def per_call(self, key: object) -> list[tuple[str, str, int]]:
        """What one forward+backward of variant `key` sends: all its graphs' collectives."""
        return [c for g in self.graphs.get(key, []) for c in g.collectives]
