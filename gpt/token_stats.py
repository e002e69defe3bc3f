"""What the writer of a ``.bin/.idx`` pair saw of it (documents, tokens, the largest token id, its
content fingerprint), kept beside the pair as ``<prefix>.stats.json``: whoever reads a pair written
here learns them without reading its ``.bin`` (2 TB at 1T tokens). The record holds only while both
files are the ones it was written for (their size, inode and modification time): a pair rewritten
by another tool, or given as it is, has no record and is read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpt.files import write_json

SUFFIX = ".stats.json"


def fingerprint(prefix: str, blocks: int = 64, block_bytes: int = 1 << 16) -> list:
    """Identity of a pair by content, not by file times (tokenizing the same text again gives the
    same identity): the sizes, the whole ``.idx`` (small: 12 bytes a document) and ``blocks`` blocks
    spread evenly over the ``.bin`` (hashing gigabytes would dominate)."""
    return _fingerprint(prefix + ".bin", prefix + ".idx", blocks, block_bytes)


def record(prefix: str, bin_path: str, idx_path: str, *, documents: int, tokens: int, max_token_id: int) -> None:
    """What the writer saw of the pair it wrote as ``bin_path`` and ``idx_path`` (just written: their
    blocks are cached), before it renames them to the prefix's names."""
    write_json(prefix + SUFFIX, {"documents": documents, "tokens": tokens, "max_token_id": max_token_id,
                                 "fingerprint": _fingerprint(bin_path, idx_path), "files": _identity(bin_path, idx_path)})


def recorded(prefix: str) -> dict[str, Any] | None:
    """The writer's record of the pair, while the pair is the one it was written for."""
    try:
        stats = json.loads(Path(prefix + SUFFIX).read_text())
        return stats if stats["files"] == _identity(prefix + ".bin", prefix + ".idx") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fingerprint(bin_path: str, idx_path: str, blocks: int = 64, block_bytes: int = 1 << 16) -> list:
    content = hashlib.sha256(np.fromfile(idx_path, dtype=np.uint8).data)
    size = os.path.getsize(bin_path)
    with open(bin_path, "rb") as f:
        for i in range(blocks if size else 0):
            f.seek(size * i // blocks)
            content.update(f.read(block_bytes))
    return [os.path.getsize(idx_path), size, content.hexdigest()]


def _identity(bin_path: str, idx_path: str) -> list[list[int]]:
    return [[s.st_size, s.st_ino, s.st_mtime_ns] for s in (os.stat(bin_path), os.stat(idx_path))]
