"""The kernels, each named once: what `kernels` exports, what `python -m kernels.bench` times and what
tests/test_cuda_parity.py checks on a GPU all read this table. Adding a kernel is one entry here, plus its
bench case (kernels/bench.py's `cases`, when it is timed) and its parity case (tests/test_cuda_parity.py's
`_cases`), both under the entry's name; tests/test_kernel_registry.py fails until they agree.

Plain data: this file imports only the standard library, so scripts/gpu_summary.py loads it on its own, without
torch (importing it as kernels.registry runs the package's __init__, which imports every kernel module).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    """One kernel.

    name:   its name in the benchmark's table and --kernels, and its parity case's name.
    module: kernels.<module> defines it (and the torch reference, `<op>_ref` where it has one).
    ops:    the public functions it provides, all exported by `kernels`; the first is also the custom op
            hsdp_kernels::<ops[0]> that torch.compile sees, the others call it (one replica's dequantize).
    bench:  `python -m kernels.bench` times it.
    dense:  a streaming kernel of the benchmark, held by scripts/gpu_summary.py to a fraction of the device's
            copy bandwidth (the payload and top-k kernels are timed without a bound).
    """

    name: str
    module: str
    ops: tuple[str, ...]
    bench: bool = False
    dense: bool = False

    @property
    def op(self) -> str:
        """The custom op's name, hsdp_kernels::<op>."""
        return self.ops[0]


def _dense(name: str, module: str, *ops: str) -> Kernel:
    return Kernel(name, module, ops, bench=True, dense=True)


def _timed(name: str, module: str, *ops: str) -> Kernel:
    return Kernel(name, module, ops, bench=True)


def _untimed(name: str, module: str, *ops: str) -> Kernel:
    return Kernel(name, module, ops)


# In the order of the benchmark's table and of the parity cases.
KERNELS: tuple[Kernel, ...] = (
    _dense("pack", "pack", "pack_shards"),
    _dense("unpack", "pack", "unpack_full"),
    _dense("pack_grads", "reduce", "pack_grads"),
    _dense("accumulate", "reduce", "accumulate_grad_shards"),
    _dense("delta", "outer", "compute_delta"),
    _dense("outer", "outer", "outer_step"),
    _dense("quantize", "quant", "quantize_int8"),
    _dense("dequantize", "quant", "dequantize_mean"),
    _dense("quantize_int4", "quant4", "quantize_int4"),
    _dense("dequantize_int4", "quant4", "dequantize_int4_mean", "dequantize_int4"),
    _timed("topk_ef", "topk", "topk_error_feedback"),
    _untimed("topk_select", "topk", "topk_select"),
    _untimed("scatter_add", "topk", "scatter_add_chunks"),
    _timed("quantize_int2", "quant2", "quantize_int2"),
    _timed("dequantize_int2", "quant2", "dequantize_int2_mean", "dequantize_int2"),
    _timed("pack_idx", "bitpack", "pack_bits"),
    _timed("unpack_idx", "bitpack", "unpack_bits"),
    _timed("decode_topk_int2", "sparse_decode", "decode_topk_int2_add"),
    # the compiled graph's functional ops (kernels/_util.py: register_graph_op)
    _untimed("cast_shard", "pack", "cast_shard"),
    _untimed("scale_grad", "reduce", "scale_grad"),
    _untimed("scaled_grad_shard", "reduce", "scaled_grad_shard"),
)

# The other public functions `kernels` exports, by module: the backend switch, and the sizes and dtypes of the
# kernels' outputs that callers allocate by.
HELPERS: dict[str, tuple[str, ...]] = {
    "backend": ("set_backend", "get_backend", "use_triton"),
    "topk": ("topk_index_dtype", "topk_numel"),
    "bitpack": ("index_bits", "packed_nbytes"),
}


def names() -> tuple[str, ...]:
    """Every kernel's name: the parity cases."""
    return tuple(k.name for k in KERNELS)


def bench_names() -> tuple[str, ...]:
    """The kernels the benchmark times, in its table's order."""
    return tuple(k.name for k in KERNELS if k.bench)


def dense_names() -> tuple[str, ...]:
    """The benchmark's streaming kernels (see Kernel.dense)."""
    return tuple(k.name for k in KERNELS if k.dense)


def public_api() -> tuple[tuple[str, str], ...]:
    """(module, function) of each name `kernels` exports: the helpers, then every kernel's ops."""
    helpers = tuple((module, f) for module, fs in HELPERS.items() for f in fs)
    return helpers + tuple((k.module, f) for k in KERNELS for f in k.ops)
