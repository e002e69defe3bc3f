"""Where a run's node-hours went: each job the train stage followed, split by cause from the run
folder's records (jobs.json's states and their times, metrics.jsonl's iterations and saves, the hang
reports), the causes of a job summing to its nodes x the time from its submission to its end.

Causes: ``queue`` (submitted, not yet running), ``start`` (the first start of the run's first job
until its first iteration ended: imports, the rendezvous, the checkpoint read, compilation),
``restart`` (any later start until its first iteration, and a requeued job's hold), ``productive``
(the iterations kept), ``checkpoint`` (training blocked by saves), ``hang`` (from the ranks' last
progress to the hung job's end or restart), ``lost`` (iterations trained again after a fault: from
the last record kept to the fault), ``rolled_back`` (iterations thrown away with a loss spike: the
records a rollback set aside in ``rolled-back/<n>/``, and its job's end),
``evaluation`` (evaluation jobs), and ``other`` (what no record accounts for: logging, evaluation
inside training, the job's end). Data loading is inside ``productive``: the records time whole
iterations.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpt.files import write_json
from gpt.metrics import read_metrics
from tasks.cluster.record import JobRecord
from tasks.cluster.slurm import hostnames
from tasks.common.figures import png_bytes, png_markdown, pyplot
from tasks.common.run_context import run_context, run_logger
from tasks.train.spikes import ROLLED_BACK

CAUSES = ("queue", "start", "restart", "productive", "checkpoint", "hang", "lost", "rolled_back", "evaluation",
          "other")
GOODPUT = "goodput.json"
FAULT_ENDS = {"SPIKED": "rolled_back", "FAILED": "lost", "STOPPED": "lost", "NODE_FAIL": "lost", "CANCELLED": "lost",
              "TIMEOUT": "lost", "PREEMPTED": "lost", "OUT_OF_MEMORY": "lost"}
HUNG = ("HUNG", "RESTARTING")


def job_seconds(job: dict[str, Any], records: list[dict[str, Any]], hangs: list[dict[str, Any]],
                first: bool) -> dict[str, float]:
    """One job's seconds by cause, but ``other`` (not yet times its nodes). ``first``: the run's
    first training job, whose first start is the run's ``start``."""
    seconds = dict.fromkeys(CAUSES, 0.0)
    if job["name"].startswith("eval"):
        seconds["evaluation"] = _end(job) - job["submitted"]
        return seconds
    at, began, ran = job["submitted"], None, False
    for state in job["states"]:
        t, name = state["time"], state["state"]
        if began is None:
            seconds["restart" if ran else "queue"] += t - at      # waiting: the queue, or a requeue's hold
            if name == "RUNNING":
                began, ran = t, True
        elif name != "RUNNING":                                   # a start of the ranks ends
            _start_ended(seconds, began, t, name, records, hangs, "start" if first else "restart")
            first, began = False, (t if name == "RESTARTING" else None)
        at = t
    return seconds


def _start_ended(seconds: dict[str, float], a: float, b: float, ended: str, records: list[dict[str, Any]],
                 hangs: list[dict[str, Any]], starting: str) -> None:
    """One start of a job's ranks, from ``a`` to ``b``, when it ended in state ``ended``; its first
    stretch, until its first iteration ended, is ``starting``."""
    ours = [r for r in records if a <= r["time"] <= b]
    trained = sorted((r for r in ours if r["kind"] == "train"), key=lambda r: r["time"])
    seconds["checkpoint"] += sum(r.get("blocking_s", 0.0) for r in ours if r["kind"] == "save")
    last = trained[-1]["time"] if trained else a
    if trained:
        seconds[starting] += trained[0]["time"] - a
        for r in trained[1:]:
            seconds["rolled_back" if r.get("rolled_back") else "productive"] += r["elapsed_ms"] / 1000
    stalled = 0.0
    if ended in HUNG:
        stalled = min(b - last, next((h["stalled_s"] for h in hangs if a < h["written"] <= b), 0.0))
        seconds["hang"] += stalled
    if ended in HUNG or ended in FAULT_ENDS:
        cause = FAULT_ENDS.get(ended, "lost") if trained else starting
        seconds[cause] += b - last - stalled
    elif not trained:
        seconds[starting] += b - a
    # what is left of a start that completed (logging, evaluation, its end) is the job's "other"


def _end(job: dict[str, Any]) -> float:
    return job["states"][-1]["time"] if job["states"] else job["submitted"]


def job_nodes(job: dict[str, Any]) -> int:
    """The nodes the job held: its node list as SLURM gave it (spares included); 1 for a local job."""
    listed = max((s["nodes"] for s in job["states"]), key=lambda n: len(hostnames(n)), default="")
    return max(1, len(hostnames(listed))) if job["executor"] == "slurm" else 1


