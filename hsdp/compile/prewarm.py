"""Imported by the launcher's zygote before it forks the ranks of a compiled run.

What every rank would otherwise do on its first torch.compile call, each on its own: import
inductor, and hash torch's and triton's sources for the cache keys (both cached per process, so
the forked ranks inherit them). About 1.5 s of CPU per rank; on a 2-core box with 4 ranks,
that was a third of a warm compile. On a CPU build, also inductor's vector-ISA questions: each
rank asked them again (a C++ build and a fresh Python child per question, 6-12 of them, ~3 CPU s),
even to load a graph from the cache.
"""

import torch

from hsdp.compile.cache import cpu_options
from hsdp.torch_compat import prewarm_inductor, resolve_vec_isas

prewarm_inductor()
if torch.version.cuda is None and torch.version.hip is None:  # CPU kernels are what its ranks compile
    cpu_options()  # this machine's ISA probe, read (or run once, here): trusted process-wide where it passed
    resolve_vec_isas()
