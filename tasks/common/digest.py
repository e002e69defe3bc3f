"""Naming things by what they were made from: one SHA-256 over values (as canonical JSON), bytes and
files, in the order they are added. Cache keys, folder names and content identities all use it."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

_FILE_CHUNK = 1 << 24


class Digest:
    """An incremental digest: ``Digest(a, b).add_file(path).hex(16)``."""

    def __init__(self, *values: Any) -> None:
        self._hash = hashlib.sha256()
        if values:
            self.add(*values)

    def add(self, *values: Any) -> Digest:
        """Values by their JSON form (keys sorted; what JSON cannot hold by ``str``)."""
        self._hash.update(json.dumps(values, sort_keys=True, default=str).encode())
        self._hash.update(b"\0")
        return self

    def add_bytes(self, data: bytes | memoryview) -> Digest:
        self._hash.update(data)
        return self

    def add_file(self, path: str | os.PathLike) -> Digest:
        """The whole content of a file."""
        with open(path, "rb") as f:
            while chunk := f.read(_FILE_CHUNK):
                self._hash.update(chunk)
        self._hash.update(b"\0")
        return self

    def hex(self, length: int | None = None) -> str:
        return self._hash.hexdigest()[:length]


def digest(*values: Any, length: int = 16) -> str:
    """A short, stable name for some values."""
    return Digest(*values).hex(length)


def file_digest(path: str | os.PathLike) -> str:
    """The digest of a file's content."""
    return Digest().add_file(path).hex()
