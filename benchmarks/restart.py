"""A fault on SLURM, two ways back: the job resubmitted (spare_nodes 0), and its ranks restarted
inside the allocation on a spare node (spare_nodes 1). The same run and fault in the same session:
``--fault hang``, rank 1 held before a collective at iteration 7 and found by the hang watch; or
``--fault kill``, rank 1 killed there (SIGKILL, as the OOM killer or a failing node kills it), where
the resubmit is the train task's retry (its delay included) and the restart the follower's answer
to srun's line.

    python -m benchmarks.restart [--cluster slurm-local] [--repeats 2] [--fault hang|kill]

Needs a SLURM cluster with two nodes (``scripts/local-slurm start`` makes one on this machine).
For each way: the seconds to find the fault (a hang: the watch's limit), from the fault known (a
hang: its report written, every rank's stack saved; a kill: the rank killed) to the run training
again (its first iteration recorded after), and the run's wall time. On a cluster whose queue is
busy, the resubmit's share grows by the wait in the queue, which the restart in the allocation does
not pay.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.cluster.jobs import JobError
from tasks.train.stage import train, train_task

HANG_S = 6.0


def once(cluster_name: str, spare_nodes: int, root: Path, fault: str) -> dict[str, float]:
    """One run with the fault; its timings, from the run folder's records."""
    run_dir, fired = root / f"spares-{spare_nodes}", root / f"fired-{spare_nodes}"
    how = "seconds=900" if fault == "hang" else "kill=1"
    os.environ["GPT_FAULT"] = f"rank=1,iteration=7,phase=sync,{how},once={fired}"
    config = Config.from_preset("tiny", mock_data=True, precision="fp32", device="cpu", vocab_size=512,
                                num_layers=2, hidden_size=64, seq_length=64, train_iters=16, save_interval=4,
                                log_interval=1, eval_interval=1000, eval_iters=1, lr_warmup_iters=2,
                                hang_timeout_s=HANG_S, run_dir=str(run_dir))
    cluster = load_cluster(cluster_name, nodes=1, tasks_per_node=2, spare_nodes=spare_nodes)
    started = time.time()
    try:
        try:
            train(config, cluster)
        except JobError:                    # a killed rank without a spare: the train task's retry
            time.sleep(train_task.retry_delay_seconds)
            train(config, cluster)
    finally:
        os.environ.pop("GPT_FAULT", None)
    if fault == "hang":
        (written,) = run_dir.glob("jobs/*/hang-*/report.json")   # once the stacks are saved, before either way acts
        found, found_s = written.stat().st_mtime, json.loads(written.read_text())["stalled_s"]
    else:
        found, found_s = fired.stat().st_mtime, 0.0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    again = min(r["time"] for r in records if r["kind"] == "train" and r["time"] > found)
    return {"found_s": found_s, "back_s": again - found, "wall_s": time.time() - started,
            "jobs": len(json.loads((run_dir / "jobs.json").read_text()))}


def run(cluster: str = "slurm-local", repeats: int = 2, workdir: str | None = None, fault: str = "hang") -> dict[str, Any]:
    ways: dict[str, list[dict[str, float]]] = {"resubmit": [], "in_allocation": []}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-restart-") as tmp:
        for k in range(repeats):           # interleaved, so that drift on the machine hits both alike
            for way, spares in (("resubmit", 0), ("in_allocation", 1)):
                ways[way].append(once(cluster, spares, Path(tmp) / f"{k}", fault))
    out: dict[str, Any] = {"benchmark": "restart", "cluster": cluster, "fault": fault, "hang_timeout_s": HANG_S,
                           "repeats": repeats}
    for way, runs in ways.items():
        out[way] = {key: {"median": round(statistics.median(r[key] for r in runs), 2),
                          "min": round(min(r[key] for r in runs), 2), "max": round(max(r[key] for r in runs), 2)}
                    for key in ("found_s", "back_s", "wall_s")}
        out[way]["jobs"] = runs[0]["jobs"]
    out["back_in_allocation_over_resubmit"] = round(out["in_allocation"]["back_s"]["median"]
                                                    / out["resubmit"]["back_s"]["median"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="slurm-local")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None, help="where the runs go (storage every node sees)")
    parser.add_argument("--fault", choices=("hang", "kill"), default="hang")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.cluster, args.repeats, args.workdir, args.fault), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
