"""Text corpus → `tokenizer.json` + llm.c shards `train.bin` / `val.bin`, streamed.

    python -m hsdp.prepare INPUT... --out DIR [--vocab N | --tokenizer tokenizer.json] [--val-fraction F]

INPUT is a text file, a folder (its files ending in a --suffix, recursively, except
under subfolders named by --exclude) or a quoted glob. Documents: each line of a
`.jsonl` file (`{"text": ...}`); any other file is one document, or several
separated by `<|endoftext|>`. Document i (in input order) goes to val iff
⌊(i+1)·F⌋ > ⌊i·F⌋: whole documents, evenly spread.
Each document is preceded by the end-of-text id (as llm.c's fineweb.py does), so
that id lies between documents.

Passes: check (every file readable, UTF-8, and .jsonl lines parse; before any
output), train a byte-level BPE on the train documents (unless --tokenizer),
encode. Files are read in chunks cut at a pre-token boundary, so memory does not
grow with the corpus and the tokens equal encoding each document whole. Outputs
appear only complete (temp name, fsync, os.replace); `prepare.json` records the
corpus, so a folder holding another corpus is refused and a finished one is kept.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

from hsdp.shards import MAX_VOCAB, ShardWriter, stale_temps, temp_name, write_json

EOT = "<|endoftext|>"
BYTES = 256  # the byte-level alphabet
CHUNK_BYTES = 1 << 20  # bytes read at a time; pieces of a long document are about this long
BATCH_CHARS = 4 << 20  # text encoded per encode_batch call (the tokenizer parallelises within a batch)
DEFAULT_VOCAB = 4096
DEFAULT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
OUTPUTS = ("tokenizer.json", "train.bin", "val.bin")
MANIFEST = "prepare.json"
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


def check_file(path: Path) -> Optional[str]:
    """Why `path` is not a usable text file (None if it is): not UTF-8, or a .jsonl line without a "text"."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        if path.suffix == ".jsonl":
            for n, line in enumerate(f, 1):
                try:
                    if line.strip() and not isinstance(json.loads(line).get("text"), str):
                        return f'line {n} has no string "text"'
                except (ValueError, AttributeError) as e:
                    return f"line {n} is not a JSON object ({str(e).splitlines()[0]})"
            return None
        offset = 0
        while chunk := f.read(CHUNK_BYTES):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                return f"not UTF-8 text (byte {offset + e.start})"
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return "not UTF-8 text (it ends inside a character)"
    return None


def check_inputs(inputs: list[str], suffixes: tuple[str, ...], exclude: tuple[str, ...], bar: bool) -> Corpus:
    """Every file readable and text (PrepareError for a named file; a found one that is not text is skipped)."""
    files, explicit = find_files(inputs, suffixes, exclude)
    for f in files:
        if not os.access(f, os.R_OK):
            raise PrepareError(f"input: cannot read {f} (permission denied)")
    kept, skipped = [], []
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="check", disable=not bar) as t:
        for f in files:
            try:
                problem = check_file(f)
            except OSError as e:
                raise PrepareError(f"input: cannot read {f} ({e.strerror})") from None
            if problem and f in explicit:
                raise PrepareError(f"input: {f}: {problem}")
            (skipped if problem else kept).append(f)
            t.update(f.stat().st_size)
    if not kept:
        raise PrepareError(f"input: none of the {len(files)} files is UTF-8 text")
    return Corpus(kept, sum(f.stat().st_size for f in kept), skipped)


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


def documents(corpus: Corpus, val_fraction: float, chunk_bytes: int) -> Iterator[tuple[bool, bool, str, int]]:
    """(is val, starts a document, text, bytes read) over the whole corpus."""
    doc = -1
    for path in corpus.files:
        for start, text, nbytes in read_pieces(path, chunk_bytes):
            doc += start
            yield is_val(doc, val_fraction), start, text, nbytes


