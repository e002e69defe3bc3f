"""Spare nodes: a job allocated with `spare_nodes` restarts its hung ranks inside its allocation,
without the node at fault and without the queue (tasks/cluster/spares.py)."""
from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tasks.cluster.config import ClusterConfig, load_cluster
from tasks.cluster.quarantine import Quarantine
from tasks.cluster.spares import (
    NONE,
    RankLost,
    ask_restart,
    end_steps,
    left_out,
    restarts_file,
    spares_left,
    unanswered,
)
from tasks.train.goodput import GOODPUT
from tests.fixtures_gpt import read_metrics
from tests.run_folder import job_records
from tests.test_hangs import HANG_S, _hang_reports, _run
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_hung_rank_restarts_on_the_spare_node_in_the_same_job(three_node_cluster, tmp_path, monkeypatch, caplog):
    """Two ranks on two nodes and a spare: rank 1 held before a collective on node2."""
    caplog.set_level("WARNING")
    cluster = load_cluster(three_node_cluster["preset"], nodes=2, tasks_per_node=1, spare_nodes=1)
    once = tmp_path / "fired"
    result, _ = _run(tmp_path, monkeypatch, f"rank=1,iteration=7,phase=sync,seconds=900,once={once}", cluster)
    run_dir = Path(result.run_dir)
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    (report,) = _hang_reports(run_dir)
    assert (report["rank"], report["node"], report["phase"], report["iteration"]) == (1, "node2", "sync", 7)
    (job,) = job_records(run_dir)                                    # one job: no resubmission, no requeue
    assert job["final"] == "COMPLETED"
    assert [s["state"] for s in job["states"]][-4:] == ["RUNNING", "RESTARTING", "RUNNING", "COMPLETED"]
    assert left_out(run_dir / "jobs", job["job_id"]) == ["node2"]
    restarted = [r.getMessage() for r in caplog.records if "restarted in the allocation" in r.getMessage()]
    assert len(restarted) == 1 and "without node node2, on node1,node3: training again at iteration" in restarted[0]
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17))
    (leg,) = json.loads((run_dir / GOODPUT).read_text())["legs"]        # the spare's node-hours counted too
    assert leg["jobs"][0]["nodes"] == 3 and sum(leg["node_seconds"].values()) == pytest.approx(leg["held_node_seconds"])
    assert all(leg["node_seconds"][cause] > 0 for cause in ("start", "restart", "hang", "lost", "productive"))
    assert_weights_equal_an_uninterrupted_run(run_dir)
    assert HANG_S <= report["stalled_s"] <= HANG_S + 10


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_rank_killed_by_its_node_restarts_on_the_spare_node_in_the_same_job(three_node_cluster, tmp_path,
                                                                            monkeypatch, caplog, operator_preset):
    """Two ranks on two nodes and a spare: rank 1 killed on node2 (SIGKILL, as the OOM killer does)
    once it has held 2 s before a collective (the save at iteration 4 is complete by then)."""
    caplog.set_level("WARNING")
    quarantine = tmp_path / "ops" / "quarantine.json"
    cluster = load_cluster(operator_preset(three_node_cluster["preset"], quarantine=str(quarantine)), nodes=2,
                           tasks_per_node=1, spare_nodes=1)
    result, _ = _run(tmp_path, monkeypatch, f"rank=1,iteration=7,phase=sync,kill=1,seconds=2,once={tmp_path / 'fired'}", cluster)
    run_dir = Path(result.run_dir)
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    assert _hang_reports(run_dir) == []                                # no hang: srun said which node
    (job,) = job_records(run_dir)
    assert [s["state"] for s in job["states"]][-4:] == ["RUNNING", "RESTARTING", "RUNNING", "COMPLETED"]
    restarting = next(s for s in job["states"] if s["state"] == "RESTARTING")
    assert "rank 1 was killed on node2 at iteration 7 (srun: error: node2: task 1: Killed)" in restarting["reason"]
    assert left_out(run_dir / "jobs", job["job_id"]) == ["node2"]
    restarted = [r.getMessage() for r in caplog.records if "restarted in the allocation" in r.getMessage()]
    assert len(restarted) == 1 and "without node node2, on node1,node3: " in restarted[0]
    assert "after rank 1 was killed on node2" in restarted[0]
    (verdict,) = Quarantine(quarantine).nodes()["node2"]                # kept out of later runs, with srun's words
    assert verdict["kind"] == "rank lost" and verdict["evidence"].endswith(f"{job['job_id']}_0_log.err")
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17))
    (leg,) = json.loads((run_dir / GOODPUT).read_text())["legs"]
    assert leg["node_seconds"]["lost"] > 0 and leg["node_seconds"]["restart"] > 0 and leg["node_seconds"]["hang"] == 0
    assert_weights_equal_an_uninterrupted_run(run_dir)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_node_set_down_leaves_the_allocation_and_its_ranks_restart_on_the_spare(three_node_cluster, tmp_path,
                                                                                  monkeypatch, caplog):
    """Three nodes: the batch script's (which must stay up: SLURM ends a job whose batch node fails),
    the node the test sets down while rank 1 trains on it, and the spare."""
    caplog.set_level("WARNING")
    cluster = load_cluster(three_node_cluster["preset"], nodes=2, tasks_per_node=1, spare_nodes=1)
    fired = tmp_path / "fired"
    fault = f"rank=1,iteration=7,phase=sync,seconds=120,node=node2,once={fired}"
    threading.Thread(target=_set_down_once, args=(fired, "node2"), daemon=True).start()
    result, _ = _run(tmp_path, monkeypatch, fault, cluster, hang_timeout_s=60)
    run_dir = Path(result.run_dir)
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    assert _hang_reports(run_dir) == []
    (job,) = job_records(run_dir)
    assert left_out(run_dir / "jobs", job["job_id"]) == ["node2"]
    restarting = next(s for s in job["states"] if s["state"] == "RESTARTING")
    assert "node node2 failed at iteration 7 (srun: error: Node failure on node2)" in restarting["reason"]
    restarted = [r.getMessage() for r in caplog.records if "restarted in the allocation" in r.getMessage()]
    assert len(restarted) == 1 and "without node node2, on node1,node3: " in restarted[0], restarted
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17))
    assert_weights_equal_an_uninterrupted_run(run_dir)


