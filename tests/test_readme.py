"""The README and the project's docs stay consistent with the code and self-contained.

- the setup/test/run command markers are there once each, in the format .ci/run parses;
- the config table is exactly what scripts/config_table.py prints from hsdp/config/schema.py,
  so a new config key cannot be added without documenting it;
- no file points outside the project (the design document is docs/design.md), and
  every "docs/design.md §n" citation names a section that exists;
- the README holds no process notes (measured results live in docs/results/, checked by
  tests/test_docs.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

README = REPO / "README.md"
DESIGN = REPO / "docs" / "design.md"


def _config_table_module():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- command markers

# .ci/run reads the commands with these sed expressions; the regexes below are their Python form.
CI_SED = {
    "setup": r"sed -n 's/^<!-- setup -->`\(.*\)`$/\1/p' README.md",
    "test": r"sed -n 's/^<!-- test -->`\(.*\)`$/\1/p' README.md",
}


@pytest.mark.parametrize("name", ["setup", "test", "run"])
def test_command_marker_once_in_ci_format(readme: str, name: str) -> None:
    marker = f"<!-- {name} -->"
    lines = [line for line in readme.splitlines() if marker in line]
    assert len(lines) == 1, f"README must have exactly one {marker} line, found {len(lines)}"
    m = re.fullmatch(re.escape(marker) + r"`(.*)`", lines[0])
    assert m and m.group(1).strip(), f"{marker} line must be {marker}`command`, got {lines[0]!r}"


def test_ci_parses_the_markers_this_way() -> None:
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for name, sed in CI_SED.items():
        assert sed in ci, f".ci/run no longer reads the {name} command with {sed!r}; update this test"


# ----------------------------------------------------------------------------- config table


def test_config_table_is_generated_from_the_dataclasses(readme: str) -> None:
    ct = _config_table_module()
    assert ct.readme_block(readme) == ct.table(), (
        "the README's config table is out of date: run `python scripts/config_table.py --write`"
    )


def test_every_config_key_is_in_the_table(readme: str) -> None:
    ct = _config_table_module()
    block = ct.readme_block(readme)
    documented = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", block, flags=re.M)
    missing = [k for k in ct.keys() if k not in documented]
    assert not missing, f"config keys missing from the README table: {missing}"
    assert len(documented) == len(set(documented)) == len(ct.keys()), "one row per key, no stale rows"


def test_every_key_has_a_meaning() -> None:
    ct = _config_table_module()
    for section, cls in ct.sections():
        comments = ct.field_comments(cls)
        for f in dataclasses.fields(cls):
            assert ct.meaning(f"{section}.{f.name}", comments).strip()


# ----------------------------------------------------------------------------- self-contained project

FORBIDDEN = ("../shared", "DESIGN §", "DESIGN.md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ""}
BUILD_DIRS = {".git", "build", "dist", "runs", "wandb", "__pycache__", ".venv", "venv", ".pytest_cache", ".hypothesis"}


def _project_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore (or a walk of the tree without git)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout.decode()
        paths = [REPO / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [
            p for p in REPO.rglob("*") if not BUILD_DIRS & set(p.relative_to(REPO).parts) and ".egg-info" not in str(p)
        ]
    return sorted({p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES})


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def test_no_file_points_outside_the_project() -> None:
    me = Path(__file__).resolve()
    hits = []
    for path in _project_files():
        text = _text(path)
        if path.resolve() == me or text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for s in FORBIDDEN:
                if s in line:
                    hits.append(f"{path.relative_to(REPO)}:{n}: {s}")
    assert not hits, "references to a design file outside the project (use docs/design.md §n):\n" + "\n".join(hits)


def test_design_citations_name_existing_sections() -> None:
    sections = set(re.findall(r"^#+ §(\d+(?:\.\d+)?) ", DESIGN.read_text(encoding="utf-8"), flags=re.M))
    assert {"1", "2", "3", "4", "5"} <= sections
    bad = []
    for path in _project_files():
        text = _text(path)
        if text is None:
            continue
        for m in re.finditer(r"docs/design\.md\s+((?:§\d+(?:\.\d+)?(?:\s*[,–-]\s*)?)+)", text):
            for ref in re.findall(r"§(\d+(?:\.\d+)?)", m.group(1)):
                if ref not in sections:
                    bad.append(f"{path.relative_to(REPO)}: docs/design.md §{ref}")
    assert not bad, "citations of sections docs/design.md does not have:\n" + "\n".join(bad)


def test_readme_has_no_process_notes(readme: str) -> None:
    for pattern in (r"\bsession\b", r"\(issue:", r"\bowed\b", r"\blent\b", r"steering"):
        m = re.search(pattern, readme, flags=re.I)
        assert m is None, f"README reads like a process note near {readme[max(0, m.start() - 60) : m.end() + 60]!r}"
