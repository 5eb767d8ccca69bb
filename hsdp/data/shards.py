"""llm.c's token shard format: read it (memmapped) and write it (streamed, never half-written under its name).

    header   256 × int32 (little-endian): [0] magic 20240520, [1] version 1, [2] token count, rest 0
    body     count × uint16 token ids

A file whose first int32 is not the magic is today's headerless uint16 file,
unless its header would otherwise be consistent (the count field matches the
file's size), which is an llm.c shard with a bad magic and is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Optional

import numpy as np

from hsdp.core.atomic import fsync_dir, temp_name

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_TOKENS = (1 << 31) - 1  # the count field is an int32
MAX_VOCAB = 1 << 16  # ids are uint16


class ShardError(ValueError):
    """A token file that cannot be read as tokens; the message is one line naming the file."""


@dataclass(frozen=True)
class ShardInfo:
    """Where the tokens of one file are."""

    path: Path
    offset: int  # bytes before the first token: HEADER_BYTES (llm.c shard) or 0 (headerless)
    count: int  # tokens

    @property
    def headered(self) -> bool:
        return self.offset == HEADER_BYTES


def read_header(path: Path) -> ShardInfo:
    """The layout of a token file (ShardError on a bad magic, version or length)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    ints = np.frombuffer(head[: len(head) // 4 * 4], dtype="<i4")
    if len(ints) >= 3 and int(ints[0]) == MAGIC:
        version, count = int(ints[1]), int(ints[2])
        if version != VERSION:
            raise ShardError(f"{path}: llm.c shard version {version}, expected {VERSION}")
        if count < 0 or size != HEADER_BYTES + 2 * count:
            raise ShardError(
                f"{path}: the header says {count} tokens ({HEADER_BYTES + 2 * count} bytes) but the file has "
                f"{size} bytes (truncated or padded)"
            )
        return ShardInfo(path, HEADER_BYTES, count)
    if len(ints) == HEADER_INTS and int(ints[2]) > 0 and size == HEADER_BYTES + 2 * int(ints[2]):
        raise ShardError(f"{path}: an llm.c shard header with magic {int(ints[0])}, expected {MAGIC}")
    if size % 2:
        raise ShardError(f"{path} has an odd byte length ({size}); a tokens file holds uint16 ids, 2 bytes each")
    return ShardInfo(path, 0, size // 2)


def open_tokens(info: ShardInfo) -> np.ndarray:
    """The file's tokens as a read-only uint16 memmap (nothing is read until it is indexed)."""
    if info.count == 0:  # numpy cannot map an empty range
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(info.path, dtype=np.uint16, mode="r", offset=info.offset, shape=(info.count,))


class ShardWriter:
    """Streams uint16 tokens into an llm.c shard at `path`.

    Tokens go to a temporary name; `commit` writes the count into the header,
    fsyncs and renames, so `path` only ever holds a complete shard. Used as a
    context manager it commits on success and deletes the temporary file on
    any exception (Ctrl-C included).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = temp_name(path)
        self.count = 0
        self._file = open(self.tmp, "wb")
        self._file.write(bytes(HEADER_BYTES))  # the count is known only at the end

    def write(self, tokens: np.ndarray) -> None:
        if tokens.dtype != np.uint16:
            raise TypeError(f"shard tokens must be uint16, got {tokens.dtype}")
        if self.count + len(tokens) > MAX_TOKENS:
            raise ShardError(f"{self.path}: more than {MAX_TOKENS} tokens, the most an llm.c shard header can count")
        self._file.write(tokens.tobytes())
        self.count += len(tokens)

    def commit(self) -> None:
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[:3] = (MAGIC, VERSION, self.count)
        self._file.seek(0)
        self._file.write(header.tobytes())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, kind: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()
