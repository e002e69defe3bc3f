"""The `evaluate` flow: one checkpoint of a run -> its evaluation job -> results beside the run.

Started for every checkpoint the run marks for evaluation by the automation that
`python -m deployments.setup` creates (the `gpt.checkpoint.saved` event runs the `evaluate/checkpoint`
deployment), or by hand:

    python -m flows.evaluate runs/my-run                  # the newest checkpoint
    python -m flows.evaluate runs/my-run --iteration 200

What a run is evaluated on is what its pretrain flow was given (`evaluation`, kept in the run folder's
evaluation.json). One evaluation per run at a time (a Prefect concurrency limit named after the run,
`evaluate-<run name>-<digest of its folder>`):
the next waits for the one before, and none competes with training for its nodes. A failed evaluation
fails this flow run, never the training's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect import flow

from flows.cli import exit_status
from flows.plan import provenance
from flows.plan.boundary import Boundary
from flows.plan.identity import RECORD
from flows.plan.params import ParameterError, refused_as_failed_run
from flows.stages import Stages
from tasks import report as reporting
from tasks.common.run_context import run_logger
from tasks.evaluate.records import results, summary
from tasks.evaluate.stage import evaluate_task
from tasks.sync import MANIFEST_NAME


def run_folder(run: str) -> Path:
    """The run folder ``run`` names, checked: inside the output roots, one the pretrain flow made
    (its record of what defines the run), and in no folder a sync wrote: what a bucket or a source
    holds is data, never a run whose files a job is built from."""
    run_dir = Path(run).expanduser().resolve()
    problem = Boundary.from_env().output_root(run_dir)
    if problem:
        raise ParameterError([f"run: {problem}"])
    if not (run_dir / "config.json").is_file():
        raise ParameterError([f"run: {run_dir} is no run folder (no config.json); give the folder a pretrain run wrote"])
    synced = next((p for p in (run_dir, *run_dir.parents) if (p / MANIFEST_NAME).is_file()), None)
    if synced is not None:
        raise ParameterError([f"run: {run_dir} lies in {synced}, which the sync wrote from a source: data is never "
                              "a run; give the run folder the pretrain flow made (output.root/<run name>)"])
    if not (run_dir / RECORD).is_file():
        raise ParameterError([f"run: {run_dir} holds no {RECORD}: the pretrain flow did not make it (or made it "
                              "before it kept one); start the run's pretrain flow again, then evaluate it"])
    return run_dir


@flow(name="evaluate", persist_result=True, log_prints=True)
@refused_as_failed_run
def evaluate(run: str, iteration: int | None = None) -> dict:
    """Evaluate one checkpoint of a run on its own job: each named set's loss and perplexity, and the
    lm-evaluation-harness tasks the run names; the results go to <run>/eval/ and the `evaluation` artifact of this flow run and of the run's training flow run.

    Args:
        run: The run folder (as the `gpt.checkpoint.saved` event names it).
        iteration: The checkpoint's iteration; empty: the newest complete checkpoint.
    """
    run_dir = run_folder(run)
    result = Stages().run("evaluate", evaluate_task, str(run_dir), iteration)
    figures = summary(result)
    run_logger().info(f"evaluation of {run_dir.name} at iteration {result.iteration}: "
          + ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in figures.items()))
    starts = provenance.recorded(run_dir)
    reporting.evaluation_report(run_dir.name, results(run_dir), starts[-1].get("flow_run_id") if starts else None)
    return {"run_dir": str(run_dir), **result.model_dump(), "figures": figures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.evaluate", description="Evaluate a checkpoint of a run.")
    p.add_argument("run", help="the run folder")
    p.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: the newest)")
    a = p.parse_args(argv)
    from flows.local_server import ensure_api

    def run() -> int:
        ensure_api()        # without PREFECT_API_URL: a temporary server that ends with this process
        print(f"results: {evaluate(a.run, a.iteration)['path']}")
        return 0
    return exit_status("evaluation", run, lambda e: f"error: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
