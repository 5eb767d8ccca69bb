"""Shared plumbing for the kernel files: input checks, op registration, the unit work-item table."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch

from kernels.backend import launch, tl, triton, use_triton

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F = TypeVar("F", bound=Callable[..., Any])


def fail(msg: str) -> NoReturn:
    raise ValueError(msg)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: tuple[int, ...] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> None:
    """Check one argument: a contiguous tensor with the given dtype/shape/device.

    Messages are only formatted on failure: these checks run on every call.
    """
    if not isinstance(t, torch.Tensor):
        fail(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(f"{op}: {name} has dtype {t.dtype}, expected {allowed}")
    if ndim is not None and t.dim() != ndim:
        fail(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None and t.shape != shape:
        fail(f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if device is not None and t.device != device:
        fail(f"{op}: {name} is on {t.device}, expected {device}")
    # The kernels index flat memory, so every tensor they touch must be dense.
    if not t.is_contiguous():
        fail(f"{op}: {name} must be contiguous")


def check_shard_sizes(op: str, shard_sizes: Sequence[int], total: int) -> list[int]:
    """Validate per-param shard numels against the unit's shard length N; return them as a list."""
    sizes = [int(s) for s in shard_sizes]
    if min(sizes, default=0) < 0:
        fail(f"{op}: shard_sizes must be >= 0, got {sizes[:8]}{'...' if len(sizes) > 8 else ''}")
    if sum(sizes) != total:
        fail(f"{op}: shard_sizes sum to {sum(sizes)}, but the shard length N is {total}")
    return sizes


def no_grad(fn: F) -> F:
    """Run fn without autograd recording (the kernels write into params in place).

    Cheaper than @torch.no_grad() when grad mode is already off, the usual case.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def register_op(name: str, impl: Callable[..., Any], mutates_args: tuple[str, ...]) -> Any:
    """Register impl as the custom op hsdp_kernels::<name>, so torch.compile sees one opaque op."""
    return torch.library.custom_op(f"hsdp_kernels::{name}", impl, mutates_args=mutates_args)


def register_graph_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Any:
    """Register a functional (out-of-place) op hsdp_kernels::<name> for compiled graphs.

    Inductor keeps it as one call in the generated code (the op appears in the graph); the impl
    picks the Triton kernel or the torch reference at run time, by `kernels.backend`.
    """
    op = torch.library.custom_op(f"hsdp_kernels::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


def call(op: Any, impl: Callable[..., Any], *args: Any) -> Any:
    """Run the custom op while torch.compile traces, else impl itself.

    Same code either way; the eager shortcut skips ~40 us of Python dispatcher
    overhead per call that a custom op costs.
    """
    return (op if torch.compiler.is_compiling() else impl)(*args)


def pow2_divisor(x: int, cap: int = 16) -> int:
    """Largest power of two <= cap that divides x (x == 0 counts as divisible)."""
    d = 1
    while d < cap and x % (2 * d) == 0:
        d *= 2
    return d


@functools.lru_cache(maxsize=128)
def unit_items(shard_sizes: tuple[int, ...], device: torch.device, block: int) -> tuple[torch.Tensor, int, int]:
    """Work items for one launch over a whole unit.

    One item per `block`-long chunk of each param's shard, so no program straddles
    two params and none has to search for its param. Returns (table, n_items,
    align): table is int64 [n_items, 4] = (param index, shard offset, shard size,
    chunk start); align is the largest power of two (<= 16) dividing every offset,
    size and N, a divisibility hint that lets the GPU vectorise loads and stores.
    Cached: the engine calls with the same shard_sizes every step, so the host
    work and the host-to-device copy happen once per unit.
    """
    rows = []
    off = 0
    align = 16
    for i, sn in enumerate(shard_sizes):
        for start in range(0, sn, block):
            rows.append((i, off, sn, start))
        align = min(align, pow2_divisor(off), pow2_divisor(sn))
        off += sn
    align = min(align, pow2_divisor(off))
    table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4).to(device)
    return table, len(rows), align


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1): a register tile's extent."""
    return 1 << max(0, (x - 1).bit_length())


# ----------------------------------------------------------------------------- packed block codecs (int4, int2)


_BLOCK_RULE = {
    2: "an even int in [2, {hi}] (a byte holds two of one block's)",
    4: "a multiple of 4 in [4, {hi}] (four per byte)",
}


