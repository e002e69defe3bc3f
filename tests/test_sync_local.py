"""tasks.sync from local sources: what it may read (regular files, inside the allowed roots, never its
own destination), the permission bits of the copies, and changed content found by its digest."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from awscrt import checksums

from tasks.sync import MANIFEST_NAME, PARTIAL_DIR, SyncError, sync
from tasks.sync import content as content_module

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def crc64(data: bytes) -> str:
    return f"crc64nvme:{checksums.crc64nvme(data):016x}"


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


# ---------------------------------------------------------------- what a sync may read

@pytest.mark.timeout(60)
def test_special_files_are_refused_by_name(tmp_path: Path) -> None:
    """Devices, FIFOs and sockets, given as sources, found in a source folder or behind a link, are
    refused by name before anything is read or written."""
    dest = tmp_path / "dest"
    for device, what in (("/dev/zero", "a character device"), ("/dev/urandom", "a character device")):
        with pytest.raises(SyncError, match=f"^{device} is {what}, not a regular file"):
            sync([device], str(dest))
    src = tree(tmp_path / "src", {"a.jsonl": b"{}\n"})
    os.mkfifo(src / "pipe")
    with pytest.raises(SyncError, match=f"^{src}/pipe is a FIFO, not a regular file"):
        sync([str(src)], str(dest))                  # would block forever reading it
    (src / "pipe").unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "sock"))
        with pytest.raises(SyncError, match=f"^{src}/sock is a socket, not a regular file"):
            sync([str(src / "*")], str(dest))
    (src / "sock").unlink()
    (src / "noise").symlink_to("/dev/urandom")      # would fill the disk
    with pytest.raises(SyncError, match=f"^{src}/noise \\(a link to /dev/urandom\\) is a character device"):
        sync([str(src)], str(dest))
    assert not dest.exists()
    (src / "noise").unlink()
    assert [f.path for f in sync([str(src)], str(dest)).files] == ["a.jsonl"]


@pytest.mark.timeout(60)
def test_cli_refuses_a_device_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "tasks.sync", "/dev/zero", str(tmp_path / "dest")], cwd=ROOT,
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "error: /dev/zero is a character device, not a regular file: sources are regular files or folders of "
        "them; leave it out of the sources"], r.stderr
    assert not (tmp_path / "dest").exists()


def test_links_out_of_the_allowed_roots_are_refused(tmp_path: Path) -> None:
    allowed, secret = tmp_path / "allowed", tree(tmp_path / "secret", {"key.pem": b"private"})
    src = tree(allowed / "src", {"a.jsonl": b"{}\n", "b.jsonl": b"[]\n"})
    (src / "inside.jsonl").symlink_to(src / "a.jsonl")
    (src / "key.jsonl").symlink_to(secret / "key.pem")
    roots = [str(allowed)]
    dest = tmp_path / "out" / "dest"
    with pytest.raises(SyncError, match=(f"^{src}/key.jsonl \\(a link to {secret}/key.pem\\) is outside the folders "
                                         f"this sync may read \\({allowed}\\)")):
        sync([str(src)], str(dest), allowed_roots=roots)
    with pytest.raises(SyncError, match=f"^{secret}/key.pem is outside the folders this sync may read"):
        sync([str(secret / "key.pem")], str(dest), allowed_roots=roots)
    (allowed / "secret-link").symlink_to(secret)     # a folder link: its files are outside too
    with pytest.raises(SyncError, match=f"^{allowed}/secret-link/key.pem \\(a link to {secret}/key.pem\\) is outside"):
        sync([str(allowed / "secret-link")], str(dest), allowed_roots=roots)
    assert not dest.exists()
    (src / "key.jsonl").unlink()
    m = sync([str(src)], str(dest), allowed_roots=roots)    # a link inside the roots is read
    assert sorted(f.path for f in m.files) == ["a.jsonl", "b.jsonl", "inside.jsonl"]
    assert (dest / "inside.jsonl").read_bytes() == b"{}\n" and not (dest / "inside.jsonl").is_symlink()
    (src / "key.jsonl").symlink_to(secret / "key.pem")  # no roots given: only the special-file rule
    anywhere = sync([str(src)], str(tmp_path / "anywhere"))
    assert "key.jsonl" in {f.path for f in anywhere.files}
    assert (tmp_path / "anywhere" / "key.jsonl").read_bytes() == b"private"


def test_the_destination_is_never_read_back(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"a.jsonl": b"{}\n"})
    inner = src / "copy"
    with pytest.raises(SyncError, match=f"^the destination {inner} lies inside the source folder {src}: "):
        sync([str(src)], str(inner))
    with pytest.raises(SyncError, match=f"^the destination {inner} lies inside the source folder {src}/: "):
        sync([str(src / "*.jsonl")], str(inner))
    assert not inner.exists()
    dest = tmp_path / "dest"
    sync([str(src)], str(dest))
    with pytest.raises(SyncError, match=f"^{dest}/a.jsonl lies inside the destination {dest}: "):
        sync([str(dest / "a.jsonl")], str(dest))
    (src / "back").symlink_to(dest / "a.jsonl")
    with pytest.raises(SyncError, match=f"^{src}/back \\(a link to {dest}/a.jsonl\\) lies inside the destination"):
        sync([str(src)], str(dest))
    (tmp_path / "dest-link").symlink_to(src)              # the destination named through a link
    with pytest.raises(SyncError, match="lies inside the source folder"):
        sync([str(src)], str(tmp_path / "dest-link" / "sub"))


# ---------------------------------------------------------------- permission bits

def test_copies_keep_the_source_permission_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each copy gets its source's bits (narrowed by the umask), from the moment it is created under
    the partial folder, which only the owner may enter; the manifest is no wider than the narrowest."""
    modes = {"secret.jsonl": 0o600, "group.jsonl": 0o640, "tool.sh": 0o750, "open.jsonl": 0o644}
    src = tree(tmp_path / "src", {rel: rel.encode() * 100 for rel in modes})
    for rel, m in modes.items():
        os.chmod(src / rel, m)
    staged: dict[str, tuple[int, int]] = {}          # name -> (its mode, the partial folder's) while written
    digest = content_module.digest

    def watched(fd: int, size: int, copy_to: int | None = None) -> str:
        if copy_to is not None:
            path = Path(os.readlink(f"/proc/self/fd/{copy_to}"))
            assert path.parent.name == PARTIAL_DIR
            staged[path.name] = (os.fstat(copy_to).st_mode & 0o777, mode(path.parent))
        return digest(fd, size, copy_to)

    monkeypatch.setattr(content_module, "digest", watched)
    with umask(0o022):
        sync([str(src)], str(tmp_path / "d1"))
    assert {rel: mode(tmp_path / "d1" / rel) for rel in modes} == modes
    assert staged == {rel: (m, 0o700) for rel, m in modes.items()}
    assert mode(tmp_path / "d1" / MANIFEST_NAME) == 0o600
    staged.clear()
    with umask(0o077):                                # the umask narrows further, never widens
        sync([str(src)], str(tmp_path / "d2"))
    assert {rel: mode(tmp_path / "d2" / rel) for rel in modes} == {rel: m & 0o700 for rel, m in modes.items()}
    assert staged == {rel: (m & 0o700, 0o700) for rel, m in modes.items()}
    with umask(0o022):
        sync([str(src / "open.jsonl")], str(tmp_path / "d3"))
        assert mode(tmp_path / "d3" / MANIFEST_NAME) == 0o644
        os.chmod(src / "group.jsonl", 0o600)          # narrowed at the source: so is the copy, not copied again
        again = sync([str(src)], str(tmp_path / "d1"))
    assert again.transferred_files == 0 and mode(tmp_path / "d1" / "group.jsonl") == 0o600


