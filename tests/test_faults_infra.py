"""Faults of the infrastructure under a run, on the real parts: a SLURM node set DOWN mid-job, a
job reaching its time limit, the S3 server stopped mid-sync and started again, the Prefect
server restarted mid-run, and a corpus several times larger than the memory the tokenizer may
use. Each ends with everything done exactly once and nothing lost beyond what the README's
faults table says; the run that lost a node ends with the weights of a run that lost none."""
from __future__ import annotations

import filecmp
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tokenize import build_corpus
from tasks.cluster.config import load_cluster
from tasks.cluster.slurm import slurm_state
from tasks.sync import MANIFEST_NAME, PARTIAL_DIR
from tasks.train.stage import TrainResult, train
from tests.fixtures_gpt import slow_iterations
from tests.fixtures_prefect import RestartablePrefectServer
from tests.fixtures_s3 import S3Server
from tests.run_folder import job_records, trained_iterations, wait_until
from tests.test_cluster_slurm import tiny
from tests.test_sync import blob, read_tree
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def _states_after_running(run_dir: Path) -> list[dict]:
    """The job's recorded states from its first RUNNING on."""
    states = job_records(run_dir)[0]["states"] if job_records(run_dir) else []
    first = next((i for i, s in enumerate(states) if s["state"] == "RUNNING"), len(states))
    return states[first:]


class Training:
    """`train` in a thread, as the train stage runs it; `result()` waits for it."""

    def __init__(self, *args: Any) -> None:
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=args, daemon=True)
        self.thread.start()

    def _run(self, *args: Any) -> None:
        try:
            self.outcome["result"] = train(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.outcome["error"] = e

    def result(self, timeout: float) -> TrainResult:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"training did not end within {timeout:.0f}s"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["result"]


def _release_requeue_hold(job_id: str) -> str | None:
    """SLURM holds a requeued job for two minutes (BeginTime); start it sooner, as an operator would.
    Not within the second of the requeue: slurmd refuses a credential issued in the second its job's
    previous one was revoked ("Job credential revoked"), and the job ends FAILED.
    Returns the job's state."""
    state = slurm_state(job_id)
    if state is not None and state[0] == "PENDING" and state[1] == "BeginTime":
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], capture_output=True, check=False)
    return state[0] if state is not None else None


def _log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "jobs" / f"{job_id}_0_log.out").read_text()


# ---------------------------------------------------------------- SLURM


