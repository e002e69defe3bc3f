"""Sync (download): make a local folder hold verified copies of every source file."""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import fcntl
import os
import shutil
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.common import crc
from tasks.common.progress import Progress, human_bytes
from tasks.common.uri import is_s3
from tasks.sync import content
from tasks.sync.integrity import (
    Check,
    checked_by_crc,
    expected_check,
    md5_check,
    server_checksum,
    verify,
)
from tasks.sync.listing import (
    MANIFEST_NAME,
    PARTIAL_DIR,
    SETTLE_NS,
    Listing,
    Source,
    is_reserved,
    list_sources,
    walk_files,
)
from tasks.sync.manifest import (
    FileEntry,
    SyncManifest,
    copy_intact,
    file_entry,
    manifest_mode,
    read_manifest,
    stamp_fields,
    sync_manifest,
    up_to_date,
    write_manifest,
)
from tasks.sync.part_hasher import PartHasher
from tasks.sync.reach import Reach
from tasks.sync.remote import Remote, SyncError, TransientSyncError
from tasks.sync.s5cmd import raise_first, run_s5cmd

# Files verified at once: they wait on the server or on HASHER, which batches what they ask, so
# the more at once the more of them one native call hashes.
VERIFY_THREADS = 32


def transfer_progress(label: str, todo: list[Source], artifact_key: str) -> Progress:
    """The progress of transferring `todo`, announced in one line."""
    progress = Progress(label, "files", items=len(todo), nbytes=sum(o.size for o in todo), artifact_key=artifact_key)
    if todo:
        progress.logger.info(f"{label}: {len(todo)} files ({human_bytes(progress.bytes or 0)}) to transfer")
    return progress


def await_verifications(futures: list[cf.Future], progress: "Progress", errors: list[str], failures: list[str],
            remote: Remote, mismatch: str) -> None:
    """Wait for the verifications still running, then raise the transfer's first error, if any."""
    for fut in futures:                 # about the order they finish: that of the files copied
        fut.result()
        progress.show()
    if errors:
        raise_first(errors, remote)
    if failures:
        raise TransientSyncError(f"{failures[0]} {mismatch} ({len(failures)} file(s)): run it again")


def _lock(folder: Path) -> int:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TransientSyncError(f"another sync is writing to {folder.parent}: wait for it to finish") from None
    return fd


def sync(sources: list[str] | str, dest: str, *, endpoint_url: str | None = None, no_sign_request: bool = False,
         profile: str | None = None, workers: int = 256, part_size_mb: int = 50, concurrency: int = 5,
         delete: bool = False, allowed_roots: Sequence[str] | None = None,
         verify_content: bool = False) -> SyncManifest:
    """Make `dest` hold verified copies of every file of `sources` (S3 URIs, globs or local paths).

    Files already there and unchanged (by the manifest) are left alone; a file that is there but
    not in the manifest is verified and kept if it matches. A local source is unchanged while its
    size, mtime, ctime and inode are those its content digest was taken at; otherwise it is hashed
    again, and copied again when its content differs. `verify_content` reads everything again:
    every local source and its copy are hashed, every S3 copy is verified against its ETag or the
    store's checksum, and whatever differs is copied again. `delete` removes files under `dest`
    that no source has.

    Local sources are regular files (or folders of them) outside `dest`, and, when `allowed_roots`
    is given, inside those folders once links are resolved. Copies of local files get the source's
    permission bits (the owner may always read its copy), narrowed by the umask; copies of S3
    objects get the umask's default. Raises SyncError (TransientSyncError when running again may
    succeed).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    remote = Remote.make(endpoint_url, no_sign_request, profile)
    folder = Path(dest).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise SyncError(f"destination {dest} is a file: give a folder")
    client = remote.client() if any(is_s3(s) for s in sources) else None
    objs = list_sources(sources, remote, client, Reach.make(allowed_roots, folder))
    partial = folder / PARTIAL_DIR
    partial.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(partial, 0o700)                # what is staged there is this user's until it is promoted
    lock = _lock(partial)
    try:
        return _sync_locked(sources, objs, folder, partial, remote, client, workers=workers,
                            part_size_mb=part_size_mb, concurrency=concurrency, delete=delete,
                            verify_content=verify_content)
    finally:
        os.close(lock)


@dataclass
class SyncWork:
    """What a sync has to do, from the listing, the old manifest and the files on disk."""
    entries: dict[str, FileEntry] = field(default_factory=dict)     # already there, unchanged
    todo: list[Source] = field(default_factory=list)                   # to transfer
    recheck: list[tuple[Source, Path]] = field(default_factory=list)   # there (or staged by an interrupted run): verify first
    rehash: list[tuple[Source, FileEntry]] = field(default_factory=list)   # local, written since copied: hash first


def sync_work(objs: list[Source], folder: Path, partial: Path, old: dict[str, FileEntry],
              verify_content: bool = False) -> SyncWork:
    out = SyncWork()
    for o in objs:
        final, staged, prev = folder / o.rel, partial / o.rel, old.get(o.rel)
        if not verify_content and up_to_date(o, prev, final):
            out.entries[o.rel] = prev  # type: ignore[assignment]
        elif o.etag is None:
            if prev is not None and prev.content is not None and copy_intact(o, prev, final):
                out.rehash.append((o, prev))
            else:
                out.todo.append(o)
        elif _has_size(final, o.size) and (verify_content or expected_check(o.etag) != "size"):
            out.recheck.append((o, final))
        elif _has_size(staged, o.size):
            out.recheck.append((o, staged))     # s5cmd renames a download to its name only when complete
        else:
            out.todo.append(o)
    return out


def _check_room(todo: list[Source], folder: Path) -> None:
    """Refuse, before transferring anything, what the destination's free space cannot hold."""
    need = sum(o.size for o in todo)
    free = shutil.disk_usage(folder).free
    if need > free:
        raise SyncError(f"{len(todo)} files ({human_bytes(need)}) to copy into {folder}, which has "
                        f"{human_bytes(free)} free: free space there (or sync elsewhere) and run it again")


