"""Triton kernels for hybrid-sharded training, each with a torch reference.

Every public function validates its inputs, then runs the Triton kernel when
`kernels.backend.use_triton(...)` says so (CUDA tensors under the default
`auto` backend) and the torch reference otherwise. Each is also registered as a
`torch.library` custom op in the `hsdp_kernels` namespace, so torch.compile
sees one opaque op per call. Importing this package launches nothing and does
not need CUDA or a working triton.

The names exported here are kernels/registry.py's: every kernel's ops and the
helpers (the backend switch, output sizes and dtypes), each from its module.
"""

from importlib import import_module

from kernels.registry import public_api

__all__ = [name for _, name in public_api()]

for _module, _name in public_api():
    globals()[_name] = getattr(import_module(f"kernels.{_module}"), _name)
del _module, _name
