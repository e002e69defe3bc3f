"""Restarts inside the allocation: a SLURM job with spare nodes runs its ranks as a loop of job
steps, and the process that follows it starts a new step without the node at fault instead of
sending the job back through the queue.

The batch script allocates ``nodes + spare_nodes`` nodes and runs ``srun`` on ``nodes`` of them.
When a step fails, it looks at ``<jobs>/<job id>_restarts``: a line the follower appended there
for this step (the node to leave out, or ``-`` for none) starts the next step on the nodes that
are left, which resumes from the newest checkpoint as any start does; no line, or a step that
succeeded, ends the job with the step's status. The follower writes the line before it kills the
step, so the loop always finds it. The file holds one allocation's restarts: the batch script
empties it when it starts (again, after a requeue, on a new allocation with its own spares).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from tasks.cluster.slurm import run_command

NONE = "-"      # a restart that leaves no node out


def restarts_file(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_restarts"


def left_out(folder: Path, job_id: str) -> list[str]:
    """One entry per restart asked for so far: the node it left out, or NONE."""
    try:
        return restarts_file(folder, job_id).read_text().split()
    except FileNotFoundError:
        return []


def spares_left(folder: Path, job_id: str, spare_nodes: int) -> int:
    """The spare nodes a job still has: each node left out so far took one."""
    return spare_nodes - len({node for node in left_out(folder, job_id) if node != NONE})


def ask_restart(folder: Path, job_id: str, node: str | None) -> None:
    """The loop of the job's batch script starts a new step once this one ends (without ``node``)."""
    with open(restarts_file(folder, job_id), "a") as f:
        f.write(f"{node or NONE}\n")


def kill_steps(job_id: str) -> bool:
    """SIGKILL to every running step of the job (not its batch script, which starts the next one):
    a hung rank answers nothing else. Whether SLURM took it."""
    listed = run_command(["squeue", "--steps", "--noheader", "--format=%i", f"--jobs={job_id}"])
    steps = [s for s in listed.stdout.split() if re.fullmatch(rf"{re.escape(job_id)}\.\d+", s)]
    return listed.returncode == 0 and bool(steps) and run_command(["scancel", "--signal=KILL", *steps]).returncode == 0


def step_loop(script: str, nodes: int, tasks_per_node: int, spare_nodes: int, folder: Path) -> str:
    """submitit's batch script with its ``srun`` line run as the restart loop, on ``nodes`` of the
    ``nodes + spare_nodes`` it allocates."""
    lines = script.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith("srun ") and "submitit.core._submit" in line]
    srun = lines[at].removeprefix("srun ")
    loop = [
        "set +e +o pipefail",
        f'restarts={shlex.quote(str(folder))}/"${{SLURM_JOB_ID}}_restarts"',
        ': > "$restarts"',
        "step=0",
        "while true; do",
        '    excluded=$(grep -v "^-$" "$restarts" | sort -u | paste -sd, -)',
        '    [ "$step" -eq 0 ] || echo "restart $step in the allocation, without: ${excluded:-no node}"',
        f'    srun --nodes={nodes} --ntasks={nodes * tasks_per_node} ${{excluded:+--exclude=$excluded}} {srun}',
        "    status=$?",
        "    step=$((step + 1))",
        '    [ "$status" -ne 0 ] && [ "$(wc -l < "$restarts")" -ge "$step" ] || exit $status',
        "done",
    ]
    header = [re.sub(r"^#SBATCH --nodes=\d+$", f"#SBATCH --nodes={nodes + spare_nodes}", line) for line in lines[:at]]
    return "\n".join([*header, *loop, *lines[at + 1:]]) + "\n"
