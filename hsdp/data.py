"""Token streams: the stdlib's own source code, text files, token .bin files, synthetic.

Batching contract (what the equivalence tests rely on): a corpus is cut into
non-overlapping windows of `seq_len` inputs (+1 target). Each micro-step takes
the next `world · batch_size` windows of a seeded per-epoch permutation, and
rank r gets rows [r·B, (r+1)·B) of them. So ranks never share a window, and the
concatenation of all ranks' batches is exactly the batch a single process with
batch size `world · B` gets.
"""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from hsdp.config.schema import Config, ConfigError

SYNTHETIC_TRAIN, SYNTHETIC_VAL = 1 << 20, 1 << 16  # tokens of the synthetic source's splits
SCAN_CHUNK = 1 << 26  # tokens per slice when scanning a .bin for its largest id (128 MiB of uint16)


def stdlib_files() -> list[Path]:
    """The running interpreter's stdlib .py files, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _bytes_of(files: list[Path]) -> np.ndarray:
    chunks = [np.frombuffer(f.read_bytes(), dtype=np.uint8) for f in files]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


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


def load_tokens(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
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
        path = Path(d.path).expanduser()
        data = np.memmap(path, dtype=np.uint16, mode="r")
        val_path = _val_bin(path)
        if val_path is not None:
            return data, np.memmap(val_path, dtype=np.uint16, mode="r")
        cut = int(len(data) * (1 - d.val_fraction))
        return data[:cut], data[cut:]
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
    """Tokens in a uint16 .bin file; ConfigError naming the file if its byte length is odd."""
    size = path.stat().st_size
    if size % 2:
        raise ConfigError(
            f"data.path: {path} has an odd byte length ({size}); a tokens file holds uint16 ids, 2 bytes each"
        )
    return size // 2


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
        path = Path(d.path).expanduser()
        n = token_count(path)
        val_path = _val_bin(path)
        train, val = (n, token_count(val_path)) if val_path is not None else _cut(n, d.val_fraction)
    else:
        train, val = SYNTHETIC_TRAIN, SYNTHETIC_VAL
    return {"train": train, "val": val}


@functools.lru_cache(maxsize=32)
def _max_token(path: str, size: int, mtime_ns: int) -> int:
    """Largest id in a uint16 .bin, over the whole file (cached by path, size and mtime)."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    # Slices bound the mapped pages touched at once; max over a memmap is vectorised.
    return max((int(tokens[i : i + SCAN_CHUNK].max()) for i in range(0, len(tokens), SCAN_CHUNK)), default=0)


def check_token_ids(path: Path, vocab_size: int) -> None:
    """ConfigError (naming the file and the first bad position) if any id in `path` is >= vocab_size."""
    st = path.stat()
    largest = _max_token(str(path.resolve()), st.st_size, st.st_mtime_ns)
    if largest < vocab_size:
        return
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
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
    (model.seq_len + 1 tokens), a tokens file whole uint16 ids all below model.vocab_size."""
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
        path = Path(d.path).expanduser()
        for f in (path, _val_bin(path)):
            if f is not None:
                check_token_ids(f, cfg.model.vocab_size)


def synthetic_tokens(vocab: int, seed: int, n: int) -> np.ndarray:
    """A seeded sparse Markov chain: learnable structure, so loss falls below ln(vocab)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    choice = rng.integers(0, 4, size=n)
    out = np.empty(n, dtype=np.uint16)
    out[0] = 0
    for i in range(1, n):  # 1M steps of numpy scalar work, ~0.5 s
        out[i] = successors[out[i - 1], choice[i]]
    return out


class TokenStream:
    """Deterministic, rank-disjoint batches of windows from one token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"data: {len(tokens)} tokens is fewer than one window of seq_len={seq_len}")
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
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
