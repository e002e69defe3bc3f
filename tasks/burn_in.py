"""One node's health, on the node: the preset's checks (a vendor's health check such as DCGM's), then
a short training job of the tiny model on the node's ranks, timed against a node outside the
quarantine in the same burn-in. A node passes when every check exits 0, its training completes (a
hang is found by the same watch as in training), and its time per iteration is within
STRAGGLER_FACTOR of the reference node's (give or take SLACK_MS)."""
from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpt.config import Config
from gpt.metrics import read_metrics
from tasks.cluster.config import ClusterConfig
from tasks.cluster.hang import STRAGGLER_FACTOR, HangWatch
from tasks.cluster.jobs import JobError, submit
from tasks.cluster.launch import DistributedTask

CHECK_TIMEOUT_S = 1800
HANG_TIMEOUT_S = 60.0
SLACK_MS = 50.0         # what a node may be slower than STRAGGLER_FACTOR x the reference's: noise at small step times


@dataclass(frozen=True)
class Health:
    node: str
    problems: tuple[str, ...]           # none: it passed (against the reference where there is one)
    ms_per_iteration: float | None      # its training's median time per iteration

    def compared(self, reference: "Health | None") -> "Health":
        """This node's health with its speed held to the reference node's."""
        if reference is None or reference.ms_per_iteration is None or self.ms_per_iteration is None:
            return self
        if self.ms_per_iteration <= STRAGGLER_FACTOR * reference.ms_per_iteration + SLACK_MS:
            return self
        return Health(self.node, (*self.problems, f"{self.ms_per_iteration:.0f} ms per iteration, "
                                                  f"{self.ms_per_iteration / reference.ms_per_iteration:.1f}x node "
                                                  f"{reference.node}'s ({reference.ms_per_iteration:.0f} ms)"),
                      self.ms_per_iteration)


class NodeChecks:
    """What the health job runs first: each check as a shell command on the node; its failures."""

    def __init__(self, checks: list[str]) -> None:
        self.checks = checks

    def __call__(self) -> list[str]:
        failed = []
        for check in self.checks:
            try:
                done = subprocess.run(check, shell=True, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                failed.append(f"{check!r} did not end within {CHECK_TIMEOUT_S} s")
                continue
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
                failed.append(f"{check!r} exited {done.returncode}: {tail[0][:200]}")
        return failed


def node_health(node: str, cluster: ClusterConfig, folder: Path, iterations: int) -> Health:
    """The checks and the training job on ``node`` alone, their records in ``folder``."""
    on_node = cluster.model_copy(update={"nodes": 1, "nodelist": node, "exclude": None, "spare_nodes": 0,
                                         "quarantine": None})
    run_dir = folder / f"{node}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        problems = [*submit(NodeChecks(cluster.burn_in_checks), on_node.model_copy(update={"tasks_per_node": 1}),
                            run_dir=run_dir, job_name=f"burn-in-checks-{node}")[0]] if cluster.burn_in_checks else []
        config = Config.from_preset("tiny", mock_data=True, precision=cluster.default_precision(),
                                    device=cluster.job_device, vocab_size=512, train_iters=iterations,
                                    save_interval=10 * iterations, eval_interval=10 * iterations, log_interval=1,
                                    lr_warmup_iters=1, hang_timeout_s=HANG_TIMEOUT_S, run_dir=str(run_dir / "train"))
        submit(DistributedTask(config.to_dict()), on_node, run_dir=run_dir / "train", job_name=f"burn-in-{node}",
               watch=lambda job: HangWatch(run_dir / "train", job, on_node.world_size, HANG_TIMEOUT_S))
    except (JobError, ValueError) as e:       # ValueError: SLURM refused the job (ClusterError)
        return Health(node, (f"its health job failed: {str(e).splitlines()[0]}",), None)
    return Health(node, tuple(problems), _ms_per_iteration(run_dir / "train" / "metrics.jsonl"))


def _ms_per_iteration(metrics: Path) -> float | None:
    """The median time per iteration, past the first two (which compile and warm up)."""
    times = [r["elapsed_ms"] for r in read_metrics(metrics) if r["kind"] == "train" and r["iteration"] > 2]
    return statistics.median(times) if times else None
