"""Flow runs whose process died without a word (kill -9, out of memory, a reboot) are marked Crashed.

Flow runs send a heartbeat event every HEARTBEAT_S seconds (PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
which `deployments/serve.py` sets for the runs it starts and the command line for its own run; set
it for workers too), also while they wait for an approval. An automation on
the server marks a run Crashed when neither a heartbeat nor a final state follows the last heartbeat
within SILENCE_S. The next run with the same parameters finds the training job that run left
behind (if it still runs) and follows it instead of submitting another (tasks.cluster.jobs).

    python -m flows.heartbeats       # create the automation once, against PREFECT_API_URL
"""
from __future__ import annotations

import os
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

NAME = "gpt-pretrain: crash silent flow runs"
HEARTBEAT_S = 30        # Prefect's smallest heartbeat interval
SILENCE_S = 90          # three missed heartbeats


def automation(silence_s: int = SILENCE_S) -> Automation:
    final = [f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")]
    return Automation(
        name=NAME,
        description="Marks a flow run Crashed when its process stops sending heartbeats (it died).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *final},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silence_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, name="Crashed",
                                    message=f"No heartbeat for {silence_s} s: the process running this flow died")],
    )


def ensure_automation(silence_s: int = SILENCE_S) -> None:
    """Create the automation unless the server already has one of this name."""
    try:
        Automation.read(name=NAME)
    except ValueError:
        automation(silence_s).create()


def heartbeats_from_this_process(server_outlives_it: bool) -> None:
    """Flow runs of this process send heartbeats; where the server outlives this process (not a
    temporary one), it gets the automation too, so a run whose process dies, paused or not, is
    marked Crashed instead of waiting forever."""
    from prefect.context import refresh_global_settings_context

    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
    refresh_global_settings_context()
    if server_outlives_it:
        ensure_automation()


if __name__ == "__main__":
    ensure_automation()
    print(f"automation {NAME!r} is in place; run flows with PREFECT_FLOWS_HEARTBEAT_FREQUENCY={HEARTBEAT_S}")
