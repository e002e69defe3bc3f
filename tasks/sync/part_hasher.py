"""Hashing multipart downloads while s5cmd is still writing them."""
from __future__ import annotations

import concurrent.futures as cf
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.sync.integrity import (
    HASHER,
    Hasher,
    etag_of_parts,
    part_ranges,
    part_size_of,
    uniform_parts,
)
from tasks.sync.listing import Source


@dataclass
class GrowingDownload:
    """A multipart download being hashed while it is written: per part, the bytes hashed so far
    and the MD5 state after them (the digest once the part is complete)."""
    obj: Source
    staged: Path
    done: threading.Event
    result: cf.Future
    ranges: list[tuple[int, int]]
    fd: int | None = None
    hashed: list[int] = field(init=False)
    states: list[bytes] = field(init=False)
    complete: list[bool] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.ranges)
        self.hashed, self.states, self.complete = [0] * n, [b""] * n, [False] * n

    def end(self, etag: str | None) -> None:
        if self.fd is not None:
            os.close(self.fd)
        if not self.result.done():
            self.result.set_result(etag)


class PartHasher:
    """Hashes multipart downloads while s5cmd is still writing them.

    s5cmd writes a download to `<name><digits>` beside its destination, each part from its own
    offset on, and renames it to `<name>` when complete. Every POLL_S one thread finds how far
    each part's data reaches (SEEK_DATA/SEEK_HOLE) and has HASHER hash what landed since, in one
    batch for all the files being written, so that their parts fill the SIMD lanes; an MD5 state is
    kept per part between batches, and a backlog is hashed without waiting. The last MARGIN bytes
    before where the data ends wait for the next round (the page being written already reads as
    data), and a part's last bytes for the download to end. The open descriptor stays on the file
    through the rename, and the inode is compared with the final file's. The ETag computed this
    way is a shortcut: when it does not match (or the file could not be tailed), `verify` hashes
    the complete file again.

    Up to WINDOW objects are tailed at once, in the order given (s5cmd's order).
    """

    POLL_S = 0.05
    WINDOW = 64
    MARGIN = 64 * 1024
    MIN_PIECE, MAX_PIECE = 1 << 20, 8 << 20

    def __init__(self, items: list[tuple[Source, Path]], client: Any) -> None:
        self._pending = list(reversed(items))
        self._client = client
        self._lock = threading.Lock()
        self._done = {o.uri: threading.Event() for o, _ in items}
        self._claimed: dict[str, cf.Future] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="part-hasher")
        self._thread.start()

    def etag(self, uri: str) -> str | None:
        """The ETag of the download of `uri`, which s5cmd reported complete, if it was tailed."""
        with self._lock:
            if uri not in self._done:
                return None
            self._done[uri].set()
            fut = self._claimed.get(uri)
        return fut.result() if fut is not None else None

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _run(self) -> None:
        window: list[GrowingDownload] = []
        try:
            while not self._closed.is_set():
                self._claim(window)
                if not window:
                    return
                self._open(window)
                more = self._hash([f for f in window if f.fd is not None])
                for f in [f for f in window if f.fd is not None and all(f.complete)]:
                    window.remove(f)
                    f.end(self._etag(f))
                if not more:
                    self._closed.wait(self.POLL_S)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting verifications
            for f in window:
                f.result.set_exception(e)
        finally:
            for f in window:
                f.end(None)

    def _claim(self, window: list[GrowingDownload]) -> None:
        while len(window) < self.WINDOW:
            with self._lock:
                while self._pending and self._done[self._pending[-1][0].uri].is_set():
                    self._pending.pop()         # complete before it could be tailed
                if not self._pending:
                    return
                o, staged = self._pending.pop()
                fut = self._claimed[o.uri] = cf.Future()
            count = int(o.etag.rsplit("-", 1)[1])  # type: ignore[union-attr]
            part = part_size_of(o.uri, 1, self._client)
            sizes = uniform_parts(o.size, part) if part is not None else []
            if len(sizes) != count:
                fut.set_result(None)
                continue
            ranges = part_ranges(sizes)
            window.append(GrowingDownload(o, staged, self._done[o.uri], fut, ranges))

    def _open(self, window: list[GrowingDownload]) -> None:
        listed: dict[Path, list[str]] = {}
        for f in [f for f in window if f.fd is None]:
            try:
                if f.done.is_set():
                    f.fd = os.open(f.staged, os.O_RDONLY)
                    continue
                if f.staged.parent not in listed:
                    listed[f.staged.parent] = os.listdir(f.staged.parent)
                temp = re.compile(re.escape(f.staged.name) + r"[0-9]+")
                names = [n for n in listed[f.staged.parent] if temp.fullmatch(n)]
                if len(names) == 1:
                    f.fd = os.open(f.staged.parent / names[0], os.O_RDONLY)
            except FileNotFoundError:
                if f.done.is_set():     # gone already: nothing to tail
                    window.remove(f)
                    f.end(None)

    def _hash(self, window: list[GrowingDownload]) -> bool:
        """Hash what landed of every part since the last call, in one batch of pieces of at most
        MAX_PIECE bytes (pieces of like length keep the lanes busy). True if more is waiting."""
        pieces: list[tuple[GrowingDownload, int, int, bool]] = []     # (file, part, bytes, final)
        more = False
        for f in window:
            done = f.done.is_set()
            for i, (offset, length) in enumerate(f.ranges):
                if f.complete[i]:
                    continue
                start, stop = offset + f.hashed[i], offset + length
                end = stop if done else min(_data_end(f.fd, start), stop) - self.MARGIN  # type: ignore[arg-type]
                n = min(end - start, self.MAX_PIECE)
                more |= end - start > n
                if done and start + n == stop:
                    pieces.append((f, i, n, True))
                elif n >= self.MIN_PIECE:
                    pieces.append((f, i, n // 64 * 64, False))
        if not pieces:
            return False
        ranges = [(f.fd, f.ranges[i][0] + f.hashed[i], n, f.states[i], f.hashed[i], final) for f, i, n, final in pieces]
        futures = [HASHER.submit(ranges[k:k + Hasher.BATCH]) for k in range(0, len(ranges), Hasher.BATCH)]
        states = [state for fut in futures for state in fut.result()]
        for (f, i, n, final), state in zip(pieces, states):
            if state is None:           # the file is shorter than the listing says: let verify say so
                f.complete = [True] * len(f.complete)
                f.states[i] = b""
                continue
            f.hashed[i] += n
            f.states[i] = state
            f.complete[i] = final
        return more

    def _etag(self, f: GrowingDownload) -> str | None:
        st, final = os.fstat(f.fd), os.stat(f.staged)  # type: ignore[arg-type]
        if b"" in f.states or (st.st_ino, st.st_dev, st.st_size) != (final.st_ino, final.st_dev, f.obj.size):
            return None
        return etag_of_parts(f.states)


def _data_end(fd: int, offset: int) -> int:
    """Where the data that starts at `offset` ends (the next hole), or `offset` if there is none."""
    try:
        if os.lseek(fd, offset, os.SEEK_DATA) != offset:
            return offset
        return os.lseek(fd, offset, os.SEEK_HOLE)
    except OSError:
        return offset           # nothing written at or after offset yet