# ---------------------------------------------------------------- tokenizer
def new_tokenizer() -> Any:
    """An untrained byte-level BPE (GPT-2's pre-tokenizer and decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(corpus: Corpus, vocab: int, val_fraction: float, bar: bool, chunk_bytes: int) -> Any:
    """A byte-level BPE of `vocab` ids (id 0 = <|endoftext|>, then the 256 bytes) trained on the train documents."""
    from tokenizers import pre_tokenizers, trainers

    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with tqdm(total=corpus.nbytes, unit="B", unit_scale=True, desc="train BPE", disable=not bar) as t:

        def train_texts() -> Iterator[str]:
            for val, _, text, nbytes in documents(corpus, val_fraction, chunk_bytes):
                t.update(nbytes)
                if not val:
                    yield text

        tok.train_from_iterator(train_texts(), trainer=trainer)
    return tok


def load_tokenizer(path: Path) -> Any:
    """A given tokenizer.json; it must know <|endoftext|> and fit uint16."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for a missing or malformed file
        raise PrepareError(f"--tokenizer: cannot load {path} ({str(e).splitlines()[0]})") from None
    if tok.token_to_id(EOT) is None:
        raise PrepareError(f"--tokenizer: {path} has no {EOT} token to put between documents")
    if tok.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
        raise PrepareError(
            f"--tokenizer: {path} has {tok.get_vocab_size(with_added_tokens=True)} ids; uint16 shards hold "
            f"at most {MAX_VOCAB}"
        )
    return tok


