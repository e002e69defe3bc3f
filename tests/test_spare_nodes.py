"""Spare nodes: a job allocated with `spare_nodes` restarts its hung ranks inside its allocation,
without the node at fault and without the queue (tasks/cluster/spares.py)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.cluster.config import ClusterConfig, load_cluster
from tasks.cluster.spares import NONE, ask_restart, left_out, spares_left
from tasks.train.goodput import GOODPUT
from tests.fixtures_gpt import read_metrics
from tests.run_folder import job_records
from tests.test_hangs import HANG_S, _hang_reports, _run
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_hung_rank_restarts_on_the_spare_node_in_the_same_job(slurm_cluster, tmp_path, monkeypatch, caplog):
    caplog.set_level("WARNING")
    cluster = load_cluster(slurm_cluster["preset"], nodes=1, tasks_per_node=2, spare_nodes=1)
    once = tmp_path / "fired"
    result, _ = _run(tmp_path, monkeypatch, f"rank=1,iteration=7,phase=sync,seconds=900,once={once}", cluster)
    run_dir = Path(result.run_dir)
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    (report,) = _hang_reports(run_dir)
    faulty = report["node"]
    assert (report["rank"], report["phase"], report["iteration"]) == (1, "sync", 7) and faulty in slurm_cluster["nodes"]
    (job,) = job_records(run_dir)                                    # one job: no resubmission, no requeue
    assert job["final"] == "COMPLETED"
    assert [s["state"] for s in job["states"]][-4:] == ["RUNNING", "RESTARTING", "RUNNING", "COMPLETED"]
    assert left_out(run_dir / "jobs", job["job_id"]) == [faulty]
    spare = next(n for n in slurm_cluster["nodes"] if n != faulty)
    restarted = [r.getMessage() for r in caplog.records if "restarted in the allocation" in r.getMessage()]
    assert len(restarted) == 1 and f"without node {faulty}, on {spare}: training again at iteration" in restarted[0]
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17))
    (leg,) = json.loads((run_dir / GOODPUT).read_text())["legs"]        # the spare's node-hours counted too
    assert leg["jobs"][0]["nodes"] == 2 and sum(leg["node_seconds"].values()) == pytest.approx(leg["held_node_seconds"])
    assert all(leg["node_seconds"][cause] > 0 for cause in ("start", "restart", "hang", "lost", "productive"))
    assert_weights_equal_an_uninterrupted_run(run_dir)
    assert HANG_S <= report["stalled_s"] <= HANG_S + 10


def test_the_batch_script_allocates_the_spares_and_runs_its_ranks_as_a_loop_of_steps(tmp_path: Path) -> None:
    script = load_cluster("slurm-local", nodes=2, tasks_per_node=4, spare_nodes=2).sbatch_script(tmp_path / "jobs")
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    (srun,) = [line.strip() for line in script.splitlines() if line.strip().startswith("srun ")]
    assert srun.startswith("srun --nodes=2 --ntasks=8 ${excluded:+--exclude=$excluded} ")
    assert f'restarts={tmp_path / "jobs"}/"${{SLURM_JOB_ID}}_restarts"' in script
    plain = load_cluster("slurm-local", nodes=2, tasks_per_node=4).sbatch_script(tmp_path / "jobs")
    assert "#SBATCH --nodes=2\n" in plain and "while true" not in plain


def test_the_loop_starts_a_step_for_each_restart_asked_and_leaves_the_named_nodes_out(tmp_path: Path) -> None:
    """The batch script's loop, run by bash with `srun` standing in as a function that records its
    arguments and asks for the next restart the way the follower does."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    script = load_cluster("slurm-local", nodes=1, tasks_per_node=2, spare_nodes=2).sbatch_script(folder)
    body = script[script.index("# command"):]
    fake = (f'srun() {{ echo "$*" >> {tmp_path}/steps; n=$(wc -l < {tmp_path}/steps); '
            f'[ "$n" = 1 ] && echo node1 >> "$restarts"; [ "$n" = 2 ] && echo - >> "$restarts"; return 7; }}\n')
    done = subprocess.run(["bash", "-c", fake + body], env={"SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    steps = (tmp_path / "steps").read_text().splitlines()
    assert done.returncode == 7 and len(steps) == 3, (done.stdout, done.stderr)
    assert "--exclude" not in steps[0] and "--exclude=node1 " in steps[1] and "--exclude=node1 " in steps[2]
    assert left_out(folder, "42") == ["node1", NONE]
    # A step that succeeded ends the job, asked or not; a new start of the job (a requeue) begins
    # with no restarts: its allocation has its spares again.
    (tmp_path / "steps").unlink()
    done = subprocess.run(["bash", "-c", fake.replace("return 7", "return 0") + body],
                          env={"SLURM_JOB_ID": "42", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and len((tmp_path / "steps").read_text().splitlines()) == 1
    assert left_out(folder, "42") == ["node1"]


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
