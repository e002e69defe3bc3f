"""The train stage, on the orchestration side: submits the training job (gpt.train on every rank)
to the cluster through tasks.cluster.jobs, follows its metrics records, and resumes the run folder's last
checkpoint when there is one. The run folder's files are listed in flows/plan/layout.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from prefect import task
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer, iteration_of, newest_intact
from gpt.config import Config, model_name
from gpt.data import DataIndex
from gpt.files import write_json
from tasks import events
from tasks.cluster.config import ClusterConfig
from tasks.cluster.hang import Hang
from tasks.cluster.jobs import JOBS_FOLDER, Fault, JobError, JobHung, NodeLost, submit
from tasks.cluster.launch import DistributedTask, job_launch
from tasks.cluster.quarantine import Quarantine
from tasks.cluster.record import JobRecord
from tasks.cluster.run_owner import RunOwner
from tasks.cluster.slurm import hostnames, usable_nodes
from tasks.common.cache import StageCache
from tasks.common.progress import Progress
from tasks.common.retry import worth_retrying
from tasks.common.run_context import run_logger
from tasks.sync import TransientSyncError
from tasks.trackers import Trackers
from tasks.train.copies import CheckpointCopies
from tasks.train.goodput import account_leg
from tasks.train.remote_checkpoints import S3_ERRORS, RemoteTier
from tasks.train.spikes import CannotRollBack, Spike, SpikeFound, roll_back, skipped_samples, skipping
from tasks.train.watch import MetricsTail, TrainingWatch

if TYPE_CHECKING:
    from tasks.precompile import PrecompileManifest

SUMMARY = "summary.json"      # the last completed job's summary: what a run trained to its length reports
MAX_FAULTS = 3     # hangs and lost ranks of one train stage before it gives up, at any iterations


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
    saved = json.loads(saved.read_text())
    before = saved.get("data_index")
    if saved.get("data_offset", 0) != config.data_offset:
        return                      # another phase of the run: its data is the phase's (tasks.train.phases)
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
          trackers: tuple[str, ...] = (), tracker_project: str = "gpt-pretrain",
          tier: RemoteTier | None = None) -> TrainResult:
    """Run (or resume, or extend) training in ``config.run_dir`` on the cluster; a second call
    resumes from the last checkpoint there, and a run trained to this length already submits
    nothing. The run folder has one owner while this runs (tasks.cluster.run_owner.RunOwner).
    ``tier``: where each complete save is copied as it comes, and where a run folder without a
    checkpoint as new gets the newest copy back from first."""
    run_dir = Path(config.run_dir)
    if not run_dir.is_absolute():
        raise ValueError(f"run_dir={config.run_dir!r}: give an absolute path on storage every node sees")
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = on_compiled_nodes(cluster, precompiled)
    with RunOwner(run_dir):
        copies = copying(tier, run_dir) if tier is not None else None
        config = skipping(config, skipped_samples(run_dir, config.data_offset))   # what earlier rollbacks left out
        refuse_other_data(run_dir, config)
        summary = trained_summary(run_dir, config.total_iters, newest_intact(run_dir / "checkpoints")[0])
        if summary is not None:
            if copies is not None:
                copies.finish()
            run_logger().info("run %s is trained to iteration %s already: nothing to submit", run_dir.name,
                              summary["iteration"])
            return TrainResult(run_dir=str(run_dir), job_ids=JobRecord(run_dir).ids(), summary=summary,
                               metrics_path=str(run_dir / "metrics.jsonl"), executor=cluster.kind)
        write_json(run_dir / "cluster.json", {**cluster.model_dump(), "resolved_executor": cluster.kind})
        tracked = Trackers(trackers, tracker_project, run_dir, config.to_dict())
        before = set(JobRecord(run_dir).ids())
        try:
            result = _train_owned(config, cluster, run_dir, precompiled, tracked, copies)
        except BaseException as e:
            account_leg(run_dir, before)
            tracked.close(finished=False)
            if copies is not None:      # the saves so far copied, unless the process is stopping
                copies.finish(None if isinstance(e, Exception) else 0)
            raise
        missing = {"checkpoint_copies_missing": copies.missing} if copies is not None and copies.missing else {}
        result = result.model_copy(update={"summary": {**result.summary, **account_leg(run_dir, before), **missing}})
        tracked.close(finished=True)
        write_json(run_dir / SUMMARY, result.summary)
        return result


def copying(tier: RemoteTier, run_dir: Path) -> CheckpointCopies:
    """The run folder's newest checkpoint first brought back from S3 where S3 holds a newer one (or
    copied there where it is missing); the copies of this stage's saves, to make as they come."""
    restore(tier, run_dir)
    copies = CheckpointCopies(tier, run_dir)
    newest, _ = newest_intact(run_dir / "checkpoints")
    if newest is not None:
        copies.catch_up(iteration_of(newest))
    return copies


