"""The evaluate stage: one checkpoint of a run scored on a job of its own, never inside training.

``evaluate_task(run_dir, iteration)`` reads what the run is evaluated on from the run folder
(``evaluation.json``, records), refuses a checkpoint the run does not keep, waits its turn (one
evaluation of a run at a time: a Prefect concurrency limit named after the run), runs the job
(job), and logs the result to the run's trackers. An evaluation already written for that very
checkpoint is the answer, and no job runs. On this machine an evaluation would share training's
cores: it waits for the run's training (the run folder's owner) to end; on SLURM it queues for
nodes of its own.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency

from gpt.checkpoint import iteration_of
from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import JobError, submit
from tasks.cluster.run_owner import RunBusy, RunOwner
from tasks.common.digest import digest
from tasks.common.errors import ParameterError
from tasks.common.retry import worth_retrying
from tasks.common.run_context import run_logger
from tasks.evaluate.job import EvaluationJob
from tasks.evaluate.records import (
    FOLDER,
    EvalResult,
    EvaluationSpec,
    checkpoint_at,
    evaluated,
    result_path,
    results,
    tracker_items,
    tracker_key,
    unpin,
)
from tasks.trackers import Trackers, evaluation_logged, unlogged

TRACKERS_WAIT_S = 300.0        # how long an evaluation waits for the run folder's owner to log it


def evaluate(run_dir: str, iteration: int | None) -> EvalResult:
    """Evaluate the checkpoint at ``iteration`` (None: the newest) of the run in ``run_dir`` as the run
    asks, on its own job; its result is written beside the run and logged to the run's trackers."""
    run = Path(run_dir)
    spec = EvaluationSpec.read(run)
    if spec is None:
        raise ParameterError([f"run: {run} names no evaluation (no evaluation.json): give the pretrain flow "
                              "evaluation.sets or evaluation.tasks"])
    try:
        checkpoint_at(run, iteration)
    except FileNotFoundError as e:
        if evaluated(run, iteration) is None:
            raise ParameterError([f"iteration: {e}"]) from None
    with concurrency(one_at_a_time(run), occupy=1, strict=True):
        result = scored(run, iteration, spec)
    to_trackers(run, result)            # outside the slot: the next evaluation need not wait for it
    return result


def scored(run: Path, iteration: int | None, spec: EvaluationSpec) -> EvalResult:
    """The evaluation of the checkpoint at ``iteration``: written already for that very checkpoint,
    or made by a job now; its pin is let go."""
    earlier = evaluated(run, iteration)
    if earlier is not None:
        run_logger().info("checkpoint iteration %d is evaluated already: %s", earlier.iteration, earlier.path)
        return earlier
    checkpoint = checkpoint_at(run, iteration)
    cluster = spec.cluster.resolved()
    job = EvaluationJob(checkpoint, spec, result_path(run, iteration_of(checkpoint)), cluster.job_device)
    if cluster.kind == "local":
        with RunOwner(run, wait=_waiting_for_training()):
            result, job_id = _submitted(job, cluster, run)
    else:
        result, job_id = _submitted(job, cluster, run)
    if not isinstance(result, dict):
        raise JobError(f"evaluation job {job_id} returned {result!r}")
    unpin(run, checkpoint)
    return EvalResult(**result)


def _submitted(job: EvaluationJob, cluster: ClusterConfig, run: Path) -> tuple[object, str]:
    run_logger().info("evaluating %s on %s (%s job)", job.checkpoint, cluster.name, cluster.kind)
    result, job_id, _ = submit(job, cluster, run_dir=run / FOLDER, job_name=f"evaluate-{job.checkpoint.name}")
    return result, job_id


def one_at_a_time(run_dir: Path) -> str:
    """The concurrency limit (one slot) that queues a run's evaluations behind each other, made by
    the run's first evaluation (two at once: one makes it, the other finds it)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = f"evaluate-{run_dir.name}-{digest(str(run_dir), length=8)}"      # two roots may hold one run name
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass
    return name


def to_trackers(run_dir: Path, result: EvalResult) -> None:
    """The run's evaluations to the tracker runs its training made (trackers.json), by one writer,
    the run folder's owner. While the pretrain flow owns the folder, it logs them (the train
    stage's follower reads eval/ on every poll; the flow's last step logs what is left), and this
    waits until it has logged ``result`` or lets the folder go, up to TRACKERS_WAIT_S; once the
    folder is free, this adds every evaluation a tracker run lacks. What neither logs goes with the
    next evaluation or the next leg. A tracker's trouble is a warning: the evaluation stands."""
    try:
        if not unlogged(run_dir, [tracker_key(r) for r in results(run_dir)]):
            return
        with RunOwner(run_dir, wait=_waiting_for_the_owner(run_dir, tracker_key(result))):
            tracked = Trackers.of_run(run_dir)
            tracked.evaluations(tracker_items(run_dir, results(run_dir)))
            tracked.close(finished=True)
    except _Logged:
        pass
    except RunBusy as e:
        run_logger().warning("the trackers did not get evaluation %d in %.0f s: the run folder is owned by %s; "
                             "the next evaluation, or the run's next leg, sends it", result.iteration,
                             TRACKERS_WAIT_S, e)
    except Exception as e:  # noqa: BLE001 - trackers never fail an evaluation that is written
        run_logger().warning("the trackers did not get evaluation %d: %s: %s; the next evaluation, or the run's "
                             "next leg, sends it", result.iteration, type(e).__name__, e)


class _Logged(Exception):
    """The run folder's owner logged the evaluation."""


def _waiting_for_the_owner(run_dir: Path, key: str) -> Callable[[str], None]:
    """While the run folder's owner holds it: done once it has logged ``key``, given up after TRACKERS_WAIT_S."""
    deadline, said = time.monotonic() + TRACKERS_WAIT_S, []

    def wait(holder: str) -> None:
        if evaluation_logged(run_dir, key):
            raise _Logged
        if time.monotonic() > deadline:
            raise RunBusy(holder)
        if not said:
            said.append(holder)
            run_logger().info("the run folder is owned by %s: it logs this evaluation to the trackers, or this "
                              "flow does once it lets the folder go", holder)
    return wait


def _waiting_for_training() -> Callable[[str], None]:
    said: list[str] = []

    def wait(holder: str) -> None:
        if not said:
            said.append(holder)
            run_logger().info("the run's training (%s) still runs on this machine: the evaluation waits for it to "
                              "end, so as not to share its cores", holder)
    return wait


evaluate_task = task(evaluate, name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying,
                     cache_policy=NO_CACHE)
