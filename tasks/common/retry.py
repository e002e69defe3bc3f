"""The one rule for retrying a stage: an error says whether running again can help (its class's
``transient``: a failed job, network trouble, an interrupted download); an error that says nothing
is retried when it is an I/O error (OSError: a connection reset, a file server that went away) and
not otherwise (a refusal of bad input, a bug: the same run fails the same way)."""
from __future__ import annotations

from typing import Any


def transient(error: BaseException | None) -> bool:
    """Whether running again may succeed where ``error`` failed."""
    if error is None:
        return False
    return bool(getattr(error, "transient", isinstance(error, OSError)))


def worth_retrying(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition for every stage: the failed state's error is transient."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, BaseException) and transient(error)