def restore(tier: RemoteTier, run_dir: Path) -> None:
    """The newest checkpoint copied to S3 brought back, where the run folder has none as new. S3 out
    of reach is a warning where the folder has a checkpoint or never trained; a folder that trained
    and lost its checkpoints waits for S3 (the stage fails, to be retried), rather than start over."""
    try:
        restored = tier.restore(run_dir)
    except S3_ERRORS as e:
        if newest_intact(run_dir / "checkpoints")[0] is None and (run_dir / "metrics.jsonl").exists():
            raise TransientSyncError(f"run {run_dir.name} has no intact checkpoint and its copies under {tier.uri} cannot be "
                            f"read ({e}): run it again once S3 answers") from None
        run_logger().warning("warning: the checkpoints copied to %s cannot be listed (%s): training goes on from the "
                             "run folder's", tier.uri, e)
        return
    if restored is not None:
        run_logger().info("checkpoint iteration %d brought back from %s (verified): the run folder had none as new",
                          restored, tier.at(restored))


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


def _train_owned(config: Config, cluster: ClusterConfig, run_dir: Path, precompiled: "PrecompileManifest | None",
                 tracked: Trackers, copies: CheckpointCopies | None) -> TrainResult:
    """The job submitted and followed until it completes; submitted again to resume after a hang
    (without the node that hung), a loss spike (rolled back), or a stop that did not requeue."""
    watch = TrainingWatch(config, cluster, run_dir, tracked, copies)
    faults: list[Fault] = []
    resubmitted = 0
    while True:
        launch, python = job_launch(cluster, config.compile_cache_dir, compile_graphs=False)
        try:
            summary, job_id, nodes = submit(DistributedTask(config.to_dict()), launch, run_dir=run_dir,
                                            job_name=f"train-{model_name(config)}", python=python,
                                            on_poll=watch.on_poll, watch=watch.hangs,
                                            restart=lambda fault: watch.restarting(counted(watch.placed(fault), faults,
                                                                                           run_dir, watch.quarantine)))
            if not stopped_without_requeue(summary, cluster, run_dir, job_id) or resubmitted >= cluster.max_requeues:
                break
            resubmitted += 1
            run_logger().warning("job %s stopped on a signal with its checkpoint saved but did not requeue itself: "
                                 "submitting it again to resume (%d of max_requeues %d)", job_id, resubmitted,
                                 cluster.max_requeues)
        except JobHung as e:
            cluster = after_fault(e.hang, faults, cluster, run_dir)
        except NodeLost as e:
            cluster = after_fault(watch.placed(e.lost), faults, cluster, run_dir)
        except SpikeFound as e:
            config = after_spike(e.spike, config, run_dir, watch)
    if summary.get("status") != "completed":
        raise JobError(f"job {job_id} returned status {summary.get('status')!r}: {summary}")
    watch.finish()      # the last copies made first
    run_logger().info("training finished: iteration %s, train loss %s, time to first iteration %.2fs",
                      summary.get("iteration"), summary.get("train_loss"), summary.get("time_to_first_iteration_s") or 0)
    return TrainResult(run_dir=str(run_dir), job_ids=JobRecord(run_dir).ids(), summary=summary,
                       metrics_path=str(run_dir / "metrics.jsonl"), executor=cluster.kind, nodelist=nodes or None)


def after_fault(fault: Fault, faults: list[Fault], cluster: ClusterConfig, run_dir: Path) -> ClusterConfig:
    """Reported; the cluster the job is submitted to again, without the node at fault."""
    counted(fault, faults, run_dir, Quarantine.of(cluster))
    cluster, where = without_node(cluster, fault.node)
    run_logger().warning("resubmitting the job to resume from the newest checkpoint%s", where)
    return cluster


