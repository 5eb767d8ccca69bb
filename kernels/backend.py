"""Which implementation runs: the Triton kernels or their torch references.

`auto` (default) runs Triton on CUDA tensors and the torch reference on CPU.
`triton` forces the kernels; on CPU tensors they run in the Triton interpreter,
which needs ``TRITON_INTERPRET=1`` set before triton is first imported (tests
use this). `torch` forces the
references. The environment variable ``HSDP_KERNELS_BACKEND`` sets the initial
choice.

This module also makes ``triton``/``tl`` importable names for the kernel files
even where triton is missing, so ``import kernels`` works on any CPU machine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
    _TRITON_ERROR = ""
except Exception as e:  # not installed, or a broken install: the references still work

    class _NoTriton:
        """Stands in for `triton` and `triton.language` so kernel definitions import."""

        constexpr = None  # only evaluated as an annotation

        @staticmethod
        def jit(fn: Callable | None = None, **_: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = tl = _NoTriton()
    HAVE_TRITON = False
    _TRITON_ERROR = f"{type(e).__name__}: {e}"

BACKENDS = ("auto", "triton", "torch")


def _initial_backend() -> str:
    name = os.environ.get("HSDP_KERNELS_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"HSDP_KERNELS_BACKEND={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


_backend = _initial_backend()


def set_backend(name: str) -> None:
    """Select `auto`, `triton` or `torch` for every kernel call that follows."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend {name!r}: expected one of {', '.join(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    """The backend selected by `set_backend` (or HSDP_KERNELS_BACKEND)."""
    return _backend


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for the Triton interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a kernel call on these tensors should launch the Triton kernel."""
    if _backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if _backend == "auto":
        return HAVE_TRITON and on_cuda
    if not HAVE_TRITON:
        raise RuntimeError(f"kernels backend 'triton' needs an importable triton ({_TRITON_ERROR})")
    if not on_cuda and not (interpreting() and _set_up_for_interpreter()):
        raise RuntimeError(
            "kernels backend 'triton' on CPU tensors runs the Triton interpreter, which needs "
            "TRITON_INTERPRET=1 in the environment before triton and kernels are first imported "
            "(triton reads it when it defines kernels; in tests set it at the top of the module "
            "or in tests/conftest.py); or use backend 'auto' or 'torch' on CPU"
        )
    return True


if HAVE_TRITON:

    @triton.jit
    def _probe():
        pass


def _set_up_for_interpreter() -> bool:
    # @triton.jit picks compiled or interpreted when a function is defined: at import
    # for our kernels and for triton's own library (tl.max, tl.zeros, ...). Both must
    # have been defined while TRITON_INTERPRET=1 for the interpreter to run them.
    return not isinstance(_probe, triton.runtime.JITFunction) and not isinstance(tl.max, triton.runtime.JITFunction)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, device: torch.device, **meta: Any) -> None:
    """Launch `kernel[grid](*args, **meta)` on `device`'s GPU (or in the interpreter on CPU)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)
