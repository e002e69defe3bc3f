"""Training through submitit on the real local SLURM cluster, watched from Prefect."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prefect import flow

from gpt.checkpoint import saved_layout
from gpt.config import Config
from tasks.cluster.config import ClusterError, load_cluster
from tasks.cluster.slurm import slurm_state
from tasks.precompile import cache_key, precompile
from tasks.train.stage import train, train_task
from tests.fixtures_gpt import GPTLauncher, slow_iterations
from tests.run_folder import job_records, wait_until
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run, checkpoint_tensors

pytestmark = pytest.mark.slurm


def tiny(**overrides: Any) -> Config:
    """The tiny preset at a sixteenth of its compute: what these tests check does not depend on the size."""
    settings = dict(mock_data=True, precision="fp32", device="cpu", vocab_size=512, log_interval=1,
                    eval_interval=1000, eval_iters=1, lr_warmup_iters=2, save_interval=5,
                    num_layers=2, hidden_size=64, seq_length=64)
    return Config.from_preset("tiny", **{**settings, **overrides})


def flow_logs(flow_run_id: Any) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
    return [entry.message for entry in logs]


def progress(flow_run_id: Any) -> float | None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return next((float(a.data) for a in found if a.type == "progress"), None)


def running(run_dir: Path, index: int = 0) -> bool:
    found = job_records(run_dir)
    return len(found) > index and any(s["state"] == "RUNNING" for s in found[index]["states"])


def rank_pid(job_id: str, rank: int) -> int | None:
    """The pid of the submitit task with this SLURM job id and rank."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
            cmdline = (entry / "cmdline").read_text()
        except OSError:
            continue
        if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_PROCID") == str(rank)
                and "submitit.core._submit" in cmdline):
            return int(entry.name)
    return None


def test_two_node_training_streams_to_prefect(slurm_cluster: dict, prefect_harness: None, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    @flow(name="cluster-two-node")
    def two_node() -> Any:
        return train_task(tiny(train_iters=12, run_dir=str(run_dir)), load_cluster(slurm_cluster["preset"]))

    state = two_node(return_state=True)
    result = state.result()
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 12
    (job,) = job_records(run_dir)
    assert job["final"] == "COMPLETED" and result.job_ids == [job["job_id"]]
    assert [s["nodes"] for s in job["states"] if s["state"] == "RUNNING"] == ["node[1-2]"]
    # The run folder: resolved config, the sbatch script, per-rank logs, metrics, TensorBoard, checkpoints.
    assert json.loads((run_dir / "config.json").read_text())["run_dir"] == str(run_dir)
    assert "#SBATCH --nodes=2" in Path(job["sbatch_script"]).read_text()
    for rank in (0, 1):
        assert (run_dir / "jobs" / f"{job['job_id']}_{rank}_log.out").exists()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if m["kind"] == "train"] == list(range(1, 13))
    assert list((run_dir / "tensorboard").iterdir()) and (run_dir / "checkpoints" / "iter_0000012").is_dir()
    messages = flow_logs(state.state_details.flow_run_id)
    assert any(re.search(r"iteration\s+12/\s*12 \| consumed samples", m) for m in messages), messages
    assert progress(state.state_details.flow_run_id) == 100.0
    assert any(f"job {job['job_id']} RUNNING on node[1-2]" in m for m in messages), messages


