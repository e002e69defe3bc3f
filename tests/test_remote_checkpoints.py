"""Checkpoints in two tiers on the real parts: each save copied to S3 (SeaweedFS on loopback) by the
head node as training goes on, verified, with keep_last per tier; a run folder that lost its
checkpoints, or itself, resumes from S3 to the weights of an uninterrupted run; an S3 server killed
mid-run delays the copies but never training; a copy that cannot be made is named at the end; a
rollback removes its saves' copies and a pinned save's copy is kept until it is evaluated."""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from gpt.checkpoint import MARKER
from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import JobError
from tasks.sync import Remote
from tasks.train import copies as copying
from tasks.train.copies import CheckpointCopies
from tasks.train.remote_checkpoints import RECORDS, RemoteTier
from tasks.train.stage import train
from tests.fixtures_gpt import slow_iterations
from tests.run_folder import wait_until
from tests.test_spikes import _cluster, _config, index  # noqa: F401 (the index fixture)
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run

pytestmark = pytest.mark.integration


def _tier(s3_server, monkeypatch, keep_last: int = 3, prefix: str = "runs/run") -> RemoteTier:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    return RemoteTier(f"s3://{s3_server.new_bucket()}/{prefix}", Remote(s3_server.endpoint_url), keep_last)


def _keys(s3_server, tier: RemoteTier, iteration: int) -> dict[str, int]:
    bucket, _, prefix = tier.at(iteration).removeprefix("s3://").partition("/")
    pages = s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1:]: o["Size"] for page in pages for o in page.get("Contents", [])}


@pytest.mark.timeout(300)
def test_each_save_is_copied_verified_as_training_goes_on_with_keep_last_per_tier(index, tmp_path, s3_server,  # noqa: F811
                                                                               monkeypatch):
    tier = _tier(s3_server, monkeypatch, keep_last=3)
    run_dir = tmp_path / "run"
    # Saves 2 s apart at least, as on a cluster (minutes): keep_last removes none before a poll sees it.
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))
    result = train(_config(index, run_dir, train_iters=40, save_interval=10, keep_last=2), _cluster(1), tier=tier)
    assert result.summary["iteration"] == 40 and "checkpoint_copies_missing" not in result.summary
    assert tier.complete() == [20, 30, 40]                      # keep_last_remote
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_0000030", "iter_0000040"]
    for iteration in (30, 40):
        local = run_dir / "checkpoints" / f"iter_{iteration:07d}"
        there = _keys(s3_server, tier, iteration)
        assert {f.name: f.stat().st_size for f in local.iterdir()} == {k: v for k, v in there.items() if "/" not in k
                                                                     and k != ".sync-manifest.json"}
        manifest = json.loads(s3_server.client().get_object(
            Bucket=tier.uri.split("/")[2], Key=f"runs/run/checkpoints/iter_{iteration:07d}/.sync-manifest.json")["Body"].read())
        assert manifest["files"] and all(f["verified"] and f["check"] != "size" for f in manifest["files"])
        assert f"{RECORDS}/metrics.jsonl" in there and f"{RECORDS}/config.json" in there
    assert not list((run_dir / "checkpoints").glob(".copy-*"))       # the staged copies are gone
    # Each copy was made while training went on: the records copied with save 20 end before the run did.
    records = tier.record(20, "metrics.jsonl")
    assert records is not None and max(json.loads(line)["iteration"] for line in records.splitlines()) < 40


@pytest.mark.timeout(600)
def test_a_run_folder_that_lost_its_checkpoints_or_itself_resumes_from_s3_to_the_uninterrupted_weights(
        index, tmp_path, s3_server, monkeypatch):  # noqa: F811
    from flows.plan.outlook import outlook
    from flows.plan.output import copy_to_resume
    from flows.plan.params import Problems

    for folder_lost in (False, True):
        tier = _tier(s3_server, monkeypatch, keep_last=2, prefix=f"runs/lost-{folder_lost}")
        run_dir = tmp_path / f"run-{folder_lost}"
        config = _config(index, run_dir, train_iters=30, save_interval=10)
        monkeypatch.setenv("GPT_FAULT", f"rank=0,iteration=25,phase=data,kill=1,once={tmp_path / f'killed-{folder_lost}'}")
        with pytest.raises(JobError):
            train(config, _cluster(1), tier=tier)                # killed at 25: saves 10 and 20 copied
        monkeypatch.delenv("GPT_FAULT")
        assert tier.complete() == [10, 20]
        shutil.rmtree(run_dir if folder_lost else run_dir / "checkpoints")

        problems = Problems()
        copy = copy_to_resume(tier, run_dir, {"model": "tiny"}, problems)
        assert copy == 20 and not problems
        told = outlook(run_dir, config, ClusterConfig(), (copy, tier.at(copy)))
        assert told.kind == "resume" and told.done == 20 and tier.at(20) in told.message

        result = train(config, _cluster(1), tier=tier)
        assert result.summary["iteration"] == 30
        log = (run_dir / "jobs" / f"{result.job_ids[-1]}_0_log.out").read_text()
        assert f"resumed from {run_dir / 'checkpoints' / 'iter_0000020'}" in log, log[-2000:]
        assert tier.complete() == [20, 30]
        assert_weights_equal_an_uninterrupted_run(run_dir)
        assert (run_dir / "config.json").is_file() and (run_dir / "metrics.jsonl").is_file()


