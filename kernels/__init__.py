"""Triton kernels for hybrid-sharded training, each with a torch reference.

Every public function validates its inputs, then runs the Triton kernel when
`kernels.backend.use_triton(...)` says so (CUDA tensors under the default
`auto` backend) and the torch reference otherwise. Each is also registered as a
`torch.library` custom op in the `hsdp_kernels` namespace, so torch.compile
sees one opaque op per call. Importing this package launches nothing and does
not need CUDA or a working triton.
"""

from kernels.backend import get_backend, set_backend, use_triton
from kernels.bitpack import pack_bits, unpack_bits
from kernels.outer import compute_delta, outer_step
from kernels.pack import pack_shards, unpack_full
from kernels.quant import dequantize_mean, quantize_int8
from kernels.quant2 import dequantize_int2, dequantize_int2_mean, quantize_int2
from kernels.quant4 import dequantize_int4, dequantize_int4_mean, quantize_int4
from kernels.reduce import accumulate_grad_shards, pack_grads
from kernels.topk import scatter_add_chunks, topk_error_feedback, topk_index_dtype, topk_numel, topk_select

__all__ = [
    "set_backend",
    "get_backend",
    "use_triton",
    "pack_shards",
    "unpack_full",
    "pack_grads",
    "accumulate_grad_shards",
    "compute_delta",
    "outer_step",
    "quantize_int8",
    "dequantize_mean",
    "quantize_int4",
    "dequantize_int4_mean",
    "dequantize_int4",
    "quantize_int2",
    "dequantize_int2_mean",
    "dequantize_int2",
    "pack_bits",
    "unpack_bits",
    "topk_select",
    "topk_error_feedback",
    "scatter_add_chunks",
    "topk_index_dtype",
    "topk_numel",
]
