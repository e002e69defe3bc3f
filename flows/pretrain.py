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
from flows.plan import approval, estimate, identity, provenance
from flows.plan.artifact import dry_run_table, plan_table
from flows.plan.build import Plan, make_plan, run_folder_problems
from flows.plan.evaluation import task_folders
from flows.plan.params import (
    BudgetParams,
    ClusterParams,
    DataParams,
    EvaluationParams,
    ModelName,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
    refused_as_failed_run,
)
from flows.stages import Stages, export_intact, index_intact, trained_intact
from tasks import report as reporting
from tasks.cluster.run_owner import RunOwner
from tasks.evaluate import IN_PROGRESS as EVALUATION_IN_PROGRESS
from tasks.evaluate import EvaluationSpec, results, summary, tracker_items
from tasks.export import export_task
from tasks.index import index_task
from tasks.precompile import precompile_task
from tasks.sync import upload_task
from tasks.train.stage import progress_of_owner, train_task
from tasks.train.trackers import Trackers


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
    dry_run: bool = False,
) -> dict:
    """Pretrain a GPT: data from S3 or local files to a trained model and its report.

    Args:
        model: Model preset (GPT-3 paper sizes, Megatron's table, or tiny for tests).
        data: JSONL sources and/or tokenized prefixes; empty runs on the bundled Shakespeare sample.
        tokenizer: GPT-2 style vocab.json/merges.txt; empty trains a BPE on the sources.
        training: Schedule, batch sizes, parallel layout and any other gpt Config field.
        cluster: Where training runs: a preset from deployments/clusters plus overrides.
        output: Root folder on shared storage, run name, and an s3:// URI to upload the run to.
        budget: Node-hours or cost above which the run waits for approval before anything is submitted.
        evaluation: Named sets and lm-eval tasks every checkpoint is evaluated on, by the evaluate flow
            on a job of its own (deployments/setup.py's automation starts it for each save).
        dry_run: Only plan: the plan artifact (layout, memory per rank against the device, time and
            cost) and nothing synced, tokenized or submitted.
    """
    plan = make_plan(model, data, tokenizer, training, cluster, output, budget, evaluation)
    if dry_run:
        return {"plan": dry_run_table(plan)}
    # One flow run at a time trains a run: a second start of it follows the first, then goes on.
    with RunOwner(plan.run_dir, wait=progress_of_owner(plan.run_dir, plan.config.total_iters)):
        return _pretrain(plan, model, data, tokenizer, output, evaluation)


