"""Nodes kept out across runs: the operator's quarantine (tasks/cluster/quarantine.py) takes the node a
fault pointed at, every later plan on that cluster excludes it and says why, and the burn-in flow
lets it back in once it is healthy (flows/burn_in.py)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flows.plan.build import make_plan
from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
from tasks.cluster.config import load_cluster
from tasks.cluster.quarantine import Quarantine, QuarantineError
from tasks.trackers import Trackers
from tasks.train.watch import TrainingWatch
from tests.run_folder import job_records
from tests.test_cluster_slurm import tiny
from tests.test_hangs import _hang_reports, _run


def test_a_quarantined_node_is_excluded_and_a_nodelist_that_names_it_keeps_it(tmp_path: Path) -> None:
    kept = Quarantine(tmp_path / "ops" / "quarantine.json")
    kept.add("node3", "hang", "job 7 hung: rank 1 on node node3 is behind the others", run="a", job="7",
             evidence="/runs/a/jobs/7/hang-1")
    kept.add("node4", "operator", "ECC errors in dmesg")
    cluster, lines = kept.kept_out(load_cluster("slurm-local", exclude="node9"))
    assert cluster.exclude == "node3,node4,node9"
    assert lines[0] == (f"node node3 is kept out by the quarantine {kept.path}: hang: job 7 hung: rank 1 on node node3 "
                        "is behind the others (run a, job 7, /runs/a/jobs/7/hang-1)")
    pinned, lines = kept.kept_out(load_cluster("slurm-local", nodelist="node4"))
    assert pinned.exclude == "node3" and lines[1].endswith("(the cluster's nodelist names it: it stays in this run)")
    assert kept.release("node3") and not kept.release("node3") and sorted(kept.nodes()) == ["node4"]
    assert not kept.release("node4", before=0.0) and kept.release("node4", before=time.time() + 1)


def test_a_damaged_quarantine_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "quarantine.json"
    path.write_text('{"nodes": ["node1"]}')
    with pytest.raises(QuarantineError, match=f"quarantine {path} is not a quarantine file"):
        Quarantine(path).nodes()


def test_the_plan_excludes_the_quarantined_nodes_and_names_the_evidence(tmp_path: Path, operator_preset) -> None:
    quarantine = tmp_path / "ops" / "quarantine.json"
    Quarantine(quarantine).add("node2", "straggler", "straggler: rank 1 on node node2 is busy 90 ms per iteration",
                               run="run-a", evidence="/runs/run-a/metrics.jsonl")
    plan = make_plan(model="tiny", data=DataParams(), tokenizer=TokenizerParams(), training=TrainingParams(),
                     cluster=ClusterParams(preset=operator_preset("slurm-local", quarantine=str(quarantine))),
                     output=OutputParams(root=str(tmp_path / "runs")))
    assert plan.cluster.exclude == "node2"
    assert "#SBATCH --exclude=node2\n" in plan.cluster.sbatch_script(tmp_path / "jobs")
    assert any("node node2 is kept out" in w and "run run-a, /runs/run-a/metrics.jsonl" in w for w in plan.warnings)


def test_a_straggler_named_in_training_goes_to_the_quarantine_once(tmp_path: Path) -> None:
    quarantine = tmp_path / "quarantine.json"
    cluster = load_cluster("slurm-local", nodes=2).model_copy(update={"quarantine": str(quarantine)})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watch = TrainingWatch(tiny(run_dir=str(run_dir), train_iters=100), cluster, run_dir, Trackers((), "t", run_dir, {}))
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i in range(1, 11):
            f.write(json.dumps({"kind": "ranks", "iteration": 10 * i, "iterations": 10, "busy_ms": [10.0, 95.0],
                                "nodes": ["node1", "node2"]}) + "\n")
    watch.on_poll()
    (verdict,) = Quarantine(quarantine).nodes()["node2"]
    assert verdict["kind"] == "straggler" and verdict["run"] == "run" and "rank 1 on node node2" in verdict["line"]


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_hung_node_stays_out_of_the_next_run_until_the_burn_in_finds_it_healthy(
        slurm_cluster, tmp_path, monkeypatch, operator_preset, prefect_harness):
    from flows.burn_in import burn_in

    quarantine = tmp_path / "ops" / "quarantine.json"
    preset = operator_preset("slurm-local", quarantine=str(quarantine))
    cluster = load_cluster(preset, nodes=1, tasks_per_node=2, spare_nodes=1)
    _run(tmp_path, monkeypatch, f"rank=1,iteration=3,phase=sync,seconds=900,once={tmp_path / 'fired'}", cluster,
         train_iters=6, save_interval=2)
    (job,) = job_records(tmp_path / "run")
    (report,) = _hang_reports(tmp_path / "run")
    (verdict,) = Quarantine(quarantine).nodes()[faulty := report["node"]]
    assert verdict["kind"] == "hang" and verdict["job"] == job["job_id"] and Path(verdict["evidence"]).is_dir()

    plan = make_plan(model="tiny", data=DataParams(), tokenizer=TokenizerParams(), training=TrainingParams(),
                     cluster=ClusterParams(preset=preset), output=OutputParams(root=str(tmp_path / "runs")))
    assert plan.cluster.exclude == faulty and any(f"node {faulty} is kept out" in w for w in plan.warnings)

    monkeypatch.setenv("GPT_FAULT", f"rank=-1,iteration=1,every=1,phase=sync,seconds=0.5,node={faulty}")
    still = burn_in(preset, iterations=8)
    assert list(still["kept"]) == [faulty] and "x node" in still["kept"][faulty][0], still
    assert [v["kind"] for v in Quarantine(quarantine).nodes()[faulty]] == ["hang", "burn-in"]
    monkeypatch.delenv("GPT_FAULT")
    healed = burn_in(preset, iterations=8)
    assert healed == {"released": [faulty], "kept": {}} and Quarantine(quarantine).nodes() == {}
