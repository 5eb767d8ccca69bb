"""The code's shape: no import cycles among the project's modules, no module over 600 lines,
and engine names compared only where engines are registered.

The import graph is read from the source (ast), function-level imports included, so a
"lazy" import that runs back up the layers counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

PACKAGES = ("hsdp", "kernels")
MAX_LINES = 600


def project_modules() -> dict[str, Path]:
    """Dotted module name → file, for every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body (resolving `from pkg import module`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # the longest project module that the target names (x.y.z → x.y if z is a function)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_find_cycle_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_imports_of_sees_function_level_and_from_package_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    src = tmp_path / "pkg" / "mod.py"
    src.write_text("def f():\n    from pkg import other\n    import pkg.third\n")
    modules = {"pkg": tmp_path / "pkg/__init__.py", "pkg.other": Path(), "pkg.third": Path(), "pkg.mod": src}
    assert imports_of(src, "pkg.mod", modules) == {"pkg", "pkg.other", "pkg.third"}


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 30, sorted(graph)  # the walk really found the project
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " → ".join(cycle)


def test_no_module_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in project_modules().items()}
    sizes["train"] = len((REPO / "train.py").read_text().splitlines())
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines: {too_big}"


def test_engine_names_are_compared_only_in_the_registry():
    """No `== "hsdp"` / `!= "ddp"` / `in ("fsdp2", ...)` on an engine name outside the registry and the schema."""
    allowed = {REPO / "hsdp/engines/registry.py", REPO / "hsdp/config/schema.py"}
    names = "hsdp|fsdp2|ddp"
    pattern = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    hits = []
    for path in [*REPO.glob("hsdp/**/*.py"), REPO / "train.py"]:
        if path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_no_private_multiprocessing_internals():
    hits = [
        f"{path.relative_to(REPO)}:{i}"
        for path in [*REPO.glob("hsdp/**/*.py"), *REPO.glob("tests/*.py"), REPO / "train.py"]
        if path.name != "test_structure.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "forkserver._" in line or "_forkserver" in line
    ]
    assert not hits, hits


def test_registry_matches_the_config_choices():
    from hsdp.config.schema import CHOICES
    from hsdp.engines.registry import ENGINES

    assert tuple(ENGINES) == CHOICES["mesh.engine"]
    assert all(cls.name == name for name, cls in ENGINES.items())
