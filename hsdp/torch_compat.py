"""Every process-global patch of torch, and every private torch / torchft API, the project depends on.

Checked against torch 2.13.0 and 2.15.0 and torchft 0.2.0 (`TORCH_CHECKED`, `TORCHFT_CHECKED`). The rest of
the project reaches these only through this module (tests/test_torch_compat.py reads the source
and fails on a private name used anywhere else), so a torch upgrade re-checks one file: the test
resolves every entry of `PRIVATE_APIS` and `PATCHES` in the installed torch and torchft, and
names the ones that moved.

Patches (process-global state of torch that the project changes; `PATCHES`):
  capture_output_code      GraphLowering.save_output_code, set inside a block and restored after it
  allow_autograd_functions_in_aot_cache    a functorch config flag, set once
  compile_backward_with_forward  a functorch config flag, set once
  trust_vec_isa_probe      inductor's cpp.vec_isa_ok, set once this machine's ISA probe is known to pass
  register_cpu_collectives the CPU kernels of four `_c10d_functional` ops (gloo), registered once
  start_compile_pool_lazily TORCH_WARM_POOL=0 in the environment, unless the user set it
  keep_region_inputs_undonated  SubgraphLowering.__init__ wrapped: a nested compile region's backward never
                           writes over its own inputs (torch 2.13 lets it: wrong grads, see the function)

Behaviour relied on without a name to resolve:
  GLOO_RENDEZVOUS_KEY      gloo's rendezvous key of a rank, deleted once connected (elastic_gloo_group)
  saved-tensor hooks       a compiled module's saved tensors pass through the saved_tensors_hooks active
                           when it runs (AOTAutograd saves with save_for_backward; the hooks are not traced):
                           compile.scope=blocks releases full params through them (hsdp/engines/blocks.py;
                           tests/engine_workers.py's release check fails if that stops)

Differences between the checked versions, absorbed here:
  inductor_keeps_collective_order  torch 2.15's simple-overlap pass (on by default) off for compile.passes
                                   ours / none; 2.13 has no such pass
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

TORCH_CHECKED = ("2.13.0", "2.15.0")  # the suite passed on both (2.15: a CUDA build, run on the CPU)
TORCHFT_CHECKED = "0.2.0"


@dataclass(frozen=True)
class Api:
    """One private name the project uses: where it lives (dotted) and why we need it."""

    path: str  # "module:attribute.chain" (the part after ":" is read with getattr)
    why: str
    instance_attr: Optional[str] = None  # set on instances (in __init__), not on the class named by path


# Every private API used (through the helpers below). tests/test_torch_compat.py resolves each.
PRIVATE_APIS: tuple[Api, ...] = (
    Api("torch:_chunk_cat", "the torch reference of the grad pack (kernels/reduce.py)"),
    Api("torch._dynamo.utils:counters", "graphs compiled in this process (recompile counts)"),
    Api("torch._dynamo:disable", "imported by the zygote before it forks ranks (RANK_LAZY_IMPORTS)"),
    Api("torch.nn:Embedding.__init__", "its _weight argument: an embedding without its own init draw"),
    Api("torch._functorch.config:autograd_cache_allow_custom_autograd_functions", "AOT cache hits (patch)"),
    Api("torch._functorch.config:force_non_lazy_backward_lowering", "AOT cache entries at forward time (patch)"),
    Api("torch._inductor.graph:GraphLowering.save_output_code", "the generated code of each graph (patch)"),
    Api("torch._inductor.graph:SubgraphLowering.__init__", "a nested region's lowering, undonated (patch)"),
    Api("torch._inductor.graph:GraphLowering", "inputs a backward may overwrite", instance_attr="bw_donated_idxs"),
    Api("torch._inductor.custom_graph_pass:CustomGraphPass", "our cacheable graph passes"),
    Api("torch._inductor.custom_graph_pass:get_hash_for_files", "the passes' cache uuid"),
    Api("torch._inductor.cpu_vec_isa:supported_vec_isa_list", "the CPU vector-ISA probe, kept"),
    Api("torch._inductor.cpu_vec_isa:valid_vec_isa_list", "the CPU vector-ISA probe, kept"),
    Api("torch._inductor.cpu_vec_isa:x86_isa_checker", "the CPU vector-ISA probe, kept"),
    Api("torch._inductor.config:cpp.vec_isa_ok", "the CPU vector-ISA probe's answer, set process-wide"),
    Api("torch._inductor.runtime.cache_dir_utils:cache_dir", "inductor's cache folder (census sidecars)"),
    Api("torch._inductor.compile_fx:compile_fx", "imported by the zygote before it forks the ranks"),
    Api("torch._inductor.codecache:torch_key", "torch's source hash, computed once before the fork"),
    Api("torch._inductor.codecache:CacheBase.get_system", "triton's cache key, computed once before the fork"),
    Api("torch._inductor.async_compile:AsyncCompile", "reads TORCH_WARM_POOL (patch)"),
    Api("torch._C._distributed_c10d:_register_work", "a c10d work handed to the graph's wait_tensor"),
    Api("torch.distributed.distributed_c10d:_resolve_process_group", "a graph's group name → its group"),
    Api("torch._C._distributed_c10d:_register_process_group", "a group under the graphs' own name for it"),
    Api("torch._C._distributed_c10d:_unregister_process_group", "(that name registered again)"),
    Api("torch.distributed.distributed_c10d:_get_default_store", "one compile per machine (compile turns)"),
    Api("torch:ops._c10d_functional.all_gather_into_tensor.default", "the compiled graph's collectives"),
    Api("torch:ops._c10d_functional.reduce_scatter_tensor.default", "the compiled graph's collectives"),
    Api("torch:ops._c10d_functional.all_reduce.default", "the compiled graph's collectives"),
    Api("torch:ops._c10d_functional.wait_tensor.default", "the compiled graph's collectives"),
    Api("torch:ops.aten._unsafe_view.default", "a view op our release pass recomputes"),
    Api("torch:ops.aten._to_copy.default", "a cast op our release pass recomputes"),
    Api("torch.distributed.fsdp._fully_shard._fsdp_api:AllGather", "FSDP2's all-gathers counted through Comm"),
    Api("torch.distributed.fsdp._fully_shard._fsdp_api:ReduceScatter", "FSDP2's reduce-scatters through Comm"),
    Api("torch.testing._internal.distributed.fake_pg:FakeStore", "registers mesh.backend=fake"),
    Api("torch.nn:Module", "a unit's param swapped for its gathered full tensor", instance_attr="_parameters"),
    Api("torch.autograd:Variable._execution_engine.queue_callback", "the end of backward: land pending reduces"),
    Api("torchft.process_group:ProcessGroupGloo._create_pg", "the elastic gloo group's connect vs op timeouts"),
    Api("torch.distributed:ProcessGroup._get_backend", "the elastic gloo group's op timeout, set after connect"),
    Api("torch.optim._muon:_zeropower_via_newtonschulz", "Muon's orthogonalization, torch's own (bf16)"),
    Api("torch.optim._muon:_adjust_lr", "Muon's per-shape LR adjustment, torch's own"),
    Api("torch.optim.adam:Adam._init_group", "AdamW's state of one param group (MuonAdamW's AdamW groups)"),
    Api(
        "torchft.manager:Manager",
        "a failed quorum's future (re-raised by the next start_quorum unless dropped)",
        instance_attr="_quorum_future",
    ),
    Api("torchft.manager:Manager", "its bound on one quorum (a retry waits <= it)", instance_attr="_quorum_timeout"),
    Api(
        "torchft.checkpointing.http_transport:HTTPTransport",
        "the heal server's port (the address a replica advertises) and its request handler (access log, "
        "the during_serve fault point)",
        instance_attr="_server",
    ),
)

# The process-global state the project changes: name → the Api (above) it changes.
PATCHES: dict[str, str] = {
    "capture_output_code": "torch._inductor.graph:GraphLowering.save_output_code",
    "allow_autograd_functions_in_aot_cache": "torch._functorch.config:autograd_cache_allow_custom_autograd_functions",
    "compile_backward_with_forward": "torch._functorch.config:force_non_lazy_backward_lowering",
    "trust_vec_isa_probe": "torch._inductor.config:cpp.vec_isa_ok",
    "register_cpu_collectives": "torch:ops._c10d_functional.all_gather_into_tensor.default",
    "start_compile_pool_lazily": "torch._inductor.async_compile:AsyncCompile",
    "keep_region_inputs_undonated": "torch._inductor.graph:SubgraphLowering.__init__",
}


def resolve(api: Api) -> Any:
    """The object `api.path` names in the installed torch / torchft (ImportError / AttributeError if gone)."""
    module, _, chain = api.path.partition(":")
    obj: Any = importlib.import_module(module)
    for name in chain.split("."):
        obj = getattr(obj, name)
    return obj


# What a launcher's zygote imports before it forks the ranks (hsdp/run/pool.py), so that they share it: torch
# imports dynamo on the first call of anything wrapped in torch._disable_dynamo, and every rank makes one (the
# torch optimizer's constructor), ~2 CPU s a rank.
RANK_LAZY_IMPORTS = ("torch._dynamo",)


def uninitialized_embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its own N(0, 1) draw (its `_weight` argument): the model's `init_unit` sets every
    weight (or a state dict is loaded), and on the meta device (`build_model(materialize=False)`, checkpoint
    export) torch's normal_ goes through its Python reference, which imports torch._dynamo: ~1.6 CPU s."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


# ------------------------------------------------------------------ compiled graphs: ops and passes
C10D_FUNCTIONAL = torch.ops._c10d_functional  # the ops a compiled graph's collectives are
C10D_FUNCTIONAL_PREFIX = "torch.ops._c10d_functional."  # how inductor's generated code calls them
ATEN_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
ATEN_TO_COPY = torch.ops.aten._to_copy.default


def _custom_graph_pass() -> tuple[type, Callable[..., Any]]:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def __getattr__(name: str) -> Any:
    # These import inductor, FSDP2 or DTensor (seconds of CPU each): resolved when first asked for, so a process
    # that imports hsdp without them (kernels, the launcher, the commands) does not pay for them.
    for names, load in _LAZY:
        if name in names:
            return dict(zip(names, load()))[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compiled_graph_count() -> int:
    """Graphs dynamo compiled in this process so far (all engines)."""
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def cpu_vec_isa_probe() -> Optional[tuple[Any, Callable[[], Any], Callable[[], Any]]]:
    """(supported ISAs, the ISAs valid here, the CPU's flags) from inductor, or None if it moved them."""
    try:
        from torch._inductor.cpu_vec_isa import supported_vec_isa_list, valid_vec_isa_list, x86_isa_checker
    except ImportError:
        return None
    return supported_vec_isa_list, valid_vec_isa_list, x86_isa_checker


# torch 2.15 added a pass, on by default, that moves a graph's collectives earlier and their waits later
# ("simple overlap"); it overrides the schedule our passes place (compile.prefetch=0 ran a gather across
# compute, prefetch=2 started every gather at once). Older torch has no such option.
SIMPLE_OVERLAP_OPTION = "aten_distributed_optimizations.enable_simple_overlap"


def inductor_keeps_collective_order() -> dict[str, bool]:
    """Inductor options that leave each collective and its wait where the graph placed them: the simple
    overlap pass off where the installed torch has it, nothing to set where it does not."""
    import torch._inductor.config as inductor_config

    section, _, flag = SIMPLE_OVERLAP_OPTION.partition(".")
    return {SIMPLE_OVERLAP_OPTION: False} if hasattr(getattr(inductor_config, section, None), flag) else {}


def prewarm_inductor() -> None:
    """Import inductor and compute torch's and triton's cache keys (both cached per process) before a fork."""
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import codecache

    with contextlib.suppress(Exception):  # a torch without these helpers: the ranks compute the keys themselves
        codecache.torch_key()
        codecache.CacheBase.get_system()  # triton's key


def resolve_vec_isas() -> None:
    """Ask inductor's vector-ISA questions in this process before a fork (its answers are cached per process):
    which ISAs build here, and each one's extensions (AVX-512 BF16 and VNNI, AMX), which it probes whatever
    `cpp.vec_isa_ok` says."""
    with contextlib.suppress(Exception):  # inductor moved them: the ranks ask themselves
        from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

        for isa in valid_vec_isa_list():
            bool(isa)
        pick_vec_isa()


@contextlib.contextmanager
def capture_output_code(sink: Optional[Callable[[str], None]]) -> Iterator[None]:
    """Patch: hand inductor's output code of each graph compiled or cache-loaded inside the block to `sink`."""
    if sink is None:
        yield
        return
    from torch._inductor.graph import GraphLowering

    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = sink
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous


def reusable_compile_region(
    fn: Callable[..., Any], max_reuse_entries: int, reuse_key: Callable[..., int]
) -> Optional[Callable[..., Any]]:
    """`torch.compiler.nested_compile_region` whose calls reuse one trace by `reuse_key`; None on a torch
    without it or without `reuse_hash_fn` (its calls could not reuse a region that has side effects, so the
    caller traces inline)."""
    import inspect

    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None or "reuse_hash_fn" not in inspect.signature(region).parameters:
        return None
    return region(fn, max_reuse_entries=max_reuse_entries, reuse_hash_fn=reuse_key)


def keep_region_inputs_undonated() -> None:
    """Patch: the lowering of a nested compile region (invoke_subgraph) donates none of its inputs.

    Why: AOTAutograd lists the backward inputs that the backward may overwrite in place (`bw_donated_idxs`,
    indices into the *outer* backward's placeholders), and torch 2.13's SubgraphLowering inherits that list
    and applies it to the region's own, unrelated placeholders. In compile.scope=step with compile.regional the
    block region's incoming grad was so marked: the region wrote its input grad's buffer in place and returned
    it, the outer graph took that buffer for free after the call and zeroed it for the embedding's grad,
    which then read zeros: wte's grad was 0 at every shape where the two buffers had one size (tokens per rank
    x d_model = vocab x d_model). Torch's own fix (pytorch PR 193960, after 2.13) clears the list for
    subgraphs; this does the same on a torch without it (a no-op where it is already cleared).
    """
    from torch._inductor.graph import SubgraphLowering

    init = SubgraphLowering.__init__
    if getattr(init, "_hsdp_undonated", False):
        return

    def undonated_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.bw_donated_idxs = None  # the outer graph's indices mean nothing for the region's placeholders

    undonated_init._hsdp_undonated = True  # type: ignore[attr-defined]
    SubgraphLowering.__init__ = undonated_init  # type: ignore[method-assign]


def allow_autograd_functions_in_aot_cache() -> None:
    """Patch: let AOTAutograd cache graphs holding (pure) autograd.Functions; older torch: no cache hit."""
    config = torch._functorch.config
    if hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        config.autograd_cache_allow_custom_autograd_functions = True


def trust_vec_isa_probe() -> None:
    """Patch: inductor takes every vector ISA the CPU reports as buildable, without probing each.

    Why: inductor probes the ISAs (a C++ build and a fresh Python child loading it, per ISA) in every process
    that compiles or loads a compiled graph: a graph loaded warm from the cache asks too, outside the compile
    options that carry `cpp.vec_isa_ok` (measured: 10-12 children, ~3 CPU s, per rank of a compiled run).
    hsdp.compile.cache sets it only once a probe here found every reported ISA buildable."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.vec_isa_ok = True


def compile_backward_with_forward() -> None:
    """Patch: AOTAutograd compiles a graph's backward when it compiles its forward, not at the first backward.

    Why: AOTAutograd writes a graph's cache entry once both halves are compiled. Compiled lazily, the
    backward is built only after the forward ran, and the forward's collectives need every rank of the
    shard group: the ranks that wait for the leader's compile (hsdp/compile/turns.py) start before the
    entry exists and trace and partition the joint graph again (~7 CPU s a graph each on the 2-core box).
    Compiled with the forward, the entry is on disk before the leader's first collective: they load it.
    """
    config = torch._functorch.config
    if hasattr(config, "force_non_lazy_backward_lowering"):
        config.force_non_lazy_backward_lowering = True


def start_compile_pool_lazily() -> None:
    """Patch (environment): inductor starts its compile workers when a compile first needs them."""
    os.environ.setdefault("TORCH_WARM_POOL", "0")


# ------------------------------------------------------------------ c10d
_CPU_COLLECTIVES: Optional[torch.library.Library] = None  # kept alive: dropping it would unregister the kernels


def register_cpu_collectives(
    all_gather: Callable[..., Any],
    reduce_scatter: Callable[..., Any],
    all_reduce: Callable[..., Any],
    all_reduce_inplace: Callable[..., Any],
) -> None:
    """Patch: the CPU kernels of `_c10d_functional.all_gather_into_tensor` / `reduce_scatter_tensor` /
    `all_reduce` / `all_reduce_` (once)."""
    global _CPU_COLLECTIVES
    if _CPU_COLLECTIVES is not None:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", all_gather, "CPU")
    lib.impl("reduce_scatter_tensor", reduce_scatter, "CPU")
    lib.impl("all_reduce", all_reduce, "CPU")
    lib.impl("all_reduce_", all_reduce_inplace, "CPU")
    _CPU_COLLECTIVES = lib


def register_work(tensor: torch.Tensor, work: Any) -> None:
    """Hand an async c10d work to the functional-collective registry, where `wait_tensor(tensor)` finds it."""
    torch._C._distributed_c10d._register_work(tensor, work)


def name_process_group(name: str, group: dist.ProcessGroup) -> str:
    """Register `group` under `name` too (replacing what this process registered there before); returns `name`.

    A compiled graph names its groups: under a name every rank gives its own group, ranks of different shard
    groups trace the same graph, so one rank per machine compiles it (hsdp/compile/turns.py).
    """
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
    from torch.distributed.distributed_c10d import GroupName

    _unregister_process_group(GroupName(name))  # a no-op when nothing is registered under it yet
    _register_process_group(GroupName(name), group)
    return name


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a compiled graph names."""
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(group_name))