# ---------------------------------------------------------------- output
def manifest(corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    """What identifies a prepared corpus: its files (path, size, mtime), the tokenizer and the split."""
    tokenizer = (
        {"file_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest()}
        if args.tokenizer
        else {"trained_vocab": args.vocab}
    )
    files = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in corpus.files]
    return {"files": files, "tokenizer": tokenizer, "val_fraction": args.val_fraction}


def check_out(out: Path, want: dict[str, Any]) -> bool:
    """PrepareError unless `out` is new or holds this very corpus (ours); True if that is already complete."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out: {out} is a file, not a folder")
    present = [n for n in (*OUTPUTS, MANIFEST) if (out / n).exists()]
    if not present:
        return False
    try:
        saved = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        raise PrepareError(
            f"--out: {out} holds {', '.join(present)} not written by hsdp.prepare; use another folder"
        ) from None
    for key in ("files", "tokenizer", "val_fraction"):
        if saved.get(key) != want[key]:
            raise PrepareError(
                f"--out: {out} holds a different corpus ({key} differs from this command's); "
                "use another folder or delete it"
            )
    return bool(saved.get("complete")) and all((out / n).is_file() for n in OUTPUTS)


def encode_corpus(
    tok: Any, corpus: Corpus, out: Path, val_fraction: float, bar: bool, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, dict[str, int]]:
    """Write train.bin and val.bin (each complete or not at all); {split: {tokens, documents}}."""
    eot = np.array([tok.token_to_id(EOT)], dtype=np.uint16)
    docs = {"train": 0, "val": 0}
    with ShardWriter(out / "train.bin") as train, ShardWriter(out / "val.bin") as val:
        writers = {"train": train, "val": val}
        batch: list[tuple[str, bool, str]] = []  # (split, starts a document, text) not yet encoded
        chars = 0

        def flush() -> None:
            encodings = tok.encode_batch_fast([text for _, _, text in batch], add_special_tokens=False)
            for (split, start, _), enc in zip(batch, encodings):
                if start:
                    writers[split].write(eot)
                writers[split].write(np.array(enc.ids, dtype=np.uint16))
            batch.clear()

        with tqdm(total=corpus.nbytes, unit="B", unit_scale=True, desc="encode", disable=not bar) as t:
            for is_val_doc, start, text, nbytes in documents(corpus, val_fraction, chunk_bytes):
                split = "val" if is_val_doc else "train"
                docs[split] += start
                batch.append((split, start, text))
                chars += len(text)
                if chars > BATCH_CHARS:
                    flush()
                    chars = 0
                t.update(nbytes)
            flush()
        for split, n in docs.items():
            if n == 0:
                raise PrepareError(
                    f"--val-fraction: the {split} split got no documents ({sum(docs.values())} in all at "
                    f"--val-fraction {val_fraction}); give more documents (files, or <|endoftext|> between them)"
                )
    return {split: {"tokens": writers[split].count, "documents": docs[split]} for split in docs}


# ---------------------------------------------------------------- the command
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="text files, folders or quoted globs")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--vocab", type=int, default=None, help=f"train a BPE of N ids (default {DEFAULT_VOCAB})")
    which.add_argument("--tokenizer", type=Path, default=None, help="use this tokenizer.json instead of training")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents held out (default 0.1)")
    p.add_argument("--suffix", action="append", default=None, help=f"folder files to read (default {DEFAULT_SUFFIXES})")
    p.add_argument("--exclude", action="append", default=[], metavar="NAME", help="skip subfolders of this name")
    args = p.parse_args(argv)
    if args.tokenizer is None and args.vocab is None:
        args.vocab = DEFAULT_VOCAB
    return args


def check_args(args: argparse.Namespace) -> None:
    """The flags alone (PrepareError, one line)."""
    if not args.inputs:
        raise PrepareError("input: no INPUT given (text files, folders or quoted globs)")
    if args.vocab is not None and not BYTES + 1 <= args.vocab <= MAX_VOCAB:
        raise PrepareError(
            f"--vocab: expected {BYTES + 1} (the bytes and {EOT}) to {MAX_VOCAB} (uint16 shards), got {args.vocab}"
        )
    if not 0 < args.val_fraction < 1:
        raise PrepareError(f"--val-fraction: expected a value in (0, 1), got {args.val_fraction}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise PrepareError(f"--tokenizer: {args.tokenizer} is not a file")


def prepare(args: argparse.Namespace, bar: bool) -> dict[str, Any]:
    """The whole command after parsing; returns what it did (for the last line)."""
    check_args(args)
    suffixes = tuple(args.suffix or DEFAULT_SUFFIXES)
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    corpus = check_inputs(args.inputs, suffixes, tuple(args.exclude), bar)
    want = manifest(corpus, args)
    out: Path = args.out
    if check_out(out, want):
        return {"done_before": True, "corpus": corpus}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            for stale in stale_temps(out / name):
                stale.unlink()
        write_json(out / MANIFEST, {**want, "complete": False})
    except OSError as e:
        raise PrepareError(f"--out: cannot write to {out} ({e.strerror})") from None
    t0 = time.perf_counter()
    if tok is None:
        tok = train_tokenizer(corpus, args.vocab, args.val_fraction, bar, CHUNK_BYTES)
    tmp = temp_name(out / "tokenizer.json")
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    splits = encode_corpus(tok, corpus, out, args.val_fraction, bar)
    seconds = time.perf_counter() - t0
    write_json(out / MANIFEST, {**want, "complete": True, "splits": splits, "seconds": round(seconds, 2)})
    return {"done_before": False, "corpus": corpus, "splits": splits, "seconds": seconds, "vocab": tok.get_vocab_size()}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    bar = os.environ.get("HSDP_NO_BAR") != "1"
    try:
        done = prepare(args, bar)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the shard writers have deleted their temporary files
        print(f"interrupted; {args.out} holds no partly written shard", file=sys.stderr)
        return 130
    corpus: Corpus = done["corpus"]
    if corpus.skipped:
        note = f"note: skipped {len(corpus.skipped)} files that are not UTF-8 text, e.g. {corpus.skipped[0]}"
        print(note, file=sys.stderr)
    if done["done_before"]:
        print(f"{args.out}: already prepared from these inputs; nothing to do", file=sys.stderr)
        return 0
    s = done["splits"]
    mb = corpus.nbytes / 1e6
    print(
        f"wrote {args.out}: tokenizer.json ({done['vocab']} ids), train.bin ({s['train']['tokens']:,} tokens, "
        f"{s['train']['documents']} docs), val.bin ({s['val']['tokens']:,} tokens, {s['val']['documents']} docs) "
        f"from {mb:.1f} MB of text in {done['seconds']:.1f} s ({mb / done['seconds']:.2f} MB/s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