def _set_down_once(fired: Path, node: str) -> None:
    """``node`` set DOWN by the operator once the fault holds the rank there."""
    deadline = time.monotonic() + 300
    while not fired.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=set down by a test"], check=True,
                   timeout=30)


def test_the_batch_script_allocates_the_spares_and_runs_its_ranks_as_a_loop_of_steps(tmp_path: Path) -> None:
    script = load_cluster("slurm-local", nodes=2, tasks_per_node=4, spare_nodes=2).sbatch_script(tmp_path / "jobs")
    assert "#SBATCH --nodes=4\n#SBATCH --no-kill\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    (srun,) = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert srun.startswith("srun --nodes=2 --ntasks=8 ${excluded:+--exclude=$excluded} ")
    assert f'restarts={tmp_path / "jobs"}/"${{SLURM_JOB_ID}}_restarts"' in script
    plain = load_cluster("slurm-local", nodes=2, tasks_per_node=4).sbatch_script(tmp_path / "jobs")
    assert "#SBATCH --nodes=2\n" in plain and "while true" not in plain


def _loop(tmp_path: Path, srun: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The batch script's loop, run by bash with ``srun`` standing in as a function (``$n``: the step,
    from 1) that answers each step the way the follower does; the loop's exit and each srun's arguments."""
    folder = tmp_path / "jobs"
    folder.mkdir(exist_ok=True)
    script = load_cluster("slurm-local", nodes=1, tasks_per_node=2, spare_nodes=2).sbatch_script(folder)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    fake = f'srun() {{ echo "$*" >> {calls}; n=$(wc -l < {calls}); {srun}; }}\n'
    done = subprocess.run(["bash", "-c", fake + script[script.index("# command"):]],
                          env={"SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    return done, calls.read_text().splitlines()


def test_the_loop_starts_a_step_for_each_restart_asked_and_leaves_the_named_nodes_out(tmp_path: Path) -> None:
    # Step 1 hangs (the follower asks before it kills it), step 2 loses a rank (srun says so; the
    # follower answers after), step 3 loses a node (srun says 0) and the follower ends the job.
    done, calls = _loop(tmp_path, '[ "$n" = 1 ] && { echo node1 >> "$restarts"; return 137; }; '
                                  '[ "$n" = 2 ] && { echo "srun: error: node2: task 1: Killed" >&2; echo - >> "$restarts"; return 9; }; '
                                  'echo "srun: error: Node failure on node3" >&2; echo end >> "$restarts"; return 0')
    assert done.returncode == 1 and len(calls) == 3, (done.stdout, done.stderr)
    assert "--exclude" not in calls[0] and "--exclude=node1 " in calls[1] and "--exclude=node1 " in calls[2]
    assert left_out(tmp_path / "jobs", "42") == ["node1", NONE]
    assert (tmp_path / "jobs" / "42_steps").read_text().splitlines() == [
        "137 ", "9 srun: error: node2: task 1: Killed", "0 srun: error: Node failure on node3"]
    assert "srun: error: node2: task 1: Killed" in done.stderr        # srun's own lines still in the job's log
    # A step that succeeded ends the job without asking; a new start of the job (a requeue) begins
    # with no restarts: its allocation has its spares again.
    done, calls = _loop(tmp_path, 'return 0')
    assert done.returncode == 0 and len(calls) == 1 and left_out(tmp_path / "jobs", "42") == []
    assert (tmp_path / "jobs" / "42_steps").read_text() == ""


@pytest.mark.parametrize(("line", "lost"), [
    ("srun: error: node1: task 1: Killed", ("node1", 1)),
    ("srun: error: node7: tasks 4-7: Bus error", ("node7", None)),
    ("srun: error: Node failure on node2", ("node2", None)),
    ("srun: error: node1: task 0: Exited with exit code 1", None),     # the rank's own error: not the node's
    ("", None),
])
def test_a_step_that_ended_by_itself_is_the_nodes_fault_when_a_signal_or_a_failure_took_its_rank(line, lost):
    found = RankLost.of("42", line)
    assert (found and (found.node, found.rank)) == lost or found is lost
    if found is not None:
        assert found.node in found.line() and line in found.line()


def test_the_follower_answers_each_step_that_failed_once(tmp_path: Path) -> None:
    (tmp_path / "42_steps").write_text("137 \n9 srun: error: node2: task 1: Killed\n")
    ask_restart(tmp_path, "42", "node1")                                 # step 1: a hang, answered before
    assert unanswered(tmp_path, "42") == "srun: error: node2: task 1: Killed"
    end_steps(tmp_path, "42")
    assert unanswered(tmp_path, "42") is None and left_out(tmp_path, "42") == ["node1"]
    assert spares_left(tmp_path, "42", 2) == 1


def test_each_node_left_out_takes_a_spare_and_a_restart_without_one_takes_none(tmp_path: Path) -> None:
    assert spares_left(tmp_path, "7", 2) == 2
    ask_restart(tmp_path, "7", None)
    ask_restart(tmp_path, "7", "node3")
    assert spares_left(tmp_path, "7", 2) == 1
    ask_restart(tmp_path, "7", "node5")
    assert (spares_left(tmp_path, "7", 2), left_out(tmp_path, "7")) == (0, [NONE, "node3", "node5"])


@pytest.mark.parametrize("fields, said", [
    ({"executor": "local"}, "spare_nodes=1 needs SLURM: the local executor has this machine only"),
    ({"executor": "slurm", "device": "neuron"}, "spare_nodes=1: restarts inside the allocation are not built for "
                                                "Trainium's launcher"),
])
def test_spare_nodes_are_refused_by_name_where_they_cannot_apply(fields: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        ClusterConfig(spare_nodes=1, **fields)


def test_a_start_the_follower_ended_is_not_watched_again(tmp_path: Path) -> None:
    """After a restart in the allocation, the hung step's heartbeats are not the job's any more: the
    new step's ranks are watched as a job that starts."""
    from tasks.cluster.hang import HangWatch

    beats = tmp_path / "heartbeats"
    beats.mkdir()
    clock = [0.0]
    watch = HangWatch(tmp_path, "9", 2, 5.0, clock=lambda: clock[0])

    def beat(rank: int, job: str, entered: int) -> None:
        (beats / f"rank-{rank}.json").write_text(json.dumps({
            "job": job, "rank": rank, "node": "node1", "phase": "sync", "iteration": 3, "entered": entered,
            "longest": {}, "time": 0}))

    beat(0, "9.0", 10)
    beat(1, "9.0", 9)
    assert watch.check("RUNNING") is None
    watch.restarted()
    clock[0] = 30.0
    assert watch.beats() == [] and watch.check("RUNNING") is None          # the old step's beats: gone from view
    beat(0, "9.0.1", 1)
    assert [b["job"] for b in watch.beats()] == ["9.0.1"]


