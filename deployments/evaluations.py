"""Every checkpoint evaluated without a person launching anything: a Prefect automation that runs
the `evaluate/checkpoint` deployment for each `gpt.checkpoint.saved` event a training run marks
for evaluation (`gpt.evaluate: true`: every `evaluation.every`-th save, and the last).

Created by `python -m deployments.setup` once the deployment exists (prefect.yaml's, deployed to a
work pool), and by `deployments/serve.py`, which serves it. The evaluate flow queues a run's
evaluations behind each other (flows/evaluate.py), so a burst of saves never starts several at once.
"""
from __future__ import annotations

from uuid import UUID

from prefect.automations import Automation
from prefect.events.actions import RunDeployment
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

from deployments import alerts

NAME = "gpt-pretrain: evaluate each checkpoint"
DEPLOYMENT = "evaluate/checkpoint"
EVENT = "gpt.checkpoint.saved"


def automation(deployment_id: UUID) -> Automation:
    return Automation(
        name=NAME,
        description=f"Runs {DEPLOYMENT} for every checkpoint a training run marks for evaluation.",
        trigger=EventTrigger(
            expect={EVENT},
            match=ResourceSpecification({"prefect.resource.id": "gpt.run.*", "gpt.evaluate": "true"}),
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[RunDeployment(source="selected", deployment_id=deployment_id,
                               parameters={"run": "{{ event.payload.run_dir }}",
                                           "iteration": "{{ event.payload.iteration }}"})],
    )


def deployment_id() -> UUID | None:
    """The id of the evaluate/checkpoint deployment, or None where it is not deployed."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(DEPLOYMENT).id
        except ObjectNotFound:
            return None


def ensure_automation(deployment: UUID) -> None:
    """Replace any automation of this name with one that runs ``deployment``."""
    alerts.replace(automation(deployment))
