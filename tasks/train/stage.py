"""The train stage, on the orchestration side: submits the training job (gpt.train on every rank)
to the cluster through tasks.cluster.jobs, follows its metrics records, and resumes the run folder's last
checkpoint when there is one. The run folder's files are listed in flows/plan/layout.py."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from prefect import task
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer, iteration_of, newest_intact
from gpt.config import Config, model_name
from gpt.data import DataIndex
from gpt.files import NotReplaceable, write_json
from gpt.metrics import saved_line, train_line, valid_line
from tasks import report as reporting
from tasks.cluster.config import ClusterConfig
from tasks.cluster.hang import Hang, HangWatch, Stragglers
from tasks.cluster.jobs import DistributedTask, JobError, JobHung, submit
from tasks.cluster.launch import job_launch
from tasks.cluster.record import JobRecord
from tasks.cluster.run_owner import RunOwner
from tasks.cluster.slurm import usable_nodes
from tasks.common.cache import StageCache
from tasks.common.progress import Progress, human_duration
from tasks.common.retry import worth_retrying
from tasks.common.run_context import run_logger
from tasks.evaluate import EvaluationSpec, ResultsTail, pin, tracker_items
from tasks.train.spikes import CannotRollBack, SpikeFound, SpikeWatch, roll_back, skipped_samples, skipping
from tasks.train.trackers import Trackers

if TYPE_CHECKING:
    from tasks.precompile import PrecompileManifest

SUMMARY = "summary.json"
MAX_HANGS = 3                 # hangs of one train stage before it gives up, at any iterations      # the last completed job's summary: what a run trained to its length reports


class MetricsTail:
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

    def rewind(self, iteration: int) -> None:
        """Read the records again from past ``iteration`` (the run went back to it)."""
        self.seen = {kind: min(seen, iteration) for kind, seen in self.seen.items()}
        self.offset, self.partial = 0, b""


class TrainResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    run_dir: str
    job_ids: list[str]
    summary: dict[str, Any]
    metrics_path: str
    executor: str
    nodelist: str | None = None

    def intact(self) -> bool:
        """The run folder still holds its metrics and a complete checkpoint (it may have been
        deleted since, and the same parameters train it again)."""
        return Path(self.metrics_path).is_file() and \
            Checkpointer(Path(self.run_dir) / "checkpoints", 1, 0).latest() is not None


def on_compiled_nodes(cluster: ClusterConfig, precompiled: "PrecompileManifest | None") -> ClusterConfig:
    """Training runs on the nodes the compile ran on."""
    if precompiled is None or not precompiled.nodelist or cluster.kind != "slurm":
        return cluster
    return cluster.model_copy(update={"nodelist": precompiled.nodelist, "exclude": None})


class DataChanged(ValueError):
    """The run folder holds checkpoints trained on other data than this run's."""


def refuse_other_data(run_dir: Path, config: Config) -> None:
    """Resuming a run on other data would mix two corpora silently (or, with the old run finished,
    train on nothing and report success): refuse, naming both. The data compared is what the
    indices draw samples from (each prefix by its content), not how many samples they hold: a
    longer run of the same data is the same run."""
    saved = run_dir / "config.json"
    if not saved.exists() or Checkpointer(run_dir / "checkpoints", 1, 0).latest() is None:
        return
    before = json.loads(saved.read_text()).get("data_index")
    if not before or not config.data_index or before == config.data_index:
        return
    try:
        same = DataIndex.read(before).drawn_from() == DataIndex.read(config.data_index).drawn_from()
    except ValueError:
        same = Path(before).name == Path(config.data_index).name  # the old index is gone: compare names
    if not same:
        raise DataChanged(f"run folder {run_dir} holds checkpoints trained on {before}, but this run's data is "
                          f"{config.data_index}: the sources or their tokenization changed. Set output.run_name "
                          "(or change the seed) to train on the new data in a new folder, or restore the old data")