def test_pipeline_stages_on_the_two_nodes_train_as_one_process(slurm_cluster: dict, prefect_harness: None,
                                                               tmp_path: Path) -> None:
    """Pipeline parallel 2 across the local cluster's two nodes, a stage on each, through a flow's
    train task: its checkpoint keeps every tensor under its global name, and the weights are those
    of the same run in one process."""
    run_dir = tmp_path / "run"
    config = tiny(train_iters=8, pipeline_parallel=2, run_dir=str(run_dir))

    @flow(name="cluster-pipeline")
    def two_stages() -> Any:
        return train_task(config, load_cluster(slurm_cluster["preset"]))

    result = two_stages()
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 8
    (job,) = job_records(run_dir)
    assert [s["nodes"] for s in job["states"] if s["state"] == "RUNNING"] == ["node[1-2]"]
    assert saved_layout(run_dir / "checkpoints" / "iter_0000008")["pipeline_parallel"] == 2
    one = tmp_path / "one"
    GPTLauncher(tmp_path).run({**config.to_dict(), "pipeline_parallel": 1, "run_dir": str(one)})
    losses = [[json.loads(line)["lm_loss"] for line in (d / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for d in (run_dir, one)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4) and len(losses[0]) == 8
    got, want = checkpoint_tensors(run_dir), checkpoint_tensors(one)
    assert sorted(got) == sorted(want)
    for name in (n for n in want if n.startswith("model.")):    # fp32: sums in another order
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_killed_rank_fails_the_task_and_the_retry_resumes(slurm_cluster: dict, prefect_harness: None,
                                                          tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    iters = 80
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))     # running when rank 1 is killed

    @flow(name="cluster-retry")
    def retried() -> Any:
        return train_task.with_options(retries=1, retry_delay_seconds=0)(
            tiny(train_iters=iters, run_dir=str(run_dir)), load_cluster(slurm_cluster["preset"]))

    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(state=retried(return_state=True)))
    runner.start()
    wait_until(lambda: (run_dir / "checkpoints" / "iter_0000005" / "COMPLETE").exists(), 120, "a checkpoint")
    first = job_records(run_dir)[0]["job_id"]
    pid = rank_pid(first, 1)
    assert pid is not None, "rank 1 of the first job is not running"
    os.kill(pid, signal.SIGKILL)
    runner.join(timeout=240)
    assert not runner.is_alive()
    state = outcome["state"]
    result = state.result()
    attempts = job_records(run_dir)
    assert [j["final"] for j in attempts] == ["FAILED", "COMPLETED"]
    assert result.job_ids == [first, attempts[1]["job_id"]]
    resumed = re.search(r"resumed from \S+ at iteration (\d+)",
                        (run_dir / "jobs" / f"{attempts[1]['job_id']}_0_log.out").read_text())
    assert resumed and 5 <= int(resumed.group(1)) < iters
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if m["kind"] == "train"] == list(range(1, iters + 1))
    messages = "\n".join(flow_logs(state.state_details.flow_run_id))
    assert f"job {first} ended FAILED" in messages and "rank 1 log tail" in messages
    assert_weights_equal_an_uninterrupted_run(run_dir)


def test_cancelling_the_flow_run_scancels_the_job(slurm_cluster: dict, prefect_harness: None, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    run_dir = tmp_path / "run"
    flow_run: dict[str, Any] = {}

    @flow(name="cluster-cancel")
    def long_training() -> Any:
        from prefect.runtime import flow_run as current

        flow_run["id"] = current.id
        return train_task(tiny(train_iters=100_000, run_dir=str(run_dir)), load_cluster(slurm_cluster["preset"]))

    runner = threading.Thread(target=lambda: long_training(return_state=True))
    runner.start()
    wait_until(lambda: running(run_dir), 90, "the job to run")
    job_id = job_records(run_dir)[0]["job_id"]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run["id"], Cancelling(), force=True)
    cancelled_at = time.monotonic()
    runner.join(timeout=60)
    assert not runner.is_alive()
    wait_until(lambda: (slurm_state(job_id) or ("GONE",))[0] in ("CANCELLED", "GONE"), 30, "scancel")
    assert time.monotonic() - cancelled_at < 40
    assert len(job_records(run_dir)) == 1, "a cancelled flow run must not resubmit"


@pytest.mark.parametrize("overrides, slurm_words", [
    ({"nodes": 4}, "PartitionConfig"),
    ({"partition": "no-such-partition"}, "invalid partition"),
])
def test_impossible_request_reports_slurms_reason(slurm_cluster: dict, tmp_path: Path, overrides: dict,
                                                  slurm_words: str) -> None:
    started = time.monotonic()
    with pytest.raises(ClusterError) as e:
        train(tiny(train_iters=2, micro_batch_size=4, run_dir=str(tmp_path)), load_cluster(slurm_cluster["preset"], **overrides))
    assert slurm_words.lower() in str(e.value).lower()
    assert time.monotonic() - started < 20
    assert not any(j["final"] in (None, "RUNNING", "PENDING") for j in job_records(tmp_path))


def test_precompile_then_train_hits_the_cache(slurm_cluster: dict, tmp_path: Path) -> None:
    cluster = load_cluster(slurm_cluster["preset"])
    config = tiny(train_iters=6, precompile_iters=2, compile=True, run_dir=str(tmp_path / "run"))
    config = dataclasses.replace(config, compile_cache_dir=str(tmp_path / "cache" / cache_key(config, cluster)))
    cold = precompile(config, cluster)
    assert not cold.hit and cold.nodelist == "node[1-2]" and cold.time_to_first_iteration_s
    warm = precompile(config, cluster)
    assert warm.hit and warm.cache_dir == cold.cache_dir and warm.digest == cold.digest
    result = train(config, cluster, precompiled=warm)
    assert result.summary["compile_cache_hit"] is True
    assert result.summary["time_to_first_iteration_s"] < cold.time_to_first_iteration_s
    script = Path(job_records(tmp_path / "run")[0]["sbatch_script"]).read_text()
    assert "#SBATCH --nodelist='node[1-2]'" in script
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert resolved["compile"] is True and resolved["compile_cache_dir"] == cold.cache_dir