def counted(fault: Fault, faults: list[Fault], run_dir: Path, quarantine: Quarantine | None) -> Fault:
    """A hang or a lost rank reported, its node quarantined where the operator keeps a quarantine, and
    the fault added to the stage's: two at one iteration, or MAX_FAULTS, end the stage (FaultedTwice),
    as starting the job again would loop."""
    events.report(fault.incident(), run_dir.name)
    hung = isinstance(fault, Hang)
    evidence = fault.folder if hung else str(run_dir / JOBS_FOLDER / f"{fault.job_id}_0_log.err")
    if fault.node and quarantine is not None:
        quarantine.verdict(fault.node, "hang" if hung else "rank lost", fault.line(), run=run_dir.name,
                           job=fault.job_id, evidence=evidence)
    if fault.iteration is not None and any(f.iteration == fault.iteration for f in faults):
        raise FaultedTwice(f"{fault.line()}. It {'hung' if hung else 'lost a rank'} at iteration {fault.iteration} "
                           f"before as well: not started again; see {evidence}, fix what stops it, and run "
                           "again") from None
    if len(faults) + 1 >= MAX_FAULTS:
        raise FaultedTwice(f"{fault.line()}. The run hung or lost a rank {MAX_FAULTS} times (at iterations "
                           f"{', '.join(str(f.iteration) for f in [*faults, fault])}): not started again; "
                           "see the stacks and logs in each job's folder") from None
    faults.append(fault)
    return fault


def after_spike(found: Spike, config: Config, run_dir: Path, watch: TrainingWatch) -> Config:
    """The run rolled back before a loss spike, reported: the configuration to resume with, which
    leaves out the samples the spike trained on."""
    try:
        spike, config = roll_back(found, config, run_dir)
    except CannotRollBack as failed:
        events.report(failed.spike.incident("the run stops here"), run_dir.name)
        raise
    events.report(spike.incident(f"resubmitting the job to resume from iteration {spike.resumed_from} without "
                                 f"the {len(spike.samples)} samples it trained on"), run_dir.name)
    watch.rewind(spike.resumed_from, config)
    return config


def stopped_without_requeue(summary: dict[str, Any], cluster: ClusterConfig, run_dir: Path, job_id: str) -> bool:
    """A SLURM job whose ranks stopped on the time-limit or preemption signal and saved, but which
    ended instead of requeuing itself (``scontrol requeue`` refused or failed, or the job was no
    longer RUNNING when it tried), and was not cancelled: running it again resumes it."""
    if cluster.kind != "slurm" or summary.get("status") != "interrupted":
        return False
    job = next((j for j in JobRecord(run_dir).jobs if j["job_id"] == job_id), None)
    return job is not None and job.get("final") != "CANCELLED"


class FaultedTwice(JobError):
    """The run hung or lost a rank twice at one iteration, or MAX_FAULTS times: starting it again would
    loop."""
    transient = False


def without_node(cluster: ClusterConfig, node: str | None) -> tuple[ClusterConfig, str]:
    """The cluster with a node that hung excluded (on SLURM), and no longer pinned to a nodelist;
    where the partition has no spare node to take its place (SLURM would refuse the job), the
    same cluster, to resume on the nodes there are. And where the job goes, said for the log."""
    if cluster.kind != "slurm" or not node:
        return cluster, ""
    excluded = set(hostnames(cluster.exclude)) | {node}
    usable = usable_nodes(cluster.partition)
    if usable is not None and len(usable - excluded) < cluster.nodes + cluster.spare_nodes:
        return cluster, (f", on the same nodes, node {node} included: partition {cluster.partition or '(default)'} "
                         f"has {len(usable - excluded)} usable node(s) besides it and the job needs "
                         f"{cluster.nodes + cluster.spare_nodes}")
    exclude = ",".join(sorted(excluded))
    return cluster.model_copy(update={"exclude": exclude, "nodelist": None}), f", without node {node}"


def _train_cache_key(parameters: dict[str, Any]) -> str:
    """Inputs that decide what training produces: the job's configuration (its compile cache
    included) and the cluster. Not the precompile result: which nodes compiled, or whether its
    cache was just built, found or not needed (a run trained to its length compiles nothing)."""
    return hash_objects(parameters["config"], parameters["cluster"])


train_task = task(train, name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying,
                  persist_result=True, cache_policy=StageCache(key_of=_train_cache_key))