def trained_summary(run_dir: Path, total_iters: int, newest: Path | None) -> dict[str, Any] | None:
    """The summary of a run trained to ``total_iters`` already: its newest intact checkpoint
    (``newest``) reached it, and the job that got there left its summary. The one place that
    decides a run needs no job."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    if newest is None or iteration_of(newest) < total_iters or summary.get("iteration") != iteration_of(newest):
        return None
    return summary


def train(config: Config, cluster: ClusterConfig, *, precompiled: "PrecompileManifest | None" = None,
          trackers: tuple[str, ...] = (), tracker_project: str = "gpt-pretrain") -> TrainResult:
    """Run (or resume, or extend) training in ``config.run_dir`` on the cluster; a second call
    resumes from the last checkpoint there, and a run trained to this length already submits
    nothing. The run folder has one owner while this runs (tasks.cluster.run_owner.RunOwner)."""
    run_dir = Path(config.run_dir)
    if not run_dir.is_absolute():
        raise ValueError(f"run_dir={config.run_dir!r}: give an absolute path on storage every node sees")
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = on_compiled_nodes(cluster, precompiled)
    with RunOwner(run_dir):
        config = skipping(config, skipped_samples(run_dir))       # the samples earlier rollbacks left out
        refuse_other_data(run_dir, config)
        summary = trained_summary(run_dir, config.total_iters, newest_intact(run_dir / "checkpoints")[0])
        if summary is not None:
            run_logger().info("run %s is trained to iteration %s already: nothing to submit", run_dir.name,
                              summary["iteration"])
            return TrainResult(run_dir=str(run_dir), job_ids=JobRecord(run_dir).ids(), summary=summary,
                               metrics_path=str(run_dir / "metrics.jsonl"), executor=cluster.kind)
        write_json(run_dir / "cluster.json", {**cluster.model_dump(), "resolved_executor": cluster.kind})
        tracked = Trackers(trackers, tracker_project, run_dir, config.to_dict())
        try:
            result = _train_owned(config, cluster, run_dir, precompiled, tracked)
        except BaseException:
            tracked.close(finished=False)
            raise
        tracked.close(finished=True)
        write_json(run_dir / SUMMARY, result.summary)
        return result


def progress_of_owner(run_dir: Path, total_iters: int) -> Callable[[str], None]:
    """While another flow run owns the run folder (the same run started twice): its training
    progress shown as this run's, from the folder's metrics records."""
    logger = run_logger()
    records = MetricsTail(run_dir / "metrics.jsonl")
    shown: list[Progress] = []

    def show(holder: str) -> None:
        if not shown:
            logger.info("run folder %s is in use by %s: following that run until it ends, then going on from "
                        "what it left", run_dir, holder)
            shown.append(Progress(f"{run_dir.name}, trained by another flow run", "iterations", items=total_iters,
                                  artifact_key="training-progress", log_every_s=60))
        for r in records.new():
            if r["kind"] == "train":
                shown[0].set(r["iteration"])
        shown[0].show()

    return show


def eta_and_cost(iterations_left: int, step_ms: float, elapsed_s: float, cluster: ClusterConfig) -> str:
    """The time left at the latest step time, and what this stage's nodes have cost so far where the
    cluster preset has a price."""
    text = f"ETA {human_duration(iterations_left * step_ms / 1000)}"
    if cluster.price_per_node_hour is not None:
        spent = elapsed_s / 3600 * cluster.nodes * cluster.price_per_node_hour
        text += f", {spent:,.2f} {cluster.currency} so far"
    return text


def _train_owned(config: Config, cluster: ClusterConfig, run_dir: Path,
                 precompiled: "PrecompileManifest | None", tracked: Trackers) -> TrainResult:
    logger = run_logger()
    total = config.total_iters
    progress = Progress(f"{model_name(config)} on {cluster.name}", "iterations", items=total,
                        artifact_key="training-progress", log_every_s=None)
    records = MetricsTail(run_dir / "metrics.jsonl")
    stragglers = Stragglers()
    notes = {"eta": "", "stragglers": "", "save": ""}
    first_record: list[float] = []         # when this stage saw the job train (the cost clock starts)
    newest = newest_intact(run_dir / "checkpoints")[0]
    spikes = SpikeWatch(config, since=iteration_of(newest) if newest else 0)
    evaluation = EvaluationSpec.read(run_dir)
    evaluated = ResultsTail(run_dir)
    announced = [iteration_of(newest) if newest else 0]      # the newest save a checkpoint event was sent for

    def to_evaluate(iteration: int) -> bool:
        """Whether the run evaluates this save: then it is pinned for its evaluation first."""
        if evaluation is None or not evaluation.evaluates(iteration, config.save_interval, total):
            return False
        try:
            pinned = pin(run_dir, iteration)
        except NotReplaceable as e:     # training goes on; this save is not evaluated
            logger.warning("checkpoint %d is not evaluated: %s", iteration, e)
            return False
        if pinned is None:
            logger.warning("checkpoint %d was gone before it could be kept for its evaluation (keep_last %d): "
                           "it is not evaluated", iteration, config.keep_last)
            return False
        return True
    if config.mock_data and (config.spike_factor or config.nan_steps):
        logger.info("loss spikes are not rolled back in this run: mock_data has no sample order to leave samples out of")

    def on_poll() -> None:
        """The job's new metrics records: progress, a log line per logged iteration, stragglers."""
        new = records.new()
        tracked.records(new)
        if tracked.open and (evaluations := evaluated.if_changed()) is not None:   # written meanwhile
            tracked.evaluations(tracker_items(run_dir, evaluations))
        for r in new:
            if r["kind"] == "valid":
                logger.info("%s", valid_line(r["iteration"], r["valid_loss"]))
                continue
            if r["kind"] == "ranks":
                notes["stragglers"] = "; ".join(stragglers.add(r))
                if notes["stragglers"]:
                    logger.warning("%s", notes["stragglers"])
                continue
            if r["kind"] == "save":
                line = saved_line(r["iteration"], r["blocking_s"], r["background_s"])
                logger.info("%s", line)
                notes["save"] = line.strip(" |")
                if r["iteration"] > announced[0]:        # not a save of an earlier leg, read again
                    announced[0] = r["iteration"]
                    reporting.checkpoint_saved(run_dir, r["iteration"], to_evaluate(r["iteration"]))
                continue
            if not first_record:
                first_record.append(time.monotonic())
            notes["eta"] = eta_and_cost(total - r["iteration"], r["elapsed_ms"], time.monotonic() - first_record[0],
                                        cluster)
            progress.note = "; ".join(n for n in notes.values() if n)
            progress.set(r["iteration"])
            progress.show()
            if r["iteration"] % config.log_interval == 0 or r["iteration"] == total:
                logger.info("%s", train_line(
                    iteration=r["iteration"], total=total, consumed=r["consumed_samples"], elapsed_ms=r["elapsed_ms"],
                    lr=r["lr"], batch=config.global_batch_size, loss=r["lm_loss"], loss_scale=r["loss_scale"],
                    grad_norm=r["grad_norm"], skipped=r["skipped"], nan=r["nan"], tokens_per_s=r["tokens_per_s"],
                    mfu_value=r["mfu"]))
            spike = None if config.mock_data else spikes.add(r)
            if spike is not None:
                raise SpikeFound(spike)

    def watch(job_id: str) -> HangWatch:
        return HangWatch(run_dir, job_id, cluster.world_size, config.hang_timeout_s)

    hangs: list[Hang] = []
    resubmitted = 0
    while True:
        launch, python = job_launch(cluster, config.compile_cache_dir, compile_graphs=False)
        try:
            summary, job_id, nodes = submit(DistributedTask(config.to_dict()), launch, run_dir=run_dir,
                                            job_name=f"train-{model_name(config)}", python=python, on_poll=on_poll,
                                            watch=watch)
            if not stopped_without_requeue(summary, cluster, run_dir, job_id) or resubmitted >= cluster.max_requeues:
                break
            resubmitted += 1
            logger.warning("job %s stopped on a signal with its checkpoint saved but did not requeue itself: "
                           "submitting it again to resume (%d of max_requeues %d)", job_id, resubmitted,
                           cluster.max_requeues)
        except JobHung as e:
            reporting.hang_report(e.hang, run_dir.name)
            if any(h.iteration == e.hang.iteration for h in hangs):
                raise HungTwice(f"{e.hang.line()}. It hung at iteration {e.hang.iteration} before as well: not "
                                "resubmitted again; see the stacks, fix what holds it, and run again") from None
            if len(hangs) + 1 >= MAX_HANGS:
                raise HungTwice(f"{e.hang.line()}. The run hung {MAX_HANGS} times (at iterations "
                                f"{', '.join(str(h.iteration) for h in [*hangs, e.hang])}): not resubmitted again; "
                                "see the stacks in each job's folder") from None
            hangs.append(e.hang)
            cluster, where = without_node(cluster, e.hang.node)
            logger.warning("resubmitting the job to resume from the newest checkpoint%s", where)
        except SpikeFound as e:
            try:
                spike, config = roll_back(e.spike, config, run_dir)
            except CannotRollBack as failed:
                reporting.spike_report(failed.spike, run_dir.name, "the run stops here")
                raise
            reporting.spike_report(spike, run_dir.name, f"resubmitting the job to resume from iteration "
                                   f"{spike.resumed_from} without the {len(spike.samples)} samples it trained on")
            records.rewind(spike.resumed_from)
            spikes.rewind(spike.resumed_from)
            announced[0] = spike.resumed_from
    if summary.get("status") != "completed":
        raise JobError(f"job {job_id} returned status {summary.get('status')!r}: {summary}")
    progress.set(total)
    progress.show(final=True)
    logger.info("training finished: iteration %s, train loss %s, time to first iteration %.2fs",
                summary.get("iteration"), summary.get("train_loss"), summary.get("time_to_first_iteration_s") or 0)
    return TrainResult(run_dir=str(run_dir), job_ids=JobRecord(run_dir).ids(), summary=summary,
                       metrics_path=str(run_dir / "metrics.jsonl"), executor=cluster.kind, nodelist=nodes or None)


