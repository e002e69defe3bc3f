"""The manifest beside the synced files: what was verified, how, and whether the copy is complete."""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tasks.sync.integrity import Check
from tasks.sync.listing import MANIFEST_NAME, Source, listing_digest
from tasks.progress import Progress


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str                            # the S3 object (s3://bucket/key), or a local source's absolute path
    path: str                           # relative to SyncManifest.local_dir
    size: int
    etag: str | None = None             # S3 ETag without quotes (None for local sources)
    source_mtime_ns: int | None = None  # local sources: their mtime, to notice changes
    mtime_ns: int                       # the local copy's mtime when verified: a later change re-verifies it
    verified: bool
    check: Check


class SyncManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    dest: str                 # the local folder (sync) or the s3:// prefix (upload)
    local_dir: str            # the local side: dest for sync, the uploaded folder for upload
    sources: list[str]
    files: list[FileEntry]
    bytes: int
    digest: str               # hash of keys, paths, sizes and versions: stable while nothing changes
    manifest_path: str
    transferred_files: int = 0    # moved by this run (0 for a no-op)
    transferred_bytes: int = 0
    deleted_files: int = 0
    complete: bool = True     # False on disk while a sync is unfinished


def _read_manifest(path: Path) -> dict[str, FileEntry]:
    try:
        data = json.loads(path.read_text())
        return {f["path"]: FileEntry(**f) for f in data.get("files", [])}
    except (OSError, ValueError, TypeError):
        return {}


def _entry(o: Source, folder: Path, check: Check) -> FileEntry:
    return FileEntry(key=o.uri, path=o.rel, size=o.size, etag=o.etag, source_mtime_ns=o.mtime_ns,
                     mtime_ns=os.stat(folder / o.rel).st_mtime_ns, verified=True, check=check)


def _up_to_date(o: Source, old: FileEntry | None, path: Path) -> bool:
    if old is None or not old.verified:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (old.key == o.uri and old.size == o.size == st.st_size and old.etag == o.etag
            and old.source_mtime_ns == o.mtime_ns and old.mtime_ns == st.st_mtime_ns)


def local_copy_matches(dest: str | os.PathLike, digest: str) -> bool:
    """Whether `dest` holds a complete sync with this listing digest, its files untouched since."""
    folder = Path(dest)
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
        if not data.get("complete") or data.get("digest") != digest:
            return False
        for f in data["files"]:
            st = (folder / f["path"]).stat()
            if (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"]):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _manifest(sources: list[str], objs: list[Source], entries: dict[str, FileEntry], folder: Path,
              progress: Progress, deleted: int, complete: bool) -> SyncManifest:
    files = [entries[o.rel] for o in objs if o.rel in entries]
    return SyncManifest(dest=str(folder), local_dir=str(folder), sources=sources, files=files,
                        bytes=sum(f.size for f in files), digest=listing_digest(objs, str(folder)),
                        manifest_path=str(folder / MANIFEST_NAME), transferred_files=progress.done_items,
                        transferred_bytes=progress.done_bytes, deleted_files=deleted, complete=complete)