def _umask() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))


def copy_mode(o: Source) -> int:
    """A local source's permission bits, readable by the owner (the umask narrows them further)."""
    return o.stat.mode & 0o777 | 0o400  # type: ignore[union-attr]


class Download:
    """The files of one sync: each verified (while s5cmd still writes, where it can), promoted from
    the partial folder into place, and entered in the manifest; a file that fails is removed."""

    def __init__(self, folder: Path, partial: Path, client: Any, pool: cf.ThreadPoolExecutor,
                 entries: dict[str, FileEntry], verify_content: bool = False) -> None:
        self.folder, self.partial, self.client, self.pool = folder, partial, client, pool
        self.entries, self.verify_content = entries, verify_content
        self.s3_mode = 0o666 & ~_umask()     # what S3 copies get: they have no mode of their own
        self.hashed: list[int] = []         # bytes of local files read to hash them
        self.unsettled: list[Source] = []   # local sources entered before their stamp settled
        self.checksums: dict[str, crc.ServerChecksum] = {}
        self.failures: list[str] = []
        self.futures: list[cf.Future] = []
        self.part_hasher: PartHasher | None = None
        self.progress: Progress | None = None
        self.fetching: dict[str, Source] = {}
        self.made: set[str] = set()         # folders under `folder` known to exist

    def ask_checksums(self, objs: list[Source]) -> None:
        """The store's CRC of every large object that has one (one HEAD each, side by side)."""
        objs = [o for o in objs if checked_by_crc(o, self.client)]
        found = self.pool.map(lambda o: server_checksum(o, self.client), objs)
        self.checksums = {o.uri: c for o, c in zip(objs, found) if c is not None}

    def promote(self, o: Source, staged: str | Path) -> None:
        final = os.path.join(self.folder, o.rel)
        parent = os.path.dirname(final)
        if parent not in self.made:
            os.makedirs(parent, exist_ok=True)
            self.made.add(parent)
        if o.etag is not None:
            os.chmod(staged, self.s3_mode)          # s5cmd writes 0644 whatever the umask
        os.replace(staged, final)

    def check_existing(self, item: tuple[Source, Path]) -> tuple[Source, Check | None]:
        o, path = item
        check = verify(path, o.size, o.etag, o.uri, self.client, self.checksums.get(o.uri))
        if path.is_relative_to(self.partial):
            if check is not None:
                self.promote(o, path)
        elif check == "size":
            check = None                    # not in the manifest and only its size agrees: fetch it
        return o, check

    def start(self, todo: list[Source], label: str) -> None:
        self.progress = transfer_progress(label, todo, "sync-progress")
        self.fetching = {o.uri: o for o in todo if o.etag is not None}
        multipart = [(o, self.partial / o.rel) for o in self.fetching.values()
                     if expected_check(o.etag) == "multipart-etag" and o.uri not in self.checksums]
        self.part_hasher = PartHasher(multipart, self.client) if multipart else None
        self.futures = [self.pool.submit(self.copy_local, o) for o in todo if o.etag is None]

    def copy_local(self, o: Source) -> None:
        """Copy a local source under the partial folder, created with its final mode, and take the
        content digest of the bytes copied."""
        staged = self.partial / o.rel
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.unlink(missing_ok=True)
        try:
            with content.opened(o) as src:
                dst = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, copy_mode(o))
                try:
                    digest = content.digest(src, o.size, copy_to=dst)
                finally:
                    os.close(dst)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.hashed.append(o.size)
        self.finish(dataclasses.replace(o, content=digest), staged)

    def rehash_local(self, item: tuple[Source, FileEntry]) -> tuple[Source, FileEntry | None]:
        """A local source written since its copy was made (or any, with verify_content): its entry
        when its content is still that of the copy, else None (copy it again)."""
        o, prev = item
        final = self.folder / o.rel
        with content.opened(o) as fd:
            digest = content.digest(fd, o.size)
        self.hashed.append(o.size)
        if digest != prev.content:
            return o, None
        if self.verify_content:
            fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
            try:
                same = content.digest(fd, o.size) == digest
            finally:
                os.close(fd)
            self.hashed.append(o.size)
            if not same:
                return o, None
        mode = os.stat(final).st_mode & 0o777
        if mode & ~copy_mode(o):
            os.chmod(final, mode & copy_mode(o))    # the source's mode narrowed since: so does the copy's
        o = dataclasses.replace(o, content=digest)
        if not o.stat.settled:  # type: ignore[union-attr]
            self.unsettled.append(o)
        return o, file_entry(o, self.folder, prev.check)

    def settle(self) -> None:
        """Record the stamps of the local sources listed within SETTLE_NS of their last write: once the
        clock has left that write's tick, each is hashed again, and the same content gets its stamp
        recorded (any later write changes it). Other content, or a ctime in the future, is left
        without one, for the next sync to hash again."""
        due = [o for o in self.unsettled if o.stat.ctime_ns <= time.time_ns()]  # type: ignore[union-attr]
        if not due:
            return
        wait_ns = max(o.stat.ctime_ns for o in due) + SETTLE_NS - time.time_ns()  # type: ignore[union-attr]
        time.sleep(max(wait_ns, 0) / 1e9 + 0.001)
        for rel, entry in self.pool.map(self.resettle, due):
            if entry is not None:
                self.entries[rel] = entry

    def resettle(self, o: Source) -> tuple[str, FileEntry | None]:
        now = time.time_ns()
        try:
            with content.opened(o) as fd:
                digest = content.digest(fd, o.size)
        except SyncError:
            return o.rel, None
        self.hashed.append(o.size)
        if digest != o.content:
            return o.rel, None
        settled = dataclasses.replace(o.stat, listed_ns=now)  # type: ignore[arg-type]
        return o.rel, self.entries[o.rel].model_copy(update=stamp_fields(settled))

    def downloaded(self, uri: str) -> None:
        """s5cmd reports `uri` complete: verify it without holding s5cmd up."""
        o = self.fetching[uri]
        staged = os.path.join(self.partial, o.rel)
        if expected_check(o.etag) == "md5" and o.uri not in self.checksums:     # no thread waits on the hashing
            self.futures.append(md5_check(staged, o.size, o.etag, then=lambda check: self.conclude(o, staged, check)))
        else:
            self.futures.append(self.pool.submit(self.finish, o, staged))
        self.progress.show()  # type: ignore[union-attr]

    def finish(self, o: Source, staged: str | Path) -> None:
        if o.etag is None:
            check: Check | None = "size" if os.stat(staged).st_size == o.size else None
        elif self.part_hasher is not None and self.part_hasher.etag(o.uri) == o.etag:
            check = "multipart-etag"    # hashed while it was written; the size was compared too
        else:
            check = verify(staged, o.size, o.etag, o.uri, self.client, self.checksums.get(o.uri))
        self.conclude(o, staged, check)

    def conclude(self, o: Source, staged: str | Path, check: Check | None) -> None:
        if check is None:
            Path(staged).unlink(missing_ok=True)
            self.failures.append(o.uri)
            return
        self.promote(o, staged)
        self.entries[o.rel] = file_entry(o, self.folder, check)
        if o.stat is not None and not o.stat.settled:
            self.unsettled.append(o)
        self.progress.add(o.size)  # type: ignore[union-attr]

    def close(self) -> None:
        if self.part_hasher is not None:
            self.part_hasher.close()            # verifications still waiting on it hash the whole file
        cf.wait(self.futures)
        if self.progress is not None:
            self.progress.show(final=True)


