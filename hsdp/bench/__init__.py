"""The benchmark tools behind `python -m hsdp.sweep` and `python -m hsdp.slowlink`, one job per module.

spec      spec files: the one reader for sweep and slow-link files, and link rates
plan      what to run: each run's overrides and validated config (a sweep's, the slow-link benchmark's)
records   a finished run as its folder records it (RunRecord); a slow-link run (LinkRun)
sweep     running a sweep: its variants and their no-comm twins, then the table and plots
netns     network namespaces joined by tc-shaped veths, and their removal
job       a multi-node torchrun job, one node per replica namespace
elastic   an elastic job: the lighthouse on a host of its own, --kill of a replica's node and its replacement
probe     the link probe (its worker: python -m hsdp.bench.probe)
slowlink  running the slow-link benchmark: per rate one network, its probe and runs; slowlink.json
analysis  time to target, sync-time and link-byte checks, crossovers, exposed communication
report    the markdown tables
plot      val-loss plots (matplotlib, imported only when drawing)
"""
