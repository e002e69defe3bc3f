"""tasks.sync against a real S3-compatible server on loopback (SeaweedFS, tests/fixtures_s3.py)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tasks.sync as sync_module
from tasks.evaluate.records import IN_PROGRESS as EVALUATION_IN_PROGRESS
from tasks.sync import (
    MANIFEST_NAME,
    PARTIAL_DIR,
    PartHasher,
    Source,
    SyncError,
    TransientSyncError,
    multipart_etag,
    sync,
    upload,
    uploader,
)
from tests.fixtures_s3 import LIST_ONLY_BUCKET, SECRET_KEY, S3Server

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def blob(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (different per seed)."""
    out, block = bytearray(), hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's AWS_* environment set to its admin credentials."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in s3_server.env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def corpus(s3: S3Server) -> tuple[str, dict[str, bytes]]:
    """A bucket with small objects under data/, one multipart object and one object outside data/."""
    bucket = s3.new_bucket()
    files = {f"part-{i}.jsonl": blob(1000 + 37 * i, i) for i in range(8)}
    files["nested/deep/vocab.json"] = b'{"a": 1}'
    s3.put_tree(bucket, "data/", files)
    files["big.bin"] = blob(11 * MIB + 123, 99)
    s3.put(bucket, "data/big.bin", files["big.bin"], part_size=5 * MIB)
    s3.put(bucket, "other/x.txt", b"not synced")
    return bucket, files


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def cli(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tasks.sync", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_full_sync_verifies_and_writes_manifest(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    dest = tmp_path / "dest"
    m = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert read_tree(dest) == files
    assert not (dest / PARTIAL_DIR).exists()
    assert m.transferred_files == len(files) and m.bytes == sum(map(len, files.values()))
    checks = {f.path: f.check for f in m.files}
    assert checks["big.bin"] == "multipart-etag" and checks["part-0.jsonl"] == "md5"
    big = next(f for f in m.files if f.path == "big.bin")
    assert big.etag.endswith("-3") and big.etag == multipart_etag(dest / "big.bin", 5 * MIB)
    assert big.key == f"s3://{bucket}/data/big.bin" and big.verified and big.size == len(files["big.bin"])
    on_disk = json.loads((dest / MANIFEST_NAME).read_text())
    assert on_disk["complete"] and on_disk["digest"] == m.digest and len(on_disk["files"]) == len(files)
    assert SECRET_KEY not in (dest / MANIFEST_NAME).read_text()


@pytest.mark.parametrize("text", ["2026-12-07T17:56:10.000Z", "2026-12-07T17:56:10.123456789Z", "2026-12-07T17:56:10+02:00",
                                  "Mon, 07 Dec 2026 17:56:10 GMT", "1733594170", "2026-12-07T17:56:10"])
def test_a_responses_timestamps_read_as_botocore_reads_them(text: str) -> None:
    """The clients read timestamps without dateutil where `datetime` can (a listing's): the same value."""
    import botocore.utils

    from tasks.sync.remote import parse_timestamp
    assert parse_timestamp(text) == botocore.utils.parse_timestamp(text)


def test_a_listing_reads_each_objects_time_with_the_fast_parser(s3: S3Server, corpus, monkeypatch) -> None:
    import tasks.sync.remote as remote_module
    bucket, files = corpus
    read = []
    monkeypatch.setattr(remote_module, "parse_timestamp", lambda text: read.append(text) or remote_module.datetime.now())
    client = remote_module.Remote.make(s3.endpoint_url, False, None).client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix="data/")["Contents"]
    assert len(read) == len(listed) > 0


def test_multipart_object_with_unequal_parts(s3: S3Server, tmp_path: Path) -> None:
    bucket, client = s3.new_bucket(), s3.client()
    parts = [blob(6 * MIB, 1), blob(5 * MIB, 2), blob(1234, 3)]
    up = client.create_multipart_upload(Bucket=bucket, Key="odd.bin")["UploadId"]
    done = [{"PartNumber": n, "ETag": client.upload_part(Bucket=bucket, Key="odd.bin", UploadId=up, PartNumber=n,
                                                          Body=data)["ETag"]} for n, data in enumerate(parts, 1)]
    client.complete_multipart_upload(Bucket=bucket, Key="odd.bin", UploadId=up, MultipartUpload={"Parts": done})
    m = sync([f"s3://{bucket}/odd.bin"], str(tmp_path / "d"), endpoint_url=s3.endpoint_url)
    assert m.files[0].check == "multipart-etag" and m.files[0].etag.endswith("-3")
    assert (tmp_path / "d" / "odd.bin").read_bytes() == b"".join(parts)


