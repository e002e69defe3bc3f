"""A run whose estimate is over its budget waits for a person: the Prefect run pauses with the
estimate on its form, and goes on only when approved."""
from __future__ import annotations

import math
import os

from prefect.input import RunInput
from pydantic import Field

from flows.plan.estimate import Estimate
from flows.plan.params import BudgetParams, ParameterError
from tasks.common.run_context import run_logger

# The operator's caps, set where the flow runs: a run's own budget may only be lower.
CAPS = {"node_hours": "GPT_BUDGET_NODE_HOURS", "cost": "GPT_BUDGET_COST"}


class Approval(RunInput):
    approve: bool = Field(False, description="Submit the run as planned")
    reason: str = Field("", max_length=2000, description="Why not (when not approving)")


def with_operator_caps(budget: BudgetParams, environ: dict[str, str] | os._Environ = os.environ) -> BudgetParams:
    """``budget`` with each limit lowered to the operator's cap where one is set."""
    limits = {}
    for field, variable in CAPS.items():
        text = environ.get(variable)
        if not text:
            continue
        try:
            cap = float(text)
        except ValueError:
            cap = math.nan
        if not (math.isfinite(cap) and cap > 0):
            raise ParameterError([f"budget: {variable}={text!r} where the flow runs is not a positive number; "
                                  "the operator must fix it"])
        own = getattr(budget, field)
        limits[field] = cap if own is None else min(own, cap)
    return budget.model_copy(update=limits)


def over_budget(estimate: Estimate, budget: BudgetParams) -> str | None:
    """Why ``estimate`` needs approval under ``budget``, or None."""
    if not budget.set or estimate.tokens == 0:
        return None
    if budget.node_hours is not None:
        if estimate.node_hours is None:
            return f"no estimate of node-hours ({estimate.source}) against budget.node_hours={budget.node_hours:g}"
        if estimate.node_hours > budget.node_hours:
            return f"{estimate.node_hours:,.1f} node-hours estimated, budget.node_hours={budget.node_hours:g}"
    if budget.cost is not None:
        if estimate.cost is None:
            why = estimate.source if estimate.node_hours is None else "the cluster preset has no price_per_node_hour"
            return f"no cost estimate ({why}) against budget.cost={budget.cost:g}"
        if estimate.cost > budget.cost:
            return f"{estimate.cost:,.2f} {estimate.currency} estimated, budget.cost={budget.cost:g}"
    return None


def approval_form(estimate: Estimate, why: str) -> str:
    lines = [f"**Over budget:** {why}.", "", "| | |", "|---|---|"]
    lines += [f"| {item} | {value} |" for item, value in estimate.rows()]
    lines += ["", "Approve to submit the run as planned; otherwise give a reason, and the run ends Cancelled."]
    return "\n".join(lines)


def ask(estimate: Estimate, why: str, budget: BudgetParams, server: bool) -> Approval:
    """Pause this flow run until someone answers on its form (``server``: a Prefect server lasts
    beyond this process to answer on; without one the run stops here)."""
    if not server:
        raise ParameterError([f"budget: {why}; approve it from the Prefect UI (run against a Prefect server: "
                              "PREFECT_API_URL) or raise the budget"])
    from prefect.flow_runs import pause_flow_run

    run_logger().info(f"over budget: {why}; waiting up to {budget.wait_hours:g} h for approval in the Prefect UI "
          "(Ctrl-C cancels the run)")
    try:
        return pause_flow_run(wait_for_input=Approval.with_initial_data(description=approval_form(estimate, why)),
                              timeout=max(60, int(budget.wait_hours * 3600)), poll_interval=10)
    except KeyboardInterrupt:
        return Approval(approve=False, reason="interrupted (Ctrl-C) where the run waited for approval")
