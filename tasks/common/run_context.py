"""Where this code runs in Prefect: the run's logger, its flow run, whether that was cancelled.
Outside a run each answers as plain Python would (the module logger, None, False)."""
from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("tasks")


def log_to_stderr() -> None:
    """Command lines: this package's log lines (progress, summaries) on stderr, whatever logging
    setup importing Prefect made."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def run_context() -> Any:
    if "prefect.context" not in sys.modules:
        return None         # no run without Prefect loaded: a command line need not pay its import
    from prefect.context import FlowRunContext, TaskRunContext

    return TaskRunContext.get() or FlowRunContext.get()


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    if run_context() is not None:
        from prefect.logging import get_run_logger

        return get_run_logger()
    return log


def flow_run_id() -> Any:
    ctx = run_context()
    if ctx is None:
        return None
    run = getattr(ctx, "task_run", None)
    return run.flow_run_id if run is not None else ctx.flow_run.id


def flow_run_cancelled(flow_run_id: Any) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType

    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception as e:  # an unreachable API must not stop the watch; the next check retries
        log.warning("could not read flow run %s: %s", flow_run_id, e)
        return False
    return state is not None and state.type in (StateType.CANCELLING, StateType.CANCELLED)