def test_multipart_download_is_hashed_while_it_is_written(s3: S3Server, monkeypatch, tmp_path: Path) -> None:
    """Parts are hashed as they land in s5cmd's temporary file (out of order, with holes between them),
    in pieces: the first while a part is written, the rest when the download is complete."""
    bucket, part = s3.new_bucket(), 5 * MIB
    data = blob(3 * part + 4321, 7)
    etag = s3.put(bucket, "big.bin", data, part_size=part)
    assert s3.put(bucket, "copy.bin", data, part_size=part) == etag
    submitted: list[tuple[float, int]] = []        # (when, pieces) of each hand-over to the hasher
    submit = sync_module.HASHER.submit
    monkeypatch.setattr(sync_module.HASHER, "submit", lambda ranges, then=None: submitted.append(
        (time.monotonic(), len(ranges))) or submit(ranges, then))
    big = Source(f"s3://{bucket}/big.bin", "big.bin", len(data), etag)
    copy = Source(f"s3://{bucket}/copy.bin", "copy.bin", len(data), etag)
    hasher = PartHasher([(big, tmp_path / "big.bin"), (copy, tmp_path / "copy.bin")], s3.client())
    try:
        temp = tmp_path / "big.bin123456"       # how s5cmd names a download in progress
        with open(temp, "wb") as f:
            for n in (2, 0, 1, 3):              # parts land out of order
                f.seek(n * part)
                f.write(data[n * part:(n + 1) * part])
                f.flush()
                time.sleep(0.3)
        renamed = time.monotonic()
        temp.rename(tmp_path / "big.bin")
        assert hasher.etag(big.uri) == etag
        assert sum(n for when, n in submitted if when < renamed) >= 3   # hashed before the download ended
        # the file under the final name is not the one that was followed: no shortcut
        (tmp_path / "copy.bin42").write_bytes(data)
        time.sleep(1)
        (tmp_path / "copy.bin").write_bytes(data)
        assert hasher.etag(copy.uri) is None
    finally:
        hasher.close()


