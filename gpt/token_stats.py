"""What the writer of a ``.bin/.idx`` pair saw of it (documents, tokens, the largest token id, its
content fingerprint), kept beside the pair as ``<prefix>.stats.json``: whoever reads a pair written
here learns them without reading its ``.bin`` (2 TB at 1T tokens). The record holds only while both
files are the ones it was written for (their device, inode, size, and modification and change times:
the change time moves with any write, rename or copy that keeps the other times, and no tool sets
it): a pair rewritten by another tool, or given as it is, has no record and is read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpt.files import write_json

SUFFIX = ".stats.json"
log = logging.getLogger(__name__)


def fingerprint(prefix: str, blocks: int = 64, block_bytes: int = 1 << 16) -> list:
    """Identity of a pair by content, not by file times (tokenizing the same text again gives the
    same identity): the sizes, the whole ``.idx`` (small: 12 bytes a document) and ``blocks`` blocks
    spread evenly over the ``.bin`` (hashing gigabytes would dominate)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    content = hashlib.sha256(np.fromfile(idx_path, dtype=np.uint8).data)
    size = os.path.getsize(bin_path)
    with open(bin_path, "rb") as f:
        for i in range(blocks if size else 0):
            f.seek(size * i // blocks)
            content.update(f.read(block_bytes))
    return [os.path.getsize(idx_path), size, content.hexdigest()]


def record(prefix: str, *, documents: int, tokens: int, max_token_id: int) -> None:
    """What the writer saw of the pair it has just written (its blocks are cached). Only a help to its
    readers: where it cannot be written, they read the pair."""
    try:
        write_json(prefix + SUFFIX, {"documents": documents, "tokens": tokens, "max_token_id": max_token_id,
                                     "fingerprint": fingerprint(prefix), "files": _identity(prefix)})
    except OSError as e:
        log.warning("%s%s not written (%s): the pair's readers will read its .bin", prefix, SUFFIX, e.strerror or e)


def recorded(prefix: str) -> dict[str, Any] | None:
    """The writer's record of the pair, while the pair is the one it was written for."""
    try:
        stats = json.loads(Path(prefix + SUFFIX).read_text())
        whole = isinstance(stats["max_token_id"], int) and len(stats["fingerprint"]) == 3
        return stats if whole and stats["files"] == _identity(prefix) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _identity(prefix: str) -> list[list[int]]:
    return [[s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns]
            for s in (os.stat(prefix + ".bin"), os.stat(prefix + ".idx"))]
