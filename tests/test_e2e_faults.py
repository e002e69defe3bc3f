"""Faults where long runs fail, end to end on the real parts: the process that runs the flow killed
mid-training (its SLURM job keeps running; the flow run is marked Crashed by the heartbeat
automation; the rerun follows that job instead of submitting a duplicate, and nothing is trained
twice or lost)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.cluster.slurm import slurm_state
from tasks.tokenize.sample_corpus import sample_corpus
from tests.fixtures_gpt import slow_iterations
from tests.run_folder import trained_iterations, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parent.parent
ITERS = 80


def _train_jobs(run_dir: Path) -> list[dict]:
    path = run_dir / "jobs.json"
    return [j for j in json.loads(path.read_text()) if j["name"].startswith("train")] if path.exists() else []


@pytest.mark.timeout(900)
def test_killed_flow_process_crashes_its_run_and_the_rerun_follows_its_job(prefect_server, slurm_cluster, tmp_path):
    # The job sleeps 0.4 s an iteration: it outlives the killed flow process until the rerun follows it.
    env = {**prefect_server.env, "PYTHONPATH": str(ROOT), "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
           "GPT_FAULT": slow_iterations(0.4)}
    made = subprocess.run([sys.executable, "-m", "flows.heartbeats"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    corpus = sample_corpus(str(tmp_path / "corpus"))
    run_dir = tmp_path / "root" / "faults"
    args = [sys.executable, "-m", "flows.pretrain", "--source", corpus, "--train-vocab-size", "2048",
            "--cluster", "slurm-local",
            "--cluster-set", f"partition={slurm_cluster['partition']}", "--train-iters", str(ITERS), "--no-compile",
            "--root", str(tmp_path / "root"), "--run-name", "faults", "--set", "save_interval=25",
            "--set", "log_interval=5", "--set", "eval_interval=100000", "--set", "lr_warmup_iters=10"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    try:
        wait_until(lambda: len(trained_iterations(run_dir)) >= 10 or first.poll() is not None, 400,
                   "the first run to train")
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        (job,) = _train_jobs(run_dir)
        runs = prefect_server.api("/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}}})
        (flow_run,) = [r for r in runs if r["parameters"].get("output", {}).get("run_name") == "faults"]
        os.killpg(first.pid, signal.SIGKILL)          # the flow process dies; nothing of it runs on
        first.wait(timeout=30)
        assert slurm_state(job["job_id"])[0] == "RUNNING"
        done_before = max(trained_iterations(run_dir))

        second = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"job {job['job_id']} of an earlier run is still RUNNING: following it" in second.stdout + second.stderr
    assert [j["job_id"] for j in _train_jobs(run_dir)] == [job["job_id"]]      # no duplicate job
    assert trained_iterations(run_dir) == list(range(1, ITERS + 1)) and done_before < ITERS

    crashed = wait_until(lambda: (r := prefect_server.flow_run(flow_run["id"]))["state"]["type"] == "CRASHED" and r,
                    240, "the silent flow run to be marked Crashed", every=3)
    assert "No heartbeat" in (crashed["state"]["message"] or "")
