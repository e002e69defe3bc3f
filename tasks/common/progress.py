"""How far a stage has come, shown where whoever runs it looks: inside a Prefect run, the run's log
and a progress artifact; on a terminal, a bar redrawn in place; otherwise plain log lines.

Every stage that reports progress (sync and upload, tokenize, training) uses `Progress`: worker
threads call `add`, the thread that owns it calls `show`, which is throttled.
"""
from __future__ import annotations

import sys
import threading
import time

from tasks.common.run_context import run_context, run_logger


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def human_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class Progress:
    """Items (and bytes) done, out of a total when one is known.

    Args:
        label: what is being done, first on every line ("sync to /data", "tokenize").
        unit: what an item is ("files", "documents", "iterations").
        items: how many items there are, or None when unknown.
        nbytes: how many bytes they hold, or None when unknown or beside the point.
        artifact_key: the key of the Prefect progress artifact; None: no artifact.
        log_every_s: seconds between log lines; None: no lines (the artifact alone).
    """

    def __init__(self, label: str, unit: str, *, items: int | None = None, nbytes: int | None = None,
                 artifact_key: str | None = None, log_every_s: float | None = 10.0) -> None:
        self.label, self.unit, self.items, self.bytes = label, unit, items, nbytes
        self.done_items = self.done_bytes = 0
        self.note = ""                      # said after the figures while set (e.g. a straggler)
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._last_line = self._last_bar = self._last_artifact = self.start
        self._log_every_s = log_every_s
        self._percent = -1.0
        self.logger = run_logger()
        in_run = run_context() is not None
        self._bar = not in_run and log_every_s is not None and sys.stderr.isatty()
        self._artifact = None
        if in_run and artifact_key is not None:
            from prefect.artifacts import create_progress_artifact

            self._artifact = create_progress_artifact(self.percent(), key=artifact_key, description=self.line())

    def add(self, nbytes: int = 0, items: int = 1) -> None:
        with self._lock:
            self.done_items += items
            self.done_bytes += nbytes

    def set(self, items: int) -> None:
        with self._lock:
            self.done_items = items

    def percent(self) -> float:
        if self.bytes:
            return round(100.0 * self.done_bytes / self.bytes, 1)
        if self.items is not None:
            return round(100.0 * self.done_items / max(self.items, 1), 1) if self.items else 100.0
        return 0.0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        done = f"{self.done_items}" + (f"/{self.items}" if self.items is not None else "") + f" {self.unit}"
        rate = f"{self.done_items / elapsed:.1f} {self.unit}/s"
        if self.bytes is not None or self.done_bytes:
            total = f"/{human_bytes(self.bytes)}" if self.bytes is not None else ""
            line = f"{self.label}: {done}, {human_bytes(self.done_bytes)}{total}, {rate}, {human_bytes(self.done_bytes / elapsed)}/s"
        else:
            line = f"{self.label}: {done}, {rate}"
        return f"{line}; {self.note}" if self.note else line

    def show(self, final: bool = False) -> None:
        if final and self.items == 0:
            return                                  # there was nothing to do
        now = time.monotonic()
        if self._bar and (final or now - self._last_bar > 0.2):
            self._last_bar = now
            width, fraction = 30, self.percent() / 100
            filled = int(width * fraction)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.line()}\x1b[K{chr(10) if final else ''}")
            sys.stderr.flush()
        elif self._log_every_s is not None and (final or now - self._last_line >= self._log_every_s):
            self._last_line = now
            self.logger.info(self.line())
        if self._artifact is not None and self.percent() != self._percent and (final or now - self._last_artifact >= 1):
            from prefect.artifacts import update_progress_artifact

            self._percent, self._last_artifact = self.percent(), now
            try:
                update_progress_artifact(self._artifact, self._percent, description=self.line())
            except Exception as e:  # noqa: BLE001 - the API away (a server restart) must not stop the work shown
                self.logger.warning("progress not shown in Prefect (%s: %s); the work goes on", type(e).__name__, e)
