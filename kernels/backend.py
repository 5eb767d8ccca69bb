"""Which implementation runs: the Triton kernels or their torch references.

`auto` (default) runs Triton on CUDA tensors and the torch reference on CPU.
`triton` forces the kernels; on CPU tensors they run in the Triton interpreter,
which needs ``TRITON_INTERPRET=1`` (tests use this). `torch` forces the
references. The environment variable ``HSDP_KERNELS_BACKEND`` sets the initial
choice.

This module also makes ``triton``/``tl`` importable names for the kernel files
even where triton is missing, so ``import kernels`` works on any CPU machine.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

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

    triton = tl = _NoTriton()  # type: ignore[assignment]
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
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "kernels backend 'triton' on CPU tensors runs the Triton interpreter, which needs the "
            "environment variable TRITON_INTERPRET=1; set it, or use backend 'auto' or 'torch' on CPU"
        )
    return True


@functools.cache
def _interpreted(kernel: Any) -> Any:
    # @triton.jit decides compiled-vs-interpreted when the module is imported. If
    # `kernels` was imported before TRITON_INTERPRET=1 was set (e.g. another test
    # module imported it first), re-wrap the same source now that it is set.
    return triton.jit(kernel.fn)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, device: torch.device, **meta: Any) -> None:
    """Launch `kernel[grid](*args, **meta)` on `device` (interpreted on CPU)."""
    if device.type == "cuda":
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                kernel[grid](*args, **meta)
            return
    elif isinstance(kernel, triton.runtime.JITFunction):
        kernel = _interpreted(kernel)
    kernel[grid](*args, **meta)
