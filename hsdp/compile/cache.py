"""What makes a warm compile load instead of compile (hsdp compiled and fsdp2 compiled alike).

Three things kept every run paying a full compile:
1. our graph passes were plain callables: inductor bypasses its FX graph cache
   for those (fixed in passes.py: cacheable passes with uuids);
2. AOTAutograd's cache refuses graphs holding an autograd.Function (our
   `_GatherShards`) unless told they are safe: ours is a pure function of
   its inputs, traced into the graph, so the cache key covers it;
3. on CPU, each process asks inductor which vector ISAs the compiler can
   build, and inductor answers by compiling a probe per ISA and loading it
   in a fresh Python child (about 10 interpreters importing torch, per rank,
   per run: most of a "warm" compile on a 2-core box). The answer depends
   only on the CPU, the compiler and torch, so it is probed once and kept in
   `<inductor cache dir>/hsdp-vec-isa.json`; when every ISA the CPU reports
   built and loaded, later processes tell inductor so (`cpp.vec_isa_ok`, in
   the compile options and process-wide: a graph loaded warm from the cache
   asks again, outside the options);
4. inductor starts its pool of compile subprocesses (fresh interpreters
   importing torch) on every compile, needed or not; a warm compile
   generates no code, so the pool is left to start lazily, when a cold
   compile first needs it (`TORCH_WARM_POOL=0`, unless the user set it);
5. AOTAutograd writes a graph's cache entry when its backward is compiled,
   lazily at the first backward by default; by then the ranks that waited
   for the leader's compile (hsdp/compile/turns.py) had started their own
   forward, missed the entry and traced and partitioned the joint graph
   again. The backward is compiled with the forward, so the entry is there
   before the leader's first collective lets them go.

Points 2, 4 and 5 change torch's process-global state, so they are hsdp/torch_compat.py's
(`allow_autograd_functions_in_aot_cache`, `start_compile_pool_lazily`,
`compile_backward_with_forward`), as are the private
inductor names point 3 reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from hsdp.core.atomic import write_json
from hsdp.torch_compat import cpu_vec_isa_probe, inductor_cache_dir, trust_vec_isa_probe


def cpu_options() -> dict[str, Any]:
    """Inductor options for CPU compiles: `cpp.vec_isa_ok` once the ISA probe has passed here (point 3).

    The same answer is given on the probing run and later ones, so the FX cache key does not change.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        return {}
    probe = cpu_vec_isa_probe()
    if probe is None:  # inductor moved its probe: fall back to probing every time
        return {}
    supported_vec_isa_list, valid_vec_isa_list, x86_isa_checker = probe
    cpu_flags = x86_isa_checker()
    key = hashlib.sha256(
        json.dumps([sorted(cpu_flags), torch.__version__, os.environ.get("CXX", ""), os.environ.get("CC", "")]).encode()
    ).hexdigest()[:16]
    path = Path(inductor_cache_dir()) / "hsdp-vec-isa.json"
    known = _read_json(path)
    if key not in known:
        on_cpu = [isa for isa in supported_vec_isa_list if all(f in cpu_flags for f in str(isa).split())]
        known[key] = [str(i) for i in valid_vec_isa_list()] == [str(i) for i in on_cpu]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, known)  # ranks probe at once on a first run: a temp name per process
    if not known[key]:
        return {}
    trust_vec_isa_probe()  # a graph loaded from the cache asks again, outside these options (torch_compat)
    return {"cpp.vec_isa_ok": True}


def _read_json(path: Path) -> dict[str, bool]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
