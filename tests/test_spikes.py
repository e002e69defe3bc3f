"""A loss spike is found, rolled back and stepped around by the run itself: the follower flags it,
the job is stopped, the run goes back to the checkpoint before it with the samples it trained on
left out of the order, and it ends as if those samples had never been in it.

The spike comes from GPT_FAULT (gpt.faults): the loss of the iteration that trains on one chosen
sample id is multiplied, wherever that sample lands in the order."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from gpt.data import DataIndex, GPTDataset
from tasks.cluster.config import load_cluster
from tasks.index import build_indices
from tasks.train.spikes import SKIPPED, SpikeWatch, TooManyRollbacks
from tasks.train.stage import train
from tests.fixtures_gpt import read_metrics, slow_iterations
from tests.run_folder import job_records
from tests.test_cluster_slurm import tiny
from tests.test_index import write_dataset
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run

SPIKED_SAMPLE = 6 * 16 + 3          # in iteration 7 at a global batch of 16


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("spike-data")
    write_dataset(str(root / "tokens"), 600, 0, 512, 3)
    return build_indices([str(root / "tokens")], split="98,1,1", seq_length=64, seed=5,
                         num_samples={"train": 16 * 24, "valid": 16, "test": 16}, out_dir=str(root / "index")).path


def _cluster(tasks_per_node: int):
    """The local executor with one thread per rank, as the uninterrupted run's ranks have: threads
    change the order of a reduction's sums, and so the last bits of the weights."""
    return load_cluster("local", tasks_per_node=tasks_per_node, env={"OMP_NUM_THREADS": "1"})


def _config(index: str, run_dir: Path, **overrides):
    settings = dict(mock_data=False, data_index=index, train_iters=16, save_interval=5, spike_window=4,
                    run_dir=str(run_dir))
    return tiny(**{**settings, **overrides})


def test_the_order_without_skipped_samples_keeps_every_other_sample_in_its_place(tmp_path):
    write_dataset(str(tmp_path / "a"), 200, 0, 500, 1)
    write_dataset(str(tmp_path / "b"), 300, 0, 500, 2)
    for data_path in ([str(tmp_path / "a")], [(0.4, str(tmp_path / "a")), (0.6, str(tmp_path / "b"))]):
        kwargs = dict(split="100,0,0", seq_length=16, seed=3, num_samples={"train": 400}, out_dir=str(tmp_path / "i"))
        plain = GPTDataset.from_index(build_indices(data_path, **kwargs).path, "train")
        skipped = [37, 38, 39, 250]
        without = GPTDataset.from_index(build_indices(data_path, **kwargs, skipped=skipped).path, "train")
        kept = np.delete(np.arange(len(plain) + (len(skipped) if len(data_path) > 1 else 0)), skipped)
        for i in range(400):
            assert without.position(i) == kept[i]
            original = plain[kept[i]] if kept[i] < len(plain) else None
            if original is not None:
                assert np.array_equal(without[i], original), i
        assert [without.position(i) for i in range(37)] == list(range(37))


