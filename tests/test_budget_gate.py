"""A run over its budget waits for approval in the Prefect UI, against a real Prefect server: the
flow run pauses with the estimate on its form and nothing submitted; approving it trains the run,
rejecting it ends the run Cancelled with the reason. The embedded default's estimate, from one
benchmark run on this machine, is within a factor of two of its measured training time."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.benchmark_history import machine_facts
from tasks.tokenize.sample_corpus import sample_corpus
from tests.fixtures_gpt import ROOT
from tests.run_folder import job_records, wait_until

pytestmark = pytest.mark.integration  # starts servers of its own


def _seed_history(root: Path, tokens_per_s: float) -> None:
    """One train benchmark of the tiny model on this machine, as the benchmark flow writes it."""
    from gpt.config import Config
    from gpt.model import param_count

    tiny = Config(model="tiny")
    record = {"time": "2026-11-01T00:00:00+00:00", "machine": machine_facts(),
              "results": {"train-tiny": {"model": "tiny", "params": param_count(tiny), "seq_length": tiny.seq_length,
                                         "tokens_per_s": tokens_per_s, "precision": "fp32", "device": "cpu"}}}
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "history.jsonl").write_text(json.dumps(record) + "\n")


def _paused(server, run_name: str) -> dict | None:
    runs = server.api("/flow_runs/filter", {"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}})
    mine = [r for r in runs if (r["parameters"].get("output") or {}).get("run_name") == run_name]
    return mine[0] if mine else None


def _start(server, tmp_path: Path, corpus: str, run_name: str, *flags: str) -> subprocess.Popen:
    env = {**server.env, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "flows.pretrain", "--source", corpus, "--train-vocab-size", "2048", "--train-iters", "4",
            "--no-compile",
            "--root", str(tmp_path / "root"), "--run-name", run_name, "--set", "eval_interval=100000",
            "--budget-node-hours", "1e-7", *flags]
    log = open(tmp_path / f"{run_name}.log", "w")
    return subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.timeout(600)
def test_over_budget_pauses_with_nothing_submitted_then_approval_trains_and_rejection_cancels(prefect_server, tmp_path):
    corpus = sample_corpus(str(tmp_path / "corpus"))
    _seed_history(tmp_path / "root", tokens_per_s=5_000)
    procs = {name: _start(prefect_server, tmp_path, corpus, name)
             for name in ("approved", "rejected", "interrupted", "killed")}
    try:
        paused = {name: wait_until(lambda n=name: _paused(prefect_server, n), 300, f"run {name} to pause", every=2)
                  for name in procs}
        for name, run in paused.items():
            run_dir = tmp_path / "root" / name
            assert not (run_dir / "checkpoints").exists() and not (run_dir / "jobs.json").exists()
            assert prefect_server.task_runs(run["id"]) == []     # the gate comes before every stage
            assert not (tmp_path / "root" / "data").exists()
            keys = run["state"]["state_details"]["run_input_keyset"]
            form = prefect_server.api(f"/flow_runs/{run['id']}/input/{keys['description']}")
            assert "**Over budget:**" in form and "node-hours estimated" in form and "| node-hours |" in form
            plan = max((a for a in prefect_server.artifacts(run["id"]) if a["key"] == "pretrain-plan"),
                       key=lambda a: a["created"])          # what the gate saw
            assert "tokens to train" in plan["data"] and "benchmark train-tiny" in plan["data"]

        prefect_server.api(f"/flow_runs/{paused['approved']['id']}/resume", {"run_input": {"approve": True}})
        prefect_server.api(f"/flow_runs/{paused['rejected']['id']}/resume",
                           {"run_input": {"approve": False, "reason": "too dear this quarter"}})
        os.kill(procs["interrupted"].pid, signal.SIGINT)                  # Ctrl-C where the run waits
        os.killpg(procs["killed"].pid, signal.SIGKILL)                     # its process dies without a word
        codes = {name: p.wait(timeout=300) for name, p in procs.items()}
        # The heartbeats stop: the server's automation marks the paused run Crashed, and an approval
        # afterwards resumes nothing.
        killed = wait_until(lambda: (r := prefect_server.flow_run(paused["killed"]["id"]))["state"]["type"] == "CRASHED"
                            and r, 240, "the killed run to be marked Crashed", every=3)
        prefect_server.api(f"/flow_runs/{paused['killed']['id']}/resume", {"run_input": {"approve": True}})
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in procs}
    assert codes == {"approved": 0, "rejected": 1, "interrupted": 1, "killed": -signal.SIGKILL}, logs
    assert "No heartbeat for 90 s: the process running this flow died" in killed["state"]["message"]
    assert prefect_server.flow_run(paused["killed"]["id"])["state"]["type"] == "CRASHED"
    assert not (tmp_path / "root" / "killed" / "checkpoints").exists()
    interrupted = prefect_server.flow_run(paused["interrupted"]["id"])
    assert interrupted["state"]["type"] == "CANCELLED" and "interrupted (Ctrl-C)" in interrupted["state"]["message"]
    assert "pretrain cancelled: " in logs["interrupted"] and "Traceback" not in logs["interrupted"]
    approved = prefect_server.flow_run(paused["approved"]["id"])
    rejected = prefect_server.flow_run(paused["rejected"]["id"])
    assert approved["state"]["type"] == "COMPLETED"
    assert rejected["state"]["type"] == "CANCELLED" and "too dear this quarter" in rejected["state"]["message"]
    assert (tmp_path / "root" / "approved" / "summary.json").is_file()
    assert not (tmp_path / "root" / "rejected" / "checkpoints").exists()
    starts = json.loads((tmp_path / "root" / "approved" / "provenance.json").read_text())["starts"]
    assert starts[0]["flow_run_id"] == paused["approved"]["id"] and starts[0]["parameters"]["budget"]["node_hours"] == 1e-7


@pytest.mark.timeout(600)
def test_with_data_jobs_nothing_is_submitted_before_approval_and_approved_the_run_completes(prefect_server, slurm_cluster,
                                                                                            tmp_path):
    """A preset that runs sync and tokenize as jobs: while the run waits for approval, no sync job and
    no tokenize array is in SLURM's queue or its records; approved, they run and the run trains."""
    corpus = sample_corpus(str(tmp_path / "corpus"))
    proc = _start(prefect_server, tmp_path, corpus, "data-jobs", "--cluster", slurm_cluster["preset"],
                  "--cluster-set", "data_jobs=true", "--cluster-set", "data_array_tasks=2")
    try:
        run = wait_until(lambda: _paused(prefect_server, "data-jobs"), 300, "the run to pause", every=2)
        assert prefect_server.task_runs(run["id"]) == []
        assert not (tmp_path / "root" / "data").exists()                # no job folder, nothing synced
        queued = subprocess.run(["squeue", "-h", "-o", "%j %Z"], capture_output=True, text=True, check=True).stdout
        assert str(tmp_path) not in queued
        prefect_server.api(f"/flow_runs/{run['id']}/resume", {"run_input": {"approve": True}})
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, (tmp_path / "data-jobs.log").read_text()[-3000:]
    names = sorted(j["name"] for path in (tmp_path / "root").rglob("*.jobs") for j in job_records(path))
    assert names == ["sync", "tokenize", "tokenize"], names
    assert prefect_server.flow_run(run["id"])["state"]["type"] == "COMPLETED"
    assert (tmp_path / "root" / "data-jobs" / "summary.json").is_file()


@pytest.mark.alone
@pytest.mark.timeout(900)
def test_the_embedded_defaults_estimate_from_one_benchmark_run_is_within_a_factor_of_two(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(ROOT), "GPT_OUTPUT_ROOTS": str(tmp_path)})
    history = tmp_path / "root" / "benchmarks"
    bench = subprocess.run([sys.executable, "-m", "flows.benchmark", "--quick", "--only", "train",
                            "--history", str(history)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    # the embedded defaults at a third of their iterations: the estimate scales with them
    run = subprocess.run([sys.executable, "-m", "flows.pretrain", "--root", str(tmp_path / "root"), "--train-iters", "100"],
                         env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    estimate_line = next(line for line in out.splitlines() if "estimate: tokens to train" in line)
    assert "benchmark train-tiny" in estimate_line
    estimated_s = 3600 * float(estimate_line.split("node-hours ")[1].split(";")[0].replace(",", ""))
    stages = next(line for line in out.splitlines() if line.strip().startswith("stages:"))
    trained_s = float(stages.split("train ")[1].split("s")[0])
    assert 0.5 < estimated_s / trained_s < 2, (estimated_s, trained_s, estimate_line, stages)