def default_store() -> dist.Store:
    """The default process group's key-value store (the rendezvous's), for small out-of-band signals."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def register_fake_backend() -> None:
    """Make `fake` a c10d backend (torch registers it when its testing module is imported)."""
    importlib.import_module("torch.testing._internal.distributed.fake_pg")


def _fsdp_comm_interfaces() -> tuple[Optional[type], Optional[type]]:
    """FSDP2's custom-comm interfaces (torch >= 2.9), or (None, None) on a torch without them."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:  # pragma: no cover - depends on the installed torch
        return None, None
    return AllGather, ReduceScatter


def _dtensor_classes() -> tuple[type, type]:
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch < 2.5 has them under a private name
        from torch.distributed._tensor import DTensor, Shard
    return DTensor, Shard


# ------------------------------------------------------------------ tensors and modules
# ------------------------------------------------------------------ optimizers: torch's own Muon and AdamW math
def muon_orthogonalize(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's Newton–Schulz iteration of one whole matrix (bf16 in, bf16 out)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """torch.optim.Muon's LR for a matrix of `shape` (its full shape, whoever holds which rows)."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)


def adamw_group_step(optimizer: torch.optim.AdamW, group: dict[str, Any]) -> None:
    """One torch.optim.AdamW step of one param group of `optimizer` (an AdamW subclass): Adam.step's body."""
    from torch.optim.adam import adam

    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        steps,
        amsgrad=group["amsgrad"],
        has_complex=has_complex,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        grad_scale=None,
        found_inf=None,
        decoupled_weight_decay=group["decoupled_weight_decay"],
    )


