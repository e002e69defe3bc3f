"""Checking a local copy against its object: the store's CRC for large objects, else the MD5 or
multipart ETag, hashed many ranges at once in SIMD lanes (HASHER over native.md5_ranges)."""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import itertools
import os
import queue
import re
import threading
import time
from typing import Any, Callable, Literal

import botocore.exceptions as bexc

from native.md5 import md5_lanes, md5_ranges
from tasks.common import crc
from tasks.common.priority import lower_priority
from tasks.common.uri import is_s3
from tasks.sync.listing import Source
from tasks.sync.remote import split_s3

MIB = 1 << 20


# Part sizes (MiB) that common uploaders use; tried when the server will not say.
COMMON_PART_SIZES_MIB = (5, 8, 15, 16, 50, 64, 100, 128, 256, 512, 1024)


# Objects this large are verified with the store's CRC where it keeps one: the HEAD that asks for
# it costs less than MD5-hashing the object. Smaller ones use the ETag the listing already has.
CRC_MIN_BYTES = 64 * MIB


Check = Literal["crc64nvme", "crc32c", "crc32", "md5", "multipart-etag", "size"]


class Hasher:
    """MD5 of byte ranges of open files, for every caller in the process, on one thread per core.

    Requests are hashed together in one native call, which hashes many ranges side by side in
    SIMD lanes (`native.md5_ranges`): many small files, or the parts of a large one, verify
    several times faster than one after another. A thread that finds fewer ranges queued than
    fill the lanes gathers more while they keep coming (a pause of GAP_S ends it) for up to
    GATHER_S, and hands the longest ranges out first, so that the lanes stay busy. A range the
    file ends before gets None. The threads run at nice NICE or lower priority (that of the
    thread that started them, when lower): where the cores are busy, the transfers whose files
    they verify go first and the hashing takes the cycles they leave, so that a download is not
    held up by the checks of what it already fetched. Files checked before any transfer starts
    (a sync that finds copies already there) are hashed at that priority too.
    """

    BATCH = 128         # ranges per native call at most
    GAP_S = 0.02
    GATHER_S = 0.1
    NICE = 10

    def __init__(self) -> None:
        self._lock, self._collect = threading.Lock(), threading.Lock()
        self._pid = -1

    def submit(self, ranges: list[tuple], then: Callable[[list[bytes | None]], Any] | None = None) -> cf.Future:
        """Future of the digests of `ranges`, as `native.md5_ranges` takes them: (fd, offset, length),
        or (fd, offset, length, state, prior, final) for a piece of a message; with `then`, of
        `then(digests)`, run in the hashing thread before the future is done. Keep the files open
        until it is done."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._pid != os.getpid():            # first use, or in a forked child
                self._pid, self._queue = os.getpid(), queue.SimpleQueue()
                for _ in range(len(os.sched_getaffinity(0))):
                    threading.Thread(target=self._work, args=(self._queue,), daemon=True, name="md5").start()
            self._queue.put((ranges, then, fut))
        return fut

    def digests(self, path: str | os.PathLike, ranges: list[tuple[int, int]]) -> list[bytes | None]:
        fd = os.open(path, os.O_RDONLY)
        try:
            return self.submit([(fd, *r) for r in ranges]).result()
        finally:
            os.close(fd)

    def _work(self, q: queue.SimpleQueue) -> None:
        lower_priority(self.NICE)
        lanes = md5_lanes()
        while True:
            with self._collect:                     # one thread collects a batch at a time
                batch = [q.get()]
                count, deadline = len(batch[0][0]), time.monotonic() + self.GATHER_S
                while count < self.BATCH:
                    wait = min(self.GAP_S, deadline - time.monotonic()) if count < lanes else 0
                    try:
                        batch.append(q.get(timeout=wait) if wait > 0 else q.get_nowait())
                    except queue.Empty:
                        break
                    count += len(batch[-1][0])
            ranges = [r for rs, _, _ in batch for r in rs]
            order = sorted(range(len(ranges)), key=lambda k: -ranges[k][2])
            try:
                digests: list[bytes | None] = [None] * len(ranges)
                for k, digest in zip(order, md5_ranges([ranges[k] for k in order])):
                    digests[k] = digest
            except BaseException as e:  # noqa: BLE001 - handed to the callers
                for _, _, fut in batch:
                    fut.set_exception(e)
                continue
            for rs, then, fut in batch:
                mine, digests = digests[:len(rs)], digests[len(rs):]
                _complete(fut, then or _unchanged, mine)


HASHER = Hasher()


def _unchanged(value: Any) -> Any:
    return value


def _complete(fut: cf.Future, fn: Callable[[Any], Any], arg: Any) -> None:
    """Complete `fut` with `fn(arg)`, or with what it raises."""
    try:
        result = fn(arg)
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `fut`
        fut.set_exception(e)
    else:
        fut.set_result(result)


def md5_check(path: str | os.PathLike, size: int, etag: str,
              then: Callable[[Check | None], Any] = _unchanged) -> cf.Future:
    """Future of `then("md5")` when the file has `size` bytes and MD5 `etag`, else of `then(None)`.
    The hashing is batched with other callers' by HASHER and `then` runs in a hashing thread (at
    once in the caller's when the file is missing or has another size): nothing waits meanwhile."""
    fd = _open_sized(path, size)
    if fd is None:
        done: cf.Future = cf.Future()
        _complete(done, then, None)
        return done
    try:
        hashed = HASHER.submit([(fd, 0, size)], then=lambda digests: then(
            "md5" if digests[0] is not None and digests[0].hex() == etag else None))
    except BaseException:
        os.close(fd)
        raise
    hashed.add_done_callback(lambda _: os.close(fd))
    return hashed


