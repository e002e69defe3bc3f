"""What to sync: S3 keys, prefixes and globs, and local files, listed with sizes and versions."""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from tasks.digest import Digest
from tasks.sync.remote import Remote, SyncError, _s3_call, split_s3

MANIFEST_NAME = ".sync-manifest.json"


PARTIAL_DIR = ".sync-partial"


GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    """One source file and where it goes."""
    uri: str            # s3://bucket/key or an absolute local path
    rel: str            # destination path relative to the local folder
    size: int
    etag: str | None = None
    mtime_ns: int | None = None

    @property
    def version(self) -> str:
        return self.etag if self.etag is not None else str(self.mtime_ns)


def _glob_base(pattern: str) -> str:
    """The part of `pattern` before the folder holding its first wildcard (ends with / or is empty)."""
    first = min(pattern.find(c) for c in GLOB_CHARS if c in pattern)
    return pattern[: pattern.rfind("/", 0, first) + 1]


def _reserved(rel: str) -> bool:
    parts = rel.split("/")
    return parts[-1] == MANIFEST_NAME or parts[0] == PARTIAL_DIR


def _list_s3(uri: str, client: Any, remote: Remote) -> list[Source]:
    bucket, key = split_s3(uri)
    is_glob = any(c in key for c in GLOB_CHARS)
    prefix = key[: min(key.find(c) for c in GLOB_CHARS if c in key)] if is_glob else key
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    found = []
    for page in _s3_call(lambda: list(pages), uri, remote):
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
            if not _reserved(rel):
                found.append(Source(f"s3://{bucket}/{k}", rel, o["Size"], o["ETag"].strip('"')))
    if not found:
        what = "no objects match" if is_glob else "no objects at"
        raise SyncError(f"{what} {uri} on {remote.where}: check the key or pattern")
    return found


def local_path(src: str) -> str:
    return os.path.abspath(os.path.expanduser(src[7:] if src.startswith("file://") else src))


def _walk(root: str) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            yield os.path.join(folder, name)


def _list_local(src: str) -> list[Source]:
    path = local_path(src)
    if any(c in path for c in GLOB_CHARS):
        base = _glob_base(path)
        paths = [p for p in _walk(base) if fnmatch.fnmatchcase(p, path)]
        if not paths:
            raise SyncError(f"no files match {src}: check the pattern")
        pairs = [(p, p[len(base):]) for p in paths]
    elif os.path.isdir(path):
        pairs = [(p, os.path.relpath(p, path).replace(os.sep, "/")) for p in _walk(path)]
        if not pairs:
            raise SyncError(f"{src} is an empty folder: check the path")
    elif os.path.isfile(path):
        pairs = [(path, os.path.basename(path))]
    else:
        raise SyncError(f"{src} does not exist: check the path")
    out = []
    for p, rel in pairs:
        if _reserved(rel):
            continue
        st = os.stat(p)
        out.append(Source(p, rel, st.st_size, None, st.st_mtime_ns))
    return out


def list_sources(sources: Iterable[str], remote: Remote, client: Any = None) -> list[Source]:
    """Every file of `sources`, with its relative destination path; names clashing are an error."""
    sources = list(sources)
    if not sources:
        raise SyncError("no sources given: pass at least one s3:// URI or local path")
    if client is None and any(s.startswith("s3://") for s in sources):
        client = remote.client()
    objs: dict[str, Source] = {}
    for src in sources:
        for o in (_list_s3(src, client, remote) if src.startswith("s3://") else _list_local(src)):
            other = objs.setdefault(o.rel, o)
            if other.uri != o.uri:
                raise SyncError(f"{other.uri} and {o.uri} would both be written to {o.rel}: "
                                "sync them into different folders")
    return sorted(objs.values(), key=lambda o: o.rel)


def listing_digest(objs: Iterable[Source], *extra: Any) -> str:
    key = Digest(*extra)
    for o in objs:
        key.add(o.uri, o.rel, o.size, o.version)
    return key.hex()
