"""Text corpus → `tokenizer.json` + llm.c shards `train_000000.bin`, … / `val_000000.bin`, …, streamed.

    python -m hsdp.prepare INPUT... --out DIR [--vocab N | --tokenizer tokenizer.json] [--val-fraction F]
                                              [--shard-tokens N]

INPUT is a text file, a folder (its files ending in a --suffix, recursively, except
under subfolders named by --exclude) or a quoted glob. Documents: each line of a
`.jsonl` file (`{"text": ...}`); any other file is one document, or several
separated by `<|endoftext|>`. Document i (in input order) goes to val iff
⌊(i+1)·F⌋ > ⌊i·F⌋: whole documents, evenly spread. When that gives val no
document (fewer than 1/F documents, e.g. one), val is instead the last F of the
last document's characters (cut at a pre-token boundary), as a document of its own.
Each document is preceded by the end-of-text id (as llm.c's fineweb.py does), so
that id lies between documents. Each split's token stream is cut into shards of
--shard-tokens tokens (the last one shorter; a cut may fall inside a document, as
llm.c's does): `data.path: DIR` (or `DIR/train_*.bin`) reads them as one stream, so
a corpus of any size works and the shard size changes nothing a run sees.

Passes: check (every file readable, UTF-8, and .jsonl lines parse; documents
counted and files hashed; before any output), train a byte-level BPE on the train
documents (unless --tokenizer), encode. The trained tokenizer's pre-tokenizer is
GPT-2's, then a cut of every pre-token longer than MAX_PRETOKEN_BYTES into pieces
of that many bytes: BPE training cost grows with the square of a pre-token's
length, so one whitespace-free document would otherwise stall it (normal text has
no pre-token that long, so its tokens do not change). Files are read in chunks cut
at a pre-token boundary, so memory does not grow with the corpus and the tokens
equal encoding each document whole. Outputs appear only complete (temp name,
fsync, os.replace); `prepare.json` records the corpus (each file's path, size and
SHA-256), so a folder holding another corpus is refused and a finished one is
kept; a prepare that fails or is interrupted removes what it wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

from hsdp.core.atomic import stale_temps, temp_name, write_json
from hsdp.data.corpus import (
    CHUNK_BYTES,
    DEFAULT_SUFFIXES,
    EOT,
    Corpus,
    PrepareError,
    Split,
    check_inputs,
    documents,
    plan_split,
)
from hsdp.data.shards import MAX_TOKENS, MAX_VOCAB, ShardWriter

BYTES = 256  # the byte-level alphabet
BATCH_CHARS = 4 << 20  # text encoded per encode_batch call (the tokenizer parallelises within a batch)
DEFAULT_VOCAB = 4096
SPLITS = ("train", "val")
TOKENIZER = "tokenizer.json"
LEGACY_SHARDS = ("train.bin", "val.bin")  # one shard per split: what prepare wrote before --shard-tokens
MANIFEST = "prepare.json"
DEFAULT_SHARD_TOKENS = 100_000_000  # as llm.c's fineweb.py: 200 MB per shard
# Longest pre-token the trained tokenizer keeps whole (in bytes; longer ones are cut into pieces this long).
# BPE training slows with the square of a pre-token's length (100 KB without whitespace: 4 s, 400 KB: 97 s);
# Python's stdlib (31 MB of code) has no pre-token longer than this, so normal text encodes as without the cut.
MAX_PRETOKEN_BYTES = 256


# ---------------------------------------------------------------- tokenizer
def new_tokenizer() -> Any:
    """An untrained byte-level BPE: GPT-2's pre-tokenizer, then pre-tokens cut to MAX_PRETOKEN_BYTES; its decoder.

    The cut is part of tokenizer.json, so hsdp.sample encodes a prompt as prepare encoded the corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            # After ByteLevel each byte is one character; [\s\S] matches any (Oniguruma's . skips newlines).
            pre_tokenizers.Split(Regex(f"[\\s\\S]{{1,{MAX_PRETOKEN_BYTES}}}"), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(corpus: Corpus, vocab: int, split: Split, bar: bool, chunk_bytes: int) -> Any:
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
            for val, _, text, nbytes in documents(corpus, split, chunk_bytes):
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


# ---------------------------------------------------------------- shards
def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def our_files(out: Path) -> list[Path]:
    """Every output name of ours present in `out` (tokenizer, shards of either layout)."""
    shards = [p for split in SPLITS for p in sorted(out.glob(f"{split}_[0-9]*.bin"))]
    return [p for p in (out / TOKENIZER, *(out / n for n in LEGACY_SHARDS)) if p.exists()] + shards


class ShardSeries:
    """One split's token stream written as shards of at most `shard_tokens` tokens, each complete or absent
    (hsdp.data.shards.ShardWriter: temp name, fsync, rename); at least one shard, even for an empty split."""

    def __init__(self, out: Path, split: str, shard_tokens: int) -> None:
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.names: list[str] = []  # the shards begun, in order
        self.count = 0  # tokens written, over all shards
        self.writer: Optional[ShardWriter] = None  # the shard being written (None between two)

    def open_next(self) -> ShardWriter:
        self.names.append(shard_name(self.split, len(self.names)))
        self.writer = ShardWriter(self.out / self.names[-1])
        return self.writer

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            writer = self.writer or self.open_next()
            take = min(len(tokens), self.shard_tokens - writer.count)
            writer.write(tokens[:take])
            self.count += take
            tokens = tokens[take:]
            if writer.count == self.shard_tokens:  # full: committed now; the next token opens the next shard
                writer.commit()
                self.writer = None

    def close(self) -> None:
        """Commit the last shard (an empty first one if nothing was written)."""
        writer = self.writer or (None if self.names else self.open_next())
        if writer is not None:
            writer.commit()
        self.writer = None

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


# ---------------------------------------------------------------- output
def manifest(corpus: Corpus, args: argparse.Namespace) -> dict[str, Any]:
    """What identifies a prepared corpus: its files (path, size, SHA-256), the tokenizer, the split and the
    shard size."""
    tokenizer = (
        {"file_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest()}
        if args.tokenizer
        else {"trained_vocab": args.vocab}
    )
    files = [[str(f.resolve()), f.stat().st_size, h] for f, h in zip(corpus.files, corpus.sha256)]
    return {
        "files": files,
        "tokenizer": tokenizer,
        "val_fraction": args.val_fraction,
        "shard_tokens": args.shard_tokens,
    }


def same_files(saved: Any, want: list[list[Any]]) -> bool:
    """Whether a manifest's files are these: same paths, sizes and contents.

    A manifest written before contents were hashed holds each file's mtime instead; it matches while
    the mtime does (a touched file then reads as another corpus, as it did)."""
    if not isinstance(saved, list) or len(saved) != len(want):
        return False
    for old, new in zip(saved, want):
        if not isinstance(old, list) or len(old) != 3 or old[:2] != new[:2]:
            return False
        if isinstance(old[2], str) and old[2] != new[2]:
            return False
        if isinstance(old[2], int) and old[2] != Path(new[0]).stat().st_mtime_ns:
            return False
    return True


def check_out(out: Path, want: dict[str, Any]) -> str:
    """What `out` holds: "new" (nothing of ours), "done" (this corpus, complete), "resume" (this corpus,
    unfinished) or "replace" (an unfinished prepare of another corpus: nothing usable, so it is replaced).

    PrepareError if it holds files not written by hsdp.prepare, or a complete prepare of another corpus."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out: {out} is a file, not a folder")
    present = [p.name for p in our_files(out)] + ([MANIFEST] if (out / MANIFEST).exists() else [])
    if not present:
        return "new"
    try:
        saved = json.loads((out / MANIFEST).read_text())
        if not isinstance(saved, dict):
            raise ValueError
    except (OSError, ValueError):
        raise PrepareError(
            f"--out: {out} holds {', '.join(present)} not written by hsdp.prepare; use another folder"
        ) from None
    written = [TOKENIZER, *(n for names in (saved.get("shards") or {}).values() for n in names)]
    complete = bool(saved.get("complete")) and "shards" in saved and all((out / n).is_file() for n in written)
    # A prepare from before --shard-tokens (train.bin, val.bin) records no shard_tokens: another layout.
    differs = [k for k in ("tokenizer", "val_fraction", "shard_tokens") if saved.get(k) != want[k]]
    if not same_files(saved.get("files"), want["files"]):
        differs.insert(0, "files")
    if differs and complete:
        raise PrepareError(
            f"--out: {out} holds a different corpus ({differs[0]} differs from this command's); "
            "use another folder or delete it"
        )
    if differs:
        return "replace"
    return "done" if complete else "resume"


def remove_outputs(out: Path) -> None:
    """Delete every file hsdp.prepare writes in `out` (outputs, manifest, temporaries of killed runs)."""
    for path in [*our_files(out), out / MANIFEST, *our_temps(out)]:
        path.unlink(missing_ok=True)


def our_temps(out: Path) -> list[Path]:
    """Temporaries of our names left by writers that were killed before they could clean up."""
    ours = [stale_temps(out / n) for n in (TOKENIZER, MANIFEST, *LEGACY_SHARDS)]
    shards = [p for p in out.glob(".*.bin.tmp-*") if is_shard(p.name[1:])]
    return [p for found in ours for p in found] + sorted(shards)


def is_shard(name: str) -> bool:
    """Whether a file name (temporary suffix allowed) is one of our numbered shards."""
    split, _, rest = name.partition("_")
    return split in SPLITS and rest[:6].isdigit() and rest[6:].startswith(".bin")


def encode_corpus(
    tok: Any,
    corpus: Corpus,
    out: Path,
    split: Split,
    bar: bool,
    chunk_bytes: int = CHUNK_BYTES,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
) -> dict[str, dict[str, Any]]:
    """Write each split's shards (each complete or not at all); {split: {tokens, documents, shards}}."""
    eot = np.array([tok.token_to_id(EOT)], dtype=np.uint16)
    docs = {"train": 0, "val": 0}
    writers = {name: ShardSeries(out, name, shard_tokens) for name in SPLITS}
    try:
        batch: list[tuple[str, bool, str]] = []  # (split, starts a document, text) not yet encoded
        chars = 0

        def flush() -> None:
            encodings = tok.encode_batch_fast([text for _, _, text in batch], add_special_tokens=False)
            for (name, start, _), enc in zip(batch, encodings):
                if start:
                    writers[name].write(eot)
                writers[name].write(np.array(enc.ids, dtype=np.uint16))
            batch.clear()

        with tqdm(total=corpus.nbytes, unit="B", unit_scale=True, desc="encode", disable=not bar) as t:
            for is_val_doc, start, text, nbytes in documents(corpus, split, chunk_bytes):
                name = "val" if is_val_doc else "train"
                docs[name] += start
                batch.append((name, start, text))
                chars += len(text)
                if chars > BATCH_CHARS:
                    flush()
                    chars = 0
                t.update(nbytes)
            flush()
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    return {name: {"tokens": w.count, "documents": docs[name], "shards": w.names} for name, w in writers.items()}


# ---------------------------------------------------------------- the command
VAL_HELP = (
    "share of documents held out as val (default 0.1): document i goes to val iff floor((i+1)F) > floor(iF); "
    "when that gives val none (fewer than 1/F documents, e.g. one), val is the last F of the last document's "
    "text instead"
)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hsdp.prepare", description=__doc__.splitlines()[0])
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="text files, folders or quoted globs")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--vocab",
        type=int,
        default=None,
        help=f"train a BPE of N ids (default {DEFAULT_VOCAB}); pre-tokens are cut to {MAX_PRETOKEN_BYTES} bytes",
    )
    which.add_argument("--tokenizer", type=Path, default=None, help="use this tokenizer.json instead of training")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F", help=VAL_HELP)
    p.add_argument("--suffix", action="append", default=None, help=f"folder files to read (default {DEFAULT_SUFFIXES})")
    p.add_argument("--exclude", action="append", default=[], metavar="NAME", help="skip subfolders of this name")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard, train_000000.bin, ... (default {DEFAULT_SHARD_TOKENS:,}; at most {MAX_TOKENS:,})",
    )
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
    if not 0 < args.val_fraction < 1:  # also refuses nan
        raise PrepareError(f"--val-fraction: expected a value in (0, 1), got {args.val_fraction}")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        raise PrepareError(f"--tokenizer: {args.tokenizer} is not a file")
    if not 1 <= args.shard_tokens <= MAX_TOKENS:
        raise PrepareError(
            f"--shard-tokens: expected 1 to {MAX_TOKENS} (an llm.c header's int32 count), got {args.shard_tokens}"
        )