def test_glob_and_single_key_sources(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    m = sync([f"s3://{bucket}/data/part-*.jsonl", f"s3://{bucket}/other/x.txt"], str(tmp_path / "d"),
             endpoint_url=s3.endpoint_url)
    expected = {k: v for k, v in files.items() if k.startswith("part-")} | {"x.txt": b"not synced"}
    assert read_tree(tmp_path / "d") == expected and len(m.files) == len(expected)


def test_resync_is_a_noop_and_changed_object_is_fetched(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    dest = tmp_path / "dest"
    first = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    mtimes = {p: p.stat().st_mtime_ns for p in dest.rglob("*") if p.is_file() and p.name != MANIFEST_NAME}
    again = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert again.transferred_files == 0 and again.digest == first.digest
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes

    s3.put(bucket, "data/part-3.jsonl", b"new content")
    changed = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert changed.transferred_files == 1 and changed.digest != first.digest
    assert read_tree(dest) == files | {"part-3.jsonl": b"new content"}


def test_delete_is_optional(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    dest = tmp_path / "dest"
    sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    s3.client().delete_object(Bucket=bucket, Key="data/nested/deep/vocab.json")
    kept = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert (dest / "nested/deep/vocab.json").exists() and kept.deleted_files == 0
    gone = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url, delete=True)
    assert gone.deleted_files == 1 and not (dest / "nested").exists()
    assert (dest / MANIFEST_NAME).exists() and len(gone.files) == len(files) - 1


def test_damaged_local_files_are_fetched_again(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    dest = tmp_path / "dest"
    sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    with open(dest / "big.bin", "r+b") as f:          # same size, different bytes
        f.seek(6 * MIB)
        f.write(b"\0" * 100)
    (dest / "part-1.jsonl").write_bytes(files["part-1.jsonl"][:-10])   # truncated
    (dest / "part-2.jsonl").unlink()
    m = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert m.transferred_files == 3 and read_tree(dest) == files


def test_files_without_manifest_are_verified_not_refetched(s3: S3Server, corpus, tmp_path: Path) -> None:
    bucket, files = corpus
    dest = tmp_path / "dest"
    sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    (dest / MANIFEST_NAME).unlink()
    m = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    assert m.transferred_files == 0 and {f.check for f in m.files} == {"md5", "multipart-etag"}


def test_large_objects_are_verified_with_the_stores_crc(s3: S3Server, monkeypatch, tmp_path: Path) -> None:
    """Where the store keeps a CRC, a large object is checked with it (a whole-object CRC64NVME, a
    composite CRC32C over parts) instead of MD5; small objects keep their ETag; damage is found."""
    import io

    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config as BotoConfig

    monkeypatch.setattr("tasks.sync.integrity.CRC_MIN_BYTES", MIB)
    bucket, client = s3.new_bucket(), s3.client()
    files = {"whole.bin": blob(3 * MIB + 5, 1), "composite.bin": blob(11 * MIB + 7, 2), "plain.bin": blob(2 * MIB, 3),
             "small.txt": b"tiny"}
    client.put_object(Bucket=bucket, Key="d/whole.bin", Body=files["whole.bin"], ChecksumAlgorithm="CRC64NVME")
    client.upload_fileobj(io.BytesIO(files["composite.bin"]), bucket, "d/composite.bin",
                          ExtraArgs={"ChecksumAlgorithm": "CRC32C"},
                          Config=TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB))
    bare = s3.client(config=BotoConfig(request_checksum_calculation="when_required"))
    bare.put_object(Bucket=bucket, Key="d/plain.bin", Body=files["plain.bin"])   # the store keeps no CRC
    client.put_object(Bucket=bucket, Key="d/small.txt", Body=files["small.txt"], ChecksumAlgorithm="CRC32")
    dest = tmp_path / "dest"
    m = sync([f"s3://{bucket}/d/"], str(dest), endpoint_url=s3.endpoint_url)
    assert read_tree(dest) == files
    assert {f.path: f.check for f in m.files} == {"whole.bin": "crc64nvme", "composite.bin": "crc32c",
                                                  "plain.bin": "md5", "small.txt": "md5"}
    (dest / MANIFEST_NAME).unlink()                             # found again, verified, kept
    assert sync([f"s3://{bucket}/d/"], str(dest), endpoint_url=s3.endpoint_url).transferred_files == 0
    for name in ("whole.bin", "composite.bin"):                 # same size, different bytes
        with open(dest / name, "r+b") as f:
            f.seek(MIB + 3)
            f.write(b"\0" * 10)
    (dest / MANIFEST_NAME).unlink()
    again = sync([f"s3://{bucket}/d/"], str(dest), endpoint_url=s3.endpoint_url)
    assert again.transferred_files == 2 and read_tree(dest) == files


def test_a_stores_crc_is_checked_whole_or_composite(tmp_path: Path) -> None:
    """A whole-object CRC and a composite one (the CRC of the parts' CRCs) are checked, and a damaged,
    short or empty file, or other part sizes, do not pass."""
    import base64

    from awscrt import checksums

    from tasks.common.crc import ServerChecksum, matches

    data, sizes = blob(3 * MIB + 5, 7), [MIB, MIB, MIB + 5]
    whole = ServerChecksum("CRC64NVME", base64.b64encode(checksums.crc64nvme(data).to_bytes(8, "big")).decode())
    parts, at = b"", 0
    for size in sizes:
        parts += checksums.crc32c(data[at:at + size]).to_bytes(4, "big")
        at += size
    composite = ServerChecksum("CRC32C", base64.b64encode(checksums.crc32c(parts).to_bytes(4, "big")).decode() + "-3")
    path = tmp_path / "obj.bin"
    path.write_bytes(data)
    assert matches(path, whole) and matches(path, composite, sizes)
    assert not matches(path, composite, [MIB, 2 * MIB + 5])     # other part sizes
    path.write_bytes(data[:MIB] + b"\0" + data[MIB + 1:])
    assert not matches(path, whole) and not matches(path, composite, sizes)
    path.write_bytes(data[:-1])
    assert not matches(path, whole) and not matches(path, composite, sizes)
    path.write_bytes(b"")
    empty = ServerChecksum("CRC64NVME", base64.b64encode(bytes(8)).decode())
    assert matches(path, empty) and not matches(path, whole)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_interrupted_sync_resumes(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    files = {f"shard-{i:03d}.bin": blob(256 * 1024, 1000 + i) for i in range(300)}
    s3.put_tree(bucket, "shards/", files)
    dest = tmp_path / "dest"
    proc = subprocess.Popen([sys.executable, "-m", "tasks.sync", f"s3://{bucket}/shards/", str(dest),
                             "--endpoint-url", s3.endpoint_url, "--workers", "1"],
                            cwd=ROOT, env=s3.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            done = len(list(dest.glob("shard-*"))) if dest.exists() else 0
            if done >= 20:
                break
            time.sleep(0.005)
        killed = _children(proc.pid)
        assert killed, "the sync finished before it could be interrupted"
        for c in killed:
            os.kill(c, signal.SIGKILL)                     # s5cmd, killed half-way
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "stopped by signal 9" in err and "Traceback" not in err, err
    partial = json.loads((dest / MANIFEST_NAME).read_text())
    assert not partial["complete"] and 20 <= len(partial["files"]) < len(files)
    before = len(partial["files"])
    m = sync([f"s3://{bucket}/shards/"], str(dest), endpoint_url=s3.endpoint_url)
    assert m.transferred_files <= len(files) - before
    assert read_tree(dest) == files and m.complete


def test_public_bucket_without_credentials(s3: S3Server, monkeypatch, tmp_path: Path) -> None:
    public, private = s3.new_bucket(public=True), s3.new_bucket()
    for b in (public, private):
        s3.put(b, "corpus/a.jsonl", b'{"text": "hi"}\n')
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    m = sync([f"s3://{public}/corpus/"], str(tmp_path / "pub"), endpoint_url=s3.endpoint_url,
             no_sign_request=True)
    assert read_tree(tmp_path / "pub") == {"a.jsonl": b'{"text": "hi"}\n'} and m.files[0].check == "md5"
    with pytest.raises(SyncError, match="access denied.*drop --no-sign-request"):
        sync([f"s3://{private}/corpus/"], str(tmp_path / "priv"), endpoint_url=s3.endpoint_url,
             no_sign_request=True)


@pytest.mark.parametrize("case", ["missing-bucket", "access-denied", "no-credentials", "bad-secret",
                                  "unreachable", "no-match"])
def test_cli_errors_are_one_clear_line(s3: S3Server, corpus, case: str, tmp_path: Path) -> None:
    bucket, _ = corpus
    env, src, endpoint = dict(s3.env), f"s3://{bucket}/data/", s3.endpoint_url
    if case == "missing-bucket":
        src = "s3://no-such-bucket-here/data/"
        expected = "bucket 'no-such-bucket-here' does not exist"
    elif case == "access-denied":
        env = dict(s3.denied_env)
        expected = f"access denied to s3://{bucket}/data/"
    elif case == "no-credentials":
        del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        expected = "no AWS credentials found"
    elif case == "bad-secret":
        env["AWS_SECRET_ACCESS_KEY"] = "wrong-secret-value"
        expected = "rejected the AWS credentials"
    elif case == "unreachable":
        endpoint = "http://127.0.0.1:9"
        expected = "cannot reach the S3 endpoint http://127.0.0.1:9"
    else:
        src = f"s3://{bucket}/data/*.parquet"
        expected = f"no objects match s3://{bucket}/data/*.parquet"
    r = cli(src, str(tmp_path / "dest"), "--endpoint-url", endpoint, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    secret = env.get("AWS_SECRET_ACCESS_KEY")
    assert not secret or secret not in r.stderr + r.stdout


def test_cli_shows_a_progress_bar_on_a_terminal(s3: S3Server, corpus, tmp_path: Path) -> None:
    import pty
    bucket, files = corpus
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tasks.sync", f"s3://{bucket}/data/", str(tmp_path / "d"),
                             "--endpoint-url", s3.endpoint_url], cwd=ROOT, env=s3.env, stdout=subprocess.PIPE,
                            stderr=follower)
    os.close(follower)
    chunks: list[bytes] = []

    def drain() -> None:          # read the terminal while the command runs, so it never blocks
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    screen = b"".join(chunks)
    os.close(leader)
    assert proc.returncode == 0 and b"manifest: " in out
    assert f"] sync to {tmp_path / 'd'}: {len(files)}/{len(files)} files".encode() in screen
    assert b"\r[" + b"#" * 30 + b"]" in screen


def test_profile_from_credentials_file(s3: S3Server, corpus, monkeypatch, tmp_path: Path) -> None:
    bucket, files = corpus
    creds = tmp_path / "credentials"
    creds.write_text(f"[corpus]\naws_access_key_id = {s3.env['AWS_ACCESS_KEY_ID']}\n"
                     f"aws_secret_access_key = {s3.env['AWS_SECRET_ACCESS_KEY']}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    m = sync([f"s3://{bucket}/data/"], str(tmp_path / "d"), endpoint_url=s3.endpoint_url, profile="corpus")
    assert read_tree(tmp_path / "d") == files and m.transferred_files == len(files)
    with pytest.raises(SyncError, match="AWS profile 'elsewhere' is not in the AWS config"):
        sync([f"s3://{bucket}/data/"], str(tmp_path / "d"), endpoint_url=s3.endpoint_url, profile="elsewhere")


def test_transfer_errors_from_s5cmd_are_one_line(s3: S3Server, monkeypatch, tmp_path: Path) -> None:
    """Listing is allowed, reading is not: the error comes from s5cmd's JSON output."""
    s3.put(LIST_ONLY_BUCKET, "corpus/a.jsonl", b"{}\n")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, s3.lister_env[k])
    with pytest.raises(SyncError, match=f"^access denied to s3://{LIST_ONLY_BUCKET}/corpus/a.jsonl: ") as e:
        sync([f"s3://{LIST_ONLY_BUCKET}/corpus/"], str(tmp_path / "d"), endpoint_url=s3.endpoint_url)
    assert "\n" not in str(e.value) and not list((tmp_path / "d").glob("*.jsonl"))
    assert not json.loads((tmp_path / "d" / MANIFEST_NAME).read_text())["complete"]


def test_concurrent_sync_into_one_folder_is_refused(tmp_path: Path) -> None:
    from tasks.sync.download import _lock
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("a")
    (tmp_path / "dest" / PARTIAL_DIR).mkdir(parents=True)
    held = _lock(tmp_path / "dest" / PARTIAL_DIR)
    try:
        with pytest.raises(TransientSyncError, match="another sync is writing to"):
            sync([str(tmp_path / "src")], str(tmp_path / "dest"))
    finally:
        os.close(held)
    assert sync([str(tmp_path / "src")], str(tmp_path / "dest")).transferred_files == 1


def test_missing_local_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SyncError, match=f"{tmp_path}/nope does not exist"):
        sync([str(tmp_path / "nope")], str(tmp_path / "dest"))
    (tmp_path / "src").mkdir()
    with pytest.raises(SyncError, match="no files match"):
        sync([str(tmp_path / "src" / "*.jsonl")], str(tmp_path / "dest"))


def test_local_sources(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_bytes(b"a" * 5000)
    (src / "sub" / "b.jsonl").write_bytes(b"b" * 300)
    (src / "c.txt").write_bytes(b"c")
    m = sync([f"file://{src}"], str(tmp_path / "d1"))
    assert read_tree(tmp_path / "d1") == {"a.jsonl": b"a" * 5000, "sub/b.jsonl": b"b" * 300, "c.txt": b"c"}
    assert {f.check for f in m.files} == {"size"} and m.files[0].key.startswith(str(src))
    assert sync([str(src)], str(tmp_path / "d1")).transferred_files == 0
    time.sleep(0.01)
    (src / "c.txt").write_bytes(b"C")
    assert sync([str(src)], str(tmp_path / "d1")).transferred_files == 1
    assert (tmp_path / "d1" / "c.txt").read_bytes() == b"C"
    g = sync([str(src / "*.jsonl")], str(tmp_path / "d2"))
    assert sorted(f.path for f in g.files) == ["a.jsonl", "sub/b.jsonl"]


def test_s3_copies_get_the_umask_default_mode(s3: S3Server, corpus, tmp_path: Path) -> None:
    """S3 objects have no mode: their copies get 0o666 narrowed by the umask (s5cmd alone writes 0644)."""
    bucket, files = corpus
    for mask, expected in ((0o077, 0o600), (0o002, 0o664)):
        old = os.umask(mask)
        try:
            sync([f"s3://{bucket}/data/"], str(tmp_path / f"d{mask:o}"), endpoint_url=s3.endpoint_url)
        finally:
            os.umask(old)
        dest = tmp_path / f"d{mask:o}"
        assert {rel: (dest / rel).stat().st_mode & 0o777 for rel in files} == dict.fromkeys(files, expected)
        assert (dest / MANIFEST_NAME).stat().st_mode & 0o777 == expected & 0o666


def test_verify_content_reads_every_s3_copy_again(s3: S3Server, corpus, tmp_path: Path) -> None:
    """A copy damaged with its size and mtime kept passes the manifest's check; verify_content finds it."""
    bucket, files = corpus
    dest = tmp_path / "dest"
    sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url)
    for name, at in (("big.bin", 6 * MIB), ("part-4.jsonl", 10)):
        st = (dest / name).stat()
        with open(dest / name, "r+b") as f:
            f.seek(at)
            f.write(b"\0" * 8)
        os.utime(dest / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url).transferred_files == 0
    full = sync([f"s3://{bucket}/data/"], str(dest), endpoint_url=s3.endpoint_url, verify_content=True)
    assert full.transferred_files == 2 and read_tree(dest) == files
    r = cli(f"s3://{bucket}/data/", str(dest), "--endpoint-url", s3.endpoint_url, "--verify-content", env=s3.env)
    assert r.returncode == 0, r.stderr


def test_upload_folder(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000010").mkdir(parents=True)
    tree = {"metrics.jsonl": b'{"iteration": 1}\n', "checkpoints/iter_0000010/model.pt": blob(7 * MIB, 5),
            "checkpoints/latest": b"10"}
    for rel, data in tree.items():
        (run / rel).write_bytes(data)
    m = upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url, part_size_mb=5)
    client = s3.client()
    for rel, data in tree.items():
        assert client.get_object(Bucket=bucket, Key=f"runs/r1/{rel}")["Body"].read() == data
    checks = {f.path: f.check for f in m.files}
    assert checks["checkpoints/iter_0000010/model.pt"] == "multipart-etag" and checks["metrics.jsonl"] == "md5"
    stored = json.loads(client.get_object(Bucket=bucket, Key=f"runs/r1/{MANIFEST_NAME}")["Body"].read())
    assert stored["digest"] == m.digest and m.manifest_path == f"s3://{bucket}/runs/r1/{MANIFEST_NAME}"

    assert upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url).transferred_files == 0
    (run / "metrics.jsonl").write_bytes(b'{"iteration": 2}\n')
    again = upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url)
    assert again.transferred_files == 1
    assert client.get_object(Bucket=bucket, Key="runs/r1/metrics.jsonl")["Body"].read() == b'{"iteration": 2}\n'
    # what was uploaded syncs back down unchanged (the manifest object is not data)
    back = sync([f"s3://{bucket}/runs/r1/"], str(tmp_path / "back"), endpoint_url=s3.endpoint_url)
    assert read_tree(tmp_path / "back") == tree | {"metrics.jsonl": b'{"iteration": 2}\n'}
    assert len(back.files) == len(tree)


