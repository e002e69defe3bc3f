"""Where a run's node-hours went (tasks/train/ledger.py): a run with a loss spike rolled back and a
hang resubmitted, its causes summing to the nodes held over time, each fault's cause non-zero."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.train.goodput import CAUSES, GOODPUT, job_seconds
from tasks.train.stage import train
from tests.run_folder import job_records
from tests.test_spikes import SPIKED_SAMPLE, _cluster, _config, index  # noqa: F401 (the index fixture)


@pytest.mark.timeout(400)
def test_a_run_with_a_rollback_and_a_hang_accounts_every_node_second(index, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("GPT_FAULT", f"sample={SPIKED_SAMPLE},factor=1000,rank=1,iteration=6,phase=sync,"
                                    f"seconds=900,once={tmp_path / 'fired'}")
    result = train(_config(index, tmp_path / "run", hang_timeout_s=6.0, keep_last=10), _cluster(2))
    run_dir = Path(result.run_dir)
    assert [j["final"] for j in job_records(run_dir)] == ["HUNG", "SPIKED", "FINISHED"]
    (leg,) = json.loads((run_dir / GOODPUT).read_text())["legs"]
    spent = leg["node_seconds"]
    assert sum(spent.values()) == pytest.approx(leg["held_node_seconds"], rel=0.01)
    assert leg["held_node_seconds"] == pytest.approx(sum(j["states"][-1]["time"] - j["submitted"]
                                                         for j in job_records(run_dir)), rel=0.01)
    made = ("start", "restart", "productive", "checkpoint", "hang", "lost", "rolled_back")
    assert all(spent[cause] > 0 for cause in made), spent
    assert spent["hang"] >= 6.0 and spent["evaluation"] == 0
    assert 0 < leg["goodput"] < 1 and result.summary["goodput"] == leg["goodput"]
    assert result.summary["node_hours_hang"] == pytest.approx(spent["hang"] / 3600)


def test_a_job_restarted_in_its_allocation_and_requeued_has_each_wait_in_its_place():
    """States as jobs.json records them: the queue, a start that hung and restarted in the
    allocation, a requeue's hold, and the start after it."""
    job = {"name": "train-tiny", "submitted": 0.0, "states": [
        {"time": 10.0, "state": "RUNNING"}, {"time": 40.0, "state": "RESTARTING"}, {"time": 41.0, "state": "RUNNING"},
        {"time": 70.0, "state": "PENDING"}, {"time": 100.0, "state": "RUNNING"}, {"time": 130.0, "state": "COMPLETED"}]}
    records = [{"kind": "train", "time": t, "elapsed_ms": 1000.0} for t in (15, 16, 17, 18, 45, 46, 105, 106)] + \
              [{"kind": "save", "time": 17.5, "blocking_s": 0.25}]
    seconds = job_seconds(job, records, [{"stalled_s": 6.0, "written": 39.0}], first=True)
    assert seconds["queue"] == 10.0 and seconds["start"] == 5.0 and seconds["hang"] == 6.0
    assert seconds["lost"] == pytest.approx(40.0 - 18.0 - 6.0)
    assert seconds["restart"] == pytest.approx((45 - 40) + (100 - 70) + (105 - 100))
    assert seconds["productive"] == 3 + 1 + 1 and seconds["checkpoint"] == 0.25
    assert set(seconds) == set(CAUSES)


@pytest.mark.timeout(300)
def test_the_nightly_suite_records_a_legs_ledger_with_goodput_flagged_when_it_drops():
    from benchmarks import ledger
    from flows.benchmark import NIGHTLY
    from tasks.benchmark_history import direction, flatten

    assert "ledger" in [spec.name for spec in NIGHTLY]
    figures = flatten({"ledger": ledger.run(iters=8, save_interval=4)})
    spent = {name.rsplit(".", 1)[-1]: value for name, value in figures.items() if ".node_s." in name}
    assert set(spent) == set(CAUSES) and sum(spent.values()) == pytest.approx(figures["ledger.held_node_s"], rel=0.01)
    assert spent["start"] > 0 and spent["productive"] > 0 and spent["checkpoint"] > 0
    assert 0 < figures["ledger.goodput"] < 1
    assert direction("ledger.goodput") == 1 and direction("ledger.held_node_s") == -1
