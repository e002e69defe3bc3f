"""One owner per run folder: a second run on the same folder is refused while the first lives; when
the process that followed a job dies (kill -9), the next run follows that job instead of
submitting a duplicate, and nothing is trained twice or lost."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.cluster.config import load_cluster
from tasks.cluster.run_owner import RunBusy
from tasks.cluster.slurm import slurm_state
from tasks.train.stage import train
from tests.fixtures_gpt import slow_iterations
from tests.run_folder import job_records, trained_iterations, wait_until
from tests.test_cluster_slurm import tiny

pytestmark = pytest.mark.integration  # starts servers of its own

ROOT = Path(__file__).resolve().parent.parent
ITERS = 60


@pytest.mark.parametrize("preset", ["local", pytest.param("slurm-local", marks=pytest.mark.slurm)])
def test_second_run_is_refused_and_a_killed_followers_job_is_followed_again(request, preset: str,
                                                                            tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))     # the first run's job outlives its flow process
    if preset == "slurm-local":
        request.getfixturevalue("slurm_cluster")
    cluster = load_cluster(preset, **({"nodes": 1} if preset == "slurm-local" else {}))
    config = tiny(train_iters=ITERS, save_interval=20, log_interval=10, run_dir=str(tmp_path))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.test_cluster_slurm import tiny; "
            "from tasks.cluster.config import load_cluster; from tasks.train.stage import train; "
            f"train(tiny(train_iters={ITERS}, save_interval=20, log_interval=10, run_dir=sys.argv[3]), "
            "load_cluster(sys.argv[2], **eval(sys.argv[4])))")
    overrides = repr({"nodes": 1} if preset == "slurm-local" else {})
    first = subprocess.Popen([sys.executable, "-c", code, str(ROOT), preset, str(tmp_path), overrides],
                             start_new_session=True)
    try:
        wait_until(lambda: len(trained_iterations(tmp_path)) >= 3, 120, "the first run's job to train")
        with pytest.raises(RunBusy, match=rf"run folder {tmp_path} is in use by pid {first.pid}"):
            train(config, cluster)
        (job,) = job_records(tmp_path)
        first.send_signal(signal.SIGKILL)            # the flow process dies; its job does not
        first.wait(timeout=30)
        if preset == "slurm-local":
            assert slurm_state(job["job_id"])[0] == "RUNNING"

        result = train(config, cluster)
    finally:
        if first.poll() is None:
            first.kill()
    assert result.summary["status"] == "completed" and result.summary["iteration"] == ITERS
    assert result.job_ids == [job["job_id"]]        # followed, not submitted again
    assert trained_iterations(tmp_path) == list(range(1, ITERS + 1))
    assert job_records(tmp_path)[0]["final"] in ("COMPLETED", "FINISHED")
