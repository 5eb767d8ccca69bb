"""kernels/registry.py names every kernel once; what reads it and what it must agree with.

`registry_problems` lists every disagreement between a registry (the real one, or one with an entry left
out) and the code: a public function of a kernel module, or an hsdp_kernels custom op, that no entry
provides; an entry naming a function its module lacks; a benchmark case (kernels/bench.py) or parity case
(tests/test_cuda_parity.py) that the registry lacks or that is missing for one of its kernels; a kernel
that scripts/gpu_check.sh asks the benchmark for and the registry does not time.
"""

import importlib
import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kernels
from kernels import bench, registry
from kernels.registry import HELPERS, KERNELS, Kernel

REPO = Path(__file__).resolve().parents[1]
NOT_KERNEL_MODULES = {"backend", "bench", "registry"}  # and the private ones, kernels/_*.py


def kernel_modules() -> dict[str, ModuleType]:
    """Every kernels/<name>.py that defines kernels, imported (which registers its custom ops)."""
    names = sorted(p.stem for p in (REPO / "kernels").glob("*.py"))
    return {
        n: importlib.import_module(f"kernels.{n}")
        for n in names
        if not n.startswith("_") and n not in NOT_KERNEL_MODULES
    }


def public_functions(module: ModuleType) -> set[str]:
    """The functions a module offers: those in its __all__, and any other public one defined in it."""
    names = set(getattr(module, "__all__", ()))
    names |= {n for n, v in vars(module).items() if getattr(v, "__module__", None) == module.__name__}
    return {
        n
        for n in names
        if not n.startswith("_") and callable(getattr(module, n, None)) and not isinstance(getattr(module, n), type)
    }


def custom_ops() -> set[str]:
    """The ops registered in the hsdp_kernels namespace (once every kernel module is imported)."""
    kernel_modules()
    prefix = "hsdp_kernels::"
    return {n.removeprefix(prefix) for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}


@cache
def bench_cases() -> frozenset[str]:
    return frozenset(bench.cases("small", torch.device("cpu"), "64"))  # the payload kernels at one chunk's k


@cache
def parity_cases() -> tuple[str, ...]:
    from tests.test_cuda_parity import _cases

    return tuple(_cases())


def gpu_check_bench_kernels() -> set[str]:
    """The kernels scripts/gpu_check.sh passes to `python -m kernels.bench --kernels`."""
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    return {k for arg in re.findall(r"--kernels[ =](\S+)", text) for k in arg.split(",")}


def registry_problems(entries: Iterable[Kernel], helpers: Mapping[str, tuple[str, ...]]) -> list[str]:
    """Each disagreement of the registry `entries` + `helpers` with the code, in words (none: they agree)."""
    entries = tuple(entries)
    provided = {(k.module, f) for k in entries for f in k.ops} | {(m, f) for m, fs in helpers.items() for f in fs}
    problems = []
    for name, module in kernel_modules().items():
        for f in sorted(public_functions(module)):
            if (name, f) not in provided and (name, f.removesuffix("_ref")) not in provided:
                problems.append(f"kernels/{name}.py defines {f}, which no registry entry provides")
    for module_name, f in sorted(provided):
        if not hasattr(importlib.import_module(f"kernels.{module_name}"), f):
            problems.append(f"the registry names {f} of kernels/{module_name}.py, which it lacks")
    ops, registered = {k.op for k in entries}, custom_ops()
    problems += [f"hsdp_kernels::{op} is no registry entry's op" for op in sorted(registered - ops)]
    problems += [f"{k.name}: its op {k.op} is not a custom op" for k in entries if k.op not in registered]
    timed = {k.name for k in entries if k.bench}
    problems += [f"kernels/bench.py has a case {n} the registry does not time" for n in sorted(bench_cases() - timed)]
    problems += [f"kernels/bench.py has no case for {n}" for n in sorted(timed - bench_cases())]
    every = {k.name for k in entries}
    cases = set(parity_cases())
    problems += [f"tests/test_cuda_parity.py has a case {n} the registry lacks" for n in sorted(cases - every)]
    problems += [f"tests/test_cuda_parity.py has no case for {n}" for n in sorted(every - cases)]
    problems += [
        f"scripts/gpu_check.sh benches {n}, which the registry does not time"
        for n in sorted(gpu_check_bench_kernels() - timed)
    ]
    return problems