def test_a_spike_is_rolled_back_around_its_samples_and_the_run_ends_as_if_they_were_never_in_the_order(
        index, tmp_path, monkeypatch, prefect_harness):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.filters import EventFilter, EventNameFilter

    from tasks.train.stage import train_task

    run_dir = tmp_path / "run"
    # Iterations last long enough for the follower to stop the job before it ends.
    monkeypatch.setenv("GPT_FAULT", f"{slow_iterations(0.4)},sample={SPIKED_SAMPLE},factor=1000")
    started = time.monotonic()

    @flow
    def training() -> object:
        return train_task(_config(index, run_dir), _cluster(2))

    state = training(return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert result.summary["status"] == "completed" and result.summary["iteration"] == 16
    with get_client(sync_client=True) as client:
        (artifact,) = [a for a in client.read_artifacts(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))) if a.key == "training-spike"]
        for _ in range(30):        # events reach the server a moment after they are sent
            events = client.read_events(EventFilter(event=EventNameFilter(name=["gpt.training.spike"])), limit=10).events
            if any(e.resource.id == "gpt.run.run" for e in events):
                break
            time.sleep(1)
    assert "loss spike at iteration 7" in artifact.data and f"| {SPIKED_SAMPLE} | `" in artifact.data
    assert any(e.payload["iterations"] == [7] and SPIKED_SAMPLE in e.payload["samples"] for e in events)

    (rollback,) = json.loads((run_dir / SKIPPED).read_text())["rollbacks"]
    assert rollback["kind"] == "loss spike" and rollback["iterations"] == [7] and rollback["resumed_from"] == 5
    assert rollback["samples"] == list(range(6 * 16, 7 * 16))
    assert rollback["losses"][0] > 1000 and all(d["documents"] and d["prefix"].endswith("tokens")
                                                for d in rollback["documents"])
    first, second = job_records(run_dir)[:2]
    assert first["final"] == "SPIKED" and second["final"] == "FINISHED"
    # The job was stopped soon after the spike (within a poll or two), not left to its end.
    assert not (run_dir / "rolled-back" / "1" / "iter_0000015").exists()
    losses = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, 17)) and max(losses) < 20

    # The order trained on: the original one without the spiked iteration's samples (computed here).
    trained = json.loads((run_dir / "config.json").read_text())["data_index"]
    plain, without = GPTDataset.from_index(index, "train"), GPTDataset.from_index(trained, "train")
    kept = np.delete(np.arange(len(plain)), rollback["samples"])
    assert all(np.array_equal(without[i], plain[kept[i]]) for i in range(16 * 16))
    assert_weights_equal_an_uninterrupted_run(run_dir)

    # A longer leg on another layout, given the index without the skip: the run folder's skip list
    # holds, and the spiked sample (still armed in GPT_FAULT) never comes back.
    result = train(_config(index, run_dir, train_iters=20), _cluster(1))
    assert result.summary["iteration"] == 20
    assert len(json.loads((run_dir / SKIPPED).read_text())["rollbacks"]) == 1
    trained = json.loads((run_dir / "config.json").read_text())["data_index"]
    assert DataIndex.read(trained).splits["train"].skipped == rollback["samples"]
    assert time.monotonic() - started < 240


def test_non_finite_losses_past_max_rollbacks_fail_the_run_with_the_report(index, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("GPT_FAULT", f"{slow_iterations(0.4)},sample={SPIKED_SAMPLE},factor=1e300")
    with pytest.raises(TooManyRollbacks, match=r"non-finite losses at iteration 7: loss inf against a median of [\d.]+, after 0 rollback\(s\) "
                                                r"\(max_rollbacks 0\).* samples it trained on are 96, 97, 98"):
        train(_config(index, run_dir, nan_steps=1, max_rollbacks=0), _cluster(2))
    assert [j["final"] for j in job_records(run_dir)] == ["SPIKED"]
    assert not (run_dir / SKIPPED).exists()


def test_the_watch_flags_a_spike_against_the_median_and_a_run_of_non_finite_losses():
    watch = SpikeWatch(tiny(spike_factor=3.0, spike_window=4, nan_steps=2))
    losses = [9.0, 8.0, 7.5, 7.0, 6.8, 30.0]          # 30 > 3 x median(8, 7.5, 7, 6.8)
    found = [watch.add({"iteration": i + 1, "lm_loss": x}) for i, x in enumerate(losses)]
    assert found[:-1] == [None] * 5 and found[-1].iterations == [6] and found[-1].median == pytest.approx(7.25)
    watch.rewind(5)
    assert watch.add({"iteration": 6, "lm_loss": float("nan")}) is None
    spike = watch.add({"iteration": 7, "lm_loss": float("inf")})
    assert spike.kind == "non-finite losses" and spike.iterations == [6, 7]
    # A resumed leg's follower reads the earlier legs' records: they fill the window, never flag.
    resumed = SpikeWatch(tiny(spike_factor=3.0, spike_window=3), since=4)
    assert [resumed.add({"iteration": i, "lm_loss": x}) for i, x in enumerate([7.0, 6.0, 60.0, 6.0], 1)] == [None] * 4
    assert resumed.add({"iteration": 5, "lm_loss": 60.0}).iterations == [5]
    # Early losses fall fast: nothing is flagged before the window is full.
    early = SpikeWatch(tiny(spike_factor=1.5, spike_window=4))
    assert all(early.add({"iteration": i, "lm_loss": x}) is None for i, x in enumerate([2.0, 9.0, 30.0, 50.0], 1))


def test_no_false_alarm_over_the_embedded_defaults_300_iterations():
    # The loss curve of `python -m flows.pretrain` (the embedded default, 300 iterations), recorded.
    losses = json.loads((Path(__file__).parent / "embedded_default_losses.json").read_text())
    assert len(losses) == 300
    watch = SpikeWatch(tiny())
    assert [i for i, x in enumerate(losses, 1) if watch.add({"iteration": i, "lm_loss": x})] == []
    watch.rewind(0)
    spiked = [*losses[:250], losses[250] * 12, *losses[251:]]
    assert [i for i, x in enumerate(spiked, 1) if watch.add({"iteration": i, "lm_loss": x})] == [251]
