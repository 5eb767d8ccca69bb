"""The compiled path's graph side (docs/design.md §10).

    graph.py    the sharded training step in traceable form: what torch.compile captures
    passes.py   graph passes: release by recompute, collective scheduling (cacheable)
    census.py   the byte census of each compiled graph, with its sidecar for cache hits
    cache.py    what else a warm compile needs to load from inductor's caches
    prewarm.py  the launcher's zygote imports inductor and hashes its cache keys once, before forking ranks
    gloo.py     on CPU, the graph's all-gathers / reduce-scatters through the eager engine's c10d calls

The compiled engine that runs these graphs is hsdp/engines/compiled.py.
"""
