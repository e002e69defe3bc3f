"""The train stage, on the orchestration side: submits the training job (gpt.train on every rank)
to the cluster through tasks.jobs, follows its metrics records, and resumes the run folder's last
checkpoint when there is one. The run folder's files are listed in flows/layout.py."""
from __future__ import annotations

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
    job_launch,
    retryable,
    submit,
)
from tasks.progress import Progress
from tasks.run_context import run_logger
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


def on_compiled_nodes(cluster: ClusterConfig, precompiled: "PrecompileManifest | None") -> ClusterConfig:
    """Training runs on the nodes the compile ran on."""
    if precompiled is None or not precompiled.nodelist or cluster.kind != "slurm":
        return cluster
    return cluster.model_copy(update={"nodelist": precompiled.nodelist, "exclude": None})


class DataChanged(ValueError):
    """The run folder holds checkpoints trained on other data than this run's."""


def refuse_other_data(run_dir: Path, config: Config) -> None:
    """Resuming a run on other data would mix two corpora silently (or, with the old run finished,
    train on nothing and report success): refuse, naming both."""
    saved = run_dir / "config.json"
    if not saved.exists() or Checkpointer(run_dir / "checkpoints", 1, 0).latest() is None:
        return
    before = json.loads(saved.read_text()).get("data_index")
    if before and config.data_index and Path(before).name != Path(config.data_index).name:
        raise DataChanged(f"run folder {run_dir} holds checkpoints trained on {before}, but this run's data is "
                          f"{config.data_index}: the sources or their tokenization changed. Set output.run_name "
                          "(or change the seed) to train on the new data in a new folder, or restore the old data")


def train(config: Config, cluster: ClusterConfig, *, precompiled: "PrecompileManifest | None" = None) -> TrainResult:
    """Run (or resume) training in ``config.run_dir`` on the cluster; a second call resumes from the
    last checkpoint there. The run folder has one owner while this runs (tasks.run_owner.RunOwner)."""
    run_dir = Path(config.run_dir)
    if not run_dir.is_absolute():
        raise ValueError(f"run_dir={config.run_dir!r}: give an absolute path on storage every node sees")
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = on_compiled_nodes(cluster, precompiled)
    with RunOwner(run_dir):
        refuse_other_data(run_dir, config)
        write_json(run_dir / "cluster.json", {**cluster.model_dump(), "resolved_executor": cluster.kind})
        return _train_owned(config, cluster, run_dir, precompiled)


def _train_owned(config: Config, cluster: ClusterConfig, run_dir: Path,
                 precompiled: "PrecompileManifest | None") -> TrainResult:
    logger = run_logger()
    total = config.total_iters
    progress = Progress(f"{config.model} on {cluster.name}", "iterations", items=total,
                        artifact_key="training-progress", log_every_s=None)
    records = MetricsFollower(run_dir / "metrics.jsonl")

    def on_poll() -> None:
        """The job's new metrics records: progress, and a log line per logged iteration."""
        for r in records.new():
            if r["kind"] == "valid":
                logger.info("%s", valid_line(r["iteration"], r["valid_loss"]))
                continue
            progress.set(r["iteration"])
            progress.show()
            if r["iteration"] % config.log_interval == 0 or r["iteration"] == total:
                logger.info("%s", train_line(
                    iteration=r["iteration"], total=total, consumed=r["consumed_samples"], elapsed_ms=r["elapsed_ms"],
                    lr=r["lr"], batch=config.global_batch_size, loss=r["lm_loss"], loss_scale=r["loss_scale"],
                    grad_norm=r["grad_norm"], skipped=r["skipped"], nan=r["nan"], tokens_per_s=r["tokens_per_s"],
                    mfu_value=r["mfu"]))

    launch, python = job_launch(cluster, config.compile_cache_dir, compile_graphs=False)
    summary, job_id, nodes = submit(DistributedTask(config.to_dict()), launch, run_dir=run_dir,
                                    job_name=f"train-{config.model}", python=python, on_poll=on_poll)
    if summary.get("status") != "completed":
        raise JobError(f"job {job_id} returned status {summary.get('status')!r}: {summary}")
    progress.set(total)
    progress.show(final=True)
    logger.info("training finished: iteration %s, train loss %s, time to first iteration %.2fs",
                summary.get("iteration"), summary.get("train_loss"), summary.get("time_to_first_iteration_s") or 0)
    return TrainResult(run_dir=str(run_dir), job_ids=JobRecord(run_dir).ids(), summary=summary,
                       metrics_path=str(run_dir / "metrics.jsonl"), executor=cluster.kind, nodelist=nodes or None)


def _train_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Inputs that decide what training produces: a precompile result counts by which cache and
    nodes it names, not by whether that cache was just built or found (the hit flag, timings)."""
    pre = parameters.get("precompiled")
    compiled = (pre.cache_dir, pre.key, pre.nodelist) if pre is not None else None
    return hash_objects(parameters["config"], parameters["cluster"], compiled)


train_task = task(train, name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=retryable,
                  persist_result=True, cache_key_fn=_train_cache_key)