def _pretrain(plan: Plan, model: str, data: DataParams, tokenizer: TokenizerParams, output: OutputParams,
              evaluation: EvaluationParams) -> dict:
    stages = Stages()
    problems = run_folder_problems(plan.run_dir, plan.identity, plan.config)   # as it is now that it is ours
    if problems:
        raise ParameterError(problems)
    outlook = plan.outlook()
    identity.record(plan.run_dir, plan.identity)
    provenance.record(plan.run_dir, flow_run.get_id() or None, dict(flow_run.parameters or {}))
    print(f"run folder {plan.run_dir} ({plan.world_size} processes on {plan.config.device}, {plan.config.precision}, "
          f"cluster preset {plan.cluster.name!r}): {outlook.message}")
    plan_table(plan, outlook.message)

    dataset = data_stages.prepare(data, tokenizer, plan.layout, stages, plan.cluster)
    warnings = data_stages.check_repetition(dataset, data.split, plan.config)
    for warning in warnings:
        print(f"warning: {warning}")
    if warnings:
        plan_table(plan, outlook.message, warnings)
    index = stages.run("index", index_task, dataset.blend, split=data.split, seq_length=plan.config.seq_length,
                       seed=plan.config.seed, num_samples=plan.config.num_samples(), out_dir=str(plan.layout.index()),
                       intact=index_intact)
    data_stages.check_vocabulary(index, dataset)
    plan = plan.with_data(dataset.tokenizer.vocab_size, index.path)
    if evaluation.wanted:       # before training: its saves are evaluated as they come
        evaluation_spec(evaluation, dataset, data, tokenizer, plan, stages).write(plan.run_dir)
    else:
        EvaluationSpec.remove(plan.run_dir)

    cost = estimate.estimate(plan.config, plan.cluster, outlook.done, estimate.read_history(plan.layout.root))
    print("estimate: " + "; ".join(f"{item} {value}" for item, value in cost.rows()))
    plan_table(plan, outlook.message, warnings, cost.rows())
    why = None if outlook.kind == "trained" else approval.over_budget(cost, plan.budget)
    if why:
        answer = approval.ask(cost, why, plan.budget, server=lasting_api())
        if not answer.approve:
            return Cancelled(message=f"not approved: {answer.reason or 'no reason given'} ({why})")

    compiled = None
    if outlook.kind == "trained":
        stages.skip("precompile", "the run is trained to its length already")
    elif plan.precompiles:
        compiled = stages.run("precompile", precompile_task, plan.config, plan.cluster)
    else:
        stages.skip("precompile", "training.compile is off: nothing to compile")
    result = stages.run("train", train_task, plan.config, plan.cluster, precompiled=compiled,
                        trackers=tuple(output.trackers), tracker_project=output.tracker_project, intact=trained_intact)

    exported = stages.run("export", export_task, result.run_dir, dataset.tokenizer, intact=export_intact)
    url = flow_run.get_flow_run_ui_url() if lasting_api() else None  # None: a temporary server
    figures = reporting.report_task(
        model=model, run_dir=result.run_dir, metrics_path=result.metrics_path, summary=result.summary,
        seq_length=plan.config.seq_length, stages=stages.records, job_ids=result.job_ids,
        uploaded_to=output.uri, flow_run_url=url, exported=exported,
    )
    if output.uri:  # after the report, so the upload holds the loss plot and the export too
        stages.run("upload", upload_task, result.run_dir, output.uri, endpoint_url=output.endpoint_url,
                   profile=output.profile or data.profile, exclude=EVALUATION_IN_PROGRESS)
    evaluated = results(Path(result.run_dir))
    if output.trackers and outlook.kind != "trained":     # last: evaluations written until now go with it
        Trackers(output.trackers, output.tracker_project, Path(result.run_dir), plan.config.to_dict()).finish(
            reporting.read_metrics(result.metrics_path), tracker_items(Path(result.run_dir), evaluated), figures,
            reporting.samples_markdown(model, exported.samples, exported.path), Path(exported.path))
    return {
        **figures, "run_dir": result.run_dir, "metrics": result.metrics_path,
        "checkpoints": str(Path(result.run_dir) / "checkpoints"), "dataset": dataset.blend, "index": index.path,
        "compile_cache": compiled.cache_dir if compiled else None, "tokenizer": dataset.tokenizer.files,
        "export": exported.path, "uploaded_to": output.uri, "flow_run": url,
        "job_ids": result.job_ids, "stages": stages.records,
        "evaluation": summary(evaluated[-1]) if evaluated else None,       # the latest written so far
    }


def evaluation_spec(evaluation: EvaluationParams, dataset: data_stages.Dataset, data: DataParams,
                    tokenizer: TokenizerParams, plan: Plan, stages: Stages) -> EvaluationSpec:
    """What each checkpoint of the run is evaluated on and where: the sets tokenized with the run's
    tokenizer, and the evaluation job's resources from the cluster preset."""
    sets = data_stages.evaluation_sets(evaluation, dataset, data, tokenizer, plan.config.seq_length, plan.layout, stages,
                                       plan.cluster)
    files = {"vocab_file": dataset.tokenizer.vocab_file, "merge_file": dataset.tokenizer.merge_file,
             "tokenizer_file": dataset.tokenizer.tokenizer_file}
    return EvaluationSpec(sets=sets, set_tokens=evaluation.set_tokens, tasks=list(evaluation.tasks),
                          task_paths=task_folders(evaluation), limit=evaluation.limit, every=evaluation.every,
                          tokenizer=files, cluster=plan.cluster.eval_job().model_dump())


if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(pretrain))