def _open_sized(path: str | os.PathLike, size: int) -> int | None:
    """The file opened for reading when it is there with `size` bytes, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size == size:
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def multipart_etag(path: str | os.PathLike, parts: int | list[int]) -> str:
    """The ETag S3 gives an object uploaded in parts: md5(part md5s)-count.

    `parts` is the part size in bytes (all parts equal but the last) or the list of part sizes.
    """
    sizes = uniform_parts(os.path.getsize(path), parts) if isinstance(parts, int) else parts
    digests = HASHER.digests(path, part_ranges(sizes))
    return "" if None in digests else etag_of_parts(digests)  # type: ignore[arg-type]


def part_ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each part."""
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def etag_of_parts(digests: list[bytes]) -> str:
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def uniform_parts(size: int, part_size: int) -> list[int]:
    return [min(part_size, size - start) for start in range(0, size, part_size)]


_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")


_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-(\d+)$")


def expected_check(etag: str | None) -> Check:
    if etag and _MD5_ETAG.match(etag):
        return "md5"
    if etag and _MULTIPART_ETAG.match(etag):
        return "multipart-etag"
    return "size"


def part_size_of(uri: str, number: int, client: Any) -> int | None:
    """The size of part `number` as the server tells it (HEAD with PartNumber), if it does."""
    if client is None or not is_s3(uri):
        return None
    bucket, key = split_s3(uri)
    try:
        return client.head_object(Bucket=bucket, Key=key, PartNumber=number)["ContentLength"]
    except (bexc.ClientError, bexc.BotoCoreError):
        return None


def checked_by_crc(o: Source, client: Any) -> bool:
    """Whether `o` is a large S3 object, worth a HEAD for the store's checksum."""
    return client is not None and o.size >= CRC_MIN_BYTES and is_s3(o.uri)


def server_checksum(o: Source, client: Any) -> crc.ServerChecksum | None:
    """The store's additional checksum of an object `checked_by_crc` (one HEAD), if it keeps one."""
    bucket, key = split_s3(o.uri)
    try:
        return crc.from_head(client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
    except (bexc.ClientError, bexc.BotoCoreError):
        return None


def _part_sizes(uri: str, size: int, count: int, client: Any) -> list[int] | None:
    """The sizes of the `count` parts an object was uploaded in, as the server tells them."""
    first = part_size_of(uri, 1, client)
    if first is None or (first >= size and count > 1):
        return None
    if len(uniform_parts(size, first)) == count:
        return uniform_parts(size, first)
    sizes = [part_size_of(uri, n, client) for n in range(1, count + 1)]
    return sizes if None not in sizes and sum(sizes) == size else None  # type: ignore[return-value,arg-type]


def verify(path: str | os.PathLike, size: int, etag: str | None, uri: str, client: Any,
           checksum: crc.ServerChecksum | None = None) -> Check | None:
    """The check that passed for the file at `path`, or None when it does not match.

    A store's `checksum` is used when given (a composite one needs the part sizes from the
    server; without them the ETag is checked instead). A multipart ETag is recomputed with the
    part size the server gives for part 1 (every part asked for when parts differ in size); a
    server that will not say gets the common part sizes tried, and only the size checked if none
    of them gives the ETag.
    """
    if os.path.getsize(path) != size:
        return None
    if checksum is not None:
        parts = None if checksum.parts is None else _part_sizes(uri, size, checksum.parts, client)
        if checksum.parts is None or parts is not None:
            return checksum.name if crc.matches(path, checksum, parts) else None  # type: ignore[return-value]
    check = expected_check(etag)
    if check == "md5":
        return md5_check(path, size, etag).result()  # type: ignore[arg-type]
    if check != "multipart-etag":
        return "size"
    count = int(etag.rsplit("-", 1)[1])  # type: ignore[union-attr]
    first = part_size_of(uri, 1, client)
    if first is None or (first >= size and count > 1):           # the server does not say
        guesses = [m * MIB for m in COMMON_PART_SIZES_MIB if len(uniform_parts(size, m * MIB)) == count]
        return "multipart-etag" if any(multipart_etag(path, p) == etag for p in guesses) else "size"
    sizes = _part_sizes(uri, size, count, client)
    return "multipart-etag" if sizes is not None and multipart_etag(path, sizes) == etag else None
