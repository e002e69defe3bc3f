"""The `pretrain` flow: sync -> tokenize -> index -> precompile -> train -> export -> report -> upload.

Each stage is a cached task from tasks/: the same inputs again skip it, and a retried flow run
reruns only what did not finish (training resumes from its last checkpoint).

`python -m flows.pretrain` with no arguments runs the embedded default here: the Shakespeare
sample corpus, a BPE trained on it, the tiny GPT on CPU, in a few minutes. Flags change the common
parameters; `--help` lists them (flows/cli.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Cancelled

from flows import data as data_stages
from flows.local_server import lasting_api
from flows.plan import approval, identity, provenance
from flows.plan.artifact import dry_run_table, plan_table
from flows.plan.build import Plan, TrainJob, make_plan, run_folder_problems
from flows.plan.estimate import Estimate
from flows.plan.outlook import Outlook
from flows.plan.params import (
    BudgetParams,
    ClusterParams,
    DataParams,
    EvaluationParams,
    ModelName,
    OutputParams,
    ParameterError,
    PhaseParams,
    TokenizerParams,
    TrainingParams,
    refused_as_failed_run,
)
from flows.stages import Stages
from gpt.config import Config
from tasks import events
from tasks import report as reporting
from tasks.cluster.run_owner import RunOwner
from tasks.common.run_context import run_logger
from tasks.evaluate.records import IN_PROGRESS as EVALUATION_IN_PROGRESS
from tasks.evaluate.records import EvaluationSpec, results, summary, tracker_items, unevaluated
from tasks.export import export_task
from tasks.precompile import PrecompileManifest, precompile_task
from tasks.sync import upload_task
from tasks.trackers import Trackers
from tasks.train import phases as run_phases
from tasks.train.remote_checkpoints import CHECKPOINTS
from tasks.train.stage import TrainResult, progress_of_owner, train_task


@flow(name="pretrain", persist_result=True, log_prints=True)
@refused_as_failed_run
def pretrain(
    model: ModelName = "tiny",
    data: DataParams = DataParams(),
    tokenizer: TokenizerParams = TokenizerParams(),
    training: TrainingParams = TrainingParams(),
    cluster: ClusterParams = ClusterParams(),
    output: OutputParams = OutputParams(),
    budget: BudgetParams = BudgetParams(),
    evaluation: EvaluationParams = EvaluationParams(),
    phases: list[PhaseParams] = [],  # noqa: B006   (the form's default: Prefect reads it from the signature)
    dry_run: bool = False,
) -> dict:
    """Pretrain a GPT: data from S3 or local files to a trained model and its report.

    Args:
        model: Model preset (GPT-3 paper sizes, Megatron's table, or tiny for tests).
        data: JSONL sources and/or tokenized prefixes; empty runs on the bundled Shakespeare sample.
        tokenizer: GPT-2 style vocab.json/merges.txt; empty trains a BPE on the sources.
        training: Schedule, batch sizes, parallel layout and any other gpt Config field.
        cluster: Where training runs: a preset from tasks/cluster/presets plus overrides.
        output: Root folder on shared storage, run name, and an s3:// URI to upload the run to.
        budget: Node-hours or cost above which the run waits for approval before anything is submitted.
        evaluation: Named sets and lm-eval tasks every checkpoint is evaluated on, by the evaluate flow
            on a job of its own (deployments/setup.py's automation starts it for each save).
        phases: Phases of the run after its first, each from its start iteration: its own blend, and
            optionally a longer seq_length and a learning-rate segment (constant, or a WSD decay). A later
            leg may add phases; one that has started cannot change. Empty: the run's phases so far.
        dry_run: Only plan: the plan artifact (layout, memory per rank against the device, time and
            cost) and nothing synced, tokenized or submitted.
    """
    plan = make_plan(model, data, tokenizer, training, cluster, output, budget, evaluation, phases, dry_run=dry_run)
    if dry_run:
        return {"plan": dry_run_table(plan)}
    # One flow run at a time trains a run: a second start of it follows the first, then goes on.
    with RunOwner(plan.run_dir, wait=progress_of_owner(plan.run_dir, plan.config.total_iters)):
        return _pretrain(plan)


def _pretrain(plan: Plan) -> dict:
    stages = Stages()
    outlook, cost = begin(plan)
    why = None if outlook.kind == "trained" else approval.over_budget(cost, plan.budget)
    if why:             # before any stage: nothing is synced, tokenized or submitted unless approved
        answer = approval.ask(cost, why, plan.budget, server=lasting_api())
        if not answer.approve:
            return Cancelled(message=f"not approved: {answer.reason or 'no reason given'} ({why})")

    dataset = data_stages.prepare(plan.data, plan.layout, stages, plan.cluster)
    index, warnings = data_stages.index(dataset, plan.data, plan.config, plan.layout, stages)
    for warning in warnings:
        run_logger().warning("warning: %s", warning)
    if warnings:
        plan_table(plan, outlook.message, [*plan.warnings, *warnings], cost.rows())
    job = plan.training_job(dataset.tokenizer, index)
    if plan.evaluation:       # before training: its saves are evaluated as they come
        data_stages.evaluation_spec(plan, dataset, stages).write(plan.run_dir)
        if not events.saves_are_evaluated():
            run_logger().warning("warning: evaluation: nothing on this Prefect server evaluates the saves (no "
                                 "automation reacts to %s): each save to evaluate is kept until it is evaluated; %s",
                                 events.SAVED, unevaluated(plan.run_dir))
    else:
        EvaluationSpec.remove(plan.run_dir)
    compiled = precompile(job, outlook, stages)
    result = train_in_phases(plan, job, dataset, compiled, stages)
    exported = stages.run("export", export_task, result.run_dir, dataset.tokenizer)
    url = flow_run.get_flow_run_ui_url() if lasting_api() else None  # None: a temporary server
    figures = reporting.report_task(
        model=job.config.model, run_dir=result.run_dir, metrics_path=result.metrics_path, summary=result.summary,
        seq_length=job.config.seq_length, stages=stages.records, job_ids=result.job_ids,
        uploaded_to=plan.output.uri, flow_run_url=url, exported=exported,
    )
    if plan.output.uri:  # after the report, so the upload holds the loss plot and the export too
        stages.run("upload", upload_task, result.run_dir, plan.output.uri, remote=plan.output.remote,
                   exclude=(*EVALUATION_IN_PROGRESS, *CHECKPOINTS))     # the train stage copied each save
    evaluated = results(Path(result.run_dir))
    if job.trackers and outlook.kind != "trained":     # last: evaluations written until now go with it
        Trackers(job.trackers, job.tracker_project, Path(result.run_dir), job.config.to_dict()).finish(
            reporting.read_metrics(result.metrics_path),
            tracker_items(Path(result.run_dir), evaluated) + run_phases.tracker_items(Path(result.run_dir)), figures,
            reporting.samples_markdown(job.config.model, exported.samples, exported.path), Path(exported.path))
    return {
        **figures, "run_dir": result.run_dir, "metrics": result.metrics_path,
        "checkpoints": str(Path(result.run_dir) / "checkpoints"), "dataset": dataset.blend, "index": index.path,
        "compile_cache": compiled.cache_dir if compiled else None, "tokenizer": dataset.tokenizer.files,
        "export": exported.path, "uploaded_to": plan.output.uri, "flow_run": url,
        "job_ids": result.job_ids, "stages": stages.records,
        "evaluation": summary(evaluated[-1]) if evaluated else None,       # the latest written so far
    }


def begin(plan: Plan) -> tuple[Outlook, Estimate]:
    """The run folder, now that this flow run owns it: checked again (another run may have started
    it), its identity and this start recorded; what training will do there and what it will take,
    shown as the plan's artifact (what the budget's gate sees)."""
    problems = run_folder_problems(plan.run_dir, plan.identity, plan.config)
    if problems:
        raise ParameterError(problems)
    if plan.branch_from:
        run_phases.branch(plan.run_dir, plan.branch_from)
    outlook = plan.outlook()
    identity.record(plan.run_dir, plan.identity)
    if plan.phases:
        run_phases.record(plan.run_dir, [p.model_dump() for p in plan.phases])
    provenance.record(plan.run_dir, flow_run.get_id() or None, dict(flow_run.parameters or {}))
    run_logger().info(f"run folder {plan.run_dir} ({plan.world_size} processes on {plan.config.device}, {plan.config.precision}, "
          f"cluster preset {plan.cluster.name!r}): {outlook.message}")
    cost = plan.estimate(outlook)
    run_logger().info("estimate: " + "; ".join(f"{item} {value}" for item, value in cost.rows()))
    for warning in plan.warnings:
        run_logger().warning("warning: %s", warning)
    plan_table(plan, outlook.message, list(plan.warnings), cost.rows())
    return outlook, cost


def train_in_phases(plan: Plan, job: TrainJob, dataset: data_stages.Dataset, compiled: PrecompileManifest | None,
                    stages: Stages) -> TrainResult:
    """Training, phase after phase (one, for a run that declares none): the first on the run's own
    data; each later one on its order over the documents the earlier ones left, from the checkpoint
    the phase before ended with. Each phase ended is closed in the run's ledger; one the run is past
    already (an earlier leg's, or the run it branched from) is not submitted again."""
    reached = plan.outlook().done

    def train(stage: str, config: Config, last: bool) -> TrainResult | None:
        if reached >= config.total_iters and not last:
            stages.skip(stage, f"the run is past this phase's end (iteration {config.total_iters}) already")
            return None
        return stages.run(stage, train_task, config, job.cluster, precompiled=compiled, trackers=job.trackers,
                          tracker_project=job.tracker_project, tier=job.tier)

    config = run_phases.first_phase(job.config, [run_phases.Phase(p.start) for p in plan.phases])
    result = train("train", config, not plan.phases)
    blend, start = dataset.blend, 0
    ends = [p.start for p in plan.phases[1:]] + [job.config.total_iters]
    for number, (declared, end) in enumerate(zip(plan.phases, ends), start=2):
        run_phases.close(plan.run_dir, number - 1, config, start)
        blend = data_stages.phase_blend(declared, blend, dataset, plan, stages, number)
        phase = run_phases.Phase(declared.start, tuple(blend), declared.seq_length, declared.rotary_base, declared.lr)
        index = data_stages.phase_index(phase, number, plan, run_phases.phase_config(job.config, phase, end), stages)
        config = run_phases.phase_config(job.config, phase, end, index.path)
        result = train(f"train-phase-{number}", config, number == len(plan.phases) + 1)
        start = declared.start
    if plan.phases:
        run_phases.close(plan.run_dir, len(plan.phases) + 1, config, start)
        reporting.mixture(plan.run_dir.name, run_phases.ledger(plan.run_dir), run_phases.declared(plan.run_dir))
    assert result is not None           # the last phase always runs its stage
    return result


def precompile(job: TrainJob, outlook: Outlook, stages: Stages) -> PrecompileManifest | None:
    """The graph cache training starts from, filled first where the job compiles."""
    if outlook.kind == "trained":
        stages.skip("precompile", "the run is trained to its length already")
    elif not job.precompiles:
        stages.skip("precompile", "training.compile is off: nothing to compile")
    else:
        return stages.run("precompile", precompile_task, job.config, job.cluster)
    return None


if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(pretrain))
