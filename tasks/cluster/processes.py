"""Processes on this host as Linux's /proc shows them: the local executor's jobs and their ranks."""
from __future__ import annotations

import contextlib
from pathlib import Path

STATE_WORDS = {"T": "stopped", "t": "stopped by a debugger", "D": "waiting in the kernel (uninterruptible)",
               "Z": "exited"}


def process_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, D, T, Z, ...), or None where there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]      # the command in parentheses may hold spaces


def command_line(pid: int) -> bytes:
    """The process's arguments, NUL-separated (empty where there is no such process)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return tree
