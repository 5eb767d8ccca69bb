"""The README and the project's docs stay consistent with the code and self-contained.

- the setup/test/run command markers are there once each, in the format .ci/run parses;
- the README is the front door: at most 300 lines, naming each user command and linking the
  pages that hold the details (docs/usage.md, docs/config.md, docs/design.md);
- the config table (docs/config.md) is exactly what scripts/config_table.py prints from
  hsdp/config/schema.py, so a new config key cannot be added without documenting it;
- every `python -m MODULE` the README and docs/ name is a module there is, and every
  `--set section.key=...` names a config key;
- no file points outside the project (the design document is docs/design.md), and
  every "docs/design.md §n" citation names a section that exists;
- the README holds no process notes, dates or commits (measured results live in
  docs/results/, checked by tests/test_docs.py).
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
CONFIG_PAGE = REPO / "docs" / "config.md"
MAX_README_LINES = 300
# The user commands, each named in the README as it is run.
COMMANDS = (
    "python train.py",
    "python -m hsdp.prepare",
    "python -m hsdp.sample",
    "python -m hsdp.export",
    "python -m hsdp.sweep",
    "python -m hsdp.slowlink",
    "python -m hsdp.plan",
)


def _config_table_module():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def _docs_markdown() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


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


# ----------------------------------------------------------------------------- the front door


def test_readme_is_short(readme: str) -> None:
    n = len(readme.splitlines())
    assert n <= MAX_README_LINES, f"README has {n} lines (at most {MAX_README_LINES}): move details to docs/"


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_names_each_user_command(readme: str, command: str) -> None:
    prose = re.sub(r"\s+", " ", readme)
    assert command in prose, f"the README does not show `{command}`"


def _local_link_targets(markdown: str) -> set[str]:
    return {m.split("#", 1)[0] for m in re.findall(r"\]\(([^)\s]+)\)", markdown)}


@pytest.mark.parametrize("page", ["docs/usage.md", "docs/config.md", "docs/design.md"])
def test_readme_links_the_detail_pages(readme: str, page: str) -> None:
    assert page in _local_link_targets(readme), f"the README does not link {page}"
    assert (REPO / page).is_file()


# ----------------------------------------------------------------------------- config table


@pytest.fixture(scope="module")
def config_page() -> str:
    return CONFIG_PAGE.read_text(encoding="utf-8")


def test_config_table_is_generated_from_the_dataclasses(config_page: str) -> None:
    ct = _config_table_module()
    assert ct.PAGE.resolve() == CONFIG_PAGE.resolve(), (
        "scripts/config_table.py writes another page than this test reads"
    )
    assert ct.table_block(config_page) == ct.table(), (
        "docs/config.md's config table is out of date: run `python scripts/config_table.py --write`"
    )


def test_every_config_key_is_in_the_table(config_page: str) -> None:
    ct = _config_table_module()
    block = ct.table_block(config_page)
    documented = re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \|", block, flags=re.M)
    missing = [k for k in ct.keys() if k not in documented]
    assert not missing, f"config keys missing from the table in docs/config.md: {missing}"
    assert len(documented) == len(set(documented)) == len(ct.keys()), "one row per key, no stale rows"


@dataclasses.dataclass
class _Commented:
    beside: int = 1  # on its line
    # too long to fit beside it,
    # so on the lines above
    above: int = 2
    bare: int = 3


def test_field_comments_beside_or_above() -> None:
    comments = _config_table_module().field_comments(_Commented)
    assert comments == {"beside": "on its line", "above": "too long to fit beside it, so on the lines above"}


def test_table_block_needs_its_markers() -> None:
    ct = _config_table_module()
    with pytest.raises(ValueError):
        ct.table_block("no markers here")
    with pytest.raises(ValueError):
        ct.table_block(f"{ct.START}\n{ct.END}\n{ct.START}\n{ct.END}\n")


# ----------------------------------------------------------------------------- commands and keys the docs name

PYTHON_M = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
SET_KEY = re.compile(r"--set[ =]([a-z_]+)\.([a-z_0-9]+)=")


def _module_exists(module: str) -> bool:
    parts = module.split(".")
    if parts[0] in ("hsdp", "kernels"):
        base = REPO.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    return importlib.util.find_spec(parts[0]) is not None


def test_module_check_tells_real_from_made_up() -> None:
    assert _module_exists("hsdp.plan") and _module_exists("hsdp.plan.validate") and _module_exists("pytest")
    assert not _module_exists("hsdp.no_such_command") and not _module_exists("no_such_package_xyz")


def test_python_m_modules_exist() -> None:
    bad = []
    for path in _docs_markdown():
        for module in sorted(set(PYTHON_M.findall(path.read_text(encoding="utf-8")))):
            if not _module_exists(module.rstrip(".")):
                bad.append(f"{path.relative_to(REPO)}: python -m {module}")
    assert not bad, "the docs run modules that do not exist:\n" + "\n".join(bad)


def test_set_keys_exist() -> None:
    keys = set(_config_table_module().keys())
    bad = []
    for path in _docs_markdown():
        for section, name in SET_KEY.findall(path.read_text(encoding="utf-8")):
            if section != "section" and f"{section}.{name}" not in keys:  # `--set section.key=value`: the form
                bad.append(f"{path.relative_to(REPO)}: --set {section}.{name}")
    assert not bad, "the docs --set config keys that do not exist:\n" + "\n".join(sorted(set(bad)))


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


README_NOT_ABOUT_THE_PROJECT = (
    r"\bsession\b",
    r"\(issue:",
    r"\bowed\b",
    r"\blent\b",
    r"steering",
    r"\b20\d\d-\d\d-\d\d\b",  # a date: when something was measured is said in docs/results/
    r"`[0-9a-f]*[0-9][0-9a-f]*[a-f][0-9a-f]*`|`[0-9a-f]*[a-f][0-9a-f]*[0-9][0-9a-f]*`",  # a commit, likewise
)


def test_readme_has_no_process_notes(readme: str) -> None:
    for pattern in README_NOT_ABOUT_THE_PROJECT:
        m = re.search(pattern, readme, flags=re.I)
        assert m is None, f"README reads like a process note near {readme[max(0, m.start() - 60) : m.end() + 60]!r}"


def test_process_note_patterns_catch_dates_and_commits() -> None:
    for note in ("measured 2026-12-03", "at `ba1a3f7`", "(issue: 12)"):
        assert any(re.search(p, note, flags=re.I) for p in README_NOT_ABOUT_THE_PROJECT), note
    assert not any(re.search(p, "`mesh.sync`, `0.0003`, `fp32`", flags=re.I) for p in README_NOT_ABOUT_THE_PROJECT)