def test_upload_of_a_run_leaves_out_the_evaluation_in_progress(s3: S3Server, tmp_path: Path) -> None:
    # While a run is uploaded its saves may still be evaluated: their pinned copies are removed once
    # scored, the evaluation jobs write their logs and record, results are written under a temporary name.
    bucket, run = s3.new_bucket(), tmp_path / "run"
    kept = {"metrics.jsonl": b"{}\n", "checkpoints/iter_0000010/model.pt": b"w", "eval/iter_0000010.json": b"{}"}
    working = {"eval/pinned/iter_0000020/checkpoints/iter_0000020/__0_0.distcp": b"w", "eval/jobs/12/12_0_log.out": b"",
               "eval/jobs.json": b"[]", "eval/.iter_0000020.json.tmp-7-8": b"{"}
    for rel, data in (kept | working).items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    m = upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url, exclude=EVALUATION_IN_PROGRESS)
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="runs/r1/")["Contents"]
    assert {o["Key"] for o in listed} == {f"runs/r1/{rel}" for rel in [*kept, MANIFEST_NAME]}
    assert {f.path for f in m.files} == set(kept)

    # the same from the command line
    r = cli(str(run), f"s3://{bucket}/runs/r2", "--endpoint-url", s3.endpoint_url,
            *[arg for pattern in EVALUATION_IN_PROGRESS for arg in ("--exclude", pattern)], env=s3.env)
    assert r.returncode == 0, r.stderr
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="runs/r2/")["Contents"]
    assert {o["Key"] for o in listed} == {f"runs/r2/{rel}" for rel in [*kept, MANIFEST_NAME]}