@pytest.mark.timeout(400)
def test_an_s3_server_killed_mid_run_delays_the_copies_never_training(index, tmp_path, own_s3_server,  # noqa: F811
                                                                     monkeypatch):
    monkeypatch.setattr(copying, "RETRY_S", (0.5,))
    tier = _tier(own_s3_server, monkeypatch, keep_last=5)
    run_dir = tmp_path / "run"
    own_s3_server.stop()                                 # down before the first save
    first_save = threading.Event()

    def start_again() -> None:
        wait_until(lambda: (run_dir / "checkpoints" / "iter_0000004").is_dir(), 120, "the second save")
        first_save.set()
        own_s3_server.start()

    threading.Thread(target=start_again, daemon=True).start()
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.3))
    result = train(_config(index, run_dir, train_iters=12, save_interval=2, keep_last=10), _cluster(1), tier=tier)
    assert first_save.is_set() and result.summary["iteration"] == 12
    assert "checkpoint_copies_missing" not in result.summary
    assert tier.complete() == [4, 6, 8, 10, 12]

    # A store that never answers: the end of the stage names the saves it could not copy.
    monkeypatch.setattr(copying, "FINAL_WAIT_S", 3.0)
    monkeypatch.delenv("GPT_FAULT")
    unreachable = RemoteTier("s3://nowhere/run", Remote("http://127.0.0.1:9"), 2)
    result = train(_config(index, tmp_path / "other", train_iters=4, save_interval=2), _cluster(1), tier=unreachable)
    assert result.summary["iteration"] == 4
    (line_2, line_4) = result.summary["checkpoint_copies_missing"]
    assert line_2.startswith("checkpoint iteration 2 has no complete copy under s3://nowhere/run/checkpoints/iter_0000002")
    assert "iteration 4" in line_4 and "cannot reach" in line_4


def _saves(run_dir: Path, *iterations: int) -> None:
    for it in iterations:
        folder = run_dir / "checkpoints" / f"iter_{it:07d}"
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(bytes([it]) * 1000)
        (folder / ".metadata").write_bytes(b"metadata")
        (folder / MARKER).write_text(json.dumps({"iteration": it}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"iteration": it}) + "\n" for it in iterations))


@pytest.mark.timeout(120)
def test_a_rollback_removes_its_saves_copies_and_a_pinned_saves_copy_waits_for_its_evaluation(tmp_path, s3_server,
                                                                                                monkeypatch):
    from tasks.evaluate.records import FOLDER, PINNED
    from tasks.trackers import Trackers
    from tasks.train.watch import TrainingWatch
    from tests.test_cluster_slurm import tiny

    tier = _tier(s3_server, monkeypatch, keep_last=1)
    run_dir = tmp_path / "run"
    _saves(run_dir, 10, 20, 30)
    pinned = run_dir / FOLDER / PINNED / "iter_0000010" / "checkpoints" / "iter_0000010"
    pinned.mkdir(parents=True)
    copies = CheckpointCopies(tier, run_dir)
    for it in (10, 20, 30):
        copies.saved(it)
    assert copies.finish() == []
    assert tier.complete() == [10, 30]                   # 20 past keep_last_remote; 10 pinned
    assert copies.note() == "S3 holds saves 10, 30"
    # A rollback to 20 whose removal of copy 30 never happened (the flow died first): no resume picks 30.
    rollback = {"kind": "loss spike", "iterations": [25], "losses": [1e4], "median": 1.0, "samples": [1],
                "documents": [], "resumed_from": 20}
    (run_dir / "skipped.json").write_text(json.dumps({"rollbacks": [rollback]}))
    assert tier.to_resume(run_dir) == 10

    shutil.rmtree(pinned.parent.parent)                   # evaluated: its pin let go
    config = tiny(run_dir=str(run_dir), train_iters=40)
    watch = TrainingWatch(config, ClusterConfig(), run_dir, Trackers((), "p", run_dir, {}),
                          CheckpointCopies(tier, run_dir))
    watch.rewind(20, config)                              # a rollback to iteration 20
    assert watch.copies.finish() == []
    assert tier.complete() == [10]                       # 30 rolled back; 10 the newest left
