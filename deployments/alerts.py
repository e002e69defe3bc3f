"""A team hears when a pretrain run fails, crashes or (optionally) finishes: a Prefect automation
that sends the run's name, its final state and the message naming the failed stage to a
notification block (Slack, or any webhook).

    python -m deployments.alerts --block slack-webhook/ml-team            # a block made in the UI
    GPT_ALERT_WEBHOOK_URL=https://hooks.slack.com/... python -m deployments.alerts --slack
    GPT_ALERT_WEBHOOK_URL=https://alerts.example/hook python -m deployments.alerts --webhook

The webhook URL is a secret: it is read from the environment and kept in a block's secrets, never
given as an argument. `python -m deployments.setup` (the work pool and both automations) takes the
same options; running either again replaces the automation.
"""
from __future__ import annotations

import argparse
import os
import sys

from prefect.automations import Automation
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

NAME = "gpt-pretrain: notify when a run ends badly"
BLOCK_NAME = "gpt-pretrain-alerts"
URL_VARIABLE = "GPT_ALERT_WEBHOOK_URL"
ENDINGS = ("Failed", "Crashed", "Completed", "Cancelled")
BAD_ENDINGS = ("Failed", "Crashed")
SUBJECT = "pretrain run {{ flow_run.name }}: {{ flow_run.state.name }}"
BODY = ("Flow run {{ flow_run.name }} of {{ flow.name }} ended {{ flow_run.state.name }}: "
        "{{ flow_run.state.message }}\n{{ flow_run|ui_url }}")


def automation(block_document_id: str, endings: tuple[str, ...] = BAD_ENDINGS) -> Automation:
    return Automation(
        name=NAME,
        description=f"Notifies when a pretrain flow run ends {', '.join(endings)}.",
        trigger=EventTrigger(
            expect={f"prefect.flow-run.{e}" for e in endings},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification({"prefect.resource.role": "flow", "prefect.resource.name": "pretrain"}),
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[SendNotification(block_document_id=block_document_id, subject=SUBJECT, body=BODY)],
    )


def save_block(kind: str, url: str) -> str:
    """A notification block named BLOCK_NAME for ``url``; its document id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook

    if kind == "slack":
        block = SlackWebhook(url=url)
    else:
        block = CustomWebhookNotificationBlock(name=BLOCK_NAME, url="{{url}}", secrets={"url": url},
                                               json_data={"subject": "{{subject}}", "text": "{{body}}"})
    return str(block.save(BLOCK_NAME, overwrite=True))


def load_block(slug: str) -> str:
    """The document id of an existing notification block, ``type-slug/name``."""
    from prefect.blocks.core import Block

    return str(Block.load(slug)._block_document_id)


def ensure_automation(block_document_id: str, endings: tuple[str, ...]) -> None:
    """Replace any automation of this name with one for ``block_document_id``."""
    replace(automation(block_document_id, endings))


def replace(made: Automation) -> None:
    """Create ``made`` in place of any automation of its name."""
    try:
        Automation.read(name=made.name).delete()
    except ValueError:
        pass
    made.create()


def add_channel_arguments(p: argparse.ArgumentParser, required: bool) -> None:
    """--block, --slack or --webhook (where alerts go) and --on (which endings alert)."""
    where = p.add_mutually_exclusive_group(required=required)
    where.add_argument("--block", help="an existing notification block, as type/name (e.g. slack-webhook/ml-team)")
    where.add_argument("--slack", action="store_true", help=f"a Slack incoming webhook at ${URL_VARIABLE}")
    where.add_argument("--webhook", action="store_true", help=f"a JSON POST to ${URL_VARIABLE}")
    p.add_argument("--on", nargs="+", choices=ENDINGS, default=list(BAD_ENDINGS),
                   help=f"the final states that notify (default: {' '.join(BAD_ENDINGS)})")


def block_from_arguments(p: argparse.ArgumentParser, a: argparse.Namespace) -> str | None:
    """The notification block the arguments name or describe (saved from $GPT_ALERT_WEBHOOK_URL), or
    None when they name none."""
    if a.block:
        return load_block(a.block)
    if not (a.slack or a.webhook):
        return None
    url = os.environ.get(URL_VARIABLE)
    if not url:
        p.error(f"set {URL_VARIABLE} to the webhook's URL (it is a secret: never an argument)")
    return save_block("slack" if a.slack else "webhook", url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.alerts", description=__doc__.splitlines()[0])
    add_channel_arguments(p, required=True)
    a = p.parse_args(argv)
    block_id = block_from_arguments(p, a)
    ensure_automation(block_id, tuple(a.on))
    print(f"automation {NAME!r} notifies on {', '.join(a.on)} through block {a.block or BLOCK_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