def _node_usable(node: str) -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%t"], capture_output=True, text=True,
                         check=False).stdout
    return out.strip().rstrip("*") in ("idle", "mix", "alloc")


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_node_set_down_mid_job_requeues_it_and_training_resumes(slurm_cluster: dict, tmp_path: Path,
                                                                  monkeypatch) -> None:
    iters, save_interval, node = 80, 5, slurm_cluster["nodes"][-1]
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.25))    # running when its node goes down
    training = Training(tiny(train_iters=iters, save_interval=save_interval, run_dir=str(tmp_path)),
                        load_cluster(slurm_cluster["preset"]))
    try:
        wait_until(lambda: (tmp_path / "checkpoints" / "iter_0000010" / "COMPLETE").exists(), 180, "a checkpoint")
        (job,) = job_records(tmp_path)
        down_at = time.time()
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=fault test: node lost"],
                       check=True)
        noticed = wait_until(lambda: next((s for s in _states_after_running(tmp_path) if s["state"] != "RUNNING"), None),
                        60, "the follower to see the job leave RUNNING")
        trained_before = max(trained_iterations(tmp_path))      # the resumed job cuts metrics back to its checkpoint
        wait_until(lambda: _release_requeue_hold(job["job_id"]) == "RUNNING", 60, "the requeued job to run again")
        result = training.result(240)
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, check=False)
        wait_until(lambda: _node_usable(node), 60, f"{node} to be back in service")
    assert noticed["time"] - down_at < 15, noticed
    states = [s["state"] for s in _states_after_running(tmp_path)]
    assert "RUNNING" in states[states.index(noticed["state"]):] and states[-1] == "COMPLETED"     # ran again
    assert result.summary["status"] == "completed" and result.job_ids == [job["job_id"]]   # requeued, not doubled
    resumed = re.findall(r"resumed from \S+ at iteration (\d+)", _log(tmp_path, job["job_id"]))
    assert len(resumed) == 1 and 10 <= int(resumed[0]) <= trained_before
    assert trained_before - int(resumed[0]) < save_interval           # at most one save_interval trained again
    again = next(s["time"] for s in _states_after_running(tmp_path)[1:] if s["state"] == "RUNNING")
    print(f"node down at iteration {trained_before}: the follower saw {noticed['state']} {noticed['time'] - down_at:.1f}s "
          f"later, the job ran again after {again - down_at:.1f}s (hold released), resumed at iteration {resumed[0]}")
    assert trained_iterations(tmp_path) == list(range(1, iters + 1))          # every iteration recorded exactly once
    assert_weights_equal_an_uninterrupted_run(tmp_path)


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_the_time_limit_signal_from_slurm_saves_requeues_and_resumes(slurm_cluster: dict, tmp_path: Path,
                                                                     monkeypatch) -> None:
    # SLURM sends the warning signal at its first 30 s time-limit check within signal_delay_s + 30 s
    # of the limit: with a one-minute limit and the smallest delay (10 s), 20-50 s into each run.
    # The training takes more than 60 s (it sleeps 0.4 s an iteration), so at least one run is cut short.
    iters = 160
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.4))
    cluster = load_cluster(slurm_cluster["preset"], time_limit=1, signal_delay_s=10, max_requeues=12)
    training = Training(tiny(train_iters=iters, save_interval=100, log_interval=10, run_dir=str(tmp_path)), cluster)
    while training.thread.is_alive():
        if job_records(tmp_path):
            _release_requeue_hold(job_records(tmp_path)[-1]["job_id"])
        training.thread.join(1)
    result = training.result(0)
    jobs = job_records(tmp_path)
    assert result.summary["status"] == "completed" and result.job_ids == [j["job_id"] for j in jobs]
    # Each run requeues itself; one that cannot (the job already ending at the limit) ends saying
    # so, and the follower submits the job again (tasks.train.stage.stopped_without_requeue).
    log = "".join(_log(tmp_path, j["job_id"]) for j in jobs)
    assert "Caught signal SIGUSR2" in log and "this job is timed-out" in log   # SLURM's signal, not ours
    stopped = [int(i) for i in re.findall(r"stopping at iteration (\d+) on a signal; checkpoint saved", log)]
    resumed = [int(i) for i in re.findall(r"resumed from \S+ at iteration (\d+)", log)]
    assert stopped and resumed == stopped                   # every run resumed exactly where the last one stopped
    # submitit logs the requeue after `scontrol requeue`, which may end the process first
    assert len(re.findall(r"Requeued job \d+", log)) + len(jobs) - 1 <= len(stopped)
    assert len(re.findall(r"Starting with JobEnvironment", log)) == len(stopped) + 1      # and started again
    ran = jobs[-1]["states"][-1]["time"] - next(s["time"] for s in jobs[0]["states"] if s["state"] == "RUNNING")
    print(f"{len(stopped)} time limits reached, at iterations {stopped}; {len(jobs)} job(s); {iters} iterations "
          f"in {ran:.0f}s")
    assert trained_iterations(tmp_path) == list(range(1, iters + 1))


