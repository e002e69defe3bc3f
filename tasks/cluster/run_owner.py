"""One owner per run folder: an exclusive lock that the operating system drops when its holder
dies, however it dies, naming the holder for whoever is refused."""
from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tasks.common.run_context import flow_run_id


class RunBusy(RuntimeError):
    """Another process owns the run folder."""
    transient = False


class RunOwner:
    """One owner per run folder: an exclusive lock on ``<run_dir>/.owner`` that the operating system
    drops when its holder dies, however it dies. The file names the holder, for the message a second
    run gets. Nested use in one process (a stage that owns the folder submitting a job into it)
    holds the one lock.

    ``wait``: instead of refusing, wait for the holder to let go, calling ``wait(holder)`` every
    ``poll_s`` seconds meanwhile (to show what the holder does)."""

    _held: dict[Path, int] = {}
    _lock = threading.Lock()

    def __init__(self, run_dir: Path, wait: Callable[[str], None] | None = None, poll_s: float = 2.0) -> None:
        self.path = Path(run_dir).resolve() / ".owner"
        self.fd: int | None = None
        self.wait, self.poll_s = wait, poll_s

    def __enter__(self) -> "RunOwner":
        with self._lock:
            if self.path in self._held:
                self._held[self.path] += 1
                return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            if self.wait is None:
                os.close(fd)
                raise RunBusy(f"run folder {self.path.parent} is in use by {holder}: wait for that run to finish (or "
                              "cancel it), or set output.run_name to train in another folder")
            try:
                self.wait(holder)
            except BaseException:
                os.close(fd)
                raise
            time.sleep(self.poll_s)
        os.ftruncate(fd, 0)
        flow_run = flow_run_id()
        os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()}" + (f", flow run {flow_run}" if flow_run else "")
                       + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}").encode(), 0)
        with self._lock:
            self._held[self.path] = 1
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._held[self.path] -= 1
            if self._held[self.path]:
                return
            del self._held[self.path]
        if self.fd is not None:
            os.close(self.fd)       # releases the lock
            self.fd = None
