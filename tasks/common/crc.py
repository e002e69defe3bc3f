"""S3's additional checksums (CRC64NVME, CRC32C, CRC32) of local files, to verify downloads.

An object store that keeps such a checksum returns it on HEAD with ``ChecksumMode=ENABLED``:
base64 of the big-endian CRC for a whole-object checksum, and ``<base64>-<parts>`` for a
composite one (the CRC of the parts' CRCs, as multipart uploads with CRC32/CRC32C store it).
CRC64NVME and CRC32C run at many GB/s per core (awscrt, with the CPU's carry-less multiply), so
checking a large file with them costs a fraction of hashing it with MD5.
"""
from __future__ import annotations

import base64
import os
import zlib
from dataclasses import dataclass
from typing import Callable

from awscrt import checksums

# S3 header suffix -> (name in the manifest, CRC function(data, previous), width in bytes)
ALGORITHMS: dict[str, tuple[str, Callable[[bytes, int], int], int]] = {
    "CRC64NVME": ("crc64nvme", lambda data, prev: checksums.crc64nvme(data, prev), 8),
    "CRC32C": ("crc32c", lambda data, prev: checksums.crc32c(data, prev), 4),
    "CRC32": ("crc32", zlib.crc32, 4),
}
# The fastest first: a store may keep more than one.
PREFERENCE = ("CRC64NVME", "CRC32C", "CRC32")
BLOCK = 8 << 20


@dataclass(frozen=True)
class ServerChecksum:
    """One checksum the store keeps for an object: ``algorithm`` is a key of ALGORITHMS."""
    algorithm: str
    value: str          # as the store gives it: base64, with ``-<parts>`` when composite

    @property
    def name(self) -> str:
        return ALGORITHMS[self.algorithm][0]

    @property
    def parts(self) -> int | None:
        """The part count of a composite checksum, None for a whole-object one."""
        _, dash, count = self.value.partition("-")
        return int(count) if dash else None


def from_head(response: dict) -> ServerChecksum | None:
    """The fastest checksum in a HEAD (or GET) response, if the store keeps any."""
    for algorithm in PREFERENCE:
        value = response.get(f"Checksum{algorithm}")
        if value:
            return ServerChecksum(algorithm, value)
    return None


def _crc(fd: int, offset: int, length: int, algorithm: str) -> int | None:
    """The CRC of ``length`` bytes at ``offset``; None if the file ends before them."""
    _, fn, _ = ALGORITHMS[algorithm]
    crc, buf = 0, bytearray(min(BLOCK, max(length, 1)))
    view = memoryview(buf)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[:min(BLOCK, length - done)]], offset + done)
        if n == 0:
            return None
        crc = fn(view[:n], crc)
        done += n
    return crc


def _encode(crc: int, algorithm: str) -> str:
    return base64.b64encode(crc.to_bytes(ALGORITHMS[algorithm][2], "big")).decode()


def matches(path: str | os.PathLike, expected: ServerChecksum, part_sizes: list[int] | None = None) -> bool:
    """Whether the file at ``path`` has the checksum ``expected``. A composite checksum needs the
    sizes of the parts the object was uploaded in."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if expected.parts is None:
            crc = _crc(fd, 0, os.fstat(fd).st_size, expected.algorithm)
            return crc is not None and _encode(crc, expected.algorithm) == expected.value
        if part_sizes is None or len(part_sizes) != expected.parts:
            return False
        width = ALGORITHMS[expected.algorithm][2]
        joined, offset = b"", 0
        for size in part_sizes:
            crc = _crc(fd, offset, size, expected.algorithm)
            if crc is None:
                return False
            joined += crc.to_bytes(width, "big")
            offset += size
        if offset != os.fstat(fd).st_size:
            return False
        _, fn, _ = ALGORITHMS[expected.algorithm]
        return f"{_encode(fn(joined, 0), expected.algorithm)}-{expected.parts}" == expected.value
    finally:
        os.close(fd)