class _EndedStep:
    """A job whose step failed, as the follower sees it: RUNNING until it is cancelled."""
    job_id, kind = "42", "slurm"

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self, sig=None) -> None:
        self.cancelled = True

    def state(self, nodes: str) -> tuple[str, str, str]:
        return ("CANCELLED" if self.cancelled else "RUNNING"), "", nodes


@pytest.mark.parametrize("line, spare_nodes, answer", [
    ("srun: error: node2: task 1: Killed", 1, "node2"),                    # restarted on the spare
    ("srun: error: node2: task 1: Killed", 0, "end"),                      # none left: NodeLost, resubmitted
    ("srun: error: node1: task 0: Exited with exit code 1", 1, "end"),     # the rank's own error: retried
])
def test_a_failed_step_is_answered_by_what_srun_says_and_the_spares_left(tmp_path, line, spare_nodes, answer):
    from tasks.cluster.hang import HangWatch
    from tasks.cluster.jobs import JOBS_FOLDER, NodeLost, _ranks_checked
    from tasks.cluster.record import JobRecord

    folder = tmp_path / JOBS_FOLDER
    folder.mkdir()
    (folder / "42_steps").write_text(f"137 {line}\n")
    record = JobRecord(tmp_path)
    record.add("42", "slurm", "train-tiny", None)
    noted = []
    cluster = load_cluster("slurm-local", nodes=1, tasks_per_node=2, spare_nodes=max(spare_nodes, 1))
    if spare_nodes == 0:                                       # its one spare taken by an earlier restart
        ask_restart(folder, "42", "node3")
        (folder / "42_steps").write_text(f"137 srun: error: node3: task 0: Killed\n137 {line}\n")
    check = lambda: _ranks_checked(_EndedStep(), HangWatch(tmp_path, "42", 2, 6.0), "RUNNING", cluster, tmp_path,  # noqa: E731
                                   record, "node[1-2]", lambda fault: noted.append(fault) or fault)
    if answer == "end" and spare_nodes == 0:
        with pytest.raises(NodeLost, match="rank 1 was killed on node2"):
            check()
        assert [j["final"] for j in job_records(tmp_path)] == ["FAILED"]
    else:
        assert check() is (answer != "end")
    assert restarts_file(folder, "42").read_text().splitlines()[-1] == answer
    assert [f.node for f in noted] == (["node2"] if answer == "node2" else [])
    assert unanswered(folder, "42") is None
