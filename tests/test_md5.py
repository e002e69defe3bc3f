"""Multi-buffer MD5 (native.md5_ranges) and the process-wide batching hasher of tasks.sync."""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from native.md5 import md5_lanes, md5_ranges
from tasks.sync import HASHER, md5_check, multipart_etag
from tasks.sync.integrity import Hasher

WIDTHS = [w for w in (1, 8, 16, 32) if w <= md5_lanes()]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[int, bytes]:
    data = random.Random(3).randbytes(3_000_000)
    path = tmp_path_factory.mktemp("md5") / "data.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("lanes", WIDTHS)
def test_digests_equal_hashlib_for_every_length_and_lane_width(data_file, lanes: int) -> None:
    fd, data = data_file
    rng = random.Random(lanes)
    lengths = list(range(0, 200)) + [255, 256, 4095, 65535, 65536, 65536 + 55, 65536 + 56, 131072, 1_000_003]
    lengths += [rng.randrange(2_000_000) for _ in range(40)]
    ranges = [(fd, rng.randrange(1000), n) for n in lengths]
    rng.shuffle(ranges)                 # lanes take messages of mixed lengths, and hand them to narrower ones
    got = md5_ranges(ranges, lanes)
    assert got == [hashlib.md5(data[off:off + n]).digest() for _, off, n in ranges]


def test_a_range_past_the_end_of_the_file_is_none(data_file) -> None:
    fd, data = data_file
    got = md5_ranges([(fd, len(data) - 10, 5), (fd, len(data) - 10, 11), (fd, 0, 64)])
    assert got == [hashlib.md5(data[-10:-5]).digest(), None, hashlib.md5(data[:64]).digest()]


def test_bad_arguments_are_clear_errors(data_file) -> None:
    fd, _ = data_file
    with pytest.raises(ValueError, match="lanes=3"):
        md5_ranges([(fd, 0, 1)], 3)
    with pytest.raises(ValueError, match="negative"):
        md5_ranges([(fd, -1, 1)])


def test_hasher_batches_concurrent_callers(tmp_path: Path) -> None:
    rng = random.Random(5)
    files = {tmp_path / f"f{i}": rng.randbytes(rng.randrange(1, 300_000)) for i in range(200)}
    for path, data in files.items():
        path.write_bytes(data)
    checks = [md5_check(p, len(d), hashlib.md5(d).hexdigest()) for p, d in files.items()]   # all in flight at once
    assert [c.result() for c in checks] == ["md5"] * len(files)
    with cf.ThreadPoolExecutor(32) as pool:        # callers that wait, from many threads
        got = list(pool.map(lambda p: HASHER.digests(p, [(0, len(files[p]))])[0], files))
    assert got == [hashlib.md5(d).digest() for d in files.values()]
    big = tmp_path / "f0"
    size = len(files[big])
    assert md5_check(big, size, "0" * 32).result() is None
    assert md5_check(big, size + 1, hashlib.md5(files[big]).hexdigest()).result() is None
    assert md5_check(tmp_path / "missing", 1, "0" * 32).result() is None
    parts = [hashlib.md5(files[big][i:i + 50_000]).digest() for i in range(0, size, 50_000)]
    assert multipart_etag(big, 50_000) == f"{hashlib.md5(b''.join(parts)).hexdigest()}-{len(parts)}"
    assert HASHER.digests(big, [(size, 1)]) == [None]


def test_the_checks_run_their_conclusion_in_the_hashing_thread_at_a_lower_priority(tmp_path: Path) -> None:
    """A check's `then` runs where the digest is known, in one of the hashing threads, which run
    below the priority of the thread that started them: the transfer they verify goes first."""
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    ran: list[tuple[str, int]] = []

    def then(check):
        ran.append((threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if check is None:
            raise ValueError("not the file")
        return check.upper()

    assert md5_check(path, 3, hashlib.md5(b"abc").hexdigest(), then=then).result() == "MD5"
    with pytest.raises(ValueError, match="not the file"):
        md5_check(path, 3, "0" * 32, then=then).result()
    with pytest.raises(ValueError, match="not the file"):       # no hashing: the size differs
        md5_check(path, 4, hashlib.md5(b"abc").hexdigest(), then=then).result()
    assert [name for name, _ in ran] == ["md5", "md5", "MainThread"]
    assert all(nice >= Hasher.NICE for name, nice in ran if name == "md5")


def test_the_portable_build_for_cpus_without_x86_simd(tmp_path, data_file) -> None:
    """What aarch64 head nodes build: the same module with only the one-lane engine, same digests."""
    import subprocess
    import sys
    import sysconfig

    import pybind11

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "native"
    out.mkdir()
    (out / "__init__.py").write_text("")
    target = out / f"_md5{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-DMD5_PORTABLE",
                    f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}",
                    str(root / "native" / "md5.cpp"), "-o", str(target)],
                   check=True, timeout=300)
    fd, data = data_file
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from native._md5 import md5_lanes, md5_ranges; "
            "fd = os.open(sys.argv[2], os.O_RDONLY); "
            "print(md5_lanes(), *[d.hex() for d in md5_ranges([(fd, 0, 3_000_000), (fd, 7, 1000), (fd, 5, 0)])])")
    path = os.readlink(f"/proc/self/fd/{fd}")
    lanes, *digests = subprocess.run([sys.executable, "-c", code, str(tmp_path), path], capture_output=True, text=True,
                                     check=True, timeout=120).stdout.split()
    assert lanes == "1"
    assert digests == [hashlib.md5(data).hexdigest(), hashlib.md5(data[7:1007]).hexdigest(), hashlib.md5(b"").hexdigest()]
