"""What to sync: S3 keys, prefixes and globs, and local files, listed with sizes and versions."""
from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from tasks.common.digest import Digest
from tasks.common.uri import is_s3
from tasks.sync.reach import Reach
from tasks.sync.remote import Remote, SyncError, s3_call, split_s3

MANIFEST_NAME = ".sync-manifest.json"


PARTIAL_DIR = ".sync-partial"


GLOB_CHARS = "*?["


# A file's ctime is set from a clock that advances in ticks (a few ms; a second or two on some
# file systems): a write in the tick of the ctime a sync recorded would leave it unchanged. A ctime
# older than this when the file was listed is settled: any later write gets another.
SETTLE_NS = 2_000_000_000


@dataclass(frozen=True)
class LocalStat:
    """A local source file as it was listed. Writing to a file changes its ctime, which no one can set
    back: a file with the same `stamp` (and size) has not been written since, once `settled`."""
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int
    mode: int
    listed_ns: int          # the clock just before the file was listed

    @classmethod
    def of(cls, st: os.stat_result, listed_ns: int) -> LocalStat:
        return cls(st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_mode, listed_ns)

    @property
    def stamp(self) -> str:
        return f"{self.mtime_ns}:{self.ctime_ns}:{self.ino}"

    @property
    def settled(self) -> bool:
        return self.listed_ns - self.ctime_ns > SETTLE_NS

    def same(self, st: os.stat_result, size: int) -> bool:
        """Whether `st` is this file, unchanged."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (
            self.dev, self.ino, size, self.mtime_ns, self.ctime_ns)


@dataclass(frozen=True)
class Source:
    """One source file and where it goes."""
    uri: str                        # s3://bucket/key or an absolute local path
    rel: str                        # destination path relative to the local folder
    size: int
    etag: str | None = None         # S3 sources
    stat: LocalStat | None = None   # local sources, as listed
    content: str | None = None      # local sources: their content digest, once known (tasks.sync.content)

    @property
    def version(self) -> str:
        """What names this version of the file: the ETag; for a local file its content digest once
        known, else its stat stamp (a stamp that changes may still hold the same content)."""
        if self.etag is not None:
            return self.etag
        return self.content if self.content is not None else self.stat.stamp  # type: ignore[union-attr]


def _glob_base(pattern: str) -> str:
    """The part of `pattern` before the folder holding its first wildcard (ends with / or is empty)."""
    first = min(pattern.find(c) for c in GLOB_CHARS if c in pattern)
    return pattern[: pattern.rfind("/", 0, first) + 1]


def is_reserved(rel: str) -> bool:
    """Whether the sync keeps its own files under this name (its manifest, its staging folder)."""
    parts = rel.split("/")
    return parts[-1] == MANIFEST_NAME or parts[0] == PARTIAL_DIR


# The longest file name Linux file systems hold, in bytes.
NAME_MAX = 255


def path_problem(rel: str) -> str | None:
    """Why ``rel`` cannot be a path inside the sync's destination (None when it can): a segment that
    climbs out (``..``) or stays (``.``), an absolute or empty segment, a NUL, a name too long."""
    if "\0" in rel:
        return "a NUL character"
    if rel.startswith("/"):
        return "an absolute path"
    for segment in rel.split("/"):
        if segment in ("", ".", ".."):
            return f"a {segment!r} segment" if segment else "an empty segment (//)"
        if len(segment.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return f"a name longer than {NAME_MAX} bytes"
    return None


def _list_s3(uri: str, client: Any, remote: Remote) -> list[Source]:
    bucket, key = split_s3(uri)
    is_glob = any(c in key for c in GLOB_CHARS)
    prefix = key[: min(key.find(c) for c in GLOB_CHARS if c in key)] if is_glob else key
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    found = []
    for page in s3_call(lambda: list(pages), uri, remote):
        for o in page.get("Contents", []):
            k = o["Key"]
            if k.endswith("/"):
                continue                                    # folder marker
            if is_glob:
                if not fnmatch.fnmatchcase(k, key):
                    continue
                rel = k[len(_glob_base(key)):]
            elif key == "" or key.endswith("/"):
                rel = k[len(key):]
            elif k == key:
                rel = k.rsplit("/", 1)[-1]
            elif k.startswith(key + "/"):
                rel = k[len(key) + 1:]
            else:
                continue
            if "\n" in k or "\r" in k:
                raise SyncError(f"s3://{bucket}/{k!r} has a line break in its key; s5cmd cannot copy it")
            found.append(Source(f"s3://{bucket}/{k}", rel, o["Size"], o["ETag"].strip('"')))
    if not found:
        what = "no objects match" if is_glob else "no objects at"
        raise SyncError(f"{what} {uri} on {remote.where}: check the key or pattern")
    return found


def local_path(src: str) -> str:
    return os.path.abspath(os.path.expanduser(src[7:] if src.startswith("file://") else src))


def walk_files(root: str) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            yield os.path.join(folder, name)


def list_local(src: str, reach: Reach, exclude: Sequence[str] = ()) -> list[Source]:
    """The local file, glob or folder `src`, less the files whose relative path matches a pattern of
    `exclude` (fnmatch: ``*`` also matches ``/``)."""
    path = local_path(src)
    if any(c in path for c in GLOB_CHARS):
        base = _glob_base(path)
        reach.folder(base)
        paths = [p for p in walk_files(base) if fnmatch.fnmatchcase(p, path)]
        if not paths:
            raise SyncError(f"no files match {src}: check the pattern")
        pairs = [(p, p[len(base):]) for p in paths]
    elif os.path.isdir(path):
        reach.folder(path)
        pairs = [(p, os.path.relpath(p, path).replace(os.sep, "/")) for p in walk_files(path)]
        if not pairs:
            raise SyncError(f"{src} is an empty folder: check the path")
    else:
        pairs = [(path, os.path.basename(path))]
    out = []
    for p, rel in pairs:
        if any(fnmatch.fnmatchcase(rel, pattern) for pattern in exclude):
            continue
        now = time.time_ns()
        st = reach.file(p)
        out.append(Source(p, rel, st.st_size, stat=LocalStat.of(st, now)))
    return out


class Listing(list):
    """The files a sync copies (a list of Source), and ``not_copied``: the sources' files named as the
    sync names its own files (``is_reserved``), which it leaves where they are and reports."""
    not_copied: list[str]


def list_sources(sources: Iterable[str], remote: Remote, client: Any = None, reach: Reach = Reach()) -> Listing:
    """Every file of `sources`, with its relative destination path; names clashing are an error.
    Local files are read only as `reach` allows."""
    sources = list(sources)
    if not sources:
        raise SyncError("no sources given: pass at least one s3:// URI or local path")
    if client is None and any(is_s3(s) for s in sources):
        client = remote.client()
    objs: dict[str, Source] = {}
    not_copied: list[str] = []
    for src in sources:
        for o in (_list_s3(src, client, remote) if is_s3(src) else list_local(src, reach)):
            if is_reserved(o.rel):
                not_copied.append(o.uri)
                continue
            problem = path_problem(o.rel)
            if problem is not None:
                raise SyncError(f"{o.uri!r} would be written to {o.rel!r}, which has {problem}: it could land "
                                "outside the destination, so nothing was copied; rename or remove that object, "
                                "or sync a prefix that leaves it out")
            other = objs.setdefault(o.rel, o)
            if other.uri != o.uri:
                raise SyncError(f"{other.uri} and {o.uri} would both be written to {o.rel}: "
                                "sync them into different folders")
    listing = Listing(sorted(objs.values(), key=lambda o: o.rel))
    listing.not_copied = sorted(not_copied)
    return listing


def listing_digest(objs: Iterable[Source], *extra: Any) -> str:
    key = Digest(*extra)
    for o in objs:
        key.add(o.uri, o.rel, o.size, o.version)
    return key.hex()
