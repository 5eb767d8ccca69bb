"""The compiled path's graph side (docs/design.md §8).

    graph.py    the sharded training step in traceable form: what torch.compile captures
    passes.py   graph passes: release by recompute, the byte census, collective scheduling

The compiled engine that runs these graphs is hsdp/engines/compiled.py.
"""
