"""How a job's tasks start: plainly (submitit's srun line), or on Trainium one torchrun per node,
the way Neuron expects; what every rank runs (DistributedTask); and the one rule for the port its
ranks meet on."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from typing import Any

import submitit

from gpt.config import Config
from tasks.cluster.config import ClusterConfig, ClusterError
from tasks.cluster.slurm import slurm_state
from tasks.common.secrets import hide_in_logs

# The port a job's ranks meet on, from its id: a requeued job keeps its id, so each restart moves
# to another port (STRIDE, a prime, apart) instead of the old one's TIME_WAIT; so does each step of
# a job restarted inside its allocation (STEP_STRIDE, another prime).
PORT_BASE, PORT_SPAN, PORT_STRIDE, STEP_STRIDE = 15000, 15000, 7919, 1013


def rendezvous_port(job_id: int, restarts: int, step: int = 0) -> int:
    return PORT_BASE + (job_id + restarts * PORT_STRIDE + step * STEP_STRIDE) % PORT_SPAN


def step_as_job(env: dict[str, str]) -> None:
    """A step on some of its job's nodes (a job with spare nodes) is, to its ranks, the job: its
    first node hosts the rendezvous and its node count divides the tasks per node."""
    if "SLURM_STEP_NODELIST" in env and "SLURM_STEP_NUM_NODES" in env:
        env["SLURM_JOB_NODELIST"], env["SLURM_JOB_NUM_NODES"] = env["SLURM_STEP_NODELIST"], env["SLURM_STEP_NUM_NODES"]

# What each of torchrun's processes runs: SLURM's rank variables made theirs, so that submitit's
# task (and its result file) is per rank, then the command that followed.
_RANK_AS_SLURM_TASK = 'export SLURM_PROCID="$RANK" SLURM_LOCALID="$LOCAL_RANK" SLURM_NTASKS="$WORLD_SIZE"; exec "$@"'
# What each node runs: its own Neuron compile cache under $0 when one is given (the cache's file
# locks are unreliable on NFS), then torchrun with $1 processes, under the wrapper in $2 (neuron_parallel_compile or
# nothing). SLURM signals every process of the step: torchrun ignores USR2 and USR1 (which would end
# it), and its ranks, which install their own handlers, checkpoint and stop (USR2) or write their
# stacks (USR1).
_NODE_LAUNCHER = "; ".join([
    'export NEURON_CC_FLAGS="${NEURON_CC_FLAGS:-}${0:+ --cache_dir=$0/${SLURMD_NODENAME:-$(hostname -s)}}"',
    'nproc=$1 wrapper=$2',
    'shift 2',
    'master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    f'port=$(({PORT_BASE} + (SLURM_JOB_ID + ${{SLURM_RESTART_COUNT:-0}} * {PORT_STRIDE}) % {PORT_SPAN}))',
    'trap "" USR1 USR2',
    'exec $wrapper @PYTHON@ -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --node_rank="$SLURM_NODEID" '
    '--nproc_per_node="$nproc" --master_addr="$master" --master_port="$port" --no-python '
    '/bin/bash -c @RANK@ rank @PYTHON@ "$@"',
])


def neuron_launch(cluster: ClusterConfig, cache_dir: str | None, *,
                  compile_graphs: bool) -> tuple[ClusterConfig, str]:
    """How a Trainium job starts, the way Neuron expects: one launcher per node (srun
    --ntasks-per-node=1), each running torchrun with ``tasks_per_node`` processes (one per
    NeuronCore), so that torch_xla sets up Neuron's multi-process runtime; for the graph-extraction
    run, neuron_parallel_compile wraps that torchrun, once per node. Each node compiles into its
    own cache folder under ``cache_dir`` (without one, into Neuron's default cache).

    Returns the cluster configuration to submit (the allocation stays ``tasks_per_node`` tasks per
    node; srun starts one per node) and the command that stands for python in submitit's srun line.
    """
    if cache_dir and re.search(r"\s", cache_dir):
        raise ClusterError(f"Neuron cache path {cache_dir!r} contains whitespace, which NEURON_CC_FLAGS cannot "
                           "carry; choose a cache root without spaces")
    python = shlex.quote(sys.executable)
    node = _NODE_LAUNCHER.replace("@PYTHON@", python).replace("@RANK@", shlex.quote(_RANK_AS_SLURM_TASK))
    wrapper = "neuron_parallel_compile" if compile_graphs else ""
    command = " ".join(["/bin/bash", "-c", shlex.quote(node), shlex.quote(cache_dir or ""), str(cluster.tasks_per_node),
                        shlex.quote(wrapper)])
    per_node = cluster.model_copy(update={"srun_extra": [*cluster.srun_extra, f"--ntasks={cluster.nodes}",
                                                         "--ntasks-per-node=1"]})
    return per_node, command


def job_launch(cluster: ClusterConfig, cache_dir: str | None, *,
               compile_graphs: bool) -> tuple[ClusterConfig, str | None]:
    """The cluster configuration to submit and how its tasks' Python starts: on Trainium one
    torchrun per node (`neuron_launch`, under neuron_parallel_compile for the graph-extraction run),
    plain elsewhere."""
    if cluster.job_device == "neuron":
        return neuron_launch(cluster, cache_dir, compile_graphs=compile_graphs)
    return cluster, None


class DistributedTask(submitit.helpers.Checkpointable):
    """What every submitit task runs: torch.distributed env from submitit, then gpt.train.main.

    On USR2 (time limit or preemption) gpt stops at an iteration boundary on all ranks and saves a
    checkpoint; rank 0 then hands over to submitit's own handler (unless the job is being cancelled), which dumps this callable again
    (``checkpoint``) and requeues the job: the next start resumes from that checkpoint.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def __call__(self) -> dict[str, Any]:
        import gpt.train

        hide_in_logs()

        if "SLURM_JOB_ID" in os.environ and "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(rendezvous_port(int(os.environ["SLURM_JOB_ID"]),
                                                            int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                                                            int(os.environ.get("SLURM_STEP_ID", "0"))))
        step_as_job(os.environ)
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        requeue = signal.getsignal(signal.SIGUSR2)
        summary = gpt.train.main(Config.from_dict(self.config))
        if (summary.get("status") == "interrupted" and os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
                and os.environ.get("RANK") == "0"):
            signal.signal(signal.SIGUSR2, requeue)
            # SIGTERM from scancel also interrupts training: a cancelled job must stay cancelled.
            job = slurm_state(os.environ["SLURM_JOB_ID"])
            if callable(requeue) and job is not None and job[0] == "RUNNING":
                try:
                    requeue(signal.SIGUSR2, None)  # rank 0: checkpoint + `scontrol requeue` + exit
                except (subprocess.SubprocessError, OSError) as e:
                    # The job ends with its checkpoint saved and the summary saying so: the process
                    # that follows it submits it again (tasks.train.stage), instead of a FAILED job.
                    print(f"scontrol requeue failed ({e}): ending with the checkpoint saved", flush=True)
        return summary
