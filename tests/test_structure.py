"""The code's shape: imports only go down the layers of docs/design.md §0, no import cycles
(between modules, or between packages), a config read without torch, no module over 600
lines, and engine names compared only where engines are registered.

The import graph is read from the source (ast), function-level imports included, so a
"lazy" import that runs back up the layers counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

PACKAGES = ("hsdp", "kernels")
MAX_LINES = 600

# docs/design.md §0's layers, bottom first: a module may import its own layer and those below, never above.
# An entry names a package (all its modules) or a module. Every module of the project must be in one.
LAYERS: tuple[tuple[str, ...], ...] = (
    # no torch: a config is read and validated anywhere
    ("hsdp.config", "hsdp.faults", "hsdp.core.atomic", "hsdp.core.timeline", "hsdp.data.shards", "hsdp.data.corpus"),
    ("hsdp.torch_compat",),  # every process-global torch patch and private torch/torchft API
    ("kernels",),
    ("hsdp.comm",),
    ("hsdp.core.layout", "hsdp.models", "hsdp.data.tokens"),
    ("hsdp.sync",),
    ("hsdp.compile",),  # the graph side: below the engines, which run its graphs
    ("hsdp.engines",),
    ("hsdp.run",),  # preflight and checkpoint/ included: they ask the data, the engines, the codec, the run folder
    (
        "train",
        "hsdp.bench",
        "hsdp.export",
        "hsdp.sample",
        "hsdp.prepare",
        "hsdp.sweep",
        "hsdp.slowlink",
        "hsdp.plan",
        "hsdp.lighthouse",
    ),  # fmt: skip
)
# Rooms whose modules sit in different layers (e.g. hsdp.data.shards reads no torch, hsdp.data.tokens does).
ROOMS_ACROSS_LAYERS = ("hsdp.core", "hsdp.data", "hsdp.models")


def project_modules() -> dict[str, Path]:
    """Dotted module name → file, for every .py file of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def graph_modules() -> dict[str, Path]:
    """`project_modules` and train.py (the driver, at the top of the layers)."""
    return {**project_modules(), "train": REPO / "train.py"}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere in its body (resolving `from pkg import module`)."""
    return {target for target, _ in import_sites(path, name, modules)}


def import_sites(path: Path, name: str, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(project module, line) for each import in `path`'s body, function-level ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
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
                yield target, node.lineno


def import_graph() -> dict[str, set[str]]:
    modules = graph_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def package_of(module: str) -> str:
    """A module collapsed to its package: hsdp.sync.policy → hsdp.sync, hsdp.torch_compat → itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "hsdp" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between packages (an import inside one package is no edge)."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = package_of(module)
        out.setdefault(here, set()).update(package_of(t) for t in targets if package_of(t) != here)
    return out


def layer_of(module: str) -> int:
    """The index in LAYERS of the entry `module` is (or is inside), or -1 if none names it."""
    if module in ("hsdp", *ROOMS_ACROSS_LAYERS):
        return 0  # the package itself (a docstring, no imports)
    for i, layer in enumerate(LAYERS):
        if any(module == entry or module.startswith(entry + ".") for entry in layer):
            return i
    return -1


def upward_imports(modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """Every import from a lower layer to a higher one, as "file:line: importer (layer) imports imported (layer)"."""
    found = []
    for name, path in modules.items():
        if not path.is_file():
            continue
        for target, line in import_sites(path, name, modules):
            if layer_of(target) > layer_of(name):
                found.append(
                    f"{path.relative_to(root)}:{line}: {name} (layer {layer_of(name)}) imports "
                    f"{target} (layer {layer_of(target)})"
                )
    return sorted(set(found))


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


def test_no_import_cycles_between_packages():
    graph = package_graph(import_graph())
    assert {"hsdp.config", "hsdp.engines", "hsdp.compile", "hsdp.data", "kernels", "train"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, "package import cycle: " + " → ".join(cycle)


MAX_LOOSE = 8


def test_few_loose_modules_directly_under_hsdp():
    """Rooms by concern: the modules directly under hsdp/ are the user commands, torch_compat and the package."""
    loose = sorted(p.name for p in (REPO / "hsdp").glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose


def test_every_module_has_a_layer():
    unplaced = sorted(name for name in graph_modules() if layer_of(name) < 0)
    assert not unplaced, f"modules in no layer of LAYERS (docs/design.md §0): {unplaced}"


def test_imports_only_go_down_the_layers():
    bad = upward_imports(graph_modules())
    assert not bad, "imports up the layers of docs/design.md §0:\n" + "\n".join(bad)


def test_upward_imports_are_found_and_named(tmp_path):
    (tmp_path / "hsdp" / "config").mkdir(parents=True)
    src = tmp_path / "hsdp" / "config" / "x.py"
    src.write_text("def f():\n    from hsdp.engines.registry import ENGINES\n")
    modules = {"hsdp.config.x": src, "hsdp.engines.registry": tmp_path / "none", "hsdp.engines": tmp_path / "none"}
    assert upward_imports(modules, tmp_path) == [
        "hsdp/config/x.py:2: hsdp.config.x (layer 0) imports hsdp.engines.registry (layer 7)"
    ]


def test_layers_mirror_the_design_doc():
    """§0's layer paragraph names the same entries in the same order as LAYERS."""
    text = (REPO / "docs" / "design.md").read_text()
    paragraph = text.split("**Layers.**", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"`([\w.]+)`", paragraph)
    assert named == [entry for layer in LAYERS for entry in layer], named


def test_reading_a_config_does_not_import_torch():
    code = "import hsdp.config.loader, sys; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_fresh_import_of_train_leaves_out_what_a_run_may_not_use():
    """DCP (with DTensor), the baseline engines (FSDP2) and the compiled engine (inductor) load when a run uses
    them: every fresh `import train` (a launcher, a torchrun worker, an elastic replica) pays for them
    otherwise. The zygote preloads the engines for the workers it forks (tests/test_zygote.py runs them)."""
    heavy = ["torch.distributed.checkpoint", "hsdp.engines.baselines", "hsdp.engines.compiled", "torch._inductor"]
    code = f"import sys, train; print([m for m in {heavy!r} if m in sys.modules])"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", (res.stdout, res.stderr[-2000:])


def test_no_module_over_600_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in graph_modules().items()}
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
    from hsdp.engines.registry import COMPILED, ENGINES

    assert tuple(ENGINES) == CHOICES["mesh.engine"]
    assert all(cls.name == name for name, cls in ENGINES.items())
    assert tuple(COMPILED) == CHOICES["compile.scope"]
    for scope in COMPILED.values():
        assert scope["hsdp"].name == "hsdp" and issubclass(scope["hsdp"], ENGINES["hsdp"])


def test_the_elastic_wing_is_reached_through_its_package_module_only():
    """Outside hsdp/sync, the wing is imported as `hsdp.sync.elastic` (its __init__: what the launcher uses),
    never one of its modules; inside it, nothing is typed `Any` that names the engine (ReplicaState is the seam)."""
    modules = graph_modules()
    bad = [
        f"{path.relative_to(REPO)}:{line}: {target}"
        for name, path in modules.items()
        if not name.startswith("hsdp.sync")
        for target, line in import_sites(path, name, modules)
        if target.startswith("hsdp.sync.elastic.")
    ]
    assert not bad, bad
    wing = sorted((REPO / "hsdp/sync/elastic").glob("*.py"))
    engine_any = [
        f"{p.name}:{i}"
        for p in wing
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"engine\W.*\bAny\b", line)
    ]
    assert not engine_any and not any("engine.units" in p.read_text() for p in wing), engine_any
