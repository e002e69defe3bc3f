"""The run folder's record of its jobs: ``<run_dir>/jobs.json``, each job's id, executor, name,
submission script, and state changes."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gpt.files import write_json
from tasks.cluster.slurm import TERMINAL
from tasks.common.records import Seconds, read_record

JOBS_RECORD = "jobs.json"


class _State(BaseModel):
    time: Seconds
    state: str
    reason: str | None
    nodes: str | None


class _Job(BaseModel):
    job_id: str
    executor: str
    name: str
    sbatch_script: str | None
    submitted: Seconds
    states: list[_State]
    final: str | None


class JobRecord:
    """Appends job ids and state changes to <run_dir>/jobs.json."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / JOBS_RECORD
        self.jobs: list[dict[str, Any]] = read_record(self.path, list[_Job], "restore it from a copy, or move it "
                                                      "aside to start the run's job history anew", [])

    def add(self, job_id: str, kind: str, name: str, script: str | None) -> None:
        self.jobs.append({"job_id": job_id, "executor": kind, "name": name, "sbatch_script": script,
                          "submitted": time.time(), "states": [], "final": None})
        write_json(self.path, self.jobs)

    def state(self, job_id: str, state: str, reason: str, nodes: str) -> None:
        job = next(j for j in self.jobs if j["job_id"] == job_id)
        job["states"].append({"time": time.time(), "state": state, "reason": reason, "nodes": nodes})
        if state in TERMINAL or state in {"FINISHED", "INTERRUPTED", "HUNG", "STOPPED", "SPIKED"}:
            job["final"] = state
        write_json(self.path, self.jobs)

    def ids(self) -> list[str]:
        return [j["job_id"] for j in self.jobs]
