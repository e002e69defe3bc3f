"""Upload a local file or folder under an S3 prefix, verified by ETag."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
from typing import Any, Sequence

import botocore.exceptions as bexc

from tasks.common.progress import Progress, human_bytes
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
    remote = Remote.make(endpoint_url, no_sign_request, profile)
    bucket, prefix = split_s3(dest_uri)
    prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    root = local_path(src)
    local_dir = root if os.path.isdir(root) else os.path.dirname(root)
    objs = list_local(src, Reach(), exclude)
    client = remote.client()
    base = f"s3://{bucket}/{prefix}"
    there: dict[str, tuple[int, str]] = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in s3_call(lambda: list(pages), base, remote):
        for o in page.get("Contents", []):
            there[o["Key"]] = (o["Size"], o["ETag"].strip('"'))
    old = _remote_manifest(client, bucket, prefix + MANIFEST_NAME) if prefix + MANIFEST_NAME in there else {}

    entries: dict[str, FileEntry] = {}

    def entry(o: Source, etag: str, check: Check) -> FileEntry:
        return FileEntry(key=base + o.rel, path=o.rel, size=o.size, etag=etag, **stamp_fields(o.stat),
                         mtime_ns=o.stat.mtime_ns, verified=True, check=check)  # type: ignore[union-attr]

    def already_there(o: Source) -> tuple[Source, Check | None]:
        size, etag = there.get(prefix + o.rel, (-1, ""))
        if size != o.size:
            return o, None
        prev = old.get(o.rel)
        if (prev is not None and prev.etag == etag and prev.size == o.size
                and prev.source_stamp == o.stat.stamp):  # type: ignore[union-attr]
            return o, prev.check
        check = verify(o.uri, o.size, etag, base + o.rel, client)
        return o, check if check != "size" else None

    failures: list[str] = []
    progress: Progress | None = None

    def finish(o: Source) -> None:
        head = s3_call(lambda: client.head_object(Bucket=bucket, Key=prefix + o.rel), base + o.rel, remote)
        etag = head["ETag"].strip('"')
        check = verify(o.uri, o.size, etag, base + o.rel, client)
        if check is None:
            failures.append(base + o.rel)
            return
        entries[o.rel] = entry(o, etag, check)
        progress.add(o.size)  # type: ignore[union-attr]

    with cf.ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
        todo = []
        for o, check in pool.map(already_there, objs):
            if check is None:
                todo.append(o)
            else:
                entries[o.rel] = entry(o, there[prefix + o.rel][1], check)
        progress = transfer_progress(f"upload to {base}", todo, "upload-progress")
        by_path = {o.uri: o for o in todo}
        futures: list[cf.Future] = []

        def uploaded(path: str) -> None:
            futures.append(pool.submit(finish, by_path[path]))
            progress.show()  # type: ignore[union-attr]

        errors = run_s5cmd([(o.uri, base + o.rel) for o in todo], remote, workers=workers,
                           part_size_mb=part_size_mb, concurrency=concurrency, on_done=uploaded) if todo else []
        try:
            changed = _changed_since_listed(todo) if errors else []
            unexplained = [error for error in errors if not any(f" {path} " in error for path in changed)]
            if errors and not unexplained:
                raise TransientSyncError(f"{changed[0]} changed or was removed while it was uploaded ({len(changed)} "
                                         "file(s)): the next try lists the folder again")
            await_verifications(futures, progress, unexplained, failures, remote, "does not match its local file after upload")
        finally:
            progress.show(final=True)
    files = [entries[o.rel] for o in objs]
    manifest = SyncManifest(
        dest=base, local_dir=local_dir, sources=[src], files=files, bytes=sum(f.size for f in files),
        digest=listing_digest([Source(f.key, f.path, f.size, f.etag) for f in files], base),
        manifest_path=base + MANIFEST_NAME, transferred_files=progress.done_items,
        transferred_bytes=progress.done_bytes)
    body = json.dumps(manifest.model_dump(), indent=1).encode()
    s3_call(lambda: client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=body),
             manifest.manifest_path, remote)
    progress.logger.info(f"uploaded {progress.done_items} of {len(files)} files ({human_bytes(progress.done_bytes)}) "
                         f"to {base}; {len(files) - progress.done_items} were already there")
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