# ---------------------------------------------------------------- S3


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_s3_server_stopped_mid_sync_and_started_again(own_s3_server: S3Server, tmp_path: Path) -> None:
    s3 = own_s3_server
    bucket = s3.new_bucket()
    files = {f"shard-{i:03d}.bin": blob(MIB, i) for i in range(40)}
    s3.put_tree(bucket, "corpus/", files)
    files["big.bin"] = blob(24 * MIB, 99)
    s3.put(bucket, "corpus/big.bin", files["big.bin"], part_size=5 * MIB)
    dest = tmp_path / "dest"

    def in_flight() -> int:
        return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()) if dest.exists() else 0

    sync = subprocess.Popen([sys.executable, "-m", "tasks.sync", f"s3://{bucket}/corpus/", str(dest),
                             "--endpoint-url", s3.endpoint_url, "--workers", "2"],
                            cwd=ROOT, env=s3.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: in_flight() > 8 * MIB, 60, "the sync to be under way", every=0.01)
        s3.stop(signal.SIGKILL)                     # the server dies mid-transfer
        placed_during_outage = len([p for p in dest.iterdir() if p.name in files])
        time.sleep(5)
        s3.start()                                  # same ports, same data
        restarted = time.monotonic()
        _, err = sync.communicate(timeout=180)
    finally:
        if sync.poll() is None:
            sync.kill()
    assert placed_during_outage < len(files)
    assert sync.returncode == 0, err[-3000:]        # s5cmd retried its requests until the server was back
    print(f"sync finished {time.monotonic() - restarted:.1f}s after the server came back")
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    assert manifest["complete"] and {f["path"]: f["check"] for f in manifest["files"]} == {
        **{name: "md5" for name in files if name != "big.bin"}, "big.bin": "multipart-etag"}
    assert read_tree(dest) == files and not (dest / PARTIAL_DIR).exists()


# ---------------------------------------------------------------- Prefect

FLOW = """
import sys
from prefect import flow
from tasks.cluster.config import load_cluster
from tasks.train.stage import train_task
from tests.test_cluster_slurm import tiny

@flow(name="train-through-a-server-restart")
def training(run_dir: str, iters: int) -> dict:
    config = tiny(train_iters=iters, save_interval=50, log_interval=10, run_dir=run_dir)
    return train_task(config, load_cluster("local")).summary

training(sys.argv[1], int(sys.argv[2]))
"""


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_prefect_server_restarted_mid_run(own_prefect_server: RestartablePrefectServer, tmp_path: Path) -> None:
    iters, run_dir = 120, tmp_path / "run"
    # Few client retries (about 6 s of them, not about a minute), so that the outage outlasts them;
    # the training sleeps 0.4 s an iteration, so that it outlasts the outage.
    env = {**own_prefect_server.server.env, "PYTHONPATH": str(ROOT), "PREFECT_CLIENT_MAX_RETRIES": "2",
           "GPT_FAULT": slow_iterations(0.4)}
    with open(tmp_path / "flow.log", "w") as log:
        runner = subprocess.Popen([sys.executable, "-c", FLOW, str(run_dir), str(iters)], env=env, cwd=tmp_path,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: len(trained_iterations(run_dir)) >= 5 or runner.poll() is not None, 300, "training to start")
        assert runner.poll() is None, (tmp_path / "flow.log").read_text()[-4000:]
        own_prefect_server.stop(signal.SIGKILL)
        stopped = time.monotonic()
        time.sleep(20)
        own_prefect_server.start()                                  # same port, same database
        outage_s = time.monotonic() - stopped
        assert runner.poll() is None and max(trained_iterations(run_dir)) < iters, "training ended before the restart"
        assert runner.wait(timeout=480) == 0, (tmp_path / "flow.log").read_text()[-4000:]
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)                   # the flow process and its job
    output = (tmp_path / "flow.log").read_text()
    assert "progress not shown in Prefect (ConnectError" in output            # the outage reached the run
    server = own_prefect_server.server
    (flow_run,) = server.api("/flow_runs/filter", {})
    assert flow_run["state"]["type"] == "COMPLETED"
    assert [(t["name"].split("-")[0], t["state"]["type"]) for t in server.task_runs(flow_run["id"])] == [
        ("train", "COMPLETED")]
    assert len(job_records(run_dir)) == 1                                 # the job trained on: nothing resubmitted
    assert trained_iterations(run_dir) == list(range(1, iters + 1))
    print(f"Prefect server away for {outage_s:.1f}s")


# ---------------------------------------------------------------- memory