def test_upload_of_a_file_removed_meanwhile_is_tried_again(s3: S3Server, tmp_path: Path, monkeypatch) -> None:
    # Another process removes a file between the listing and its copy: the upload fails as transient,
    # so the stage runs it again, and the next try lists the folder again.
    bucket, run = s3.new_bucket(), tmp_path / "run"
    run.mkdir()
    (run / "kept.txt").write_text("kept")
    (run / "scored.bin").write_bytes(b"pinned until scored")
    listed_then_removed = uploader.list_local

    def list_local(*args, **kwargs):
        listed = listed_then_removed(*args, **kwargs)
        (run / "scored.bin").unlink()
        return listed
    monkeypatch.setattr(uploader, "list_local", list_local)
    with pytest.raises(TransientSyncError, match=r"scored.bin changed or was removed while it was uploaded"):
        upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url)
    monkeypatch.setattr(uploader, "list_local", listed_then_removed)
    m = upload(str(run), f"s3://{bucket}/runs/r1", endpoint_url=s3.endpoint_url)
    assert [f.path for f in m.files] == ["kept.txt"]

    # A copy that fails for another reason beside it is that failure, not worth trying again.
    (run / "new.txt").write_text("new")
    (run / "scored.bin").write_bytes(b"pinned again")
    monkeypatch.setattr(uploader, "list_local", list_local)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, s3.lister_env[k])
    with pytest.raises(SyncError, match=f"^access denied to s3://{LIST_ONLY_BUCKET}/runs/r1/") as e:
        upload(str(run), f"s3://{LIST_ONLY_BUCKET}/runs/r1", endpoint_url=s3.endpoint_url)
    assert not isinstance(e.value, TransientSyncError)


