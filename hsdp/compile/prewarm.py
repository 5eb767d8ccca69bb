"""Imported by the launcher's zygote before it forks the ranks of a compiled run.

What every rank would otherwise do on its first torch.compile call, each on its own: import
inductor, and hash torch's and triton's sources for the cache keys (both cached per process, so
the forked ranks inherit them). About 1.5 s of CPU per rank; on a 2-core box with 4 ranks,
that was a third of a warm compile.
"""

from hsdp.torch_compat import prewarm_inductor

prewarm_inductor()