class MemoryCgroup:
    """A memory cgroup (v2, else v1) that a command runs in, with no swap: its memory (page cache
    included, which the kernel reclaims first) may not exceed `limit`, or the kernel kills it."""

    def __init__(self, name: str, limit: int) -> None:
        found = self.hierarchy()
        if found is None:
            pytest.skip("no memory cgroup hierarchy to limit a process's memory in")
        mount, self.v2 = found
        self.path = mount / name
        try:
            if self.v2:
                (mount / "cgroup.subtree_control").write_text("+memory")
            self.path.mkdir()
            self.write("memory.max" if self.v2 else "memory.limit_in_bytes", limit)
            swap = self.path / ("memory.swap.max" if self.v2 else "memory.memsw.limit_in_bytes")
            if swap.exists():
                swap.write_text(str(0 if self.v2 else limit))
        except OSError as e:
            self.remove()
            pytest.skip(f"cannot make a memory cgroup under {mount} ({e}): run the tests as root")

    @staticmethod
    def hierarchy() -> tuple[Path, bool] | None:
        """Where memory cgroups are made, and whether it is cgroup v2."""
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, options, *_ = line.split()
            if kind == "cgroup2" and "memory" in (Path(mount) / "cgroup.controllers").read_text().split():
                return Path(mount), True
            if kind == "cgroup" and "memory" in options.split(","):
                return Path(mount), False
        return None

    def write(self, name: str, value: int) -> None:
        (self.path / name).write_text(str(value))

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """argv in this cgroup (the shell joins it, then becomes argv)."""
        joined = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *argv]
        return subprocess.run(joined, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)

    def oom_kills(self) -> int:
        events = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return int(re.search(r"^oom_kill (\d+)$", events, re.MULTILINE).group(1))

    def remove(self) -> None:
        if self.path.exists():
            self.path.rmdir()


@pytest.fixture
def memory_limit(tmp_path: Path) -> Iterator[MemoryCgroup]:
    cgroup = MemoryCgroup(f"gpt-test-{tmp_path.name}", 320 * MIB)
    try:
        yield cgroup
    finally:
        cgroup.remove()


@pytest.mark.timeout(240)
def test_a_corpus_four_times_the_memory_limit_tokenizes_completely(memory_limit: MemoryCgroup, shakespeare_dir: Path,
                                                                    bpe_vocab: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    limit = 320 * MIB
    hog = memory_limit.run([sys.executable, "-c", f"bytearray({limit})"], timeout=60)
    assert hog.returncode in (-9, 137) and memory_limit.oom_kills() == 1        # the limit is enforced
    corpus = build_corpus(sorted(shakespeare_dir.glob("*.txt")), tmp_path / "corpus.jsonl", 4 * limit / 1e6)
    vocab, merges = bpe_vocab

    def tokenize(prefix: str, run: Callable[..., subprocess.CompletedProcess]) -> subprocess.CompletedProcess:
        return run([sys.executable, "-m", "tasks.tokenize", "--input", corpus["path"], "--vocab-file", str(vocab),
                    "--merge-file", str(merges), "--append-eod", "--output-prefix", str(tmp_path / prefix)],
                   timeout=120)

    limited = tokenize("limited", memory_limit.run)
    assert limited.returncode == 0 and memory_limit.oom_kills() == 1, limited.stdout[-2000:] + limited.stderr[-2000:]
    free = tokenize("free", lambda argv, timeout: subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                                                  timeout=timeout, check=False))
    assert free.returncode == 0, free.stderr[-2000:]
    summary = json.loads(limited.stdout.splitlines()[-1])
    assert summary["documents"] + sum(summary["skipped"].values()) == corpus["documents"]    # every line read
    for suffix in ("bin", "idx"):
        assert filecmp.cmp(tmp_path / f"limited_text_document.{suffix}", tmp_path / f"free_text_document.{suffix}",
                           shallow=False)
    for big in [Path(corpus["path"]), *tmp_path.glob("*_text_document.*")]:
        big.unlink()                                # gigabytes: not kept with the test's other files
