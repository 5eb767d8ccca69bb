"""Token streams: the stdlib's own source code, text files, token .bin files (llm.c shards too), synthetic.

Batching contract (what the equivalence tests rely on): a corpus is cut into
non-overlapping windows of `seq_len` inputs (+1 target). Each micro-step takes
the next `world · batch_size` windows of a seeded per-epoch permutation, and
rank r gets rows [r·B, (r+1)·B) of them. So ranks never share a window, and the
concatenation of all ranks' batches is exactly the batch a single process with
batch size `world · B` gets.
"""

from __future__ import annotations

import bisect
import functools
import glob
import json
import os
import sysconfig
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from hsdp.config.schema import Config, ConfigError
from hsdp.data.shards import ShardError, ShardInfo, open_tokens, read_header

SYNTHETIC_TRAIN, SYNTHETIC_VAL = 1 << 20, 1 << 16  # tokens of the synthetic source's splits
SCAN_CHUNK = 1 << 26  # tokens per slice when scanning a .bin for its largest id (128 MiB of uint16)
TOKENIZER = "tokenizer.json"  # beside a tokens file: the tokenizer that wrote it (hsdp.prepare)
GLOB_CHARS = "*?["
SHARDS = "{split}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"  # hsdp.prepare's numbered shards of one split


def stdlib_files() -> list[Path]:
    """The running interpreter's stdlib .py files (none under site-packages), sorted by their path in it.

    os.walk over strings, not Path.rglob: ~10x faster, and every worker of a stdlib run lists them."""
    root = sysconfig.get_paths()["stdlib"]
    names = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d != "site-packages"]
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        names += [f if rel == "." else f"{rel}/{f}" for f in files if f.endswith(".py")]
    return [Path(root, name) for name in sorted(names)]


def _bytes_of(files: list[Path]) -> np.ndarray:
    data = bytearray()
    for f in files:
        data += f.read_bytes()
    return np.frombuffer(data, dtype=np.uint8)


def _split_files(files: list[Path], val_fraction: float) -> tuple[list[Path], list[Path]]:
    """A fixed split by file: every k-th file (k = round(1/val_fraction)) is validation."""
    k = max(2, round(1 / val_fraction))
    return [f for i, f in enumerate(files) if i % k], [f for i, f in enumerate(files) if i % k == 0]


def _text_files(pattern: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)) if Path(p).is_file())


def _val_bin(path: Path) -> Path | None:
    """`val.bin` beside a tokens file, if there is one (and it is not the file itself)."""
    val_path = path.with_name("val.bin")
    return val_path if val_path.is_file() and val_path != path else None


def token_files(pattern: str) -> tuple[list[Path], list[Path]]:
    """(train, val) token files of `data.path`: one file, a glob of shards (sorted), or a folder hsdp.prepare wrote.

    A folder: its `train_*.bin` shards and `val_*.bin` (or, prepared before shards, `train.bin` and `val.bin`).
    Val of a file or glob: `val.bin` beside the (first) file; for a glob whose file name says `train`, the same
    glob with `val` in its place (llm.c's `fineweb_train_*.bin` → `fineweb_val_*.bin`); else none (the tail of
    train is held out). ConfigError if nothing matches.
    """
    path = Path(pattern).expanduser()
    if path.is_dir():
        return prepared_files(path)
    is_glob = not path.is_file() and any(c in pattern for c in GLOB_CHARS)
    train = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file()) if is_glob else [path]
    if not train or not train[0].is_file():
        shards = sorted(path.parent.glob(SHARDS.format(split="train"))) if path.parent.is_dir() else []
        hint = (
            f"; {path.parent} holds hsdp.prepare's shards ({shards[0].name}, ...): set data.path to the folder"
            if shards
            else ""
        )
        raise ConfigError(
            f"data.path: expected an existing .bin token file, a glob of shards or a prepared folder, got "
            f"{pattern!r}{hint}"
        )
    val: list[Path] = []
    if is_glob and "train" in path.name:
        head, _, tail = path.name.rpartition("train")
        val = sorted(Path(p) for p in glob.glob(str(path.with_name(f"{head}val{tail}"))) if Path(p).is_file())
    if not val:
        beside = _val_bin(train[0])
        val = [beside] if beside is not None and beside not in train else []
    return train, val