def _sync_locked(sources: list[str], objs: Listing, folder: Path, partial: Path, remote: Remote, client: Any, *,
                 workers: int, part_size_mb: int, concurrency: int, delete: bool,
                 verify_content: bool) -> SyncManifest:
    manifest_path = folder / MANIFEST_NAME
    mode = manifest_mode(objs)
    work = sync_work(objs, folder, partial, read_manifest(manifest_path), verify_content)
    with cf.ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
        run = Download(folder, partial, client, pool, work.entries, verify_content)
        run.ask_checksums(work.todo + [o for o, _ in work.recheck])
        for o, check in pool.map(run.check_existing, work.recheck):
            if check is None:
                work.todo.append(o)
            else:
                run.entries[o.rel] = file_entry(o, folder, check)
        for o, entry in pool.map(run.rehash_local, work.rehash):
            if entry is None:
                work.todo.append(o)
            else:
                run.entries[o.rel] = entry
        _empty(partial)                     # leftovers of an interrupted run
        _check_room(work.todo, folder)
        run.start(work.todo, f"sync to {folder}")
        if run.entries:
            run.progress.logger.info(f"{len(run.entries)} of {len(objs)} files already in {folder} and unchanged")
        ok = False
        try:
            errors = run_s5cmd([(o.uri, str(partial / o.rel)) for o in run.fetching.values()], remote,
                               workers=workers, part_size_mb=part_size_mb, concurrency=concurrency,
                               on_done=run.downloaded) if run.fetching else []
            await_verifications(run.futures, run.progress, errors, run.failures, remote, "does not match its ETag after download")
            run.settle()
            ok = True
        finally:
            run.close()
            if not ok:   # record what is verified so far; the next run resumes from it
                write_manifest(manifest_path, sync_manifest(sources, objs, run.entries, folder, run.progress, 0, False,
                                                        sum(run.hashed), objs.not_copied), mode)
    progress = run.progress
    deleted = _delete_extra(folder, {o.rel for o in objs}) if delete else 0
    manifest = sync_manifest(sources, objs, run.entries, folder, progress, deleted, True, sum(run.hashed),
                             objs.not_copied)
    write_manifest(manifest_path, manifest, mode)
    shutil.rmtree(partial, ignore_errors=True)
    methods = collections.Counter(f.check for f in manifest.files)
    summary = (f"synced {len(objs)} files ({human_bytes(manifest.bytes)}) to {folder}: {progress.done_items} "
               f"transferred ({human_bytes(progress.done_bytes)}), {len(objs) - progress.done_items} already there; "
               f"verified by {', '.join(f'{m} {n}' for m, n in sorted(methods.items()))}"
               + (f"; local sources hashed: {human_bytes(manifest.hashed_bytes)}" if manifest.hashed_bytes else ""))
    progress.logger.info(summary + (f", {deleted} deleted" if delete else ""))
    return manifest


def _has_size(path: Path, size: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _empty(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_dir():
            shutil.rmtree(item)
        else:
            item.unlink()


def _delete_extra(folder: Path, keep: set[str]) -> int:
    count = 0
    for path in list(walk_files(str(folder))):
        rel = os.path.relpath(path, folder).replace(os.sep, "/")
        if rel not in keep and not is_reserved(rel):
            os.unlink(path)
            count += 1
    for inner, _, _ in os.walk(folder, topdown=False):
        if inner != str(folder) and not os.listdir(inner):
            os.rmdir(inner)
    return count
