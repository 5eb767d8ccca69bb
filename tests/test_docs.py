"""The docs read as the current state of the project, link only to what exists, and say where results come from.

- no stale phrases ("planned", "later issue", ...) in the README, docs/**/*.md, or the docstrings and
  comments of the code (hsdp/, kernels/, train.py, scripts/): what is built is described as built;
- every relative link in README.md and docs/**/*.md points at a file that exists;
- every docs/results/*.md names, at its top (before its first `##` section), the command that
  produced it, the commit that recorded it (a hash that git knows, when git can tell) with that
  commit's date, and the machine; the README's results summary links to each of them;
- docs/design.md's sections are numbered in the order they come (§0, §1, ..., §n.1, §n.2, ...), and
  every file its §0 map names exists.
"""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

from tests.helpers import REPO

RESULTS = REPO / "docs" / "results"

STALE_PHRASES = ("planned", "later issue", "later feature", "(not measured then)")
PROCESS_NOTES = (r"\bsession\b", r"\(issue:", r"\bowed\b", r"\blent\b", r"steering")


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _code_files() -> list[Path]:
    files = [*sorted((REPO / "hsdp").rglob("*.py")), *sorted((REPO / "kernels").rglob("*.py"))]
    files += [REPO / "train.py", *sorted((REPO / "scripts").glob("*.py"))]
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts]


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose_of_python(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal (docstrings included) of a Python file."""
    kinds = {tokenize.COMMENT, tokenize.STRING}
    if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python >= 3.12 splits f-strings into parts
        kinds.add(tokenize.FSTRING_MIDDLE)
    try:
        return [
            (t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type in kinds
        ]
    except (tokenize.TokenError, SyntaxError):  # not valid Python: scan all of it
        return [(1, source)]


def _stale_hits(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    hits = []
    lower = text.lower()
    for phrase in STALE_PHRASES:
        for m in re.finditer(re.escape(phrase), lower):
            hits.append((first_line + text.count("\n", 0, m.start()), phrase))
    return hits


# ----------------------------------------------------------------------------- stale phrases


def test_no_stale_phrases_in_docs() -> None:
    bad = [f"{_rel(p)}:{n}: {phrase!r}" for p in _markdown_files() for n, phrase in _stale_hits(p.read_text("utf-8"))]
    assert not bad, "the docs describe something as not done yet; say what is there:\n" + "\n".join(bad)


def test_no_stale_phrases_in_code_docstrings_and_comments() -> None:
    bad = []
    for path in _code_files():
        for line, text in _prose_of_python(path.read_text("utf-8")):
            bad += [f"{_rel(path)}:{n}: {phrase!r}" for n, phrase in _stale_hits(text, line)]
    assert not bad, "a docstring or comment describes something as not done yet:\n" + "\n".join(bad)


def test_results_have_no_process_notes() -> None:
    bad = []
    for path in sorted(RESULTS.glob("*.md")):
        text = path.read_text("utf-8")
        for pattern in PROCESS_NOTES:
            for m in re.finditer(pattern, text, flags=re.I):
                bad.append(f"{_rel(path)}: {text[max(0, m.start() - 40) : m.end() + 40]!r}")
    assert not bad, "results read like process notes:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- links

CODE_BLOCK = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", flags=re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", flags=re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", flags=re.M)
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", flags=re.I)


def _link_targets(markdown: str) -> list[str]:
    prose = CODE_SPAN.sub("", CODE_BLOCK.sub("", markdown))
    return [m.group(1) for rx in (INLINE_LINK, REFERENCE_DEF, HTML_LINK) for m in rx.finditer(prose)]


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I)) or target.startswith(("#", "//"))


def test_link_parser_finds_what_a_reader_would_click() -> None:
    text = (
        '[a](x.md) ![img](../p.png "title") `[c](not-a-link.md)` [[n] b](nested.md)\n'
        "```\n[d](in-a-block.md)\n```\n[ref]: r.md\n[e](https://example.com) [f](#anchor) [g](g.md#sec)\n"
    )
    assert set(_link_targets(text)) == {
        "x.md",
        "../p.png",
        "nested.md",
        "r.md",
        "https://example.com",
        "#anchor",
        "g.md#sec",
    }
    assert _is_external("https://example.com") and _is_external("#anchor") and not _is_external("g.md#sec")


@pytest.mark.parametrize("path", _markdown_files(), ids=_rel)
def test_relative_links_point_at_existing_files(path: Path) -> None:
    broken = []
    for target in _link_targets(path.read_text("utf-8")):
        if _is_external(target):
            continue
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (path.parent / file_part).resolve()
        if not resolved.is_file():
            broken.append(target)
    assert not broken, f"{_rel(path)} links to files that do not exist: {broken}"


# ----------------------------------------------------------------------------- provenance of results

COMMIT_WITH_DATE = re.compile(r"`?\b([0-9a-f]{7,40})\b`?\s*\((\d{4}-\d{2}-\d{2})\)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def _names_a_command(markdown: str) -> bool:
    code = [m.group(0) for m in CODE_BLOCK.finditer(markdown)]
    code += [m.group(0) for m in CODE_SPAN.finditer(CODE_BLOCK.sub("", markdown))]
    return any(re.search(r"\bpython ", c) for c in code)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_can_check_commits() -> bool:
    return _git("rev-parse", "--is-shallow-repository") == "false"


def _results_files() -> list[Path]:
    return sorted(RESULTS.glob("*.md"))


def test_there_are_results_files() -> None:
    assert _results_files(), "docs/results/ holds no results"


@pytest.mark.parametrize("path", _results_files(), ids=_rel)
def test_results_file_names_command_commit_and_date(path: Path) -> None:
    text = path.read_text("utf-8")
    assert _names_a_command(text), f"{_rel(path)} names no command (a `python ...` code span or block)"
    pairs = COMMIT_WITH_DATE.findall(text)
    assert pairs, f"{_rel(path)} names no commit with its date, e.g. `abc1234` (2026-01-31)"
    assert DATE.search(text)
    if not _git_can_check_commits():
        return
    for commit, date in pairs:
        full = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
        assert full, f"{_rel(path)}: {commit} is not a commit of this repository"
        actual = _git("show", "-s", "--format=%ad", "--date=short", full)
        assert actual == date, f"{_rel(path)}: commit {commit} is dated {actual}, not {date}"


def _top(markdown: str) -> str:
    """A page's opening: everything before its first `##` section (outside code blocks)."""
    m = re.search(r"^## ", CODE_BLOCK.sub(lambda b: "x" * len(b.group(0)), markdown), flags=re.M)
    return markdown[: m.start()] if m else markdown


def test_top_stops_at_the_first_section() -> None:
    assert _top("# T\n\n- a\n```\n## not a section\n```\n## S\nbody\n") == "# T\n\n- a\n```\n## not a section\n```\n"


@pytest.mark.parametrize("path", _results_files(), ids=_rel)
def test_results_file_opens_with_command_commit_date_and_machine(path: Path) -> None:
    top = _top(path.read_text("utf-8"))
    assert _names_a_command(top), f"{_rel(path)} does not open with its command (a `python ...` before its first ##)"
    assert COMMIT_WITH_DATE.search(top), (
        f"{_rel(path)} does not open with its commit and date, e.g. `abc1234` (2026-01-31)"
    )
    assert re.search(r"\*\*Machine", top), f"{_rel(path)} does not open with its machine (a **Machine:** line)"


def test_readme_links_every_results_file() -> None:
    linked = {
        (REPO / t.split("#", 1)[0]).resolve()
        for t in _link_targets((REPO / "README.md").read_text("utf-8"))
        if not _is_external(t)
    }
    missing = [_rel(p) for p in _results_files() if p.resolve() not in linked]
    assert not missing, f"the README's results summary does not link {missing}"


# ----------------------------------------------------------------------------- the design document

DESIGN = REPO / "docs" / "design.md"
SECTION = re.compile(r"^#+ §(\d+)(?:\.(\d+))? ", flags=re.M)


def _section_numbers(markdown: str) -> list[tuple[int, int]]:
    """(n, sub) of each "§n" / "§n.sub" heading in order; sub 0 for a top-level section."""
    return [(int(n), int(sub or 0)) for n, sub in SECTION.findall(CODE_BLOCK.sub("", markdown))]


def _out_of_order(numbers: list[tuple[int, int]]) -> list[str]:
    """Each heading whose number is not the next one: §0 first, then §n+1 or §n.(k+1) after §n.k."""
    bad, prev = [], (-1, 0)
    for n, sub in numbers:
        ok = (n, sub) == (prev[0] + 1, 0) or (n, sub) == (prev[0], prev[1] + 1)
        if not ok:
            bad.append(f"§{n}.{sub} after §{prev[0]}.{prev[1]}" if sub else f"§{n} after §{prev[0]}.{prev[1]}")
        prev = (n, sub)
    return bad


def test_section_order_check_catches_a_swap() -> None:
    assert _out_of_order([(0, 0), (1, 0), (1, 1), (1, 2), (2, 0)]) == []
    assert _out_of_order([(0, 0), (1, 0), (1, 2), (1, 1)]) != []
    assert _out_of_order([(1, 0), (2, 0)]) != []  # the map (§0) first


def test_design_sections_are_numbered_in_order() -> None:
    numbers = _section_numbers(DESIGN.read_text("utf-8"))
    assert len(numbers) > 10
    bad = _out_of_order(numbers)
    assert not bad, "docs/design.md's sections are out of order:\n" + "\n".join(bad)


def _map_paths(design: str) -> list[str]:
    """Every file or folder §0's map names, bare names resolved against the last folder named before them."""
    block = design.split("## §0 ", 1)[1].split("**Layers.**", 1)[0]
    paths, base = [], ""
    for token in re.findall(r"(?<![\w.])((?:[\w]+/)*[\w]+(?:\.py|/))", block):
        if token.startswith(("hsdp/", "kernels/")) or token == "train.py":
            paths.append(token)
            base = token if token.endswith("/") else token.rpartition("/")[0] + "/"
        elif token.endswith(".py"):
            paths.append(base + token)
    return paths


def test_map_paths_resolve_bare_names() -> None:
    block = (
        "## §0 Map\n    x   hsdp/run/lock.py (a) · guard.py · checkpoint/integrity.py; kernels/ (backend.py)\n"
        "**Layers.** hsdp/not_in_the_map.py"
    )
    assert _map_paths(block) == [
        "hsdp/run/lock.py",
        "hsdp/run/guard.py",
        "hsdp/run/checkpoint/integrity.py",
        "kernels/",
        "kernels/backend.py",
    ]


def test_design_map_names_files_that_exist() -> None:
    paths = _map_paths(DESIGN.read_text("utf-8"))
    assert len(paths) > 40, paths
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/design.md §0 names files that do not exist: {missing}"
    for room in ("core", "data", "models"):  # the rooms by concern: each module named where it lives
        for module in sorted((REPO / "hsdp" / room).glob("*.py")):
            if module.name != "__init__.py":
                assert _rel(module) in paths, f"docs/design.md §0 does not name {_rel(module)}"
