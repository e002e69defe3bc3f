"""What a finished job left: rank 0's result (given shared storage a moment to show it), and for a
failed job SLURM's verdict with the log tail of the rank that failed first."""
from __future__ import annotations

import re
import time
from collections import deque
from pathlib import Path
from typing import Any

from submitit.core.utils import JobPaths, pickle_load

RESULT_GRACE_S = 20.0
SRUN_TASK_FAILED = re.compile(r"srun: error: \S+: task (\d+): (?:Killed|Exited|Segmentation|Aborted|Terminated)")


def _tail(path: Path, n: int = 40) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except FileNotFoundError:
        return ""


def _load_result(paths: JobPaths) -> tuple[str, Any] | None:
    try:
        return pickle_load(paths.result_pickle)
    except (FileNotFoundError, EOFError):
        return None


def await_result(paths: JobPaths) -> tuple[str, Any] | None:
    """Rank 0's result, allowing shared storage a moment to show it."""
    deadline = time.monotonic() + RESULT_GRACE_S
    result = _load_result(paths)
    while result is None and time.monotonic() < deadline:
        time.sleep(0.5)
        result = _load_result(paths)
    return result


def _failing_rank(folder: Path, job_id: str, num_tasks: int) -> int:
    """The first task srun reported dead, else the first whose result is an error, else the first
    with a traceback, else rank 0."""
    paths = [JobPaths(folder, job_id=job_id, task_id=r) for r in range(num_tasks)]
    reported = [int(r) for r in SRUN_TASK_FAILED.findall(_tail(paths[0].stderr, 400)) if int(r) < num_tasks]
    if reported:
        return reported[0]
    for rank, p in enumerate(paths):
        result = _load_result(p)
        if result is not None and result[0] == "error":
            return rank
    for rank, p in enumerate(paths):
        if "Traceback" in _tail(p.stderr, 200):
            return rank
    return 0


def failure_report(folder: Path, job_id: str, num_tasks: int, state: str, reason: str) -> str:
    """SLURM's verdict plus the tail of the failing rank's log."""
    rank = _failing_rank(folder, job_id, num_tasks)
    paths = JobPaths(folder, job_id=job_id, task_id=rank)
    err = _tail(paths.stderr)
    out = _tail(paths.stdout, 10)
    why = f" (reason: {reason})" if reason not in ("", "None") else ""
    return (f"job {job_id} ended {state}{why}; rank {rank} log tail "
            f"({paths.stderr}):\n{err or '(empty)'}\n--- stdout ({paths.stdout}):\n{out or '(empty)'}")
