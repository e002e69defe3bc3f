"""A local job of several tasks: each rank's torch on its share of this machine's cores (the local
executor's default) against each rank on every core (torch's own default), alternating in one run.

    python -m benchmarks.local_threads [--tasks 2] [--iters 100] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.train.stage import train


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run(tasks: int = 2, iters: int = 100, repeats: int = 2, workdir: str | None = None) -> dict[str, Any]:
    """Wall time and the CPU time of the job's processes (the submitit controller and its ranks,
    all waited for), per run; the ratios of the medians, shared over every core."""
    cores = len(os.sched_getaffinity(0))
    modes = {"shared": {}, "every_core": {"OMP_NUM_THREADS": str(cores)}}
    config = dict(mock_data=True, device="cpu", precision="fp32", vocab_size=512, train_iters=iters,
                  lr_warmup_iters=2, log_interval=10, eval_interval=10**6, save_interval=10**6,
                  num_layers=4, hidden_size=128, seq_length=128)
    figures: dict[str, dict[str, list[float]]] = {mode: {"wall_s": [], "cpu_s": []} for mode in modes}
    inherited = os.environ.pop("OMP_NUM_THREADS", None)     # the preset's env alone decides below
    try:
        with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-local-threads-") as tmp:
            for repeat in range(repeats):
                for mode, env in modes.items():
                    run_dir = str(Path(tmp) / f"{mode}-{repeat}")
                    cpu, started = _children_cpu_s(), time.perf_counter()
                    train(Config.from_preset("tiny", run_dir=run_dir, **config),
                          load_cluster("local", tasks_per_node=tasks, env=env))
                    figures[mode]["wall_s"].append(round(time.perf_counter() - started, 2))
                    figures[mode]["cpu_s"].append(round(_children_cpu_s() - cpu, 2))
    finally:
        if inherited is not None:
            os.environ["OMP_NUM_THREADS"] = inherited
    median = {mode: {k: statistics.median(v) for k, v in f.items()} for mode, f in figures.items()}
    return {
        "benchmark": "local_threads", "cores": cores, "tasks": tasks, "iters": iters, "runs": figures,
        "threads_per_rank": {"shared": max(1, cores // tasks), "every_core": cores},
        "shared_over_every_core": {k: round(median["shared"][k] / median["every_core"][k], 3)
                                   for k in ("wall_s", "cpu_s")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2, help="tasks (ranks) of the local job")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--workdir", default=None, help="where the temporary run folders go")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.tasks, args.iters, args.repeats, args.workdir), indent=2))


if __name__ == "__main__":
    main()
