"""A local source's content digest (CRC64NVME, many GB/s per core), taken while the file is copied or
on its own, from the very file that was listed."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from tasks.common.crc import ALGORITHMS
from tasks.sync.listing import Source
from tasks.sync.remote import SyncError, TransientSyncError

NAME = "crc64nvme"
_CRC = ALGORITHMS["CRC64NVME"][1]
BLOCK = 1 << 20


@contextlib.contextmanager
def opened(o: Source) -> Iterator[int]:
    """A descriptor of the local source `o`, refused unless it is still the file that was listed
    (same device, inode, size and times), before and after the block reads it."""
    try:
        fd = os.open(o.uri, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)    # a FIFO put there since would not block
    except FileNotFoundError:
        raise TransientSyncError(f"{o.uri} disappeared since it was listed: run the sync again") from None
    except OSError as e:
        raise SyncError(f"cannot read {o.uri}: {e.strerror}: check its permissions") from None
    try:
        if not o.stat.same(os.fstat(fd), o.size):  # type: ignore[union-attr]
            raise TransientSyncError(f"{o.uri} changed since it was listed: run the sync again")
        yield fd
        if not o.stat.same(os.fstat(fd), o.size):  # type: ignore[union-attr]
            raise TransientSyncError(f"{o.uri} changed while it was read: run the sync again")
    finally:
        os.close(fd)


def digest(fd: int, size: int, copy_to: int | None = None) -> str:
    """The content digest of the file open at `fd` (`size` bytes expected; read from its start to its
    end), writing the same bytes to `copy_to` on the way when given."""
    crc, buf, offset = 0, bytearray(min(BLOCK, max(size, 1))), 0
    view = memoryview(buf)
    while n := os.preadv(fd, [view], offset):
        crc = _CRC(view[:n], crc)
        if copy_to is not None:
            written = 0
            while written < n:
                written += os.write(copy_to, view[written:n])
        offset += n
    return f"{NAME}:{crc:016x}"