def stopped_without_requeue(summary: dict[str, Any], cluster: ClusterConfig, run_dir: Path, job_id: str) -> bool:
    """A SLURM job whose ranks stopped on the time-limit or preemption signal and saved, but which
    ended instead of requeuing itself (``scontrol requeue`` refused or failed, or the job was no
    longer RUNNING when it tried), and was not cancelled: running it again resumes it."""
    if cluster.kind != "slurm" or summary.get("status") != "interrupted":
        return False
    job = next((j for j in JobRecord(run_dir).jobs if j["job_id"] == job_id), None)
    return job is not None and job.get("final") != "CANCELLED"


class HungTwice(JobError):
    """The run hung twice at one iteration, or MAX_HANGS times: resubmitting again would loop."""
    transient = False


def without_node(cluster: ClusterConfig, node: str | None) -> tuple[ClusterConfig, str]:
    """The cluster with a node that hung excluded (on SLURM), and no longer pinned to a nodelist;
    where the partition has no spare node to take its place (SLURM would refuse the job), the
    same cluster, to resume on the nodes there are. And where the job goes, said for the log."""
    if cluster.kind != "slurm" or not node:
        return cluster, ""
    excluded = {n for n in (cluster.exclude or "").split(",") if n} | {node}
    usable = usable_nodes(cluster.partition)
    if usable is not None and len(usable - excluded) < cluster.nodes:
        return cluster, (f", on the same nodes, node {node} included: partition {cluster.partition or '(default)'} "
                         f"has {len(usable - excluded)} usable node(s) besides it and the job needs {cluster.nodes}")
    exclude = ",".join(sorted(excluded))
    return cluster.model_copy(update={"exclude": exclude, "nodelist": None}), f", without node {node}"


def _train_cache_key(parameters: dict[str, Any]) -> str:
    """Inputs that decide what training produces: the job's configuration (its compile cache
    included) and the cluster. Not the precompile result: which nodes compiled, or whether its
    cache was just built, found or not needed (a run trained to its length compiles nothing)."""
    return hash_objects(parameters["config"], parameters["cluster"])


train_task = task(train, name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying,
                  persist_result=True, cache_policy=StageCache(key_of=_train_cache_key))
