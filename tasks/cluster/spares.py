"""Restarts inside the allocation: a SLURM job with spare nodes runs its ranks as a loop of job
steps, and the process that follows it starts a new step without the node at fault instead of
sending the job back through the queue.

The batch script allocates ``nodes + spare_nodes`` nodes (``--no-kill``: a node that fails is
taken out of the allocation, which goes on) and runs ``srun`` on ``nodes`` of them. When a step
fails, it looks at ``<jobs>/<job id>_restarts``: a line the follower
appended there for this step (the node to leave out, or ``-`` for none) starts the next step on the
nodes that are left, which resumes from the newest checkpoint as any start does; ``end``, or no
line within VERDICT_WAIT_S, ends the job with the step's status. A step that succeeded (status 0,
and no error from srun) ends the job.

The follower answers two kinds of fault. A hang: it writes the line before it kills the step, so
the loop finds it at once. A step that failed by itself: the loop appends the step's status and
srun's first error line to ``<jobs>/<job id>_steps``, and the follower answers from that line
(``RankLost``): a rank killed by a signal, or a node that failed, is the node's fault and restarts
without it; any other end (a rank's error, which every start would meet again) ends the job. Both
files hold one allocation's steps: the batch script empties them when it starts (again, after a
requeue, on a new allocation with its own spares).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tasks.cluster.slurm import run_command
from tasks.events import Incident

NONE = "-"      # a restart that leaves no node out
END = "end"     # the follower's answer to a step that ended by itself: the job ends with it
VERDICT_WAIT_S = 60     # how long the loop waits for that answer (the follower polls every few seconds)
# How srun says a step ended (its first error line): a task killed by a signal (the kernel's OOM
# killer, a failing node's memory or bus), and a node lost. A task that exited with a status had
# an error of its own, which a new start would meet again.
_TASK_LOST = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): (?P<how>Killed|Bus error|"
                        r"Segmentation fault)$")
_NODE_LOST = re.compile(r"srun: error: Node failure on (?P<node>\S+)$")


@dataclass(frozen=True)
class RankLost:
    """A step that ended because one node lost its rank or failed: the node's fault, not the run's."""
    job_id: str
    node: str
    rank: int | None        # the rank killed; None where the node itself failed
    why: str                # srun's line
    iteration: int | None = None    # the iteration it was lost in, once the run's records say

    @classmethod
    def of(cls, job_id: str, why: str) -> "RankLost | None":
        """The fault srun's first error line ``why`` names; None where the step ended for another reason."""
        if (node := _NODE_LOST.match(why)) is not None:
            return cls(job_id, node["node"], None, why)
        if (task := _TASK_LOST.match(why)) is not None:
            return cls(job_id, task["node"], int(task["tasks"]) if task["tasks"].isdigit() else None, why)
        return None

    def noticed(self) -> str:
        return f"rank {self.rank} was killed on {self.node}" if self.rank is not None else f"node {self.node} failed"

    def line(self) -> str:
        at = f" at iteration {self.iteration}" if self.iteration is not None else ""
        return f"job {self.job_id}: {self.noticed()}{at} ({self.why})"

    def incident(self) -> Incident:
        return Incident("gpt.training.rank-lost", "training-rank-lost", self.line(),
                        {"job_id": self.job_id, "iteration": self.iteration, "node": self.node, "rank": self.rank,
                         "srun": self.why}, f"job {self.job_id}: {self.noticed()}", f"**{self.line()}**\n")


def restarts_file(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_restarts"


def steps_file(folder: Path, job_id: str) -> Path:
    return Path(folder) / f"{job_id}_steps"


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def left_out(folder: Path, job_id: str) -> list[str]:
    """One entry per restart asked for so far: the node it left out, or NONE."""
    return [line for line in _lines(restarts_file(folder, job_id)) if line != END]


def unanswered(folder: Path, job_id: str) -> str | None:
    """srun's first error line ("" for none) for a step that failed, which the follower has not
    answered yet. The answers are read first: a new allocation empties the steps first."""
    answered = len(_lines(restarts_file(folder, job_id)))
    ended = _lines(steps_file(folder, job_id))
    return ended[answered].partition(" ")[2] if len(ended) > answered else None


def spares_left(folder: Path, job_id: str, spare_nodes: int) -> int:
    """The spare nodes a job still has: each node left out so far took one."""
    return spare_nodes - len({node for node in left_out(folder, job_id) if node != NONE})


def ask_restart(folder: Path, job_id: str, node: str | None) -> None:
    """The loop of the job's batch script starts a new step once this one ends (without ``node``)."""
    _answer(folder, job_id, node or NONE)


def end_steps(folder: Path, job_id: str) -> None:
    """The loop ends the job with the step that ended."""
    _answer(folder, job_id, END)


def _answer(folder: Path, job_id: str, line: str) -> None:
    with open(restarts_file(folder, job_id), "a") as f:
        f.write(f"{line}\n")


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
    job = f'{shlex.quote(str(folder))}/"${{SLURM_JOB_ID}}'
    loop = [
        "set +e +o pipefail",
        f'restarts={job}_restarts" steps={job}_steps" srun_errors={job}_srun.err"',
        ': > "$steps"; : > "$restarts"',
        "step=0",
        "while true; do",
        f'    excluded=$(grep -v -e "^{NONE}$" -e "^{END}$" "$restarts" | sort -u | paste -sd, -)',
        '    [ "$step" -eq 0 ] || echo "restart $step in the allocation, without: ${excluded:-no node}"',
        f'    srun --nodes={nodes} --ntasks={nodes * tasks_per_node} ${{excluded:+--exclude=$excluded}} {srun} '
        '2> "$srun_errors"',
        "    status=$?",
        '    cat "$srun_errors" >&2',
        '    failed=$(grep -m1 "^srun: error: " "$srun_errors")',
        '    [ "$status" -eq 0 ] && [ -z "$failed" ] && exit 0',
        "    step=$((step + 1))",
        '    echo "$status $failed" >> "$steps"',
        f"    for _ in $(seq {VERDICT_WAIT_S}); do",
        '        [ "$(wc -l < "$restarts")" -ge "$step" ] && break',
        "        sleep 1",
        "    done",
        '    answer=$(sed -n "${step}p" "$restarts")',
        f'    [ -n "$answer" ] && [ "$answer" != {END} ] && continue',
        '    [ "$status" -ne 0 ] || status=1     # a node lost: srun says 0',
        "    exit $status",
        "done",
    ]
    header = [re.sub(r"^#SBATCH --nodes=\d+$", f"#SBATCH --nodes={nodes + spare_nodes}\n#SBATCH --no-kill", line)
              for line in lines[:at]]
    return "\n".join([*header, *loop, *lines[at + 1:]]) + "\n"