@dataclass
class PackedCodec:
    """The host side of a packed block codec, `bits` (4: kernels/quant4.py, 2: kernels/quant2.py): 8 // bits
    values a byte, `width` fp32 numbers a quant block (its table: int4's scale, int2's two levels).

    Its ops are quantize_int<bits>(x, block) -> (packed, table), dequantize_int<bits>_mean(packed, table, block,
    out) and dequantize_int<bits> (one replica), made here from the codec's kernels and torch references: the
    input checks, the custom-op registration, the buffers and the launch are the same for both codecs.

    A kernel's tile is `rows` quant blocks, one a row of next_pow2(block) values (about `tile` values in all,
    `mean_tile` in the mean's): a block's statistic is a row reduction, and both the values and the packed
    bytes are contiguous runs.
    """

    bits: int
    width: int
    table_name: str
    tile: int
    mean_tile: int
    num_warps: int
    max_block: int = 16384

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def check_block(self, op: str, block: object) -> None:
        """block: an int in [per_byte, max_block], a multiple of per_byte (a byte never holds two blocks)."""
        pb = self.per_byte
        if not isinstance(block, int) or isinstance(block, bool) or not pb <= block <= self.max_block or block % pb:
            fail(f"{op}: block must be {_BLOCK_RULE[pb].format(hi=self.max_block)}, got {block!r}")

    @staticmethod
    def rows(cols: int, tile: int) -> int:
        """Rows of a tile of about `tile` values, rows of `cols` (a power of two) values each."""
        return max(1, tile // cols)

    # ------------------------------------------------------------------------- quantize

    def quantize_op(self, kernel: Any, ref: Callable[..., Any], doc: str) -> Callable[..., Any]:
        """quantize_int<bits>: `kernel(x, packed, table, n, nbytes, block, block // per_byte, ROWS, BP, DENSE)`,
        DENSE: block is BP (a power of two: a tile's values are all real but maybe in the last tile) and x is
        8-byte aligned (a kernel may read value pairs as int64)."""
        name, pb, width = f"quantize_int{self.bits}", self.per_byte, self.width

        def impl(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
            if not use_triton(x):
                return ref(x, block)
            n = x.numel()
            nb, nbytes = -(-n // block), -(-n // pb)
            packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
            table = torch.empty(width * nb, dtype=torch.float32, device=x.device)
            if n:
                bp = next_pow2(block)
                rows = self.rows(bp, self.tile)
                launch(
                    kernel, (-(-nb // rows),), x, packed, table, n, nbytes, block, block // pb,
                    ROWS=rows, BP=bp, DENSE=bp == block and x.data_ptr() % 8 == 0, num_warps=self.num_warps,
                    enable_fp_fusion=False, device=x.device,
                )  # fmt: skip
            return packed, table

        def fake(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
            n = x.numel()
            return x.new_empty(-(-n // pb), dtype=torch.uint8), x.new_empty(width * -(-n // block), dtype=torch.float32)

        op = register_op(name, impl, mutates_args=())
        op.register_fake(fake)

        @no_grad
        def quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
            check_tensor(name, "x", x, dtypes=(torch.float32,), ndim=1)
            self.check_block(name, block)
            return call(op, impl, x, block)

        return _named(quantize, name, doc)

    # ------------------------------------------------------------------------- dequantize

    def mean_op(self, kernel: Any, ref: Callable[..., None], doc: str) -> Callable[..., None]:
        """dequantize_int<bits>_mean: `kernel(packed, table, out, n, nbytes, table row length, block,
        block // per_byte, M, 1/M, M, EXACT_INV, ROWS, BP)`, BP = a block's bytes rounded up to a power of two.

        out = sum / M: multiplying by 1/M gives the same correctly rounded quotient when M is a power of two
        (1/M is exact), and is much cheaper than a division; other M divide (tl.div_rn)."""
        name, pb, width = f"dequantize_int{self.bits}_mean", self.per_byte, self.width

        def impl(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
            if not use_triton(packed, table, out):
                return ref(packed, table, block, out)
            M, nbytes = packed.shape
            n = out.numel()
            if n:
                bp = next_pow2(block // pb)
                rows = self.rows(bp * pb, self.mean_tile)
                launch(
                    kernel, (-(-n // (rows * block)),), packed, table, out, n, nbytes, table.shape[1], block,
                    block // pb, M, 1.0 / M, float(M), EXACT_INV=(M & (M - 1)) == 0, ROWS=rows, BP=bp,
                    num_warps=self.num_warps, enable_fp_fusion=False, device=out.device,
                )  # fmt: skip

        op = register_op(name, impl, mutates_args=("out",))

        @no_grad
        def mean(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
            self.check_block(name, block)
            check_tensor(name, "out", out, dtypes=(torch.float32,), ndim=1)
            n = out.numel()
            if n + self.max_block >= 2**31:  # the kernels' int32 offsets run to at most a tile past n
                fail(f"{name}: out must have n < 2**31 - {self.max_block} elements, got {n}")
            check_tensor(name, "packed", packed, dtypes=(torch.uint8,), ndim=2, device=out.device)
            M, want = packed.shape[0], -(-n // pb)
            if M < 1 or packed.shape[1] != want:
                fail(
                    f"{name}: packed must be [M >= 1, ceil(n/{pb}) = {want}] for out of {n} elements, "
                    f"got {tuple(packed.shape)}"
                )
            shape = (M, width * -(-n // block))
            check_tensor(name, self.table_name, table, dtypes=(torch.float32,), shape=shape, device=out.device)
            call(op, impl, packed, table, block, out)

        return _named(mean, name, doc)

    def one_replica_op(self, mean: Callable[..., None], doc: str) -> Callable[..., None]:
        """dequantize_int<bits>: the mean of a single replica (packed and table 1-D; M = 1 is exact)."""
        name = f"dequantize_int{self.bits}"
        shapes = (f"[M, ceil(n/{self.per_byte})]", "[M, nb]" if self.width == 1 else f"[M, {self.width}·nb]")

        def dequantize(packed: torch.Tensor, table: torch.Tensor, block: int, out: torch.Tensor) -> None:
            if not isinstance(packed, torch.Tensor) or packed.dim() != 1:
                fail(f"{name}: packed must be a 1-D tensor (use {name}_mean for {shapes[0]})")
            if not isinstance(table, torch.Tensor) or table.dim() != 1:
                fail(f"{name}: {self.table_name} must be a 1-D tensor (use {name}_mean for {shapes[1]})")
            mean(packed[None], table[None], block, out)

        return _named(dequantize, name, doc)


# The kernels' tile code. Values: [ROWS, BP] (BP = next_pow2(block)), the program's quant blocks, one a row.
# Bytes: [ROWS, BPB] (BPB = BP // per_byte), `per_block` = block // per_byte bytes of each row.


@triton.jit
def load_block_rows(x_ptr, n, block, ROWS: tl.constexpr, BP: tl.constexpr):
    """(b, x, mask): the rows' block numbers, their values (0 past a block or n) and where they are real."""
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BP)
    offs = b[:, None] * block + col[None, :]
    mask = (col[None, :] < block) & (offs < n)
    return b, tl.load(x_ptr + offs, mask=mask, other=0.0), mask


@triton.jit
def pack_pairs(v, shift: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] ints -> [ROWS, COLS // 2]: v[2j] | v[2j + 1] << shift (neighbours: one thread's registers)."""
    even, odd = tl.split(tl.reshape(v, [ROWS, COLS // 2, 2]))
    return even | (odd << shift)


@triton.jit
def store_block_bytes(p_ptr, byte, b, per_block, nbytes, BPB: tl.constexpr):
    """Store the rows' packed bytes (int [ROWS, BPB]) where they are real."""
    j = tl.arange(0, BPB)
    at = b[:, None] * per_block + j[None, :]
    tl.store(p_ptr + at, byte.to(tl.uint8), mask=(j[None, :] < per_block) & (at < nbytes))


@triton.jit
def byte_rows(per_block, nbytes, ROWS: tl.constexpr, BPB: tl.constexpr):
    """(b, at, mask): the rows' block numbers (int32: n + a tile < 2**31), their bytes' offsets, where real."""
    b = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BPB)
    at = b[:, None] * per_block + j[None, :]
    return b, at, (j[None, :] < per_block) & (at < nbytes)


@triton.jit
def store_mean_rows(out_ptr, acc, b, n, block, inv_m, M_f, EXACT_INV: tl.constexpr, BP: tl.constexpr):
    """out = acc / M for the rows' values (acc fp32 [ROWS, BP]): acc * (1/M) where M is a power of two."""
    if EXACT_INV:
        acc = acc * inv_m
    else:
        acc = tl.div_rn(acc, M_f)
    col = tl.arange(0, BP)
    offs = b[:, None] * block + col[None, :]
    tl.store(out_ptr + offs, acc, mask=(col[None, :] < block) & (offs < n))


def _named(fn: F, name: str, doc: str) -> F:
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn
