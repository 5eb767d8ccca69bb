"""A text corpus as `python -m hsdp.prepare` reads it: its files, documents, split and pieces.

Documents: each line of a `.jsonl` file (`{"text": ...}`); any other file is one
document, or several separated by `<|endoftext|>`. Document i (in input order) goes
to val iff ⌊(i+1)·F⌋ > ⌊i·F⌋: whole documents, evenly spread; when that gives val
none, val is the last F of the last document's characters (cut at a pre-token
boundary). Files are checked (readable, UTF-8, .jsonl lines parse; documents
counted and files hashed) before any output, and read in chunks cut at a
pre-token boundary, so memory does not grow with the corpus and the tokens equal
encoding each document whole.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Optional

from tqdm import tqdm

EOT = "<|endoftext|>"
CHUNK_BYTES = 1 << 20  # bytes read at a time; pieces of a long document are about this long
DEFAULT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
# A cut point: before a space or newline that starts a new pre-token (the next char is not whitespace).
# GPT-2's pre-tokenizer regex splits there too, so encoding the pieces equals encoding the whole.
CUT = re.compile(r"[ \n](?=\S)")


class PrepareError(Exception):
    """Bad input; the message is one line."""


@dataclass(frozen=True)
class Corpus:
    files: list[Path]  # in order; documents are numbered across them
    nbytes: int
    skipped: list[Path]  # found by a folder or glob, but not UTF-8 text
    documents: int = 0  # non-empty documents across the files
    last_chars: int = 0  # characters of the last document
    sha256: list[str] = field(default_factory=list)  # each file's, in order


@dataclass(frozen=True)
class Split:
    """Which text goes to val: whole documents (is_val), or else the tail of the last document."""

    val_fraction: float
    tail_doc: Optional[int] = None  # the document whose tail is val (None: whole documents)
    tail_from: int = 0  # the character of that document where val may begin (moved on to a pre-token start)


# ---------------------------------------------------------------- input
def find_files(
    inputs: list[str], suffixes: tuple[str, ...], exclude: tuple[str, ...] = ()
) -> tuple[list[Path], set[Path]]:
    """The files the inputs name, in order (folders and globs sorted), and which were named explicitly.

    In a folder: files ending in one of `suffixes`, not inside a subfolder named in `exclude`."""
    files: list[Path] = []
    explicit: set[Path] = set()
    for text in inputs:
        path = Path(text).expanduser()
        if path.is_dir():
            found = (p for p in path.rglob("*") if p.suffix in suffixes and p.is_file())
            files += sorted(p for p in found if not set(p.relative_to(path).parts[:-1]) & set(exclude))
        elif path.exists() or not any(c in text for c in "*?["):
            if not path.is_file():
                raise PrepareError(f"input: {text} is not a file or folder")
            files.append(path)
            explicit.add(path)
        else:
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise PrepareError(f"input: the glob {text} matches no files")
            files += matches
    if not files:
        raise PrepareError(f"input: no files (folders are searched for {', '.join(suffixes)})")
    return files, explicit


@dataclass(frozen=True)
class FileScan:
    """What the check pass learns of one file."""

    problem: Optional[str]  # why it is not usable text (None: it is)
    documents: int  # non-empty documents in it (as read_pieces yields them)
    last_chars: int  # characters of its last document
    sha256: str  # of its bytes: the corpus's identity, whatever its mtime


def scan_jsonl(f: BinaryIO, digest: Any) -> FileScan:
    """A .jsonl file: every non-blank line a JSON object with a string "text"; a non-empty one is a document."""
    docs, last = 0, 0
    for n, line in enumerate(f, 1):
        digest.update(line)
        if not line.strip():
            continue
        try:
            text = json.loads(line).get("text")
        except (ValueError, AttributeError) as e:
            return FileScan(f"line {n} is not a JSON object ({str(e).splitlines()[0]})", 0, 0, "")
        if not isinstance(text, str):
            return FileScan(f'line {n} has no string "text"', 0, 0, "")
        if text:
            docs, last = docs + 1, len(text)
    return FileScan(None, docs, last, digest.hexdigest())


def scan_text(f: BinaryIO, digest: Any) -> FileScan:
    """A text file: UTF-8, its documents the non-empty stretches between <|endoftext|> markers.

    Streamed: only the last len(EOT) - 1 characters are kept between chunks (a marker may straddle two)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    keep = len(EOT) - 1
    carry, chars, docs, last, offset = "", 0, 0, 0, 0  # chars: of the current document, not counting carry
    while chunk := f.read(CHUNK_BYTES):
        digest.update(chunk)
        try:
            text = carry + decoder.decode(chunk)
        except UnicodeDecodeError as e:
            return FileScan(f"not UTF-8 text (byte {offset + e.start})", 0, 0, "")
        offset += len(chunk)
        *whole, rest = text.split(EOT)
        for part in whole:
            chars += len(part)
            if chars:
                docs, last = docs + 1, chars
            chars = 0
        chars += max(0, len(rest) - keep)
        carry = rest[max(0, len(rest) - keep) :]
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return FileScan("not UTF-8 text (it ends inside a character)", 0, 0, "")
    chars += len(carry)
    if chars:
        docs, last = docs + 1, chars
    return FileScan(None, docs, last, digest.hexdigest())


