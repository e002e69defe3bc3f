"""Running one job on the cluster: submit it with submitit (SLURM, or local processes), follow
it to its end, cancel it. Used by every stage that runs work on the cluster (sync, tokenize, precompile,
train, evaluate).

The submitting process watches the job itself (squeue / scontrol, no sacct needed), hands rank
0's new log lines to a callback, records job ids and state changes in ``<run_dir>/jobs.json``, and
cancels the job when the flow run is cancelled or the process exits.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import submitit
from submitit.core.utils import FailedJobError, JobPaths

from gpt import heartbeat
from gpt.files import write_json
from tasks.cluster.config import ClusterConfig, ClusterError
from tasks.cluster.executors import executor
from tasks.cluster.hang import Hang, HangWatch
from tasks.cluster.outcome import await_result, failure_report
from tasks.cluster.processes import command_line, process_state, process_tree
from tasks.cluster.record import JobRecord
from tasks.cluster.run_owner import RunOwner
from tasks.cluster.slurm import TERMINAL, requeued, run_command, scancel, slurm_state
from tasks.cluster.spares import RankLost, ask_restart, end_steps, kill_steps, spares_left, unanswered
from tasks.cluster.stacks import save_stacks
from tasks.common.run_context import flow_run_cancelled, flow_run_id, run_logger

log = logging.getLogger(__name__)

JOBS_FOLDER = "jobs"     # <run_dir>/jobs/: the jobs' scripts, logs and results
POLL_S = 2.0
CANCEL_CHECK_S = 5.0
CANCEL_WAIT_S = 120.0    # for a cancelled hung job to end
LOCAL_KILL_WAIT_S = 30.0  # SLURM's KillWait for local jobs: what SIGTERM leaves running is then killed
# Pending reasons that no amount of waiting resolves: fail at once with SLURM's words.
PENDING_FOREVER = {"BadConstraints", "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                   "InvalidAccount", "InvalidQOS", "AccountNotAllowed", "QOSMaxNodePerJobLimit",
                   "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob", "QOSMaxWallDurationPerJobLimit"}

class JobError(RuntimeError):
    """A job failed; the message carries SLURM's state and the failing rank's log tail. Running it
    again may succeed (tasks.common.retry)."""
    transient = True


class StopJob(Exception):
    """Raised by a follower's ``on_poll`` to stop the job at once: its ranks are killed (nothing
    more is saved), the job is recorded in ``state`` with the message, and the exception goes on."""
    state = "STOPPED"


@dataclass(frozen=True)
class ReturnedError:
    """An error a job returns instead of raising: the stage's own (bad input, network trouble), not
    the job's failure. The process that submitted the job raises ``error`` where the stage runs (or
    places it first: a shard's line in its whole file), so that the stage's retry rule decides, and
    a bad input is never resubmitted as a failed job."""
    error: BaseException


class FlowRunCancelled(JobError):
    """The flow run was cancelled while its job ran; the job has been scancelled."""
    transient = False


class SubmitterExiting(JobError):
    """The process that follows the job is exiting; the job has been cancelled."""
    transient = False


class NodeLost(JobError):
    """A node killed a rank of the job, or failed, and the job had no spare node left: it ended with
    its step."""

    def __init__(self, lost: RankLost) -> None:
        super().__init__(lost.line())
        self.lost = lost


class JobHung(JobError):
    """The job stopped advancing (tasks.cluster.hang); its stacks were saved and it has been cancelled."""

    def __init__(self, hang: Hang) -> None:
        super().__init__(hang.line())
        self.hang = hang


Fault = Hang | RankLost     # what restarts a job inside its allocation

_ACTIVE: dict[str, "RunningJob"] = {}
_ACTIVE_LOCK = threading.Lock()


def _cancel_active() -> None:
    """No orphans: jobs still running when this process exits are cancelled."""
    with _ACTIVE_LOCK:
        jobs = list(_ACTIVE.values())
        _ACTIVE.clear()
    cancel_jobs(jobs)


def cancel_jobs(jobs: list["RunningJob"]) -> None:
    """SIGTERM to every job (scancel); a local job's processes that are still there LOCAL_KILL_WAIT_S
    later are killed, as SLURM does after its KillWait (a rank still starting ignores SIGTERM)."""
    left = {pid: command_line(pid) for job in jobs if job.kind == "local" for pid in process_tree(int(job.job_id))}
    for job in jobs:
        job.cancel()
    deadline = time.monotonic() + LOCAL_KILL_WAIT_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: line for pid, line in left.items() if process_state(pid) not in (None, "Z")
                and command_line(pid) == line}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


atexit.register(_cancel_active)


def _exit_on_sigterm() -> Callable[[], None]:
    """Let SIGTERM unwind the waiting code (so its job is cancelled) where nothing else handles it;
    under Prefect, its own SIGTERM handler already raises. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return lambda: None

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------- submission and monitoring


