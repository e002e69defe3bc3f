"""Files and folders that appear whole or not at all: written under a temporary name beside their
place and renamed onto it, so a reader (or a later run after a crash) never sees part of one.

A write that fails because the storage is full, read-only or not writable raises WriteError, whose
message names the path and what to do; what was written so far is removed. A folder is replaced
only when it is empty or its writer recognises it as its own: nothing a writer did not write is
ever deleted.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

_WHAT_TO_DO = {
    errno.ENOSPC: "no space left on the device: free space in {folder} (or write elsewhere) and run it again",
    errno.EDQUOT: "the disk quota is used up: free space in {folder} (or write elsewhere) and run it again",
    errno.EROFS: "{folder} is on a read-only file system: make it writable (or write elsewhere) and run it again",
    errno.EACCES: "permission denied: make {folder} writable for this user (or write elsewhere) and run it again",
    errno.EPERM: "not permitted: make {folder} writable for this user (or write elsewhere) and run it again",
}


class WriteError(OSError):
    """A write failed for a reason that whoever owns the storage fixes; ``str()`` is the message."""
    transient = False          # a full or read-only disk stays so: running again does not help

    def __str__(self) -> str:
        return self.strerror


class NotReplaceable(ValueError):
    """A folder holds what its writer did not write, so it is not replaced; nothing was changed."""


def storage_error(error: BaseException, path: str | os.PathLike,
                  written: Iterable[str | os.PathLike] = ()) -> WriteError | None:
    """``error`` as a WriteError naming ``path`` and what to do, when the storage is at fault (full,
    read-only, not writable); None for any other error. A denied access counts only when it concerns
    ``path``, what lies in the ``written`` paths (temporary ones) or the folders holding them: reading
    something else (a checkpoint) may be denied too, and making the output writable would not help."""
    if not isinstance(error, OSError) or isinstance(error, WriteError) or error.errno not in _WHAT_TO_DO:
        return None
    path = Path(path)
    if error.errno in (errno.EACCES, errno.EPERM) and error.filename is not None:
        denied = Path(os.fsdecode(error.filename)).absolute()
        targets = [Path(p).absolute() for p in (path, *written)]
        if not any(denied.is_relative_to(t) or t.is_relative_to(denied) for t in targets):
            return None
    advice = _WHAT_TO_DO[error.errno].format(folder=path.parent)
    return WriteError(error.errno, f"cannot write {path}: {advice}")


@contextlib.contextmanager
def writing(path: str | os.PathLike, written: Iterable[str | os.PathLike] = ()) -> Iterator[None]:
    """Turns a storage failure inside the block into a WriteError naming ``path`` (see storage_error)."""
    try:
        yield
    except OSError as e:
        clear = storage_error(e, path, written)
        if clear is None:
            raise
        raise clear from e


@contextlib.contextmanager
def as_os_error(path: str | os.PathLike) -> Iterator[None]:
    """safetensors and tokenizers report a failed write as their own exception whose text ends in
    Rust's "(os error N)": raise it as the OSError it is, so that a full or read-only disk is named."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e


def _writer_id() -> str:
    """This writer's own suffix (host, process, thread): two writers never share a temporary name."""
    return f"{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def replaced(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed onto it when the block ends without an error and
    removed otherwise. The name is this writer's own (process and thread), never shared."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with writing(path, [tmp]):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):     # absent, or a read-only folder where it never was
            os.remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    with replaced(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def write_json(path: str | os.PathLike, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def check_replaceable(folder: Path, foreign: Callable[[Path], Iterable[str]], writer: str) -> None:
    """Refuse (NotReplaceable) unless ``folder`` is absent, an empty folder, or a folder in which
    ``foreign`` finds no entry that ``writer`` did not write."""
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise NotReplaceable(f"{folder} exists and is not a folder: {writer} writes a folder there; "
                             "give another path or move it away")
    if not any(folder.iterdir()):
        return
    names = sorted(foreign(folder))
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise NotReplaceable(f"{folder} holds what {writer} did not write ({shown}), so it is left as it is: "
                             "give a new or empty folder, or move those away")


@contextlib.contextmanager
def replaced_folder(folder: str | os.PathLike, foreign: Callable[[Path], Iterable[str]],
                    writer: str) -> Iterator[Path]:
    """An empty temporary folder beside ``folder`` that takes its place when the block ends without
    an error, and is removed otherwise.

    ``folder`` must be absent, an empty folder, or one that ``writer`` wrote before: ``foreign(folder)``
    lists the entries it did not write, and any makes this refuse with NotReplaceable, on entry
    (before anything is written) and again just before the swap. An absent or empty folder is
    replaced in one rename; a previous one is moved aside, the new one renamed into its place, and
    the previous one then removed. Then the temporary folders of writers that were killed (same
    host, process gone) are removed.
    """
    folder = Path(folder).resolve()
    check_replaceable(folder, foreign, writer)
    suffix = _writer_id()
    tmp = folder.with_name(f".{folder.name}.tmp-{suffix}")
    try:
        with writing(folder, [tmp]):
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            yield tmp
            _swap(tmp, folder, folder.with_name(f".{folder.name}.old-{suffix}"), foreign, writer)
            _remove_stale(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(tmp: Path, folder: Path, old: Path, foreign: Callable[[Path], Iterable[str]], writer: str) -> None:
    try:
        os.rename(tmp, folder)           # absent or empty: replaced in one step
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    check_replaceable(folder, foreign, writer)   # it may have changed while the new one was written
    os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except BaseException:
        os.rename(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(folder: Path) -> None:
    """Remove ``.<name>.tmp-*`` / ``.<name>.old-*`` folders that a killed writer on this host left."""
    if not folder.parent.is_dir():
        return
    host = socket.gethostname()
    for entry in folder.parent.iterdir():
        for kind in ("tmp", "old"):
            rest = entry.name.removeprefix(f".{folder.name}.{kind}-{host}-")
            pid = rest.partition("-")[0]
            if rest != entry.name and pid.isdigit() and not process_alive(int(pid)) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