def chunk_cat(tensors: list[torch.Tensor], dim: int, num_chunks: int, out: torch.Tensor) -> torch.Tensor:
    """`torch._chunk_cat`: each tensor cut into `num_chunks` along `dim`, chunk i of all concatenated in row i."""
    return torch._chunk_cat(tensors, dim=dim, num_chunks=num_chunks, out=out)


def swap_parameter(owner: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """Put a plain tensor where `owner.<attr>` (a parameter) is, without nn.Module's checks (as FSDP2 does)."""
    # ignored: nn.Module declares Parameter | None there, and a plain tensor is the point of the swap
    owner._parameters[attr] = tensor  # type: ignore[assignment]


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the running backward pass ends (as FSDP2 does; autograd's engine, private)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ------------------------------------------------------------------ torchft
def http_transport_port(transport: Any) -> int:
    """The port of torchft's HTTP checkpoint transport's own server (private, as its address() reads it)."""
    return transport._server.socket.getsockname()[1]


def forget_failed_quorum(manager: Any) -> None:
    """Let the next `manager.start_quorum()` ask the lighthouse again: torchft keeps a failed quorum's future
    and re-raises its error at the next start_quorum otherwise."""
    manager._quorum_future = None


def quorum_timeout_s(manager: Any) -> Optional[float]:
    """torchft's own bound on one quorum (the Manager's quorum_timeout), or None if the manager has none."""
    timeout = manager._quorum_timeout if hasattr(manager, "_quorum_timeout") else None
    return timeout.total_seconds() if timeout is not None else None


def silence_http_access_log(transport: Any) -> None:
    """Drop the heal server's per-request access-log lines (http.server writes each GET to stderr).

    The handler class is built inside torchft's `HTTPTransport.__init__`, one per transport, so this
    changes only that server; refused requests (`log_error`) are still printed.
    """
    transport._server.RequestHandlerClass.log_request = lambda *args, **kwargs: None


def watch_http_transfers(
    transport: Any, sending: Callable[[], None], sent: Optional[Callable[[], None]] = None
) -> None:
    """Call `sending()` once per answer of torchft's HTTP checkpoint transport's server that has a body of more
    than one write (a state, not an error page), on the server's thread, once part of that body is out: after
    the headers and the body's first write (torchft's streaming save: the list of its records), before the
    next. Where the heal's during_serve fault point sits: a fault there cuts a transfer in the middle.
    `sent()`, when given, is called once such an answer is over (its last byte written, or its peer gone)."""
    handler = transport._server.RequestHandlerClass

    class Writer:
        def __init__(self, raw: Any) -> None:
            self.raw, self.writes = raw, 0

        def write(self, data: Any) -> Any:
            self.writes += 1
            if self.writes == 3:  # 1: the status line and headers; 2: the body's first part
                sending()
            return self.raw.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.raw, name)

    class Watched(handler):  # type: ignore[misc, valid-type]
        def setup(self) -> None:
            super().setup()
            self.wfile: Any = Writer(self.wfile)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                if sent is not None and self.wfile.writes >= 3:
                    sent()

    transport._server.RequestHandlerClass = Watched


_LAZY: tuple[tuple[tuple[str, ...], Callable[[], tuple[Any, ...]]], ...] = (
    (("CustomGraphPass", "get_hash_for_files"), _custom_graph_pass),
    (("FSDPAllGather", "FSDPReduceScatter"), _fsdp_comm_interfaces),
    (("DTensor", "Shard"), _dtensor_classes),
)


# The store key under which gloo's full-mesh connect publishes a rank's addresses (ProcessGroupGloo's device
# index, then the rank), read by every peer; checked by tests/test_torch_compat.py.
GLOO_RENDEZVOUS_KEY = "{device}/{rank}"


def elastic_gloo_group(connect_timeout: timedelta, op_timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group whose re-forming after a quorum change (the store rendezvous and
    gloo's full-mesh connect) may take `connect_timeout`, while each collective after it still fails after
    `op_timeout` (failure detection). gloo has one timeout for both; it is set to the op bound once connected.

    Once connected, each rank deletes its own rendezvous key (`GLOO_RENDEZVOUS_KEY`): torchft names a group's
    store prefix by its quorum id, and a restarted lighthouse numbers quorums from 1 again, so a later group
    under a re-used prefix read the earlier group's addresses and timed out connecting (a dropped round, then
    another). gloo's connect on one rank can finish before a peer has read that rank's key, but every rank reads
    all keys before it connects any pair: so once a collective over the whole group has completed, every key has
    been read, and each rank deletes its own after one (a 4-byte all-reduce, under the connect bound).
    """
    from torchft.process_group import ProcessGroupGloo

    class _Gloo(ProcessGroupGloo):
        def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> Any:
            pg = super()._create_pg(store, rank, world_size)
            backend = pg._get_backend(torch.device("cpu"))
            backend.allreduce([torch.zeros(1)]).wait()  # every rank has read every key
            store.delete_key(GLOO_RENDEZVOUS_KEY.format(device=0, rank=rank))
            backend.set_timeout(op_timeout)
            return pg

    return _Gloo(timeout=connect_timeout)
