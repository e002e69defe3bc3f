"""What training tells the Prefect server as it happens: a checkpoint saved (which starts its
evaluation through the automation of deployments/evaluations.py), a hung job, a loss spike. Each is
an event on the run's resource (``gpt.run.<name>``) that automations match; an incident is also a
warning in the run's log and a markdown artifact. Outside a Prefect run only the log line is left."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_markdown_artifact

from tasks.common.run_context import run_context, run_logger

if TYPE_CHECKING:
    from tasks.cluster.hang import Hang
    from tasks.train.spikes import Spike


def _training_alert(line: str, run_name: str, event: str, payload: dict[str, Any], key: str, description: str,
                    markdown: str) -> None:
    """A training incident in the run's log, and, inside a Prefect run, as an event on the run's
    resource and a markdown artifact."""
    run_logger().warning("%s", line)
    if run_context() is None:
        return
    run_event(event, run_name, payload)
    create_markdown_artifact(key=key, description=description, markdown=markdown)


def run_event(event: str, run_name: str, payload: dict[str, Any], **labels: str) -> None:
    """A Prefect event on the run's resource (``gpt.run.<name>``), with labels automations match on."""
    from prefect.events import emit_event

    emit_event(event=event, resource={"prefect.resource.id": f"gpt.run.{run_name}", "prefect.resource.name": run_name,
                                      **labels}, payload=payload)


def hang_report(hang: Hang, run_name: str) -> None:
    """A hung job (tasks.cluster.hang.Hang): an event and an artifact naming the rank, node, phase and
    iteration, with every rank's last heartbeat."""
    rows = "\n".join(f"| {b['rank']} | {b['node']} | {b['phase']} | {b['iteration']} | {b['entered']} |"
                     for b in sorted(hang.ranks, key=lambda b: b["rank"]))
    _training_alert(hang.line(), run_name, "gpt.training.hang",
                    {k: v for k, v in hang.to_dict().items() if k != "ranks"}, "training-hang",
                    f"job {hang.job_id} hung at iteration {hang.iteration}",
                    f"**{hang.line()}**\n\n| rank | node | phase | iteration | phases entered |\n|---|---|---|---|---|\n"
                    f"{rows}\n")


SPIKE_ROWS = 64           # samples listed in the training-spike artifact; skipped.json keeps them all


def spike_report(spike: Spike, run_name: str, what_next: str) -> None:
    """A loss spike (tasks.train.spikes.Spike): an event and an artifact naming the iterations, the
    losses, and each sample with the documents it came from."""
    rows = "\n".join(f"| {d['sample']} | `{d['prefix']}` | {', '.join(map(str, d['documents']))} |"
                     for d in spike.documents[:SPIKE_ROWS])
    more = len(spike.documents) - SPIKE_ROWS
    _training_alert(f"{spike.line()}: {what_next}", run_name, "gpt.training.spike",
                    {k: v for k, v in spike.to_dict().items() if k != "documents"}, "training-spike", spike.line(),
                    f"**{spike.line()}**: {what_next}\n\n| sample | prefix | documents |\n|---|---|---|\n{rows}\n"
                    + (f"\n{more} more samples: see `skipped.json` in the run folder\n" if more > 0 else ""))


def checkpoint_saved(run_dir: Path, iteration: int, evaluate: bool) -> None:
    """A complete checkpoint as a Prefect event on the run's resource: the evaluation automation
    (deployments/evaluations.py) runs the evaluate flow for those marked ``gpt.evaluate: true``."""
    if run_context() is None:
        return
    run_event("gpt.checkpoint.saved", run_dir.name,
              {"run_dir": str(run_dir), "iteration": iteration,
               "path": str(run_dir / "checkpoints" / f"iter_{iteration:07d}")},
              **{"gpt.evaluate": "true" if evaluate else "false"})