def prepared_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(train, val) of a folder hsdp.prepare wrote: numbered shards, or the single train.bin / val.bin of old."""
    train = sorted(folder.glob(SHARDS.format(split="train")))
    if train:
        return train, sorted(folder.glob(SHARDS.format(split="val")))
    if (folder / "train.bin").is_file():
        return [folder / "train.bin"], [folder / "val.bin"] if (folder / "val.bin").is_file() else []
    raise ConfigError(f"data.path: the folder {folder} holds no train_*.bin shards or train.bin (hsdp.prepare's)")


def shard_info(path: Path) -> ShardInfo:
    """The layout of one token file (headered llm.c shard or headerless); ConfigError naming it if bad."""
    try:
        return read_header(path)
    except ShardError as e:
        raise ConfigError(f"data.path: {e}") from None
    except OSError as e:
        raise ConfigError(f"data.path: cannot read {path} ({e.strerror})") from None


class TokenParts:
    """Several token arrays (shards) read as one: `len()` and `[a:b]` slices across their boundaries."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("TokenParts supports contiguous slices only")
        pieces = []
        i = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            lo, hi = start - self.starts[i], min(stop, self.starts[i + 1]) - self.starts[i]
            pieces.append(self.parts[i][lo:hi])
            start, i = self.starts[i + 1], i + 1
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)

    def cut(self, n: int) -> tuple[TokenParts, TokenParts]:
        """The first n tokens and the rest, as lazy views (memmap slices read nothing)."""
        head, tail = [], []
        for part, start in zip(self.parts, self.starts):
            k = min(max(n - start, 0), len(part))
            head.append(part[:k])
            tail.append(part[k:])
        return TokenParts(head), TokenParts(tail)


Tokens = Union[np.ndarray, TokenParts]  # one split's tokens: an array, or shards read as one


def _open_parts(files: list[Path]) -> Tokens:
    """One memmap for one file (as before shards), else the files read as one."""
    arrays = [open_tokens(shard_info(f)) for f in files]
    return arrays[0] if len(arrays) == 1 else TokenParts(arrays)


def tokenizer_path(cfg: Config) -> Optional[Path]:
    """`tokenizer.json` beside the tokens data (as hsdp.prepare writes it), if there is one."""
    if cfg.data.source != "tokens" or not cfg.data.path:
        return None
    path = Path(cfg.data.path).expanduser()
    candidate = (path if path.is_dir() else path.parent) / TOKENIZER
    return candidate if candidate.is_file() else None


