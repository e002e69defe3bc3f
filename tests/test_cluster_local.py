"""The embedded default: no scheduler, submitit's local executor on this machine."""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest

from gpt.config import Config
from tasks.cluster import jobs
from tasks.cluster.config import load_cluster
from tasks.cluster.jobs import submit
from tasks.cluster.processes import command_line, process_state, process_tree
from tasks.train.stage import train


def test_local_executor_trains_in_its_run_folder(tmp_path: Path) -> None:
    first = str(tmp_path / "run")
    config = Config.from_preset("tiny", mock_data=True, precision="fp32", device="cpu", vocab_size=512,
                                train_iters=4, lr_warmup_iters=1, log_interval=1, eval_interval=1000, save_interval=2,
                                run_dir=first)
    result = train(config, load_cluster("local").model_copy(update={"executor": "local"}))
    assert result.executor == "local" and result.summary["status"] == "completed"
    (job,) = json.loads((Path(first) / "jobs.json").read_text())
    assert job["executor"] == "local" and job["final"] == "FINISHED" and job["sbatch_script"] is None
    metrics = [json.loads(line) for line in Path(result.metrics_path).read_text().splitlines()]
    assert [m["iteration"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4]
    assert "iteration        4/       4" in (Path(first) / "jobs" / f"{job['job_id']}_0_log.out").read_text()


def test_the_local_executors_ranks_share_the_cores_unless_told(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = functools.partial(os.getenv, "OMP_NUM_THREADS")
    shared, _, _ = submit(threads, load_cluster("local", tasks_per_node=2), run_dir=tmp_path / "a", job_name="threads")
    assert shared == str(max(1, len(os.sched_getaffinity(0)) // 2))
    alone, _, _ = submit(threads, load_cluster("local"), run_dir=tmp_path / "b", job_name="threads")
    assert alone is None                                    # one rank: torch's own default
    told, _, _ = submit(threads, load_cluster("local", tasks_per_node=2, env={"OMP_NUM_THREADS": "3"}),
                        run_dir=tmp_path / "c", job_name="threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    inherited, _, _ = submit(threads, load_cluster("local", tasks_per_node=2), run_dir=tmp_path / "d", job_name="threads")
    assert (told, inherited) == ("3", "5")


def test_a_cancelled_local_job_that_ignores_sigterm_is_killed_after_the_kill_wait(tmp_path: Path, monkeypatch) -> None:
    """As SLURM after its KillWait: a rank that has not yet set its own SIGTERM handler (submitit
    ignores SIGTERM until then) does not outlive the process that cancelled its job."""
    monkeypatch.setattr(jobs, "LOCAL_KILL_WAIT_S", 2.0)
    started = tmp_path / "started"

    def stop_once_started() -> None:
        if started.exists():
            raise RuntimeError("the follower stops")

    with pytest.raises(RuntimeError, match="the follower stops"):
        submit(functools.partial(_sleep_after_marking, started, 600), load_cluster("local"),
               run_dir=tmp_path / "run", job_name="sleeper", on_poll=stop_once_started)
    (job,) = json.loads((tmp_path / "run" / "jobs.json").read_text())
    assert job["final"] == "CANCELLED"
    assert not [pid for pid in process_tree(int(job["job_id"])) if process_state(pid) not in (None, "Z")]
    assert not _processes_with(str(tmp_path / "run" / "jobs")), "a process of the cancelled job is left"


def _sleep_after_marking(path: Path, seconds: float) -> None:
    path.touch()
    time.sleep(seconds)


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line holds ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and text.encode() in command_line(int(entry.name)) \
                and process_state(int(entry.name)) not in (None, "Z"):
            found.append(int(entry.name))
    return found
