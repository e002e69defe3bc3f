"""Serve the deployments from one long-running process: `pretrain/gpt3`, `evaluate/checkpoint`,
`benchmark/nightly` and `burn-in/quarantine`.

    prefect server start                     # or PREFECT_API_URL pointing at a server
    python deployments/serve.py              # runs flow runs as subprocesses of this process
    prefect deployment run pretrain/gpt3 --param model=gpt3-125m --watch

Flow runs started here send heartbeats, and the server gets the automation that marks a run
Crashed when they stop (flows/heartbeats.py), and the one that evaluates each checkpoint a
run saves (deployments/evaluations.py). For a work pool instead (workers on other
machines), see deployments/prefect.yaml.
"""
from __future__ import annotations

import argparse
import os

from prefect import serve
from prefect.schedules import Cron

from deployments import evaluations
from flows.benchmark import benchmark
from flows.burn_in import burn_in
from flows.evaluate import evaluate
from flows.heartbeats import HEARTBEAT_S, ensure_automation
from flows.pretrain import pretrain

NIGHTLY_CRON = "0 2 * * *"  # 02:00 every day, in `--timezone`


def deployments(cron: str = NIGHTLY_CRON, timezone: str = "UTC", history: str = "runs/benchmarks") -> list:
    return [
        pretrain.to_deployment(
            name="gpt3", tags=["pretrain"],
            description="GPT pretraining: sync, tokenize, index, precompile, train (SLURM), report.",
        ),
        evaluate.to_deployment(
            name="checkpoint", tags=["evaluate"],
            description="Evaluate one checkpoint of a run on its own job: set perplexities and lm-eval tasks.",
        ),
        benchmark.to_deployment(
            name="nightly", schedules=[Cron(cron, timezone=timezone)], tags=["benchmark"],
            parameters={"history": history},
            description="Nightly benchmarks of every stage; history, regressions and trends as artifacts.",
        ),
        burn_in.to_deployment(
            name="quarantine", tags=["burn-in"],
            description="A health job on each node a cluster's quarantine keeps out; those that pass are let back in.",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python deployments/serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cron", default=NIGHTLY_CRON, help=f"schedule of benchmark/nightly (default {NIGHTLY_CRON!r})")
    p.add_argument("--timezone", default="UTC")
    p.add_argument("--history", default="runs/benchmarks", help="benchmark history folder or s3:// prefix")
    p.add_argument("--limit", type=int, default=None, help="at most this many flow runs at once")
    a = p.parse_args(argv)
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))   # for the runs started here
    ensure_automation()
    served = deployments(a.cron, a.timezone, a.history)
    evaluations.ensure_automation(next(d for d in served if d.name == "checkpoint").apply())
    serve(*served, limit=a.limit)


if __name__ == "__main__":
    main()