# ----------------------------------------------------------------------------- the registry agrees with the code


def test_the_registry_agrees_with_the_kernels_the_bench_and_the_parity_test():
    problems = registry_problems(KERNELS, HELPERS)
    assert not problems, "kernels/registry.py disagrees with the code:\n" + "\n".join(problems)


@pytest.mark.parametrize("left_out", [k.name for k in KERNELS])
def test_a_kernel_left_out_of_the_registry_is_reported(left_out):
    """Each entry is needed: without it, its functions, its op and its cases are reported (timed or not)."""
    k = next(k for k in KERNELS if k.name == left_out)
    problems = registry_problems([e for e in KERNELS if e is not k], HELPERS)
    for f in k.ops:
        assert f"kernels/{k.module}.py defines {f}, which no registry entry provides" in problems
    assert f"hsdp_kernels::{k.op} is no registry entry's op" in problems
    assert f"tests/test_cuda_parity.py has a case {k.name} the registry lacks" in problems
    assert (f"kernels/bench.py has a case {k.name} the registry does not time" in problems) == k.bench


@pytest.mark.parametrize("module", sorted(set(HELPERS) - NOT_KERNEL_MODULES))
def test_a_helper_left_out_of_the_registry_is_reported(module):
    problems = registry_problems(KERNELS, {m: fs for m, fs in HELPERS.items() if m != module})
    assert sorted(problems) == sorted(
        f"kernels/{module}.py defines {f}, which no registry entry provides" for f in HELPERS[module]
    )


def test_a_timed_kernel_without_a_bench_case_or_untimed_is_reported():
    entries = [Kernel(k.name, k.module, k.ops, bench=not k.bench) if k.name == "topk_select" else k for k in KERNELS]
    assert registry_problems(entries, HELPERS) == ["kernels/bench.py has no case for topk_select"]
    entries = [Kernel(k.name, k.module, k.ops) if k.name == "pack" else k for k in KERNELS]
    assert "kernels/bench.py has a case pack the registry does not time" in registry_problems(entries, HELPERS)
    assert "scripts/gpu_check.sh benches pack, which the registry does not time" in registry_problems(entries, HELPERS)


def test_entries_are_unique_and_dense_ones_timed():
    assert len(set(registry.names())) == len(KERNELS)
    ops = [f for _, f in registry.public_api()]
    assert len(set(ops)) == len(ops)
    assert all(k.bench for k in KERNELS if k.dense)


# ----------------------------------------------------------------------------- what reads it


def test_kernels_exports_every_kernel_and_helper_of_the_registry():
    assert kernels.__all__ == [f for _, f in registry.public_api()]
    for module, f in registry.public_api():
        assert getattr(kernels, f) is getattr(importlib.import_module(f"kernels.{module}"), f), f


def test_the_bench_and_the_parity_test_take_their_kernels_from_the_registry():
    from tests.test_cuda_parity import CASE_NAMES

    assert bench.KERNELS == registry.bench_names()
    assert list(parity_cases()) == CASE_NAMES == list(registry.names())


def test_the_bench_refuses_a_kernel_the_registry_lacks(capsys):
    assert bench.main(["--kernels", "pack,nosuchkernel", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "unknown kernels ['nosuchkernel']" in err and ",".join(registry.bench_names()) in err


def test_gpu_summary_bounds_the_registry_s_dense_kernels():
    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "scripts" / "gpu_summary.py")
    assert spec is not None and spec.loader is not None
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    assert gs.DENSE == registry.dense_names()


def test_the_registry_imports_nothing_heavy():
    """kernels/registry.py is plain data: read on its own (as scripts/gpu_summary.py does), no torch or triton."""
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('r', sys.argv[1])\n"
        "r = importlib.util.module_from_spec(spec); sys.modules['r'] = r; spec.loader.exec_module(r)\n"
        "assert r.names() and not {'torch', 'triton', 'kernels'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(REPO / "kernels" / "registry.py")], check=True, timeout=60)
