"""Upload a local file or folder under an S3 prefix, verified by ETag."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
from typing import Any, Sequence

import botocore.exceptions as bexc

from tasks.common.progress import human_bytes
from tasks.common.uri import is_s3
from tasks.sync.download import VERIFY_THREADS, await_verifications, transfer_progress
from tasks.sync.integrity import Check, verify
from tasks.sync.listing import (
    MANIFEST_NAME,
    Source,
    list_local,
    listing_digest,
    local_path,
)
from tasks.sync.manifest import FileEntry, SyncManifest, stamp_fields
from tasks.sync.reach import Reach
from tasks.sync.remote import Remote, SyncError, TransientSyncError, s3_call, split_s3
from tasks.sync.s5cmd import run_s5cmd


def upload(src: str, dest_uri: str, *, endpoint_url: str | None = None, no_sign_request: bool = False,
           profile: str | None = None, workers: int = 256, part_size_mb: int = 50,
           concurrency: int = 5, exclude: Sequence[str] = ()) -> SyncManifest:
    """Upload the local file or folder `src` under the S3 prefix `dest_uri`, verified by ETag.

    Objects already there with the same content are left alone. The manifest is written to
    `<dest_uri>/.sync-manifest.json`. Files whose path in `src` matches a pattern of `exclude`
    (fnmatch) are left out. When every failed copy is of a file that another process changed or removed
    since the listing, the upload fails as transient: the next try lists the folder again.
    """
    if not is_s3(dest_uri):
        raise SyncError(f"upload destination {dest_uri!r} is not an s3:// URI: write s3://BUCKET/PREFIX")
    return _Upload(src, dest_uri, Remote.make(endpoint_url, no_sign_request, profile), exclude).run(
        workers=workers, part_size_mb=part_size_mb, concurrency=concurrency)


class _Upload:
    """One upload: what the prefix holds already (its objects and the manifest an earlier upload left),
    what is copied, and each copy verified against its local file."""

    def __init__(self, src: str, dest_uri: str, remote: Remote, exclude: Sequence[str]) -> None:
        self.src, self.remote = src, remote
        self.bucket, prefix = split_s3(dest_uri)
        self.prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        self.base = f"s3://{self.bucket}/{self.prefix}"
        root = local_path(src)
        self.local_dir = root if os.path.isdir(root) else os.path.dirname(root)
        self.objs = list_local(src, Reach(), exclude)
        self.client = remote.client()
        self.there: dict[str, tuple[int, str]] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in s3_call(lambda: list(pages), self.base, remote):
            for o in page.get("Contents", []):
                self.there[o["Key"]] = (o["Size"], o["ETag"].strip('"'))
        manifest = self.prefix + MANIFEST_NAME
        self.old = _remote_manifest(self.client, self.bucket, manifest) if manifest in self.there else {}
        self.entries: dict[str, FileEntry] = {}
        self.failures: list[str] = []

    def run(self, **s5cmd: Any) -> SyncManifest:
        with cf.ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
            todo = []
            for o, check in pool.map(self.already_there, self.objs):
                if check is None:
                    todo.append(o)
                else:
                    self.entries[o.rel] = self.entry(o, self.there[self.prefix + o.rel][1], check)
            self.progress = progress = transfer_progress(f"upload to {self.base}", todo, "upload-progress")
            by_path = {o.uri: o for o in todo}
            futures: list[cf.Future] = []

            def uploaded(path: str) -> None:
                futures.append(pool.submit(self.finish, by_path[path]))
                progress.show()

            errors = run_s5cmd([(o.uri, self.base + o.rel) for o in todo], self.remote, on_done=uploaded,
                               **s5cmd) if todo else []
            try:
                changed = _changed_since_listed(todo) if errors else []
                unexplained = [error for error in errors if not any(f" {path} " in error for path in changed)]
                if errors and not unexplained:
                    raise TransientSyncError(f"{changed[0]} changed or was removed while it was uploaded "
                                             f"({len(changed)} file(s)): the next try lists the folder again")
                await_verifications(futures, progress, unexplained, self.failures, self.remote,
                                    "does not match its local file after upload")
            finally:
                progress.show(final=True)
        return self.manifest()

    def entry(self, o: Source, etag: str, check: Check) -> FileEntry:
        return FileEntry(key=self.base + o.rel, path=o.rel, size=o.size, etag=etag, **stamp_fields(o.stat),
                         mtime_ns=o.stat.mtime_ns, verified=True, check=check)  # type: ignore[union-attr]

    def already_there(self, o: Source) -> tuple[Source, Check | None]:
        """The object of this file, when the prefix holds it with the same content, and how that is known."""
        size, etag = self.there.get(self.prefix + o.rel, (-1, ""))
        if size != o.size:
            return o, None
        prev = self.old.get(o.rel)
        if (prev is not None and prev.etag == etag and prev.size == o.size
                and prev.source_stamp == o.stat.stamp):  # type: ignore[union-attr]
            return o, prev.check
        check = verify(o.uri, o.size, etag, self.base + o.rel, self.client)
        return o, check if check != "size" else None

    def finish(self, o: Source) -> None:
        """A copy s5cmd has made, verified against its local file."""
        key = self.prefix + o.rel
        head = s3_call(lambda: self.client.head_object(Bucket=self.bucket, Key=key), self.base + o.rel, self.remote)
        etag = head["ETag"].strip('"')
        check = verify(o.uri, o.size, etag, self.base + o.rel, self.client)
        if check is None:
            self.failures.append(self.base + o.rel)
            return
        self.entries[o.rel] = self.entry(o, etag, check)
        self.progress.add(o.size)

    def manifest(self) -> SyncManifest:
        """The manifest of the upload, written beside the objects."""
        files = [self.entries[o.rel] for o in self.objs]
        manifest = SyncManifest(
            dest=self.base, local_dir=self.local_dir, sources=[self.src], files=files,
            bytes=sum(f.size for f in files),
            digest=listing_digest([Source(f.key, f.path, f.size, f.etag) for f in files], self.base),
            manifest_path=self.base + MANIFEST_NAME, transferred_files=self.progress.done_items,
            transferred_bytes=self.progress.done_bytes)
        body = json.dumps(manifest.model_dump(), indent=1).encode()
        s3_call(lambda: self.client.put_object(Bucket=self.bucket, Key=self.prefix + MANIFEST_NAME, Body=body),
                manifest.manifest_path, self.remote)
        self.progress.logger.info(f"uploaded {self.progress.done_items} of {len(files)} files "
                                  f"({human_bytes(self.progress.done_bytes)}) to {self.base}; "
                                  f"{len(files) - self.progress.done_items} were already there")
        return manifest


def _changed_since_listed(objs: list[Source]) -> list[str]:
    """The local files of `objs` that were written or removed since they were listed."""
    changed = []
    for o in objs:
        try:
            same = o.stat.same(os.stat(o.uri), o.size)  # type: ignore[union-attr]
        except FileNotFoundError:
            same = False
        if not same:
            changed.append(o.uri)
    return changed


def _remote_manifest(client: Any, bucket: str, key: str) -> dict[str, FileEntry]:
    try:
        data = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        return {f["path"]: FileEntry(**f) for f in data.get("files", [])}
    except (bexc.ClientError, bexc.BotoCoreError, ValueError, TypeError, KeyError):
        return {}
