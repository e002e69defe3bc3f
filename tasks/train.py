"""Train stage: the training job on the cluster (tasks.jobs), resumed from the run folder's last
checkpoint when there is one.

Run folder::

    <run_dir>/config.json     resolved gpt Config        cluster.json   resolved ClusterConfig
    <run_dir>/jobs.json       job ids, state history     jobs/          sbatch scripts, per-rank logs
    <run_dir>/metrics.jsonl   <run_dir>/tensorboard/     <run_dir>/checkpoints/
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer
from gpt.config import Config
from gpt.files import write_json
from gpt.metrics import train_line, valid_line
from tasks.cluster import ClusterConfig
from tasks.jobs import (
    DistributedTask,
    JobError,
    JobRecord,
    neuron_python,
    retryable,
    submit,
)
from tasks.run_context import run_context, run_logger
from tasks.run_owner import RunOwner

if TYPE_CHECKING:
    from tasks.precompile import PrecompileManifest



class MetricsFollower:
    """Records appended to a metrics.jsonl since the last call (a line still being written waits).
    The job cuts the file back when it resumes from a checkpoint: records up to the newest one
    already read are skipped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.seen: dict[str, int] = {}

    def new(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_size < self.offset:
                self.offset, self.partial = 0, b""
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        *complete, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in complete:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record["iteration"] > self.seen.get(record["kind"], 0):
                self.seen[record["kind"]] = record["iteration"]
                out.append(record)
        return out


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    run_dir: str
    job_ids: list[str]
    summary: dict[str, Any]
    metrics_path: str
    executor: str
    nodelist: str | None = None


class Progress:
    """A Prefect progress artifact (percent of iterations done); a no-op outside a run."""

    def __init__(self, key: str, description: str) -> None:
        self.id = None
        self.last = -1.0
        if run_context() is not None:
            from prefect.artifacts import create_progress_artifact

            self.id = create_progress_artifact(progress=0.0, key=key, description=description)

    def update(self, iteration: int, total: int) -> None:
        percent = round(100.0 * iteration / max(total, 1), 1)
        if self.id is not None and percent != self.last:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, percent)
            self.last = percent


def resolved_config(config: Config, run_dir: Path, precompiled: "PrecompileManifest | None") -> Config:
    changes: dict[str, Any] = {"run_dir": str(run_dir)}
    if precompiled is not None:   # on Trainium the cache is Neuron's, filled with torch.compile off
        changes.update(compile=config.device != "neuron", compile_cache_dir=precompiled.cache_dir)
    return dataclasses.replace(config, **changes)


def on_compiled_nodes(cluster: ClusterConfig, precompiled: "PrecompileManifest | None") -> ClusterConfig:
    """Training runs on the nodes the compile ran on."""
    if precompiled is None or not precompiled.nodelist or cluster.kind != "slurm":
        return cluster
    return cluster.model_copy(update={"nodelist": precompiled.nodelist, "exclude": None})


class DataChanged(ValueError):
    """The run folder holds checkpoints trained on other data than this run's."""


def refuse_other_data(root: Path, config: Config) -> None:
    """Resuming a run on other data would mix two corpora silently (or, with the old run finished,
    train on nothing and report success): refuse, naming both."""
    saved = root / "config.json"
    if not saved.exists() or Checkpointer(root / "checkpoints", 1, 0).latest() is None:
        return
    before = json.loads(saved.read_text()).get("data_index")
    if before and config.data_index and Path(before).name != Path(config.data_index).name:
        raise DataChanged(f"run folder {root} holds checkpoints trained on {before}, but this run's data is "
                          f"{config.data_index}: the sources or their tokenization changed. Set output.run_name "
                          "(or change the seed) to train on the new data in a new folder, or restore the old data")


def train(config: Config, cluster: ClusterConfig, *, run_dir: str,
          precompiled: "PrecompileManifest | None" = None) -> TrainResult:
    """Run (or resume) training in run_dir on the cluster; a second call resumes from the last
    checkpoint in run_dir. The run folder has one owner while this runs (tasks.jobs.RunOwner)."""
    root = Path(run_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cluster = on_compiled_nodes(cluster, precompiled)
    resolved = resolved_config(config, root, precompiled)
    resolved.validate(world_size=cluster.world_size)
    with RunOwner(root):
        refuse_other_data(root, resolved)
        resolved.save(str(root / "config.json"))
        write_json(root / "cluster.json", {**cluster.model_dump(), "resolved_executor": cluster.kind})
        return _train_owned(resolved, cluster, root, precompiled)


def _train_owned(resolved: Config, cluster: ClusterConfig, root: Path,
                 precompiled: "PrecompileManifest | None") -> TrainResult:
    logger = run_logger()
    total = resolved.total_iters
    progress = Progress("training-progress", f"{resolved.model} on {cluster.name}: iterations done")

    records = MetricsFollower(root / "metrics.jsonl")

    def on_poll() -> None:
        """The job's new metrics records: progress, and a log line per logged iteration."""
        for r in records.new():
            if r["kind"] == "valid":
                logger.info("%s", valid_line(r["iteration"], r["valid_loss"]))
                continue
            progress.update(r["iteration"], total)
            if r["iteration"] % resolved.log_interval == 0 or r["iteration"] == total:
                logger.info("%s", train_line(
                    iteration=r["iteration"], total=total, consumed=r["consumed_samples"], elapsed_ms=r["elapsed_ms"],
                    lr=r["lr"], batch=resolved.global_batch_size, loss=r["lm_loss"], loss_scale=r["loss_scale"],
                    grad_norm=r["grad_norm"], skipped=r["skipped"], nan=r["nan"], tokens_per_s=r["tokens_per_s"],
                    mfu_value=r["mfu"]))

    python = None
    if cluster.job_device == "neuron" and precompiled is not None:
        python = neuron_python(precompiled.cache_dir, compile_graphs=False)
    summary, job_id, nodes = submit(DistributedTask(resolved.to_dict()), cluster, run_dir=root,
                                    job_name=f"train-{resolved.model}", python=python, on_poll=on_poll)
    if summary.get("status") != "completed":
        raise JobError(f"job {job_id} returned status {summary.get('status')!r}: {summary}")
    if total:
        progress.update(total, total)
    logger.info("training finished: iteration %s, train loss %s, time to first iteration %.2fs",
                summary.get("iteration"), summary.get("train_loss"), summary.get("time_to_first_iteration_s") or 0)
    return TrainResult(run_dir=str(root), job_ids=JobRecord(root).ids(), summary=summary,
                       metrics_path=str(root / "metrics.jsonl"), executor=cluster.kind, nodelist=nodes or None)


def _train_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Inputs that decide what training produces: a precompile result counts by which cache and
    nodes it names, not by whether that cache was just built or found (the hit flag, timings)."""
    pre = parameters.get("precompiled")
    compiled = (pre.cache_dir, pre.key, pre.nodelist) if pre is not None else None
    return hash_objects(parameters["config"], parameters["cluster"], parameters["run_dir"], compiled)


train_task = task(name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=retryable,
                  persist_result=True, cache_key_fn=_train_cache_key)(train)
