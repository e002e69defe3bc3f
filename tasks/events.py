"""What training tells the Prefect server as it happens: a checkpoint saved (which starts its
evaluation through the automation of deployments/evaluations.py), a hung job, a loss spike. Each is
an event on the run's resource (``gpt.run.<name>``) that automations match; an incident is also a
warning in the run's log and a markdown artifact (an ``Incident``, which its subject writes: Hang,
Spike). Outside a Prefect run only the log line is left."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.artifacts import create_markdown_artifact

from tasks.common.run_context import run_context, run_logger


@dataclass(frozen=True)
class Incident:
    """Something that went wrong in training, as the run reports it (a hung job, a loss spike)."""
    event: str                  # the Prefect event, e.g. gpt.training.hang
    key: str                    # the artifact's key
    line: str                   # the one line of the run's log
    payload: dict[str, Any]     # the event's payload
    description: str            # the artifact's description
    markdown: str               # the artifact


def report(incident: Incident, run_name: str) -> None:
    """An incident in the run's log, and, inside a Prefect run, as an event on the run's resource and
    a markdown artifact."""
    run_logger().warning("%s", incident.line)
    if run_context() is None:
        return
    run_event(incident.event, run_name, incident.payload)
    create_markdown_artifact(key=incident.key, description=incident.description, markdown=incident.markdown)


def run_event(event: str, run_name: str, payload: dict[str, Any], **labels: str) -> None:
    """A Prefect event on the run's resource (``gpt.run.<name>``), with labels automations match on."""
    from prefect.events import emit_event

    emit_event(event=event, resource={"prefect.resource.id": f"gpt.run.{run_name}", "prefect.resource.name": run_name,
                                      **labels}, payload=payload)


SAVED = "gpt.checkpoint.saved"


def saves_are_evaluated() -> bool:
    """Whether anything evaluates the saves this process announces: an enabled automation on its
    Prefect server that reacts to them (none outside a Prefect run, where no event is sent)."""
    if run_context() is None:
        return False
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        automations = client.read_automations()
    return any(a.enabled and SAVED in getattr(a.trigger, "expect", ()) for a in automations)


def checkpoint_saved(run_dir: Path, iteration: int, evaluate: bool) -> None:
    """A complete checkpoint as a Prefect event on the run's resource: the evaluation automation
    (deployments/evaluations.py) runs the evaluate flow for those marked ``gpt.evaluate: true``."""
    if run_context() is None:
        return
    run_event(SAVED, run_dir.name,
              {"run_dir": str(run_dir), "iteration": iteration,
               "path": str(run_dir / "checkpoints" / f"iter_{iteration:07d}")},
              **{"gpt.evaluate": "true" if evaluate else "false"})
