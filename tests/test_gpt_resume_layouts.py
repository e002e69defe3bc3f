"""A run outlives its layout: each leg resumes the last one's checkpoint under another data- or
tensor-parallel layout, micro-batch or log interval, and the loss at every iteration is the
uninterrupted run's; a new run starts from another run's weights, with or without its optimizer."""
from __future__ import annotations

import json

import pytest
import torch

from gpt.checkpoint import saved_layout
from tests.fixtures_gpt import SMALL, read_metrics
from tests.uninterrupted import checkpoint_tensors

ITERS = 16
# The schedule is fixed at the full length, so each leg (train_iters 4, 8, ...) extends the one before.
RUN = {**SMALL, "train_iters": ITERS, "lr_decay_iters": ITERS, "eval_interval": 4, "save_interval": 4}
LEGS = [  # (world size, what changes)
    (2, {"data_parallel_mode": "ddp"}),
    (2, {"data_parallel_mode": "fsdp", "activation_checkpointing": True}),
    (2, {"tensor_parallel": 2}),
    (1, {"micro_batch_size": 4, "log_interval": 3}),
]


def _losses(run_dir) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir)}


@pytest.mark.timeout(300)
def test_each_leg_resumes_under_another_layout_with_the_uninterrupted_losses(gpt_launcher, tmp_path):
    reference = tmp_path / "reference"
    gpt_launcher.run({**RUN, "run_dir": str(reference)})
    run = tmp_path / "run"
    for leg, (world_size, change) in enumerate(LEGS, start=1):
        out = gpt_launcher.run({**RUN, **change, "train_iters": 4 * leg, "run_dir": str(run)}, world_size=world_size)
        if leg > 1:
            assert f"at iteration {4 * (leg - 1)}" in out, out[-2000:]
        newest = run / "checkpoints" / f"iter_{4 * leg:07d}"
        assert saved_layout(newest) == {"world_size": world_size, "nodes": 1, "device": "cpu", "parts": False,
                                        "tensor_parallel": change.get("tensor_parallel", 1),
                                        "pipeline_parallel": 1, "context_parallel": 1,
                                        "data_parallel_mode": change.get("data_parallel_mode", "ddp")}
    want, got = _losses(reference), _losses(run)
    assert sorted(got) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert got[it] == pytest.approx(want[it], rel=1e-4), f"iteration {it}: {got[it]} vs {want[it]}"
    assert [r["consumed_samples"] for r in read_metrics(run)] == [8 * i for i in range(1, ITERS + 1)]


@pytest.mark.timeout(300)
def test_a_new_run_starts_from_another_runs_weights_with_or_without_its_optimizer(gpt_launcher, tmp_path):
    source = tmp_path / "source"
    gpt_launcher.run({**SMALL, "run_dir": str(source)})
    checkpoint = source / "checkpoints" / f"iter_{SMALL['train_iters']:07d}"
    fresh = tmp_path / "fresh"
    gpt_launcher.run({**SMALL, "train_iters": 2, "run_dir": str(fresh)})
    steps = {}
    for with_optimizer in (False, True):
        run = tmp_path / f"from-source-{with_optimizer}"
        out = gpt_launcher.run({**SMALL, "train_iters": 2, "lr": 1e-9, "min_lr": 0, "init_from": str(checkpoint),
                                "init_from_optimizer": with_optimizer, "run_dir": str(run)})
        assert f"of {checkpoint}" in out and "resumed from" not in out
        first = read_metrics(run)[0]
        assert (first["iteration"], first["consumed_samples"]) == (1, 8)   # a new run: its own schedule and data order
        # The first batch is the source run's first batch: the source's weights do far better on it.
        assert first["lm_loss"] < read_metrics(fresh)[0]["lm_loss"] - 0.05
        tensors = checkpoint_tensors(run)
        source_tensors = checkpoint_tensors(source)
        for name, value in source_tensors.items():
            if name.startswith("model."):   # two steps at lr 1e-9 leave the weights as they were
                torch.testing.assert_close(tensors[name], value, rtol=0, atol=1e-6)
        steps[with_optimizer] = {float(v) for k, v in tensors.items() if k.endswith(".step")}
    assert steps == {False: {2.0}, True: {float(SMALL["train_iters"] + 2)}}


def test_a_run_saved_in_trainium_parts_is_refused_under_another_tensor_parallel_size(tmp_path):
    """The plan's check (flows.plan.outlook.cannot_load) from the checkpoint alone: its marker, or for an
    older checkpoint its tensor names."""
    import torch.distributed.checkpoint as dcp

    from flows.plan.outlook import cannot_load, parts_of
    from gpt.config import Config

    path = tmp_path / "iter_0000010"
    dcp.save({"model": {"h.0.attn.qkv.weight.tp1of4": torch.zeros(2)}}, checkpoint_id=path, no_dist=True)
    (path / "COMPLETE").write_text(json.dumps({"iteration": 10}))
    assert parts_of(path) == 4
    config = Config(mock_data=True, device="neuron", tensor_parallel=4)
    assert cannot_load(path, config) is None
    problem = cannot_load(path, Config(mock_data=True, device="neuron", tensor_parallel=2))
    assert "parts of TP 4" in problem and "--tp 4" in problem and "gpt.export" in problem
    assert "parts of TP 4" in cannot_load(path, Config(mock_data=True, device="cpu", tensor_parallel=4))
