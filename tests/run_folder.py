"""What tests read of a run folder while its jobs run: the job records, the iterations trained, and
a bounded wait for either to say something."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """The predicate's first true value, or an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def job_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run folder's jobs.json (tasks.cluster.record.JobRecord), empty before the first submission."""
    path = run_dir / "jobs.json"
    return json.loads(path.read_text()) if path.exists() else []


def trained_iterations(run_dir: Path) -> list[int]:
    """The iterations of the train records in metrics.jsonl, in file order."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["iteration"] for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]
