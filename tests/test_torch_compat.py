"""hsdp/torch_compat.py is the one door to torch's private APIs and process-global patches.

Two checks, so a torch (or torchft) upgrade shows what to re-check: every private API and patch
the module lists still exists in the installed versions, and no other module of the project
names a private torch / torchft API or patches torch (read from the source with ast).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hsdp import torch_compat
from tests.helpers import REPO

COMPAT = REPO / "hsdp" / "torch_compat.py"
ROOTS = ("torch", "torchft")
# Private names of the standard library that code may use (namedtuple's API, os._exit after fork).
REFLECTION = ("getattr", "setattr", "hasattr", "delattr")  # builtins that name an attribute by a string
STDLIB_PRIVATE = {"_exit", "_replace", "_asdict", "_fields", "_make"}
# Private uses in files whose owners have not yet routed them through hsdp/torch_compat.py:
# path → what to call instead. Delete an entry when its file is done (a stale entry is reported).
PENDING: dict[str, str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` → ("a", ["b", "c"]); None unless the expression is a name followed by attributes."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def project_files() -> list[Path]:
    return sorted([*REPO.glob("hsdp/**/*.py"), *REPO.glob("kernels/*.py"), REPO / "train.py"])


def defined_private_names(files: list[Path]) -> set[str]:
    """Private names the project defines itself (functions, classes, attributes, variables, modules)."""
    names = {p.stem for p in files if _private(p.stem)}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                # only an attribute of the project's own objects: `manager._x = ...` sets a library's private
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return {n for n in names if _private(n)}


def private_uses(path: Path, defined: set[str]) -> list[str]:
    """Each private torch / torchft name, torch patch or foreign private attribute `path` uses, as "line: what"."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    torch_names: set[str] = set()  # names bound to torch / torchft modules or objects
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    torch_names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ROOTS and not node.level:
            torch_names.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):  # aliases: `aten = torch.ops.aten`, `config = torch._functorch.config`
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[0] in torch_names:
                torch_names.add(node.targets[0].id)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS and any(map(_private, a.name.split("."))):
                    found.append(f"{line}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ROOTS and not node.level:
            names = [*node.module.split("."), *(a.name for a in node.names)]
            if any(map(_private, names)):
                found.append(f"{line}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            # the first private name of a torch chain (torch._C, not torch._C._distributed_c10d again)
            if chain and chain[0] in torch_names and _private(node.attr) and not any(map(_private, chain[1][:-1])):
                found.append(f"{line}: {chain[0]}.{'.'.join(chain[1])}")
            elif not chain or chain[0] not in torch_names:
                if _private(node.attr) and node.attr not in defined | STDLIB_PRIVATE:
                    found.append(f"{line}: .{node.attr} (a library's private attribute)")
            if isinstance(node.ctx, ast.Store) and chain and chain[0] in torch_names:
                found.append(f"{line}: patches {chain[0]}.{'.'.join(chain[1])}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if re.search(r"\btorch(\.\w+)*\._[a-z]", node.value):
                found.append(f"{line}: {node.value!r}")
        elif isinstance(node, ast.Call):
            chain = _chain(node.func)
            if chain and chain[1][-2:] == ["library", "Library"]:
                found.append(f"{line}: torch.library.Library (a process-global kernel registration)")
            if chain and chain[0] == "setattr" and node.args and (_chain(node.args[0]) or ("",))[0] in torch_names:
                found.append(f"{line}: setattr on torch")
            # a private name reached through a string: getattr(manager, "_quorum_timeout")
            if chain and chain[0] in REFLECTION and not chain[1] and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                    if name.value not in defined | STDLIB_PRIVATE:
                        found.append(f"{line}: {chain[0]}(..., {name.value!r}) (a library's private attribute)")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_no_private_torch_api_outside_torch_compat():
    files = project_files()
    defined = defined_private_names(files)
    bad, pending_seen = [], set()
    for path in files:
        if path == COMPAT:
            continue
        rel = str(path.relative_to(REPO))
        uses = private_uses(path, defined)
        if uses and rel in PENDING:
            pending_seen.add(rel)
            continue
        bad += [f"{rel}:{use}" for use in uses]
    assert not bad, "private torch/torchft APIs or torch patches outside hsdp/torch_compat.py:\n" + "\n".join(bad)
    stale = set(PENDING) - pending_seen
    assert not stale, f"PENDING entries whose files no longer use a private API (delete them): {sorted(stale)}"


def test_the_scan_sees_each_kind_of_private_use(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch._inductor.graph import GraphLowering\n"
        "aten = torch.ops.aten\n"
        "def f(m, x):\n"
        "    torch._C._foo(x)\n"
        "    y = aten._to_copy.default\n"
        "    dist.all_reduce = x\n"
        "    m._parameters['w'] = x\n"
        "    lib = torch.library.Library('_c10d_functional', 'IMPL')\n"
        "    return 'torch.testing._internal.x'\n"
    )
    uses = "\n".join(private_uses(src, defined=set()))
    for expected in [
        "3: from torch._inductor.graph",
        "6: torch._C",
        "7: aten._to_copy",
        "8: patches dist.all_reduce",
        "9: ._parameters",
        "10: torch.library.Library",
        "11: 'torch.testing._internal.x'",
    ]:
        assert expected in uses, (expected, uses)


def test_the_scan_sees_a_library_private_set_or_read_by_name(tmp_path):
    """`manager._quorum_future = None` (its own store does not make it the project's name) and
    `getattr(manager, "_quorum_timeout")` (a private name in a string) are both found."""
    src = tmp_path / "m.py"
    src.write_text(
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "def f(manager, a):\n"
        "    manager._quorum_future = None\n"
        "    t = getattr(manager, '_quorum_timeout', None)\n"
        "    return hasattr(a, '_mine'), a._mine, t\n"
    )
    defined = defined_private_names([src])
    assert "_mine" in defined and "_quorum_future" not in defined, defined
    uses = "\n".join(private_uses(src, defined))
    assert "5: ._quorum_future" in uses and "6: getattr(..., '_quorum_timeout')" in uses, uses
    assert "_mine" not in uses, uses


def test_every_listed_private_api_exists_in_the_installed_torch():
    """A torch / torchft upgrade that moved one of these fails here, naming it (and its use)."""
    missing = []
    for api in torch_compat.PRIVATE_APIS:
        if api.path.startswith("torchft") and importlib.util.find_spec("torchft") is None:
            continue
        try:
            obj = torch_compat.resolve(api)
        except (ImportError, AttributeError) as e:
            missing.append(f"{api.path} ({api.why}): {e}")
            continue
        # The class's source as its file defines it: another test in this process may have wrapped __init__.
        if api.instance_attr and not re.search(
            rf"self\.{api.instance_attr}\b|[\"']{api.instance_attr}[\"']", inspect.getsource(obj)
        ):
            missing.append(f"{api.path}: the class no longer sets self.{api.instance_attr} ({api.why})")
    assert not missing, "\n".join(missing)


def test_every_patch_is_a_listed_api_and_a_function_of_the_module():
    paths = {api.path for api in torch_compat.PRIVATE_APIS}
    for name, target in torch_compat.PATCHES.items():
        assert callable(getattr(torch_compat, name)), name
        assert target in paths, f"{name} patches {target}, which PRIVATE_APIS does not list"


def test_checked_versions_are_named():
    """The versions this module was checked against; a different installed one is a reminder, not a failure."""
    assert torch_compat.TORCH_CHECKED and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in torch_compat.TORCH_CHECKED)
    assert re.fullmatch(r"\d+\.\d+\.\d+", torch_compat.TORCHFT_CHECKED)
    if torch.__version__.split("+")[0] not in torch_compat.TORCH_CHECKED:
        pytest.skip(f"torch {torch.__version__} installed, checked against {torch_compat.TORCH_CHECKED}: re-check")
    try:
        ft = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        return
    if ft != torch_compat.TORCHFT_CHECKED:
        pytest.skip(f"torchft {ft} installed, checked against {torch_compat.TORCHFT_CHECKED}: re-check")


def test_capture_output_code_restores_what_it_patched():
    from torch._inductor.graph import GraphLowering  # noqa: F401 - tests may name private APIs

    before = GraphLowering.save_output_code
    with torch_compat.capture_output_code(lambda code: None):
        assert GraphLowering.save_output_code is not before
    assert GraphLowering.save_output_code is before


def test_the_heal_server_serves_without_an_access_log_line(capfd):
    """A heal GET is served (the state comes back) and prints no http.server access-log line."""
    from datetime import timedelta

    from hsdp.sync.elastic.manager import _http_transport

    timeout = timedelta(seconds=60)
    server, client = _http_transport(timeout, "127.0.0.1"), _http_transport(timeout, "127.0.0.1")
    try:
        server.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, timeout)
        state = client.recv_checkpoint(0, server.metadata(), 3, timeout)
    finally:
        server.shutdown()
        client.shutdown()
    assert torch.equal(state["w"], torch.arange(4.0))
    assert "GET /checkpoint/" not in capfd.readouterr().err


def test_an_uninitialized_embedding_takes_no_draw_and_imports_no_dynamo():
    """torch_compat.uninitialized_embedding: nn.Embedding's `_weight` argument still skips its init (the global
    RNG is untouched), and on the meta device nothing imports torch._dynamo (in a fresh interpreter)."""
    state = torch.get_rng_state()
    emb = torch_compat.uninitialized_embedding(7, 3)
    assert emb.weight.shape == (7, 3) and torch.equal(torch.get_rng_state(), state)
    code = (
        "import sys, torch\n"
        "from hsdp.torch_compat import uninitialized_embedding\n"
        "with torch.device('meta'):\n"
        "    e = uninitialized_embedding(7, 3)\n"
        "assert e.weight.is_meta and 'torch._dynamo' not in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_an_elastic_gloo_group_formed_again_under_a_used_prefix_connects():
    """torchft names a group's store prefix by its quorum id, which a restarted lighthouse hands out again from 1:
    the second group under the same prefix must not read the first one's addresses (gloo's connect timed out,
    and the round was dropped). Two ranks in threads; rank 1 forms the second group later, as a replica that
    reaches the round later. Checks GLOO_RENDEZVOUS_KEY too: a key that is not gloo's would stay and fail."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{server.port}/torchft/1/0"  # the same quorum id, both times
    results: dict[tuple[int, int], object] = {}

    def rank(r: int) -> None:
        for attempt in range(2):
            if attempt == 1 and r == 1:
                time.sleep(1.0)  # rank 0 reaches the rendezvous first: it would read rank 1's old key
            g = torch_compat.elastic_gloo_group(timedelta(seconds=60), timedelta(seconds=60))
            try:
                g.configure(addr, f"replica_{r}", r, 2)
                t = torch.ones(1)
                g.allreduce([t], dist.AllreduceOptions()).wait()
                results[(r, attempt)] = t.item()
            except Exception as e:  # the failure this guards against: a connect to the old group's address
                results[(r, attempt)] = str(e).splitlines()[0]
            finally:
                g.abort(errored=False)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)  # the hang guard
    assert results == {(0, 0): 2.0, (1, 0): 2.0, (0, 1): 2.0, (1, 1): 2.0}, results


def test_a_reusable_compile_region_is_none_where_torch_cannot_reuse_one(monkeypatch):
    """This torch reuses one region across calls; a torch without nested_compile_region, or whose
    nested_compile_region takes no reuse key, gets None (the caller traces each unit inline)."""

    def key(*args):
        return 0

    def double(x):
        return 2 * x

    assert torch_compat.reusable_compile_region(double, 3, key) is not None

    def old_region(fn, max_reuse_entries=1):  # nested_compile_region before reuse_hash_fn
        return fn

    monkeypatch.setattr(torch.compiler, "nested_compile_region", old_region)
    assert torch_compat.reusable_compile_region(double, 3, key) is None
    monkeypatch.delattr(torch.compiler, "nested_compile_region")
    assert torch_compat.reusable_compile_region(double, 3, key) is None
