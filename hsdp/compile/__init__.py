"""The compiled path's graph side (docs/design.md §8).

    graph.py    the sharded training step in traceable form: what torch.compile captures
    passes.py   graph passes: release by recompute, collective scheduling (cacheable)
    census.py   the byte census of each compiled graph, with its sidecar for cache hits
    cache.py    what else a warm compile needs to load from inductor's caches

The compiled engine that runs these graphs is hsdp/engines/compiled.py.
"""