# ---------------------------------------------------------------- changed content

def test_same_size_rewrite_with_restored_mtime_is_synced_again(tmp_path: Path) -> None:
    src = tree(tmp_path / "src", {"a.jsonl": b'{"text": "one"}\n', "b.jsonl": b'{"text": "two"}\n'})
    dest = tmp_path / "dest"
    first = sync([str(src)], str(dest))
    recorded = {f.path: f.content for f in first.files}
    assert recorded == {"a.jsonl": crc64(b'{"text": "one"}\n'), "b.jsonl": crc64(b'{"text": "two"}\n')}
    assert all(f.source_ctime_ns is not None for f in first.files)   # fresh files: hashed again, then recorded
    st = os.stat(src / "a.jsonl")
    (src / "a.jsonl").write_bytes(b'{"text": "ONE"}\n')              # same size ...
    os.utime(src / "a.jsonl", ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the mtime set back
    after = os.stat(src / "a.jsonl")
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    second = sync([str(src)], str(dest))
    assert second.transferred_files == 1 and (dest / "a.jsonl").read_bytes() == b'{"text": "ONE"}\n'
    assert second.digest != first.digest and second.files[0].content == crc64(b'{"text": "ONE"}\n')
    os.utime(src / "b.jsonl")                                        # touched, content the same
    third = sync([str(src)], str(dest))
    assert third.transferred_files == 0 and third.hashed_bytes >= len(b'{"text": "two"}\n')
    assert third.digest == second.digest
    assert sync([str(src)], str(dest)).hashed_bytes == 0          # its new stamp recorded: not hashed again
    # replaced by another file (another inode) with the same size and times: hashed, found changed
    other = tmp_path / "other.jsonl"
    other.write_bytes(b'{"text": "TWO"}\n')
    st = os.stat(src / "b.jsonl")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, src / "b.jsonl")
    fourth = sync([str(src)], str(dest))
    assert fourth.transferred_files == 1 and (dest / "b.jsonl").read_bytes() == b'{"text": "TWO"}\n'
    assert fourth.digest not in (first.digest, second.digest)


@pytest.mark.timeout(120)
def test_unchanged_large_source_is_not_hashed_again(tmp_path: Path) -> None:
    data = os.urandom(50 * MIB)
    src = tree(tmp_path / "src", {"big.bin": data, "small.jsonl": b"{}\n"})
    total = len(data) + 3
    dest = tmp_path / "dest"
    first = sync([str(src)], str(dest))
    assert first.hashed_bytes >= total and first.transferred_files == 2
    assert json.loads((dest / MANIFEST_NAME).read_text())["files"][0]["content"] == crc64(data)
    again = sync([str(src)], str(dest))
    assert again.hashed_bytes == 0 and again.transferred_files == 0 and again.digest == first.digest
    # the copy damaged behind the manifest's back, its size and mtime kept: only a full check sees it
    st = os.stat(dest / "big.bin")
    with open(dest / "big.bin", "r+b") as f:
        f.seek(30 * MIB)
        f.write(b"\0" * 16)
    os.utime(dest / "big.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert sync([str(src)], str(dest)).transferred_files == 0
    full = sync([str(src)], str(dest), verify_content=True)
    assert full.hashed_bytes >= 2 * total and full.transferred_files == 1
    assert (dest / "big.bin").read_bytes() == data and full.digest == first.digest
    clean = sync([str(src)], str(dest), verify_content=True)     # every source and copy read: nothing to do
    assert clean.hashed_bytes == 2 * total and clean.transferred_files == 0
