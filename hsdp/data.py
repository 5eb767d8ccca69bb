"""Token streams: the stdlib's own source code, text files, token .bin files, synthetic.

Batching contract (what the equivalence tests rely on): a corpus is cut into
non-overlapping windows of `seq_len` inputs (+1 target). Each micro-step takes
the next `world · batch_size` windows of a seeded per-epoch permutation, and
rank r gets rows [r·B, (r+1)·B) of them. So ranks never share a window, and the
concatenation of all ranks' batches is exactly the batch a single process with
batch size `world · B` gets.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from hsdp.config import Config


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


def load_tokens(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) token arrays for `cfg.data.source`."""
    d = cfg.data
    if d.source == "stdlib":
        train, val = _split_files(stdlib_files(), d.val_fraction)
        return _bytes_of(train), _bytes_of(val)
    if d.source == "text":
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(d.path)) if Path(p).is_file())
        if len(files) == 1:  # one file: hold out its tail
            data = _bytes_of(files)
            cut = int(len(data) * (1 - d.val_fraction))
            return data[:cut], data[cut:]
        train, val = _split_files(files, d.val_fraction)
        return _bytes_of(train), _bytes_of(val)
    if d.source == "tokens":
        path = Path(d.path).expanduser()
        data = np.memmap(path, dtype=np.uint16, mode="r")
        val_path = path.with_name("val.bin")
        if val_path.is_file() and val_path != path:
            return data, np.memmap(val_path, dtype=np.uint16, mode="r")
        cut = int(len(data) * (1 - d.val_fraction))
        return data[:cut], data[cut:]
    return synthetic_tokens(cfg.model.vocab_size, cfg.run.seed, 1 << 20), synthetic_tokens(
        cfg.model.vocab_size, cfg.run.seed + 1, 1 << 16)


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
        rows = np.stack([np.asarray(self.tokens[i * T: i * T + T + 1], dtype=np.int64) for i in ids])
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        return x, y


class Data:
    """Train and val streams for one rank."""

    def __init__(self, cfg: Config, rank: int, world: int) -> None:
        train, val = load_tokens(cfg)
        for split, tokens in (("train", train), ("val", val)):
            head = np.asarray(tokens[: 1 << 20])  # a full scan of a large .bin would be slow
            if len(head) and int(head.max()) >= cfg.model.vocab_size:
                raise ValueError(f"data: {split} token id {int(head.max())} >= model.vocab_size={cfg.model.vocab_size}")
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