@dataclass
class RunningJob:
    """A job being followed: by its submitit handle when this process started it, else (re-attached
    after the process that started it died) by its id alone."""
    job_id: str
    kind: str                           # "slurm" or "local"
    handle: submitit.Job | None = None

    def state(self, nodes: str) -> tuple[str, str, str]:
        """(state, reason, nodes); for local jobs FINISHED once the controller is gone."""
        if self.kind == "slurm":
            return slurm_state(self.job_id) or ("GONE", "no longer known to SLURM", nodes)
        running = not self.handle.done() if self.handle is not None else _local_alive(int(self.job_id))
        return ("RUNNING" if running else "FINISHED"), "", os.uname().nodename

    def cancel(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """scancel, or ``sig`` to every process of a local job (SIGTERM: each rank saves and stops;
        SIGKILL for ranks that no longer answer). SLURM kills what SIGTERM leaves after its KillWait."""
        if self.kind == "slurm":
            scancel(self.job_id)
        else:
            for pid in process_tree(int(self.job_id)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def signal_ranks(self, sig: signal.Signals, pids: list[int]) -> None:
        """Send ``sig`` to the job's ranks: every task of its steps on SLURM, the given processes here."""
        if self.kind == "slurm":
            r = run_command(["scancel", f"--signal={sig.name.removeprefix('SIG')}", self.job_id])
            if r.returncode != 0:
                log.warning("scancel --signal %s: %s", self.job_id, r.stderr.strip())
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _local_alive(pid: int) -> bool:
    """Whether the submitit controller of a local job (or the shell that runs it) still runs."""
    return process_state(pid) not in (None, "Z") and b"submitit" in command_line(pid)


def _unfinished(record: JobRecord, job_name: str, kind: str) -> RunningJob | None:
    """A job of this name that an earlier run started and never saw end, if it still runs; the ones
    that ended meanwhile get their end recorded."""
    for job in reversed(record.jobs):
        if job["name"] != job_name or job["final"] is not None or job["executor"] != kind:
            continue
        running = RunningJob(job["job_id"], kind)
        state, reason, nodes = running.state("")
        if state not in TERMINAL and state not in ("GONE", "FINISHED"):
            return running
        record.state(job["job_id"], state, reason or "ended while no flow run followed it", nodes)
    return None


R = TypeVar("R")     # what a job's function returns


@contextlib.contextmanager
def _job_folder(run_dir: Path) -> Iterator[JobRecord]:
    """The folder's jobs record, for one submitter at a time: the folder's owner (under the run's
    own owner, the train stage or the flow, the same lock)."""
    with RunOwner(run_dir):
        yield JobRecord(run_dir)


def submit(fn: Callable[[], R], cluster: ClusterConfig, *, run_dir: Path, job_name: str,
           python: str | None = None, on_poll: Callable[[], None] | None = None,
           watch: Callable[[str], HangWatch] | None = None,
           restart: Callable[[Fault], Fault] | None = None) -> tuple[R, str, str]:
    """Submit fn as one job, follow it to the end, return (rank 0's result, job id, nodelist).
    ``on_poll`` runs each time the job's state is checked (every POLL_S) and once at the end.
    ``watch(job_id)`` gives the job's HangWatch: a job that stops advancing has every rank's stack
    saved, is cancelled, and raises JobHung; one with a spare node left (``spare_nodes``) is
    restarted inside its allocation instead, without the node at fault, once ``restart(hang)``
    (which may raise to stop it) has taken note and returned the fault as noted; and so is one whose
    rank a node killed or lost (``restart(RankLost)``).

    The run folder is owned for the whole time (RunOwner). A job of the same name that an earlier
    run submitted and that still runs (the process that followed it died) is followed again
    instead of submitting a second one. Raises ClusterError when SLURM refuses the request,
    RunBusy when another process owns the folder, JobError when the job fails.
    """
    with _job_folder(run_dir) as record:
        running = _unfinished(record, job_name, cluster.kind)
        if running is not None:
            run_logger().info("job %s of an earlier run is still %s: following it instead of submitting another",
                              running.job_id, running.state("")[0])
        else:
            running = _submit(fn, cluster, run_dir=run_dir, job_name=job_name, python=python, record=record)
        return _follow(running, cluster, run_dir=run_dir, record=record, on_poll=on_poll or (lambda: None),
                       watch=watch(running.job_id) if watch is not None else None, restart=restart)


def submit_array(fns: list[Callable[[], R]], cluster: ClusterConfig, *, run_dir: Path, job_name: str,
                 on_poll: Callable[[], None] | None = None) -> list[R | JobError]:
    """Submit each of ``fns`` as one task of a SLURM job array (each task ``cluster``'s resources,
    all run side by side), follow every task to its end, and return, in order, each task's result
    or the JobError it failed with: a failed task does not stop the others. The flow run cancelled,
    or this process exiting, cancels them all."""
    with _job_folder(run_dir) as record:
        while (earlier := _unfinished(record, job_name, cluster.kind)) is not None:
            run_logger().warning("task %s of an earlier %s array still runs, followed by no process: cancelling it "
                                 "before the new array writes where it writes", earlier.job_id, job_name)
            _kill(earlier, "")
            record.state(earlier.job_id, "CANCELLED", "an earlier array's task that no process followed", "")
        running = _submit(fns, cluster, run_dir=run_dir, job_name=job_name, python=None, record=record)
        outcomes: list[R | JobError] = []
        try:
            for task in running:
                try:
                    outcomes.append(_follow(task, cluster, run_dir=run_dir, record=record,
                                            on_poll=on_poll or (lambda: None))[0])
                except (FlowRunCancelled, SubmitterExiting):
                    raise
                except JobError as e:
                    outcomes.append(e)
        finally:
            cancel_jobs(running[len(outcomes) + 1:])
        return outcomes


def _submit(fn: Callable[[], Any] | list[Callable[[], Any]], cluster: ClusterConfig, *, run_dir: Path, job_name: str,
            python: str | None, record: JobRecord) -> Any:
    """One job for ``fn``, or one array task for each of a list of them."""
    folder = run_dir / JOBS_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    ex = executor(cluster, folder, job_name, python)
    try:
        jobs = ex.submit_array(fn) if isinstance(fn, list) else [ex.submit(fn)]
    except FailedJobError as e:
        raise ClusterError(f"SLURM refused job {job_name!r} ({cluster.name}: nodes={cluster.nodes}, "
                           f"partition={cluster.partition}): {str(e).strip()}") from e
    running = [RunningJob(str(job.job_id), cluster.kind, job) for job in jobs]
    for task in running:
        script = folder / f"{task.job_id.split('_')[0]}_submission.sh"
        record.add(task.job_id, cluster.kind, job_name, str(script) if script.exists() else None)
    what = f"job {running[0].job_id}" if not isinstance(fn, list) else \
        f"array {running[0].job_id.split('_')[0]} of {len(running)} tasks, each"
    run_logger().info("submitted %s %s (%s, %d x %d tasks); logs in %s",
                      cluster.kind, what, cluster.name, cluster.nodes, cluster.tasks_per_node, folder)
    return running if isinstance(fn, list) else running[0]


def _follow(running: RunningJob, cluster: ClusterConfig, *, run_dir: Path, record: JobRecord,
            on_poll: Callable[[], None], watch: HangWatch | None = None,
            restart: Callable[[Fault], Fault] | None = None) -> tuple[Any, str, str]:
    """Follow the job to its end: its state recorded as it changes, ``on_poll`` at every poll, its
    ranks watched; returns (rank 0's result, job id, nodelist). A job this leaves before its end
    (an error, the flow run cancelled, this process exiting) is cancelled."""
    job_id, folder = running.job_id, run_dir / JOBS_FOLDER
    with _ACTIVE_LOCK:
        _ACTIVE[job_id] = running
    result_paths = JobPaths(folder, job_id=job_id, task_id=0)
    followed_run = flow_run_id()
    last: tuple[str, str, str] | None = None
    nodes, result = "", None
    next_cancel_check = time.monotonic() + CANCEL_CHECK_S
    finished = False
    restore_sigterm = _exit_on_sigterm()
    try:
        while True:
            info = running.state(nodes)
            if info != last:
                _changed(job_id, info, record)
                last = info
            state, reason, nodes = info
            try:
                _polled(running, on_poll, record, nodes)
                if _ranks_checked(running, watch, state, cluster, run_dir, record, nodes, restart):
                    last = None         # the new step's RUNNING is recorded at the next poll
            except (StopJob, JobError):
                finished = True         # stopped, and recorded so, by the check that raised
                raise
            if state == "PENDING" and reason.split(",")[0] in PENDING_FOREVER:
                raise ClusterError(f"job {job_id} can never start: SLURM says {reason!r} "
                                   f"({cluster.name}: nodes={cluster.nodes}, partition={cluster.partition}, "
                                   f"nodelist={cluster.nodelist}); change the cluster configuration")
            if state in TERMINAL or state in ("GONE", "FINISHED"):
                result = await_result(result_paths)
                if result is not None or running.kind == "local" or not requeued(job_id):
                    break
            if followed_run is not None and time.monotonic() > next_cancel_check:
                next_cancel_check = time.monotonic() + CANCEL_CHECK_S
                if flow_run_cancelled(followed_run):
                    raise FlowRunCancelled(f"flow run cancelled: job {job_id} cancelled")
            if not threading.main_thread().is_alive():
                raise SubmitterExiting(f"the submitting process is exiting: job {job_id} cancelled")
            time.sleep(POLL_S)
        finished = True
        _polled(running, on_poll, record, nodes)
        if result is None or result[0] != "success":
            raise JobError(failure_report(folder, job_id, cluster.world_size, state, reason))
        return result[1], job_id, nodes
    finally:
        restore_sigterm()
        with _ACTIVE_LOCK:
            _ACTIVE.pop(job_id, None)
        if not finished:
            run_logger().warning("cancelling job %s", job_id)
            cancel_jobs([running])
            record.state(job_id, "CANCELLED", "cancelled by the submitting process", nodes)


def _changed(job_id: str, info: tuple[str, str, str], record: JobRecord) -> None:
    """A new state of the job: recorded, and said."""
    state, reason, nodes = info
    record.state(job_id, state, reason, nodes)
    if state == "PENDING":
        run_logger().info("job %s PENDING (%s)", job_id, reason)
    elif state == "RUNNING":
        run_logger().info("job %s RUNNING on %s", job_id, nodes)
    else:
        run_logger().info("job %s %s%s", job_id, state, f" ({reason})" if reason not in ("", "None") else "")


def _polled(running: RunningJob, on_poll: Callable[[], None], record: JobRecord, nodes: str) -> None:
    """``on_poll``; where it stops the job (StopJob), the job is killed and recorded before the error
    goes on."""
    try:
        on_poll()
    except StopJob as e:
        _kill(running, nodes)
        record.state(running.job_id, e.state, str(e), nodes)
        raise


def _ranks_checked(running: RunningJob, watch: HangWatch | None, state: str, cluster: ClusterConfig, run_dir: Path,
                   record: JobRecord, nodes: str, restart: Callable[[Fault], Fault] | None) -> bool:
    """A hung job has its stacks saved and is restarted inside its allocation where it can be
    (True), else stopped (JobHung); a rank that failed while the others run on stops them (JobError).
    A job with spare nodes whose step ended by itself is restarted where its node was at fault."""
    if watch is None:
        return False
    if cluster.spare_nodes and state == "RUNNING" and (why := unanswered(run_dir / JOBS_FOLDER, running.job_id)) is not None:
        return _step_ended(running, RankLost.of(running.job_id, why), watch, cluster, run_dir, record, nodes, restart)
    hang = watch.check(state)
    if hang is not None:
        hang = _stacks_saved(running, hang, run_dir)
        if restart is not None and spares_left(run_dir / JOBS_FOLDER, running.job_id, cluster.spare_nodes) > 0 \
                and _restarted(running, hang, watch, restart, run_dir, record, nodes):
            return True
        raise JobHung(_stopped(running, hang, record, nodes))
    failed = watch.abandoned()
    if failed is not None:
        why = f"rank {failed['rank']} failed, the others stopped"
        run_logger().warning("rank %s failed while the others run on: stopping job %s", failed["rank"], running.job_id)
        _kill(running, nodes)
        record.state(running.job_id, "FAILED", why, nodes)
        raise JobError(failure_report(run_dir / JOBS_FOLDER, running.job_id, cluster.world_size, "FAILED", why))
    return False


def _step_ended(running: RunningJob, lost: RankLost | None, watch: HangWatch, cluster: ClusterConfig, run_dir: Path,
                record: JobRecord, nodes: str, restart: Callable[[Fault], Fault] | None) -> bool:
    """The answer to a step that failed by itself: restarted without the node that lost its rank, once
    ``restart(lost)`` has taken note (True); with no spare left, the job ended (NodeLost: submitted
    again without the node); else the job ends with the step, to be retried as any failed job is."""
    folder = run_dir / JOBS_FOLDER
    if lost is None or restart is None:
        end_steps(folder, running.job_id)
        return False
    if spares_left(folder, running.job_id, cluster.spare_nodes) <= 0:
        end_steps(folder, running.job_id)
        _kill(running, nodes)
        record.state(running.job_id, "FAILED", f"{lost.line()}; no spare node left", nodes)
        raise NodeLost(lost)
    try:
        lost = restart(lost)
    except BaseException:
        end_steps(folder, running.job_id)
        record.state(running.job_id, "FAILED", lost.line(), nodes)
        raise
    ask_restart(folder, running.job_id, lost.node)
    watch.restarted()
    record.state(running.job_id, "RESTARTING", f"{lost.line()}; restarting in the allocation without node {lost.node}",
                 nodes)
    run_logger().warning("job %s: %s; restarting its ranks in the allocation without node %s, from the newest "
                         "checkpoint", running.job_id, lost.noticed(), lost.node)
    return True


def _restarted(running: RunningJob, hang: Hang, watch: HangWatch, restart: Callable[[Fault], Fault], run_dir: Path,
               record: JobRecord, nodes: str) -> bool:
    """The job's hung step killed and the next started by its batch script, without the node at
    fault: the same job, on its spare node, from the newest checkpoint, once ``restart(hang)`` has
    taken note (where it raises, the job is stopped). False where SLURM would not kill the step (the
    job is then stopped as a hung job is without spares, and the hang taken note of there)."""
    ask_restart(run_dir / JOBS_FOLDER, running.job_id, hang.node)
    if not kill_steps(running.job_id):
        run_logger().warning("job %s: its hung step could not be killed alone: stopping the job", running.job_id)
        return False
    try:
        hang = restart(hang)
    except BaseException:
        _stopped(running, hang, record, nodes)
        raise
    watch.restarted()
    without = f"without node {hang.node}" if hang.node else "on the same nodes (no node is at fault)"
    record.state(running.job_id, "RESTARTING", f"{hang.line()}; restarting in the allocation {without}", nodes)
    run_logger().warning("job %s: restarting its ranks in the allocation %s, from the newest checkpoint",
                         running.job_id, without)
    return True


def _stopped(running: RunningJob, hang: Hang, record: JobRecord, nodes: str) -> Hang:
    """The hung job killed (its ranks no longer answer SIGTERM), and recorded so."""
    _kill(running, nodes)
    record.state(running.job_id, "HUNG", hang.line(), nodes)
    return hang


def _stacks_saved(running: RunningJob, hang: Hang, run_dir: Path) -> Hang:
    """Every rank's Python stack and the heartbeats into ``<run>/jobs/<job>/hang-<time>/`` with a
    report."""
    folder = run_dir / JOBS_FOLDER / running.job_id / f"hang-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    hang = dataclasses.replace(hang, folder=str(folder))
    logger = run_logger()
    logger.warning("%s: saving every rank's stack", hang.line())
    how = save_stacks(lambda pids: running.signal_ranks(heartbeat.STACK_SIGNAL, pids), hang.ranks, run_dir, folder,
                      running.job_id if running.kind == "slurm" else None)
    for rank, taken in sorted(how.items()):
        if taken != "signal":
            logger.warning("rank %d gave no stack of its own (stopped, or stuck in native code): %s", rank,
                           "read from outside by py-spy" if taken == "py-spy" else taken)
    write_json(folder / "report.json", {**hang.to_dict(), "stacks": {str(r): t for r, t in sorted(how.items())}})
    return hang


def _kill(running: RunningJob, nodes: str) -> None:
    """Cancel a job whose ranks no longer answer SIGTERM, and wait (bounded) for it to end."""
    running.cancel(signal.SIGKILL)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while time.monotonic() < deadline and running.state(nodes)[0] not in TERMINAL | {"GONE", "FINISHED"}:
        time.sleep(POLL_S)