def usr2_after_a_checkpoint(run_dir: Path, cluster: Any, iters: int) -> tuple[threading.Thread, dict[str, Any], str]:
    """Training of ``iters`` iterations on ``cluster`` in a thread, sent USR2 once it saved at
    iteration 5: (the thread, where its result lands, the job id). Slow iterations (GPT_FAULT) keep
    it running when the signal comes."""
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(tiny(train_iters=iters, run_dir=str(run_dir)),
                                                                         cluster)))
    runner.start()
    wait_until(lambda: (run_dir / "checkpoints" / "iter_0000005" / "COMPLETE").exists(), 120, "a checkpoint")
    job_id = job_records(run_dir)[0]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    return runner, outcome, job_id


def requeued_and_resumed(run_dir: Path, job_id: str, runner: threading.Thread) -> None:
    """The signalled job requeued itself, started again now (SLURM holds a requeued batch job for two
    minutes otherwise) and ``runner`` ended."""
    wait_until(lambda: job_records(run_dir)[0]["states"][-1]["state"] == "PENDING", 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    runner.join(timeout=180)
    assert not runner.is_alive()


def assert_resumed_where_it_stopped(run_dir: Path, stopped_in: str, resumed_in: str, iters: int) -> None:
    """The leg logged in job log ``stopped_in`` saved and stopped at the iteration the leg logged in
    ``resumed_in`` resumed from, and the run has every iteration's metrics once."""
    stopped = re.search(r"stopping at iteration (\d+) on a signal; checkpoint saved",
                        (run_dir / "jobs" / stopped_in).read_text())
    resumed = re.search(r"resumed from \S+ at iteration (\d+)", (run_dir / "jobs" / resumed_in).read_text())
    assert stopped and resumed and stopped.group(1) == resumed.group(1)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if m["kind"] == "train"] == list(range(1, iters + 1))


def test_usr2_saves_requeues_and_resumes(slurm_cluster: dict, tmp_path: Path, monkeypatch) -> None:
    iters = 60
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))
    runner, outcome, job_id = usr2_after_a_checkpoint(tmp_path, load_cluster(slurm_cluster["preset"]), iters)
    requeued_and_resumed(tmp_path, job_id, runner)
    result = outcome["result"]
    assert result.summary["status"] == "completed" and result.job_ids == [job_id]
    assert_resumed_where_it_stopped(tmp_path, f"{job_id}_0_log.out", f"{job_id}_0_log.out", iters)
    states = [s["state"] for s in job_records(tmp_path)[0]["states"]]
    assert states.index("PENDING", states.index("RUNNING")) < len(states) - 1


def test_a_job_stopped_on_the_signal_that_cannot_requeue_itself_is_submitted_again(slurm_cluster: dict,
                                                                                   tmp_path: Path, monkeypatch) -> None:
    """`--no-requeue` makes SLURM refuse `scontrol requeue`, as it refuses a job already ending: the
    ranks have saved, the job ends with that said, and the follower submits it again to resume."""
    iters = 40
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))
    cluster = load_cluster(slurm_cluster["preset"], sbatch_extra={"no-requeue": True})
    runner, outcome, first = usr2_after_a_checkpoint(tmp_path, cluster, iters)
    runner.join(timeout=240)
    assert not runner.is_alive()
    result = outcome["result"]
    assert result.summary["status"] == "completed" and result.job_ids[0] == first and len(result.job_ids) == 2
    assert "scontrol requeue failed" in (tmp_path / "jobs" / f"{first}_0_log.out").read_text()
    assert_resumed_where_it_stopped(tmp_path, f"{first}_0_log.out", f"{result.job_ids[1]}_0_log.out", iters)


def test_terminated_submitter_leaves_no_job(slurm_cluster: dict, tmp_path: Path) -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.test_cluster_slurm import tiny; "
            "from tasks.cluster.config import load_cluster; from tasks.train.stage import train; "
            "train(tiny(train_iters=100_000, run_dir=sys.argv[3]), load_cluster(sys.argv[2]))")
    root = Path(__file__).resolve().parent.parent
    submitter = subprocess.Popen([sys.executable, "-c", code, str(root), slurm_cluster["preset"], str(tmp_path)])
    try:
        wait_until(lambda: running(tmp_path), 90, "the job to run")
        job_id = job_records(tmp_path)[0]["job_id"]
        submitter.send_signal(signal.SIGTERM)
        assert submitter.wait(timeout=30) != 0
        wait_until(lambda: (slurm_state(job_id) or ("GONE",))[0] in ("CANCELLED", "GONE"), 20, "scancel")
    finally:
        submitter.kill()
