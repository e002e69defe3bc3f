"""submitit's executors as the jobs are submitted with them: SLURM's sbatch (arrays included)
started without the submitter's credentials, or local processes whose ranks share this machine's
cores."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import submitit
from submitit.core.utils import DelayedSubmission, JobPaths
from submitit.slurm.slurm import SlurmJob

from tasks.cluster.config import ClusterConfig
from tasks.cluster.spares import step_loop
from tasks.common.secrets import credential_variables


class SlurmExecutor(submitit.SlurmExecutor):
    """submitit's SLURM executor with sbatch started without the submitter's credentials: sbatch
    exports its environment to every rank and SLURM keeps a copy of it with the job. With
    ``spare_nodes``, its ranks run as the loop of steps that restarts them inside the allocation
    (tasks.cluster.spares)."""

    spare_nodes = 0

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        script = super()._make_submission_file_text(command, uid)
        if not self.spare_nodes:
            return script
        return step_loop(script, self.parameters["nodes"], self.parameters["ntasks_per_node"], self.spare_nodes,
                         self.folder)

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        unset = [arg for name in credential_variables() for arg in ("-u", name)]
        return ["env", *unset, *super()._make_submission_command(submission_file_path)]

    def _internal_process_submissions(self, delayed: list[DelayedSubmission]) -> list[submitit.Job]:
        """An array is submitted by this class too (submitit's own array path, as of submitit 1.5.4,
        submits through its plain executor, whose sbatch would carry the credentials): each task's
        pickle is written first, one sbatch with ``--array`` follows, then the pickles take the
        tasks' ids, as submitit does it."""
        if len(delayed) == 1:
            return super()._internal_process_submissions(delayed)
        staging = JobPaths.get_first_id_independent_folder(self.folder)
        staging.mkdir(parents=True, exist_ok=True)
        pickles = [staging / f"{uuid.uuid4().hex}.pkl" for _ in delayed]
        for submission, path in zip(delayed, pickles):
            submission.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            submission.dump(path)
        array = SlurmExecutor(self.folder, self.max_num_timeout, python=self.python)
        array.update_parameters(**self.parameters)
        array.parameters["map_count"] = len(delayed)
        first = array._submit_command(self._submitit_command_str)
        jobs = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=list(range(first.num_tasks)))
                for i in range(len(delayed))]
        for job, path in zip(jobs, pickles):
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


def executor(cluster: ClusterConfig, folder: Path, job_name: str, python: str | None) -> submitit.Executor:
    if cluster.kind == "slurm":
        ex = SlurmExecutor(folder=folder, max_num_timeout=cluster.max_requeues, python=python)
        ex.update_parameters(**cluster.slurm_parameters(job_name))
        ex.spare_nodes = cluster.spare_nodes
        return ex
    ex = submitit.LocalExecutor(folder=folder, max_num_timeout=cluster.max_requeues)
    credentials = credential_variables()
    # A Ctrl-C at the terminal is the flow's to answer (it cancels the job: each rank saves and stops).
    ex.update_parameters(tasks_per_node=cluster.tasks_per_node, nodes=1, timeout_min=cluster.time_limit,
                         setup=["trap '' INT", *([f"unset {' '.join(credentials)}"] if credentials else []),
                                *_local_threads(cluster), *cluster.setup_lines()])
    return ex


def _local_threads(cluster: ClusterConfig) -> list[str]:
    """The local executor's ranks share this machine's cores: unless the preset or the environment
    says otherwise, each rank's torch takes its share of them (torchrun gives each of several ranks
    one), where by default every rank would take them all and their threads would wait on each other."""
    if cluster.tasks_per_node == 1 or "OMP_NUM_THREADS" in cluster.env or "OMP_NUM_THREADS" in os.environ:
        return []
    return [f"export OMP_NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // cluster.tasks_per_node)}"]
