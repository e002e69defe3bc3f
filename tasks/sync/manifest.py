"""The manifest beside the synced files: what was verified, how, and whether the copy is complete.
For local sources it also keeps each file's content digest with the stat stamp it was taken at,
so that a later sync hashes again only the files written since."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gpt.files import replaced
from tasks.common.progress import Progress
from tasks.sync.integrity import Check
from tasks.sync.listing import MANIFEST_NAME, LocalStat, Source, listing_digest


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str                            # the S3 object (s3://bucket/key), or a local source's absolute path
    path: str                           # relative to SyncManifest.local_dir
    size: int
    etag: str | None = None             # S3 ETag without quotes (None for local sources)
    source_mtime_ns: int | None = None  # local sources: their stat stamp (mtime, ctime, inode) when
    source_ctime_ns: int | None = None  # `content` was taken: while it holds, the content is the same
    source_ino: int | None = None
    content: str | None = None          # local sources: digest of the bytes copied (tasks.sync.content)
    mtime_ns: int                       # the local copy's mtime when verified: a later change re-verifies it
    verified: bool
    check: Check

    @property
    def source_stamp(self) -> str:
        return f"{self.source_mtime_ns}:{self.source_ctime_ns}:{self.source_ino}"


class SyncManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    dest: str                 # the local folder (sync) or the s3:// prefix (upload)
    local_dir: str            # the local side: dest for sync, the uploaded folder for upload
    sources: list[str]
    files: list[FileEntry]
    bytes: int
    digest: str               # hash of keys, paths, sizes and versions (ETags, local content digests)
    manifest_path: str
    transferred_files: int = 0    # moved by this run (0 for a no-op)
    transferred_bytes: int = 0
    hashed_bytes: int = 0         # of local sources, read by this run to take their content digest
    deleted_files: int = 0
    complete: bool = True     # False on disk while a sync is unfinished
    not_copied: list[str] = []    # sources' files named as the sync's own files (listing.is_reserved)

    def intact(self) -> bool:
        """Every file this sync verified is still there, untouched since (its size and mtime)."""
        folder = Path(self.local_dir)
        for f in self.files:
            try:
                st = (folder / f.path).stat()
            except OSError:
                return False
            if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
                return False
        return Path(self.manifest_path).is_file()


def read_manifest(path: Path) -> dict[str, FileEntry]:
    try:
        data = json.loads(path.read_text())
        return {f["path"]: FileEntry(**f) for f in data.get("files", [])}
    except (OSError, ValueError, TypeError):
        return {}


def stamp_fields(st: LocalStat | None) -> dict[str, int]:
    """The FileEntry fields of a local source's stamp; none while it is not settled (a later write
    could leave it as it is), so that the next sync hashes the file again."""
    if st is None or not st.settled:
        return {}
    return dict(source_mtime_ns=st.mtime_ns, source_ctime_ns=st.ctime_ns, source_ino=st.ino)


def file_entry(o: Source, folder: Path, check: Check) -> FileEntry:
    return FileEntry(key=o.uri, path=o.rel, size=o.size, etag=o.etag, content=o.content, **stamp_fields(o.stat),
                     mtime_ns=os.stat(os.path.join(folder, o.rel)).st_mtime_ns, verified=True, check=check)


def copy_intact(o: Source, old: FileEntry | None, path: Path) -> bool:
    """Whether `path` is still the verified copy `old` records of this source's key, size and ETag."""
    if old is None or not old.verified:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (old.key == o.uri and old.size == o.size == st.st_size and old.etag == o.etag
            and old.mtime_ns == st.st_mtime_ns)


def up_to_date(o: Source, old: FileEntry | None, path: Path) -> bool:
    """The copy is intact and its source unchanged: the same ETag, or a local file not written since
    its content digest was taken."""
    return copy_intact(o, old, path) and (o.stat is None or (
        old.content is not None and old.source_stamp == o.stat.stamp))  # type: ignore[union-attr]


def sync_manifest(sources: list[str], objs: list[Source], entries: dict[str, FileEntry], folder: Path,
              progress: Progress, deleted: int, complete: bool, hashed: int,
              not_copied: list[str] = ()) -> SyncManifest:
    files = [entries[o.rel] for o in objs if o.rel in entries]
    known = [dataclasses.replace(o, content=entries[o.rel].content) if o.rel in entries and o.etag is None else o
             for o in objs]
    return SyncManifest(dest=str(folder), local_dir=str(folder), sources=sources, files=files,
                        bytes=sum(f.size for f in files), digest=listing_digest(known, str(folder)),
                        manifest_path=str(folder / MANIFEST_NAME), transferred_files=progress.done_items,
                        transferred_bytes=progress.done_bytes, hashed_bytes=hashed, deleted_files=deleted,
                        complete=complete, not_copied=list(not_copied))


def manifest_mode(objs: list[Source]) -> int:
    """The manifest's mode: no wider than any local source's (the owner may always read and write it),
    then narrowed by the umask."""
    mode = 0o666
    for o in objs:
        if o.stat is not None:
            mode &= o.stat.mode | 0o600
    return mode


def write_manifest(path: Path, manifest: SyncManifest, mode: int) -> None:
    """Write `manifest` to `path` whole, created with `mode` (and the umask) from its first byte."""
    text = json.dumps(manifest.model_dump(), indent=2, sort_keys=True, default=str) + "\n"
    with replaced(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o666)
        with os.fdopen(fd, "w") as f:
            f.write(text)
