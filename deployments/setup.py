"""Everything the Prefect server needs once for this project, in one command: the process work pool
the deployments use, the automation that marks silent flow runs Crashed (flows/heartbeats.py),
the one that evaluates each checkpoint once `evaluate/checkpoint` is deployed
(deployments/evaluations.py) and, when a channel is given, the alert automation (deployments/alerts.py).

    python -m deployments.setup                                   # work pool and crash automation
    GPT_ALERT_WEBHOOK_URL=https://hooks.slack.com/... python -m deployments.setup --slack
    python -m deployments.setup --block slack-webhook/ml-team --on Failed Crashed Completed

Run against PREFECT_API_URL; running it again changes nothing but the alert's channel.
"""
from __future__ import annotations

import argparse
import sys

from deployments import alerts, evaluations
from flows import heartbeats

POOL = "gpt"


def ensure_work_pool(name: str = POOL) -> bool:
    """Create the process work pool ``name`` unless it exists; True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", description="gpt-pretrain flow runs (deployments/prefect.yaml)",
                base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.setup", description=__doc__.splitlines()[0])
    p.add_argument("--pool", default=POOL, help="the work pool's name (deployments/prefect.yaml uses gpt)")
    alerts.add_channel_arguments(p, required=False)
    a = p.parse_args(argv)
    block_id = alerts.block_from_arguments(p, a)
    created = ensure_work_pool(a.pool)
    print(f"work pool {a.pool!r} {'created' if created else 'already there'}")
    heartbeats.ensure_automation()
    print(f"automation {heartbeats.NAME!r} in place; run workers with "
          f"PREFECT_FLOWS_HEARTBEAT_FREQUENCY={heartbeats.HEARTBEAT_S}")
    evaluate = evaluations.deployment_id()
    if evaluate is None:
        print(f"automation {evaluations.NAME!r} not made: deploy {evaluations.DEPLOYMENT} first (prefect deploy --all "
              "--prefect-file deployments/prefect.yaml), then run this again; deployments/serve.py makes it itself")
    else:
        evaluations.ensure_automation(evaluate)
        print(f"automation {evaluations.NAME!r} runs {evaluations.DEPLOYMENT} for each checkpoint to evaluate")
    if block_id is not None:
        alerts.ensure_automation(block_id, tuple(a.on))
        print(f"automation {alerts.NAME!r} alerts on {', '.join(a.on)} through block {a.block or alerts.BLOCK_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
