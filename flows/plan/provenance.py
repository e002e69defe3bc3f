"""How a run was made, kept in its folder beside config.json: each start's time, flow run and
parameters (or command line), the project's git commit and whether the tree was dirty, and the
versions of the packages that train it."""
from __future__ import annotations

import json
import platform
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from gpt.files import write_json
from tasks.benchmark_history import git_state, now

RECORD = "provenance.json"
PACKAGES = ("gpt-pretrain", "gpt-core", "torch", "numpy", "prefect", "pydantic", "submitit", "boto3",
            "transformers", "torchao", "torch-xla", "torch-neuronx")
PROJECT = Path(__file__).resolve().parents[2]


def record(run_dir: Path, flow_run_id: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    """Add this start to ``run_dir``/provenance.json (one entry per start, oldest first)."""
    path = run_dir / RECORD
    starts = recorded(run_dir)
    entry = {"time": now(), "flow_run_id": flow_run_id, "host": socket.gethostname(), "argv": sys.argv,
             "parameters": {k: _plain(v) for k, v in parameters.items()}, "project": str(PROJECT), **git_state(PROJECT),
             "python": platform.python_version(), "packages": versions()}
    write_json(path, {"starts": [*starts, entry]})
    return entry


def _plain(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def recorded(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / RECORD).read_text())["starts"]
    except (OSError, ValueError, KeyError):
        return []


def versions() -> dict[str, str]:
    """Installed versions of PACKAGES (those not installed left out)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found