def scan_file(path: Path) -> FileScan:
    """Check one file, count its documents and hash it, in one read."""
    with open(path, "rb") as f:
        return (scan_jsonl if path.suffix == ".jsonl" else scan_text)(f, hashlib.sha256())


def check_inputs(inputs: list[str], suffixes: tuple[str, ...], exclude: tuple[str, ...], bar: bool) -> Corpus:
    """Every file readable and text (PrepareError for a named file; a found one that is not text is skipped)."""
    files, explicit = find_files(inputs, suffixes, exclude)
    for f in files:
        if not os.access(f, os.R_OK):
            raise PrepareError(f"input: cannot read {f} (permission denied)")
    kept: list[tuple[Path, FileScan]] = []
    skipped: list[Path] = []
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="check", disable=not bar) as t:
        for f in files:
            try:
                scan = scan_file(f)
            except OSError as e:
                raise PrepareError(f"input: cannot read {f} ({e.strerror})") from None
            if scan.problem and f in explicit:
                raise PrepareError(f"input: {f}: {scan.problem}")
            if scan.problem:
                skipped.append(f)
            else:
                kept.append((f, scan))
            t.update(f.stat().st_size)
    if not kept:
        raise PrepareError(f"input: none of the {len(files)} files is UTF-8 text")
    last = [s.last_chars for _, s in kept if s.documents]
    return Corpus(
        files=[f for f, _ in kept],
        nbytes=sum(f.stat().st_size for f, _ in kept),
        skipped=skipped,
        documents=sum(s.documents for _, s in kept),
        last_chars=last[-1] if last else 0,
        sha256=[s.sha256 for _, s in kept],
    )


def last_cut(text: str, chunk_bytes: int) -> int:
    """The last index before which `text` may be cut without changing its pre-tokens (0: none yet).

    Text without such a point (one giant word) is cut anyway once it is 64 chunks long, so memory
    stays bounded; only the tokens at that cut may then differ from encoding the document whole."""
    cut = 0
    for m in CUT.finditer(text):
        cut = m.start()
    return cut if cut or len(text) < 64 * chunk_bytes else len(text)


def read_pieces(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bool, str, int]]:
    """(starts a document, text, bytes read) of one file, in order; a long document comes in several pieces."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line in f:
                text = json.loads(line)["text"] if line.strip() else ""
                if text:
                    yield True, text, len(line)
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, start, pending = "", True, 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(chunk_bytes)
            carry += decoder.decode(raw, final=not raw)
            pending += len(raw)
            *whole, carry = carry.split(EOT)
            for text in whole:  # each ends a document
                if text or not start:
                    yield start, text, pending
                    pending = 0
                start = True
            if not raw:
                break
            if len(carry) > chunk_bytes and (cut := last_cut(carry, chunk_bytes)) > 0:
                yield start, carry[:cut], pending
                carry, start, pending = carry[cut:], False, 0
    if carry or not start:
        yield start, carry, pending


def is_val(doc: int, val_fraction: float) -> bool:
    return int((doc + 1) * val_fraction) > int(doc * val_fraction)


def plan_split(corpus: Corpus, val_fraction: float) -> Split:
    """Whole documents to val if that gives val at least one, else the tail of the last document (PrepareError
    when there is no text, or the last document is too short to cut)."""
    n = corpus.documents
    if n == 0:
        raise PrepareError(f"input: the {len(corpus.files)} files hold no text (no documents)")
    if int(n * val_fraction) >= 1:
        return Split(val_fraction)
    if corpus.last_chars < 2:
        raise PrepareError(
            f"--val-fraction: {n} documents give val none at {val_fraction}, and the last document "
            f"({corpus.last_chars} character) is too short to split into train and val; give more text"
        )
    tail = max(1, round(corpus.last_chars * val_fraction))
    return Split(val_fraction, tail_doc=n - 1, tail_from=corpus.last_chars - tail)


def tail_cut(text: str, at: int) -> int:
    """Where val begins in a piece: the first pre-token start at or after `at` (else `at` itself)."""
    m = CUT.search(text, at)
    return m.start() if m else at


def documents(corpus: Corpus, split: Split, chunk_bytes: int) -> Iterator[tuple[bool, bool, str, int]]:
    """(is val, starts a document, text, bytes read) over the whole corpus."""
    doc, seen, in_tail = -1, 0, False  # seen: characters of the tail document before this piece
    for path in corpus.files:
        for start, text, nbytes in read_pieces(path, chunk_bytes):
            doc += start
            if doc != split.tail_doc:
                yield is_val(doc, split.val_fraction), start, text, nbytes
            elif in_tail:
                yield True, False, text, nbytes
            elif (at := split.tail_from - seen) >= len(text):
                seen += len(text)
                yield False, start, text, nbytes
            else:  # val begins in this piece: its tail is a document of its own
                cut = tail_cut(text, max(at, 0))
                if cut:
                    yield False, start, text[:cut], nbytes
                yield True, True, text[cut:], 0 if cut else nbytes
                in_tail = True