def start_output(out: Path, state: str, want: dict[str, Any]) -> None:
    """Make `out` ours: replace an unfinished prepare of another corpus, drop killed runs' temporaries, and
    write the manifest (incomplete)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        if state == "replace":
            print(f"note: {out} held an unfinished prepare of another corpus; replacing it", file=sys.stderr)
            remove_outputs(out)
        for stale in our_temps(out):
            if stale.name.startswith(f".{MANIFEST}"):
                continue  # rewritten just below
            stale.unlink()
        write_json(out / MANIFEST, {**want, "complete": False})
    except OSError as e:
        raise PrepareError(f"--out: cannot write to {out} ({e.strerror})") from None


def write_outputs(args: argparse.Namespace, tok: Any, corpus: Corpus, split: Split, want: dict, bar: bool) -> dict:
    """Train (unless given a tokenizer), then tokenizer.json, the shards and the complete manifest."""
    out: Path = args.out
    t0 = time.perf_counter()
    if tok is None:
        tok = train_tokenizer(corpus, args.vocab, split, bar, CHUNK_BYTES)
    tmp = temp_name(out / TOKENIZER)
    tok.save(str(tmp))
    os.replace(tmp, out / TOKENIZER)
    splits = encode_corpus(tok, corpus, out, split, bar, shard_tokens=args.shard_tokens)
    seconds = time.perf_counter() - t0
    shards = {name: s.pop("shards") for name, s in splits.items()}
    record = {**want, "complete": True, "splits": splits, "shards": shards, "seconds": round(seconds, 2)}
    if split.tail_doc is not None:
        record["val_is_tail_of_document"] = split.tail_doc
    write_json(out / MANIFEST, record)
    return {"splits": splits, "shards": shards, "seconds": seconds, "vocab": tok.get_vocab_size()}


def prepare(args: argparse.Namespace, bar: bool) -> dict[str, Any]:
    """The whole command after parsing; returns what it did (for the last line).

    Every refusal comes before `out` is touched; a failure or Ctrl-C after that removes what this run
    wrote (and `out` itself if this run made it), so the folder takes any corpus next time."""
    check_args(args)
    suffixes = tuple(args.suffix or DEFAULT_SUFFIXES)
    tok = load_tokenizer(args.tokenizer) if args.tokenizer else None
    corpus = check_inputs(args.inputs, suffixes, tuple(args.exclude), bar)
    split = plan_split(corpus, args.val_fraction)
    want = manifest(corpus, args)
    out: Path = args.out
    state = check_out(out, want)
    if state == "done":
        return {"done_before": True, "corpus": corpus}
    made = not out.exists()
    start_output(out, state, want)
    try:
        done = write_outputs(args, tok, corpus, split, want, bar)
    except BaseException:
        remove_outputs(out)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    return {"done_before": False, "corpus": corpus, "split": split, **done}


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    bar = os.environ.get("HSDP_NO_BAR") != "1"
    try:
        done = prepare(args, bar)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # prepare() has removed what it wrote
        print(f"interrupted; nothing of this run is left in {args.out}", file=sys.stderr)
        return 130
    except OSError as e:  # e.g. the disk filled up, or an input vanished mid-run; prepare() has cleaned up
        print(f"error: {e.filename or args.out}: {e.strerror}", file=sys.stderr)
        return 2
    corpus: Corpus = done["corpus"]
    if corpus.skipped:
        note = f"note: skipped {len(corpus.skipped)} files that are not UTF-8 text, e.g. {corpus.skipped[0]}"
        print(note, file=sys.stderr)
    if done["done_before"]:
        print(f"{args.out}: already prepared from these inputs; nothing to do", file=sys.stderr)
        return 0
    s = done["splits"]
    if done["split"].tail_doc is not None:
        print(
            f"note: {corpus.documents} documents give val no whole one at --val-fraction {args.val_fraction}; "
            "val is the last document's tail",
            file=sys.stderr,
        )
    mb = corpus.nbytes / 1e6
    print(
        f"wrote {args.out}: tokenizer.json ({done['vocab']} ids), train ({s['train']['tokens']:,} tokens, "
        f"{s['train']['documents']} docs, {len(done['shards']['train'])} shards), val ({s['val']['tokens']:,} tokens, "
        f"{s['val']['documents']} docs, {len(done['shards']['val'])} shards) "
        f"from {mb:.1f} MB of text in {done['seconds']:.1f} s ({mb / done['seconds']:.2f} MB/s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