def test_upload_to_missing_bucket(s3: S3Server, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(SyncError, match="bucket 'nothere-bucket' does not exist"):
        upload(str(tmp_path / "f"), "s3://nothere-bucket/x", endpoint_url=s3.endpoint_url)


# ---------------------------------------------------------------- the Prefect task

def test_sync_task_caches_on_listing_and_retries_transient_errors(s3: S3Server, corpus, tmp_path: Path,
                                                                  prefect_harness) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client

    from tasks.sync import Remote, sync_task

    bucket, files = corpus
    dest = str(tmp_path / "dest")

    @flow
    def pipeline(endpoint: str, dest: str):
        return sync_task([f"s3://{bucket}/data/"], dest, remote=Remote(endpoint), return_state=True)

    first = pipeline(s3.endpoint_url, dest)
    assert first.is_completed() and not first.name == "Cached"
    assert pipeline(s3.endpoint_url, dest).name == "Cached"
    Path(dest, "part-0.jsonl").write_bytes(b"damaged")
    repaired = pipeline(s3.endpoint_url, dest)
    assert repaired.name == "Completed" and repaired.result().transferred_files == 1
    assert read_tree(Path(dest)) == files

    with get_client(sync_client=True) as client:
        progress = [a for a in client.read_artifacts() if a.type == "progress"]
    assert progress and any(a.data == 100.0 for a in progress)

    from prefect.exceptions import ObjectNotFound

    quick = sync_task.with_options(retries=1, retry_delay_seconds=0, retry_jitter_factor=None)

    @flow
    def attempts(src: str, endpoint: str) -> int:
        state = quick([src], str(tmp_path / "x"), remote=Remote(endpoint), return_state=True)
        assert state.is_failed()
        # Task runs reach the server as events, a moment after they end: read it once it is there, failed.
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:
                try:
                    run = client.read_task_run(state.state_details.task_run_id)
                    if run.state is not None and run.state.is_failed():
                        return run.run_count
                except ObjectNotFound:
                    pass
                assert time.monotonic() < deadline, "the failed task run never reached the server"
                time.sleep(0.2)

    assert attempts(f"s3://{bucket}/data/", "http://127.0.0.1:9") == 2         # unreachable: retried
    assert attempts("s3://no-such-bucket-here/", s3.endpoint_url) == 1          # missing bucket: not retried


def test_sync_task_of_local_sources_runs_again_on_new_content(tmp_path: Path, prefect_harness) -> None:
    """Cached while nothing is written; a same-size rewrite with its mtime set back runs it again with a
    new digest (so tokenize and index run again); a touch runs it and keeps the digest."""
    from prefect import flow

    from tasks.sync import sync_task

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b'{"text": "one"}\n')
    dest, roots = str(tmp_path / "dest"), [str(tmp_path)]

    @flow
    def pipeline(allowed: list[str], verify_content: bool = False):
        return sync_task([str(src)], dest, allowed_roots=allowed, verify_content=verify_content, return_state=True)

    first = pipeline(roots)
    assert first.name == "Completed" and pipeline(roots).name == "Cached"
    st = os.stat(src / "a.jsonl")
    (src / "a.jsonl").write_bytes(b'{"text": "ONE"}\n')
    os.utime(src / "a.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = pipeline(roots)
    assert changed.name == "Completed" and changed.result().transferred_files == 1
    assert changed.result().digest != first.result().digest
    assert pipeline(roots).name == "Cached"
    os.utime(src / "a.jsonl")
    touched = pipeline(roots)
    assert touched.name == "Completed" and touched.result().transferred_files == 0
    assert touched.result().digest == changed.result().digest
    forced = pipeline(roots, verify_content=True)
    assert forced.name == "Completed" and forced.result().hashed_bytes == 2 * len(b'{"text": "ONE"}\n')
    with pytest.raises(SyncError, match=f"^{src}/a.jsonl is outside the folders this sync may read"):
        pipeline([str(tmp_path / "elsewhere")])                  # the cached result is not handed out


@pytest.mark.timeout(120)
def test_keys_that_would_leave_the_destination_are_refused_by_name_before_any_transfer(monkeypatch, tmp_path: Path) -> None:
    """AWS S3 keeps a key such as ``data/../../x`` as written (SeaweedFS refuses it), so moto's
    server, which stores keys as AWS does, holds the bucket here."""
    import boto3
    from moto.server import ThreadedMotoServer

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="corpora")
        for key in ("data/a.jsonl", "data/../../../../x/escape.jsonl"):
            client.put_object(Bucket="corpora", Key=key, Body=b'{"text": "a"}\n')
        assert "data/../../../../x/escape.jsonl" in [o["Key"] for o in client.list_objects_v2(Bucket="corpora")["Contents"]]
        dest = tmp_path / "root" / "raw"
        with pytest.raises(SyncError, match=r"data/\.\./\.\./\.\./\.\./x/escape\.jsonl.*a '\.\.' segment.*nothing was copied"):
            sync(["s3://corpora/data/"], str(dest), endpoint_url=endpoint)
    finally:
        server.stop()
    assert not dest.exists() or read_tree(dest) == {}
    assert not list(tmp_path.rglob("*.jsonl")) and not list(Path("/x").glob("escape.jsonl"))


