"""A hung or slow rank never burns the allocation: the follower finds a job that stopped advancing
from its ranks' heartbeats, saves every rank's stack, cancels it and resubmits it without the node
that hung; a run that hangs twice at one iteration stops with the report; a slow rank is named.

Faults come from GPT_FAULT (gpt.faults), which these tests set for the jobs they submit:
a chosen rank sleeps when it enters a phase at an iteration.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tasks.cluster.config import load_cluster
from tasks.cluster.hang import STRAGGLER_FACTOR, STRAGGLER_ITERATIONS, Stragglers
from tasks.train.stage import FaultedTwice, train
from tests.fixtures_gpt import read_metrics
from tests.run_folder import job_records
from tests.test_cluster_slurm import tiny
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run

HANG_S = 6.0          # hang_timeout_s of these runs


def _run(tmp_path: Path, monkeypatch, fault: str, cluster, **config):
    monkeypatch.setenv("GPT_FAULT", fault)
    settings = dict(train_iters=16, save_interval=4, log_interval=1, hang_timeout_s=HANG_S, run_dir=str(tmp_path / "run"))
    started = time.monotonic()
    result = train(tiny(**{**settings, **config}), cluster)
    return result, time.monotonic() - started


def _hang_reports(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run_dir.glob("jobs/*/hang-*/report.json"))]


def _stacks(report: dict) -> dict[int, str]:
    return {r: (Path(report["folder"]) / f"rank-{r}-stacks.txt").read_text() for r in (0, 1)}


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_rank_hung_before_a_collective_is_found_stacked_and_resubmitted_without_its_node(
        slurm_cluster, tmp_path, monkeypatch):
    cluster = load_cluster(slurm_cluster["preset"], nodes=1, tasks_per_node=2, nodelist="node1")
    result, _ = _run(tmp_path, monkeypatch, "rank=1,iteration=7,phase=sync,seconds=900,node=node1", cluster)
    run_dir = Path(result.run_dir)
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    (report,) = _hang_reports(run_dir)
    assert (report["rank"], report["node"], report["phase"], report["iteration"]) == (1, "node1", "sync", 7)
    assert HANG_S <= report["stalled_s"] <= HANG_S + 10
    assert report["stacks"] == {"0": "signal", "1": "signal"}
    stacks = _stacks(report)
    assert "in at" in stacks[1] and "gpt/heartbeat.py" in stacks[1]          # rank 1 sleeping in the fault
    assert "all_reduce" in stacks[0]                                         # rank 0 waiting for it
    first, second = job_records(run_dir)
    assert first["final"] == "HUNG" and second["final"] == "COMPLETED"
    assert {s["nodes"] for s in second["states"] if s["state"] == "RUNNING"} == {"node2"}
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17))
    assert_weights_equal_an_uninterrupted_run(run_dir)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_hang_on_a_job_that_holds_every_node_resumes_on_the_nodes_there_are(slurm_cluster, tmp_path, monkeypatch,
                                                                              caplog):
    caplog.set_level("WARNING")
    cluster = load_cluster(slurm_cluster["preset"], nodes=2, tasks_per_node=1)
    once = tmp_path / "fired"
    # Rank 1 stops (SIGSTOP): it can write no stack of its own, so py-spy reads it on its node.
    result, _ = _run(tmp_path, monkeypatch, f"rank=1,iteration=3,phase=sync,stop=1,once={once}", cluster,
                     train_iters=6, save_interval=2)
    run_dir = Path(result.run_dir)
    (report,) = _hang_reports(run_dir)
    assert report["rank"] == 1 and result.summary["iteration"] == 6
    assert report["stacks"] == {"0": "signal", "1": "py-spy"}
    stacks = _stacks(report)
    assert f"(pid {report['ranks'][1]['pid']} on {report['node']}" in stacks[1]
    assert "wrote no stack within 3 s of SIGUSR1; read from outside the process by py-spy" in stacks[1]
    assert re.search(r"\bat \(.*gpt/faults\.py:\d+\)", stacks[1]), stacks[1]    # stopped in the fault
    assert "all_reduce" in stacks[0]                                               # rank 0 waiting for it
    first, second = job_records(run_dir)
    assert first["final"] == "HUNG" and second["final"] == "COMPLETED"
    assert f"on the same nodes, node {report['node']} included: partition" in caplog.text
    assert "has 1 usable node(s) besides it and the job needs 2" in caplog.text
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 7))


@pytest.mark.timeout(300)
def test_a_rank_hung_in_data_loading_is_found_and_the_prefect_run_shows_where(tmp_path, monkeypatch, prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.filters import EventFilter, EventNameFilter

    from tasks.train.stage import train_task

    once = tmp_path / "fired"
    monkeypatch.setenv("GPT_FAULT", f"rank=0,iteration=6,phase=data,seconds=900,once={once}")
    config = tiny(train_iters=16, save_interval=4, log_interval=1, hang_timeout_s=HANG_S, run_dir=str(tmp_path / "run"))

    @flow
    def training() -> object:
        return train_task(config, load_cluster("local", tasks_per_node=2))

    state = training(return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        (artifact,) = [a for a in artifacts if a.key == "training-hang"]
        (ledger,) = [a for a in artifacts if a.key == "goodput"]
        events = []
        hangs = EventFilter(event=EventNameFilter(name=["gpt.training.hang"]))
        for _ in range(30):        # events reach the server a moment after they are sent
            events = client.read_events(hangs, limit=10).events
            if events:
                break
            time.sleep(1)
    (report,) = _hang_reports(Path(result.run_dir))
    assert (report["rank"], report["phase"], report["iteration"]) == (0, "data", 6)
    assert "in at" in _stacks(report)[0]
    assert "at iteration 6, phase data; rank 0 on node" in artifact.data and "| 1 |" in artifact.data
    assert events and events[0].payload["rank"] == 0 and events[0].resource.id == "gpt.run.run"
    assert result.summary["iteration"] == 16 and len(result.job_ids) == 2
    assert [r["iteration"] for r in read_metrics(result.run_dir)] == list(range(1, 17))
    assert "## Where the node-hours went: run" in ledger.data and "| hang |" in ledger.data
    assert "data:image/png;base64," in ledger.data


@pytest.mark.timeout(300)
def test_a_long_save_is_not_a_hang_but_a_save_that_never_ends_is(tmp_path, monkeypatch):
    # Every rank spends 2 x hang_timeout_s in each save: saving is slow, not hung.
    result, _ = _run(tmp_path, monkeypatch, f"rank=-1,iteration=4,every=1,phase=save,seconds={2 * HANG_S}",
                     load_cluster("local", tasks_per_node=2), train_iters=8)
    assert _hang_reports(Path(result.run_dir)) == [] and len(result.job_ids) == 1
    once = tmp_path / "fired"
    result, _ = _run(tmp_path, monkeypatch, f"rank=1,iteration=12,phase=save,seconds=900,once={once}",
                     load_cluster("local", tasks_per_node=2), train_iters=16)
    (report,) = _hang_reports(Path(result.run_dir))
    assert (report["phase"], report["iteration"]) == ("save", 12)
    assert report["limit_s"] >= 4 * HANG_S                    # a save gets several times the limit
    assert result.summary["iteration"] == 16


@pytest.mark.timeout(300)
def test_the_same_hang_twice_stops_the_run_with_its_report(tmp_path, monkeypatch):
    with pytest.raises(FaultedTwice, match=r"hung: .* at iteration 6, phase data; rank 1 .* before as well"):
        _run(tmp_path, monkeypatch, "rank=1,iteration=6,phase=data,seconds=900", load_cluster("local", tasks_per_node=2))
    run_dir = tmp_path / "run"
    assert len(_hang_reports(run_dir)) == 2 and [j["final"] for j in job_records(run_dir)] == ["HUNG", "HUNG"]


@pytest.mark.timeout(300)
def test_a_collective_that_cannot_complete_fails_the_job_and_no_rank_holds_it(tmp_path, monkeypatch):
    from tasks.cluster.jobs import JobError

    monkeypatch.setenv("GPT_FAULT", "rank=1,iteration=3,phase=sync,seconds=900")
    started = time.monotonic()
    with pytest.raises(JobError) as e:
        train(tiny(train_iters=8, hang_timeout_s=900, collective_timeout_s=10, run_dir=str(tmp_path / "run")),
              load_cluster("local", tasks_per_node=2))
    assert time.monotonic() - started < 120
    assert "Timed out waiting 10000ms" in str(e.value) and "rank 0 failed, the others stopped" in str(e.value)
    assert [j["final"] for j in job_records(tmp_path / "run")] == ["FAILED"]      # rank 1 did not hold it on


@pytest.mark.timeout(600)
def test_a_slow_rank_is_named_as_a_straggler_and_a_normal_run_has_none(tmp_path, monkeypatch):
    # No save before the end: a save's work shows in the busy time of the iterations around it. The
    # delay is many times an iteration's own work, so a busy machine slowing rank 0 does not hide it.
    result, _ = _run(tmp_path, monkeypatch, "rank=1,iteration=2,every=1,phase=data,seconds=0.5",
                     load_cluster("local", tasks_per_node=2), train_iters=50, save_interval=50, log_interval=5,
                     hang_timeout_s=None)
    records = [r for r in _records(result.run_dir) if r["kind"] == "ranks"]
    watch = Stragglers()
    found = [line for r in records for _, line in watch.add(r)]
    assert len(records[0]["busy_ms"]) == 2 and found, records
    named = re.match(r"straggler: rank 1 on node \S+ is busy .* for (\d+) iterations \(to iteration (\d+)\)", found[0])
    # the first interval holds an iteration before the delay starts: it counts when it is already 1.5x slower
    assert named and STRAGGLER_ITERATIONS <= int(named[1]) < STRAGGLER_ITERATIONS + 5, found[0]
    assert all(line.startswith("straggler: rank 1 ") for line in found)

    normal = tmp_path / "normal"
    monkeypatch.delenv("GPT_FAULT")
    # the preset's own size: each interval keeps the ranks busy long enough that scheduling noise stays small
    result = train(tiny(train_iters=100, log_interval=10, save_interval=100, run_dir=str(normal),
                        num_layers=4, hidden_size=128, seq_length=128), load_cluster("local", tasks_per_node=2))
    records = [r for r in _records(result.run_dir) if r["kind"] == "ranks"]
    watch = Stragglers()
    assert len(records) == 10 and [line for r in records for _, line in watch.add(r)] == []
    ratios = [max(r["busy_ms"]) / min(r["busy_ms"]) for r in records]
    assert max(ratios) < 2 * STRAGGLER_FACTOR


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_at_thousands_of_ranks_the_follower_reads_the_heartbeats_less_often(tmp_path, monkeypatch):
    from tasks.cluster import hang

    reads: list[str] = []
    monkeypatch.setattr(hang.heartbeat, "read", lambda run_dir: reads.append(str(run_dir)) or [])
    now = [0.0]
    large = hang.HangWatch(tmp_path / "large", "7", 8000, None, clock=lambda: now[0])
    small = hang.HangWatch(tmp_path / "small", "8", 8, None, clock=lambda: now[0])
    for t in range(0, 82, 2):   # a poll every 2 s
        now[0] = float(t)
        large.check("RUNNING")
        small.check("RUNNING")
    assert reads.count(str(tmp_path / "small")) == 41                # every poll
    assert reads.count(str(tmp_path / "large")) == 6                 # at 0, 16, 32, 48, 64 and 80 s
    large.check("PENDING")                                            # requeued: read at once when it runs again
    large.check("RUNNING")
    assert reads.count(str(tmp_path / "large")) == 7


def test_a_rank_that_failed_in_an_earlier_start_of_a_requeued_job_does_not_stop_the_new_one(tmp_path, monkeypatch):
    """A rank that failed as its job was requeued leaves a "failed" heartbeat; once the new start's
    ranks beat, that failure is over: only a failure that lasts FAILED_GRACE_S stops a job."""
    from tasks.cluster import hang

    beat = {"node": "n1", "step_s": 0.4, "longest": {}}
    beats = [{**beat, "job": "9.2", "rank": 0, "phase": "save", "entered": 5, "iteration": 160},
             {**beat, "job": "9.2", "rank": 1, "phase": "failed", "entered": 6, "iteration": 160}]
    monkeypatch.setattr(hang.heartbeat, "read", lambda run_dir: list(beats))
    now = [0.0]
    watch = hang.HangWatch(tmp_path, "9", 2, None, clock=lambda: now[0])
    watch.check("RUNNING")                                    # the new start, before its ranks beat
    beats[0] = {**beats[0], "job": "9.3", "phase": "start", "entered": 1, "iteration": 100}
    for t in range(2, 40, 2):
        now[0] = float(t)
        watch.check("RUNNING")
        assert watch.abandoned() is None
    beats[0] = {**beats[0], "phase": "failed"}              # a failure of this start does stop it
    for t in range(40, 60, 2):
        now[0] = float(t)
        watch.check("RUNNING")
    assert watch.abandoned()["rank"] == 0


def test_starting_gets_a_floor_however_short_the_runs_limit(tmp_path, monkeypatch):
    """Imports and the rendezvous do not scale with hang_timeout_s: ranks still starting after
    several times a 6 s limit on a busy node are not hung; past START_FLOOR_S they are."""
    from tasks.cluster import hang

    beats = [{"node": "n1", "step_s": None, "longest": {}, "job": "9", "rank": r, "phase": "start", "entered": 1,
              "iteration": 0} for r in range(2)]
    monkeypatch.setattr(hang.heartbeat, "read", lambda run_dir: list(beats))
    now = [0.0]
    watch = hang.HangWatch(tmp_path, "9", 2, 6.0, clock=lambda: now[0])
    for t in range(0, int(hang.START_FLOOR_S), 5):
        now[0] = float(t)
        assert watch.check("RUNNING") is None
    now[0] = hang.START_FLOOR_S + 5
    found = watch.check("RUNNING")
    assert found is not None and found.phase == "start" and found.limit_s == hang.START_FLOOR_S
