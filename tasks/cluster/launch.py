"""How a job's tasks start: plainly (submitit's srun line), or on Trainium one torchrun per node,
the way Neuron expects."""
from __future__ import annotations

import re
import shlex
import sys

from tasks.cluster.config import ClusterConfig, ClusterError

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
    'port=$((15000 + (SLURM_JOB_ID + ${SLURM_RESTART_COUNT:-0} * 7919) % 15000))',
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