def test_a_path_inside_the_destination_is_told_from_one_that_is_not() -> None:
    from tasks.sync.listing import path_problem

    assert path_problem("a/b/c.jsonl") is None and path_problem("..a/b..") is None
    for rel, problem in (("../x", "'..'"), ("a/../../x", "'..'"), ("/etc/x", "absolute"), ("a//b", "empty"),
                         ("a/./b", "'.'"), ("a\0b", "NUL"), ("a/" + "n" * 256, "longer than 255")):
        assert problem in path_problem(rel), rel


@pytest.mark.timeout(60)
def test_an_endpoint_that_redirects_to_itself_is_one_line_after_one_request(tmp_path: Path) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    requests: list[str] = []

    class RedirectToItself(BaseHTTPRequestHandler):
        def answer(self) -> None:
            requests.append(self.path)
            self.send_response(301)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_PUT = do_POST = answer

        def log_message(self, *_) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), RedirectToItself)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret"}
    try:
        r = cli("s3://corpora/data/", str(tmp_path / "dest"), "--endpoint-url", endpoint, env=env)
    finally:
        server.shutdown()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: the S3 endpoint {endpoint} answered with a redirect (HTTP 301"), lines[0]
    assert "check --endpoint-url" in lines[0] and "Traceback" not in r.stderr + r.stdout
    assert len(requests) <= 3, requests
