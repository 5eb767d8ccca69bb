"""Checkpoint integrity: a checksum per file, written with the checkpoint and verified before use.

DCP checks that its files exist and are long enough, not that their bytes are the ones it
wrote: a same-size corruption (a bad disk block, a partial copy) would load silently and
train on garbage. Each checkpoint therefore carries `checksums.json`, the SHA-256 of every
other file in its folder; each rank hashes the data files it wrote (in parallel), rank 0 the
metadata, and the file is written before the `.complete` marker. A resume (`run.resume`) and
`python -m hsdp.export` re-hash every file first and refuse a mismatch with one line naming
the file. What is saved must also be finite (`all_finite`): a diverged state is never
checkpointed, so pruning never replaces a good checkpoint with a bad one.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

CHECKSUMS = "checksums.json"
UNHASHED = {CHECKSUMS, ".complete", ".complete.tmp"}
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(folder: Path, names: list[str]) -> dict[str, str]:
    return {name: file_sha256(folder / name) for name in names}


def rank_data_files(folder: Path, rank: int) -> list[str]:
    """The DCP data files rank `rank` wrote (FileSystemWriter names them __<rank>_<i>.distcp)."""
    return sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))


def write_checksums(folder: Path, digests: dict[str, str]) -> Path:
    """checksums.json for `folder`: `digests` plus every other file not yet in it (hashed here)."""
    rest = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in UNHASHED and p.name not in digests)
    all_digests = {**digests, **hash_files(folder, rest)}
    path = folder / CHECKSUMS
    path.write_text(json.dumps(dict(sorted(all_digests.items())), indent=1) + "\n")
    return path


class ChecksumError(ValueError):
    """A checkpoint file does not match its recorded checksum (or is missing)."""


def verify_checksums(folder: Path) -> int:
    """Re-hash every file `checksums.json` lists; ChecksumError naming the first mismatch. Returns the count.

    Raises FileNotFoundError if the checkpoint has no checksums.json (the caller decides what that means).
    """
    recorded = json.loads((folder / CHECKSUMS).read_text())
    if not isinstance(recorded, dict):
        raise ChecksumError(f"{folder / CHECKSUMS} is not a file → checksum map")
    for name, expected in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            raise ChecksumError(f"{path} is missing")
        if file_sha256(path) != expected:
            raise ChecksumError(f"{path} does not match its checksum (the file is corrupt)")
    return len(recorded)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict; a DTensor's local shard."""
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return [local]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def first_non_finite(state: dict[str, Any]) -> str | None:
    """The key of the first floating-point tensor in `state` holding a NaN or inf, else None."""
    for key, value in state.items():
        for t in tensors_of(value):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return key
    return None


def finite_or_none(value: Any) -> Any:
    """JSON-safe: a non-finite float becomes None (`null`), recursively; JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    return value