def tokenizer_vocab_size(path: Path) -> int:
    """Ids a tokenizer.json can produce (its model's vocab and its added tokens), without loading it."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        ids = [int(i) for i in spec["model"]["vocab"].values()] + [int(t["id"]) for t in spec.get("added_tokens", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"model.vocab_size: cannot read the vocabulary of {path} ({e})") from None
    return max(ids) + 1


def resolve_vocab_size(cfg: Config) -> None:
    """model.vocab_size null → the size of tokenizer.json beside data.path (in place; ConfigError without one).

    An explicit size must hold every id the tokenizer can produce."""
    tok = tokenizer_path(cfg)
    if cfg.model.vocab_size is None:
        if tok is None:
            raise ConfigError(
                f"model.vocab_size: null takes the size of a {TOKENIZER} beside data.path, and there is none "
                f"beside {cfg.data.path!r}; set model.vocab_size"
            )
        cfg.model.vocab_size = tokenizer_vocab_size(tok)
    elif tok is not None and tokenizer_vocab_size(tok) > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than {tok}'s {tokenizer_vocab_size(tok)} ids; "
            "set it to at least that, or null"
        )


def load_tokens(cfg: Config) -> tuple[Tokens, Tokens]:
    """(train, val) token arrays for `cfg.data.source`."""
    d = cfg.data
    if d.source == "stdlib":
        train, val = _split_files(stdlib_files(), d.val_fraction)
        return _bytes_of(train), _bytes_of(val)
    if d.source == "text":
        files = _text_files(d.path)
        if len(files) == 1:  # one file: hold out its tail
            data = _bytes_of(files)
            cut = int(len(data) * (1 - d.val_fraction))
            return data[:cut], data[cut:]
        train, val = _split_files(files, d.val_fraction)
        return _bytes_of(train), _bytes_of(val)
    if d.source == "tokens":
        train_files, val_files = token_files(d.path)
        parts = _open_parts(train_files)
        if val_files:
            return parts, _open_parts(val_files)
        cut = int(len(parts) * (1 - d.val_fraction))
        return parts.cut(cut) if isinstance(parts, TokenParts) else (parts[:cut], parts[cut:])
    return synthetic_tokens(cfg.model.vocab_size, cfg.run.seed, SYNTHETIC_TRAIN), synthetic_tokens(
        cfg.model.vocab_size, cfg.run.seed + 1, SYNTHETIC_VAL
    )


# ------------------------------------------------------------------ checks before any worker starts
def _cut(n: int, val_fraction: float) -> tuple[int, int]:
    """(train, val) lengths of one array whose tail is held out (as `load_tokens` cuts it)."""
    cut = int(n * (1 - val_fraction))
    return cut, n - cut


@functools.lru_cache(maxsize=8)
def _stdlib_split_lengths(val_fraction: float) -> tuple[int, int]:
    train, val = _split_files(stdlib_files(), val_fraction)
    return sum(f.stat().st_size for f in train), sum(f.stat().st_size for f in val)


def token_count(path: Path) -> int:
    """Tokens in a .bin file (headered or not); ConfigError naming the file if its layout is bad."""
    return shard_info(path).count


def split_lengths(cfg: Config) -> dict[str, int]:
    """Tokens in the train and val splits of `cfg.data`, from file sizes (nothing is read)."""
    d = cfg.data
    if d.source == "stdlib":
        train, val = _stdlib_split_lengths(d.val_fraction)
    elif d.source == "text":
        files = _text_files(d.path)
        if len(files) == 1:
            train, val = _cut(files[0].stat().st_size, d.val_fraction)
        else:
            train_files, val_files = _split_files(files, d.val_fraction)
            train, val = (sum(f.stat().st_size for f in fs) for fs in (train_files, val_files))
    elif d.source == "tokens":
        train_files, val_files = token_files(d.path)
        n = sum(token_count(f) for f in train_files)
        train, val = (n, sum(token_count(f) for f in val_files)) if val_files else _cut(n, d.val_fraction)
    else:
        train, val = SYNTHETIC_TRAIN, SYNTHETIC_VAL
    return {"train": train, "val": val}


@functools.lru_cache(maxsize=32)
def _max_token(path: str, offset: int, size: int, mtime_ns: int) -> int:
    """Largest id in a token file past its header, over the whole file (cached by path, size and mtime)."""
    tokens = open_tokens(ShardInfo(Path(path), offset, (size - offset) // 2))
    # Slices bound the mapped pages touched at once; max over a memmap is vectorised.
    return max((int(tokens[i : i + SCAN_CHUNK].max()) for i in range(0, len(tokens), SCAN_CHUNK)), default=0)


def check_token_ids(path: Path, vocab_size: int) -> None:
    """ConfigError (naming the file and the first bad position) if any id in `path` is >= vocab_size."""
    info = shard_info(path)
    st = path.stat()
    largest = _max_token(str(path.resolve()), info.offset, st.st_size, st.st_mtime_ns)
    if largest < vocab_size:
        return
    tokens = open_tokens(info)
    for i in range(0, len(tokens), SCAN_CHUNK):
        bad = np.flatnonzero(tokens[i : i + SCAN_CHUNK] >= vocab_size)
        if len(bad):
            at = i + int(bad[0])
            raise ConfigError(
                f"data.path: {path} holds token id {int(tokens[at])} at position {at} (largest "
                f"{largest}), >= model.vocab_size={vocab_size}"
            )


def check_data(cfg: Config) -> None:
    """Data problems that would otherwise fail inside every worker: each split must hold one window
    (model.seq_len + 1 tokens), a tokens file a good header (if any) and ids all below model.vocab_size."""
    d = cfg.data
    window = cfg.model.seq_len + 1
    for split, n in split_lengths(cfg).items():
        if n < window:
            where = (
                f"data.path: the {split} split of {d.path}"
                if d.source in ("text", "tokens")
                else f"model.seq_len: the {split} split of data.source={d.source}"
            )
            raise ConfigError(
                f"{where} has {n} tokens, fewer than one window (model.seq_len + 1 = {window}); "
                "use more data, a smaller model.seq_len or another data.val_fraction"
            )
    if d.source == "tokens":
        train_files, val_files = token_files(d.path)
        vocab_size = cfg.model.vocab_size
        assert vocab_size is not None  # resolve_vocab_size ran first (hsdp.run.preflight)
        for f in train_files + val_files:
            check_token_ids(f, vocab_size)


@functools.lru_cache(maxsize=4)
def synthetic_tokens(vocab: int, seed: int, n: int) -> np.ndarray:
    """A seeded sparse Markov chain: learnable structure, so loss falls below ln(vocab).

    Kept per process (read-only): a process that builds several Data, or forks ranks after building one
    (tests/train_server.py warms it before its zygote forks), computes each chain once.
    """
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    choice = rng.integers(0, 4, size=n)
    # A chain is sequential, so this is a Python loop; over plain ints it is ~4x faster than over numpy
    # scalars (0.1 s instead of 0.45 s for 1M tokens, paid by every worker of every synthetic run).
    flat = successors.ravel().tolist()  # successor c of token x at 4x + c
    out = [0] * n
    x = 0
    for i, c in enumerate(choice[1:].tolist(), 1):
        x = flat[4 * x + c]
        out[i] = x
    tokens = np.array(out, dtype=np.uint16)
    tokens.flags.writeable = False  # shared by every caller
    return tokens


class TokenStream:
    """Deterministic, rank-disjoint batches of windows from one token array."""

    def __init__(self, tokens: Tokens, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"data: {len(tokens)} tokens is fewer than one window of seq_len={seq_len}")
        self._epoch = -1
        self._perm: Optional[np.ndarray] = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        assert self._perm is not None  # set for the first epoch asked
        return self._perm

    def windows(self, start: int, count: int) -> np.ndarray:
        """Window indices number start … start+count−1 of the endless epoch sequence."""
        out = np.empty(count, dtype=np.int64)
        for j in range(count):
            epoch, pos = divmod(start + j, self.n_windows)
            out[j] = self._permutation(epoch)[pos]
        return out

    def batch(self, index: int, rank: int, world: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `index`-th global batch (world·batch_size windows), rank's rows only."""
        global_rows = world * batch_size
        ids = self.windows(index * global_rows + rank * batch_size, batch_size)
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * T : i * T + T + 1], dtype=np.int64) for i in ids])
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        return x, y


class Data:
    """Train and val streams for one rank."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        # Sizes and token ids were checked by config validation (check_data), once, before the workers.
        train, val = load_tokens(cfg)
        self.train = TokenStream(train, cfg.model.seq_len, cfg.run.seed)
        self.val = TokenStream(val, cfg.model.seq_len, cfg.run.seed + 1)
        self.rank, self.world = rank, world
        self.batch_size = cfg.data.batch_size
        self.grad_accum = cfg.optim.grad_accum

    def train_batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.train.batch(step * self.grad_accum + micro, self.rank, self.world, self.batch_size)

    def val_batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed validation batches: the same i gives the same windows at every eval."""
        return self.val.batch(i, self.rank, self.world, self.batch_size)
