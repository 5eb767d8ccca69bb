"""`python -m hsdp.plan`: a step-time and compute-utilisation model of a config at given link rates.

workload.py (what a step computes and moves: the engine's byte counts) · model.py (the step timeline) ·
calibrate.py (compute-only times from a fake-backend run) · collectives.py (the shard group's
collectives timed on the mesh, which a fake-backend run leaves out) · project.py (FLOPs on a named GPU, failure
cost) · report.py (table, JSON, plot) · __main__.py (the command) · validate.py (predicted vs measured
across the real shaped link: `python -m hsdp.plan.validate`).
"""
