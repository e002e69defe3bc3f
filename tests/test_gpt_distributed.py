"""Data and tensor parallel on two gloo processes give the single-process loss curve; log formats."""
import re

import pytest

from tests.fixtures_gpt import SMALL, read_metrics


@pytest.fixture(scope="module")
def reference(one_rank_run):
    return one_rank_run


@pytest.mark.parametrize("layout", [
    {"data_parallel_mode": "ddp"},
    {"data_parallel_mode": "fsdp", "activation_checkpointing": True},
    {"tensor_parallel": 2},
], ids=["ddp2", "fsdp2-checkpointing", "tp2"])
def test_two_ranks_match_one_process(layout, reference, gpt_launcher, tmp_path):
    run_dir = tmp_path / "run"
    gpt_launcher.run({**SMALL, **layout, "run_dir": str(run_dir)}, world_size=2)
    _assert_the_curves_of(reference[0], run_dir)


def test_tensor_parallel_with_ddp_replicas_matches_one_process(reference, gpt_launcher, tmp_path):
    """TP 2 x DP 2 as DDP: DDP takes no DTensor, so the replicas average the gradients' shards."""
    run_dir = tmp_path / "run"
    gpt_launcher.run({**SMALL, "tensor_parallel": 2, "data_parallel_mode": "ddp", "run_dir": str(run_dir)},
                     world_size=4)
    _assert_the_curves_of(reference[0], run_dir)


def _assert_the_curves_of(ref_dir, run_dir) -> None:
    expected = [r["lm_loss"] for r in read_metrics(ref_dir)]
    got = [r["lm_loss"] for r in read_metrics(run_dir)]
    assert len(got) == len(expected) == SMALL["train_iters"]
    assert got == pytest.approx(expected, rel=2e-6, abs=0)
    assert [r["grad_norm"] for r in read_metrics(run_dir)] == pytest.approx(
        [r["grad_norm"] for r in read_metrics(ref_dir)], rel=1e-4)
    assert [r["valid_loss"] for r in read_metrics(run_dir, "valid")] == pytest.approx(
        [r["valid_loss"] for r in read_metrics(ref_dir, "valid")], rel=2e-6, abs=0)


def test_log_line_metrics_and_events(reference):
    run_dir, out = reference
    line = re.compile(
        r" iteration +(\d+)/ +8 \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): [\d.]+ \| "
        r"learning rate: [\d.E+-]+ \| global batch size: +8 \| lm loss: [\d.E+-]+ \| loss scale: 1\.0 \| "
        r"grad norm: [\d.]+ \| number of skipped iterations: +0 \| number of nan iterations: +0 \| "
        r"tokens/s: [\d.]+ \| MFU: n/a \|")
    iterations = [int(m.group(1)) for m in line.finditer(out)]
    assert iterations == list(range(1, 9))
    assert re.search(r" validation loss at iteration 4 \| lm loss value: [\d.E+-]+ \|", out)
    records = read_metrics(run_dir)
    assert set(records[0]) == {"kind", "iteration", "consumed_samples", "lm_loss", "lr", "grad_norm", "loss_scale",
                               "elapsed_ms", "tokens_per_s", "mfu", "skipped", "nan", "time"}
    assert [r["consumed_samples"] for r in records] == [8 * i for i in range(1, 9)]
    assert records[-1]["lm_loss"] < records[0]["lm_loss"]
    assert [r["iteration"] for r in read_metrics(run_dir, "valid")] == [4, 8]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert '"status": "completed"' in out


def test_tensorboard_dir_gets_the_events_the_run_folder_gets(gpt_launcher, tmp_path):
    """Megatron's --tensorboard-dir: rank 0 writes TensorBoard's events there too, the same scalars."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, copy = tmp_path / "run", tmp_path / "tb"
    gpt_launcher.run({**SMALL, "run_dir": str(run_dir), "tensorboard_dir": str(copy)}, world_size=2)
    losses = []
    for folder in (run_dir / "tensorboard", copy):
        events = EventAccumulator(str(folder))
        events.Reload()
        losses.append([(e.step, e.value) for e in events.Scalars("train/lm_loss")])
    assert len(losses[0]) == SMALL["train_iters"] and losses[0] == losses[1]
