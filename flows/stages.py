"""Running the stages of a flow: each stage a cached task (whose own cache policy runs it again
when its recorded outputs are gone or damaged: tasks.common.cache), its wall time and final state
recorded, and a failure named by its stage."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypeVar

from tasks.common.run_context import run_logger

if TYPE_CHECKING:
    from prefect import Task

R = TypeVar("R")


class Stages:
    """Runs stage tasks in order, recording wall time and final state (Completed or Cached)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def skip(self, stage: str, why: str) -> None:
        run_logger().info("stage %s skipped: %s", stage, why)
        self.records.append({"stage": stage, "state": "Skipped", "seconds": 0.0})

    def run(self, stage: str, task_fn: "Task[..., R]", *args: Any, origins: dict[str, str] | None = None,
            **kwargs: Any) -> R:
        """Run a stage task. ``origins``: the user's name (a source path or S3 key) of each file the
        stage reads from a copy, which its error names instead of the copy."""
        start = time.perf_counter()
        state = task_fn(*args, return_state=True, **kwargs)
        self.records.append({"stage": stage, "state": state.name, "seconds": time.perf_counter() - start})
        try:
            return state.result()  # raises the stage's error, failing the flow run
        except Exception as e:
            e.failed_stage = stage  # named in the flow run's final state (flows.plan.params.refused_as_failed_run)
            if origins:
                e.args = tuple(named_as_given(a, origins) if isinstance(a, str) else a for a in e.args)
            raise


def named_as_given(text: str, origins: dict[str, str]) -> str:
    """``text`` with each copy's path replaced by the name the user gave its original."""
    for copy in sorted(origins, key=len, reverse=True):
        text = text.replace(copy, origins[copy])
    return text
