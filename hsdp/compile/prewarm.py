"""Imported by the launcher's zygote before it forks the ranks of a compiled run.

What every rank would otherwise do on its first torch.compile call, each on its own: import
inductor, and hash torch's and triton's sources for the cache keys (both cached per process, so
the forked ranks inherit them). About 1.5 s of CPU per rank; on a 2-core box with 4 ranks,
that was a third of a warm compile.
"""

import contextlib

import torch._inductor.compile_fx  # noqa: F401
from torch._inductor import codecache

# A torch without these helpers: the ranks compute the keys themselves.
with contextlib.suppress(Exception):
    codecache.torch_key()
    codecache.CacheBase.get_system()  # triton's key
