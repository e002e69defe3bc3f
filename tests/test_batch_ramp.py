"""Batch-size ramp-up (Megatron's --rampup-batch-size START INCREMENT SAMPLES) on real gloo ranks:
the batches Megatron trains, a kill in the middle of the ramp resumed under another data-parallel
size, and the count of iterations and samples the plan and the index use."""
import time

import pytest

from gpt.config import Config
from tests.fixtures_gpt import SMALL, curve, read_metrics

pytestmark = pytest.mark.timeout(300)

RAMP = {**SMALL, "train_iters": None, "lr_warmup_iters": None, "train_samples": 400, "global_batch_size": 16, "micro_batch_size": 2,
        "rampup_batch_size": [4, 4, 100], "lr_warmup_samples": 32, "eval_interval": 10, "save_interval": 5}


def megatron_batches(start: int, increment: int, ramp_samples: int, global_batch: int, train_samples: int) -> list[int]:
    """Each iteration's global batch as Megatron-LM trains it, written out from its rules: the batch
    of a step is start + increment x int(consumed / (ramp_samples / increments)) while consumed is at
    most ramp_samples, the whole batch after; the run is the ramp's steps that start within it, then
    whole batches until train_samples."""
    per_increment = ramp_samples / ((global_batch - start) // increment)
    batches, consumed = [], 0
    while consumed <= ramp_samples and consumed <= train_samples:
        batch = start + int(consumed / per_increment) * increment
        batches.append(batch)
        consumed += batch
    batches += [global_batch] * ((train_samples - consumed) // global_batch)
    return batches


def test_the_ramps_count_is_megatrons():
    config = Config.from_dict(RAMP)
    want = megatron_batches(4, 4, 100, 16, 400)
    assert config.total_iters == len(want) == 34
    assert [config.batch_of(i) for i in range(1, len(want) + 1)] == want
    assert config.samples_after(len(want)) == sum(want) == 392
    # train_iters counts steps, the first ones smaller: the index holds what they consume.
    by_steps = Config.from_dict({**RAMP, "train_samples": None, "train_iters": 20, "lr_warmup_samples": None})
    assert by_steps.num_samples()["train"] == sum(megatron_batches(4, 4, 100, 16, 10 ** 6)[:20])


@pytest.mark.parametrize("world, layout", [(1, {}), (2, {}), (2, {"pipeline_parallel": 2})],
                         ids=["one-process", "dp2", "pp2"])
def test_a_run_trains_the_batches_megatron_trains(world, layout, gpt_launcher, tmp_path):
    """Megatron's batches, one process, two data-parallel ranks, and a pipeline whose schedule runs as
    many micro-batches as each step has."""
    run = tmp_path / "run"
    out = gpt_launcher.run({**RAMP, **layout, "run_dir": str(run)}, world_size=world)
    records = read_metrics(run)
    want = megatron_batches(4, 4, 100, 16, 400)
    assert [r["iteration"] for r in records] == list(range(1, len(want) + 1))
    consumed = [sum(want[:i]) for i in range(1, len(want) + 1)]
    assert [r["consumed_samples"] for r in records] == consumed
    assert "global batch size:     4 |" in out and "global batch size:    16 |" in out
    # The learning rate follows the samples: linear warmup over the first 32, whatever the batch.
    assert records[0]["lr"] == pytest.approx(RAMP["lr"] * 4 / 32)
    assert records[4]["lr"] == pytest.approx(RAMP["lr"] * 20 / 32)


def test_killed_in_the_middle_of_the_ramp_and_resumed_on_another_layout(gpt_launcher, tmp_path, monkeypatch):
    """kill -9 at iteration 12 (the batch is 8 there), resumed by two data-parallel ranks from the save
    at iteration 10: the losses of the uninterrupted one-process run."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    gpt_launcher.run({**RAMP, "run_dir": str(reference)})
    monkeypatch.setenv("GPT_FAULT", "rank=0,iteration=12,phase=data,stop=1")
    (rank,) = gpt_launcher.start({**RAMP, "run_dir": str(run)})
    deadline = time.monotonic() + 200
    while "fault injected: rank 0 stops" not in (rank.log.read_text() if rank.log.exists() else ""):
        assert time.monotonic() < deadline and rank.returncode is None, "the run never reached iteration 12"
        time.sleep(0.2)
    rank.kill()
    assert rank.wait(30) != 0
    monkeypatch.delenv("GPT_FAULT")
    assert Config.from_dict(RAMP).batch_of(12) == 8
    out = gpt_launcher.run({**RAMP, "run_dir": str(run)}, world_size=2)
    assert "resumed from" in out and "at iteration 10" in out
    assert curve(run) == pytest.approx(curve(reference), rel=1e-5)
    assert curve(run, key="consumed_samples") == curve(reference, key="consumed_samples")


@pytest.mark.parametrize("ramp, message", [
    ([4, 5, 100], "choose a start and an increment that reach it"),
    ([2, 2, 100], "make start and increment multiples of 4"),
    ([4, 4], "expected three positive whole numbers"),
])
def test_a_ramp_that_cannot_run_is_refused_naming_the_field(ramp, message):
    problems = Config.from_dict({**RAMP, "rampup_batch_size": ramp}).problems(2)
    assert [field for field, _ in problems] == ["rampup_batch_size"] and message in problems[0][1], problems
