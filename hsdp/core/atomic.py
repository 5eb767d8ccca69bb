"""Atomic file writes: a file appears under its name only complete (temp name, fsync, os.replace).

Used by the run folder (replicas.json, checkpoint markers), the compile caches' sidecars and
`prepare`'s outputs; the llm.c shard writer (hsdp/data/shards.py) streams through the same temp name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def temp_name(path: Path) -> Path:
    """The name a file is written under until it is complete (same folder, so os.replace is atomic)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_text(path: Path, text: str) -> None:
    """Write `text` atomically (temp name, fsync, os.replace): readers see the old file or the new one."""
    tmp = temp_name(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON atomically (see write_text)."""
    write_text(path, json.dumps(data, indent=1))


def stale_temps(path: Path) -> list[Path]:
    """Leftovers of writers of `path` that were killed before they could clean up."""
    return sorted(path.parent.glob(f".{path.name}.tmp-*"))


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
