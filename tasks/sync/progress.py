"""Files and bytes done out of the total: Prefect log lines and a progress artifact inside a run, a
terminal bar on a tty, plain log lines otherwise."""
from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger("tasks.sync")


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