def ledger(run_dir: Path, job_ids: list[str]) -> dict[str, Any]:
    """The node-seconds by cause of the jobs ``job_ids`` (one leg of the run), each job's and their sum."""
    records = [*read_metrics(run_dir / "metrics.jsonl"), *({**r, "rolled_back": True}
                                                           for p in run_dir.glob(f"{ROLLED_BACK}/*/metrics.jsonl")
                                                           for r in read_metrics(p))]
    hangs = [{**json.loads(p.read_text()), "written": p.stat().st_mtime} for p in run_dir.glob("jobs/*/hang-*/report.json")]
    jobs = [j for j in JobRecord(run_dir).jobs if j["job_id"] in job_ids and j["final"] is not None]
    first_train = next((j["job_id"] for j in JobRecord(run_dir).jobs if j["name"].startswith("train")), None)
    rows = []
    for job in jobs:
        seconds = job_seconds(job, records, hangs, first=job["job_id"] == first_train)
        held = _end(job) - job["submitted"]
        seconds["other"] = max(0.0, held - sum(seconds.values()))
        nodes = job_nodes(job)
        rows.append({"job_id": job["job_id"], "name": job["name"], "nodes": nodes, "held_s": held,
                     "node_seconds": {c: s * nodes for c, s in seconds.items()}})
    total = {c: sum(r["node_seconds"][c] for r in rows) for c in CAUSES}
    held = sum(r["held_s"] * r["nodes"] for r in rows)
    return {"jobs": rows, "node_seconds": total, "held_node_seconds": held,
            "goodput": total["productive"] / held if held else None}


def account_leg(run_dir: Path, before: set[str]) -> dict[str, Any]:
    """The ledger of the jobs submitted since ``before`` (the job ids there were): added to
    ``<run>/goodput.json`` (one entry per leg, oldest first), said in the log and, in a Prefect run,
    as the ``goodput`` artifact; its figures for the run's summary (and so its trackers)."""
    try:
        leg = {"time": time.time(), **ledger(run_dir, [i for i in JobRecord(run_dir).ids() if i not in before])}
        write_json(run_dir / GOODPUT, {"legs": [*_legs(run_dir), leg]})
    except (OSError, ValueError, KeyError, TypeError) as e:     # the run's own outcome stands
        run_logger().warning("the node-hours of this leg were not accounted: %s", e)
        return {}
    held = leg["held_node_seconds"]
    run_logger().info("node-hours of this leg: %.4g held, %s", held / 3600, ", ".join(
        f"{cause} {seconds / held:.1%}" for cause, seconds in leg["node_seconds"].items() if seconds) if held else "none")
    if held and run_context() is not None:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(ledger_markdown(run_dir.name, leg), key="goodput",
                                 description="Where this leg's node-hours went")
    return {"goodput": leg["goodput"] or 0.0, "node_hours": held / 3600,
            **{f"node_hours_{cause}": seconds / 3600 for cause, seconds in leg["node_seconds"].items()}}


def _legs(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / GOODPUT).read_text())["legs"]
    except (OSError, ValueError, KeyError):
        return []


def ledger_markdown(run_name: str, leg: dict[str, Any]) -> str:
    """The leg as a table of node-hours by cause, and a stacked bar per job."""
    held = leg["held_node_seconds"] or 1.0
    rows = "\n".join(f"| {cause} | {seconds / 3600:.4g} | {seconds / held:.1%} |"
                      for cause, seconds in leg["node_seconds"].items() if seconds)
    figure, ax = pyplot().subplots(figsize=(7, 0.6 + 0.45 * max(1, len(leg["jobs"]))), dpi=90)
    left = [0.0] * len(leg["jobs"])
    for cause in CAUSES:
        widths = [job["node_seconds"][cause] / 3600 for job in leg["jobs"]]
        if any(widths):
            ax.barh([f"{job['name']} {job['job_id']}" for job in leg["jobs"]], widths, left=left, label=cause)
            left = [a + w for a, w in zip(left, widths)]
    ax.set_xlabel("node-hours")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    figure.tight_layout()
    goodput = f"{leg['goodput']:.1%}" if leg["goodput"] is not None else "none"
    return (f"## Where the node-hours went: {run_name}\n\n{held / 3600:.4g} node-hours held by "
            f"{len(leg['jobs'])} job(s); goodput (productive iterations) {goodput}\n\n"
            f"| cause | node-hours | share |\n|---|---|---|\n{rows}\n\n"
            f"{png_markdown(png_bytes(figure), 'node-hours by cause')}\n")
