"""Pipeline parallel (torch.distributed.pipelining) on real gloo ranks: every layout trains as one
process does, a run resumes under another pipeline size, and its export is the one-process export."""
from __future__ import annotations

import pytest
import torch

from gpt.checkpoint import saved_layout
from gpt.config import Config, ConfigError
from gpt.export import find_checkpoint, load_checkpoint
from gpt.parallel.pipeline import bubble_fraction, stage_layers, stages_of_rank
from tests.fixtures_gpt import SMALL, curve, read_metrics, trained_alone

# 8 layers, 4 micro-batches of 2 per step on one data-parallel rank (2 on each of two).
RUN = {**SMALL, "num_layers": 8}
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return trained_alone(tmp_path_factory, RUN)


@pytest.mark.parametrize("world, layout", [
    (2, {"pipeline_parallel": 2}),
    (4, {"pipeline_parallel": 2, "data_parallel_mode": "ddp"}),
    (4, {"pipeline_parallel": 2, "tensor_parallel": 2, "data_parallel_mode": "fsdp", "activation_checkpointing": True}),
    (8, {"pipeline_parallel": 2, "tensor_parallel": 2, "data_parallel_mode": "ddp"}),
    (4, {"pipeline_parallel": 4, "pipeline_schedule": "gpipe"}),
    (2, {"pipeline_parallel": 2, "virtual_pipeline_stages": 2, "pipeline_schedule": "interleaved-1f1b"}),
    (2, {"pipeline_parallel": 2, "virtual_pipeline_stages": 2, "pipeline_schedule": "interleaved-zb"}),
], ids=["pp2", "pp2-dp2", "pp2-tp2-fsdp", "pp2-tp2-dp2", "pp4-gpipe", "pp2x2-interleaved", "pp2x2-zero-bubble"])
def test_pipeline_layouts_train_as_one_process(world, layout, one_process, gpt_launcher, tmp_path):
    run_dir = tmp_path / "run"
    gpt_launcher.run({**RUN, **layout, "run_dir": str(run_dir)}, world_size=world)
    assert len(curve(run_dir)) == RUN["train_iters"]
    for kind, key in (("train", "lm_loss"), ("train", "grad_norm"), ("valid", "valid_loss")):
        assert curve(run_dir, kind, key) == pytest.approx(curve(one_process, kind, key), rel=1e-4), key


@pytest.mark.timeout(400)
def test_a_run_resumes_under_other_pipeline_sizes_and_exports_as_one_process(gpt_launcher, tmp_path):
    iters = 12
    run = {**RUN, "train_iters": iters, "lr_decay_iters": iters, "save_interval": 4}
    reference = tmp_path / "reference"
    gpt_launcher.run({**run, "run_dir": str(reference)})
    legs = [(2, {"pipeline_parallel": 2}), (1, {}), (4, {"pipeline_parallel": 4})]
    run_dir = tmp_path / "run"
    for leg, (world, change) in enumerate(legs, start=1):
        out = gpt_launcher.run({**run, **change, "train_iters": 4 * leg, "run_dir": str(run_dir)}, world_size=world)
        if leg > 1:
            assert f"at iteration {4 * (leg - 1)}" in out, out[-2000:]
        assert saved_layout(run_dir / "checkpoints" / f"iter_{4 * leg:07d}")["pipeline_parallel"] == \
            change.get("pipeline_parallel", 1)
    assert curve(run_dir) == pytest.approx(curve(reference), rel=1e-4)
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, iters + 1))
    ours, theirs = (load_checkpoint(*find_checkpoint(d)).state_dict() for d in (run_dir, reference))
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)
    assert torch.equal(ours["wte.weight"], ours["lm_head.weight"])


def test_layers_split_evenly_and_interleaved_stages_loop_over_the_ranks():
    assert [list(r) for r in stage_layers(8, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert stages_of_rank(1, 2, 2) == [1, 3] and stages_of_rank(0, 4, 1) == [0]
    assert bubble_fraction("1f1b", 4, 1, 12) == pytest.approx(3 / 15)
    assert bubble_fraction("interleaved-1f1b", 4, 2, 12) == pytest.approx(3 / 27)
    assert bubble_fraction("1f1b", 1, 1, 12) == 0.0


@pytest.mark.parametrize("change, world, message", [
    ({"pipeline_parallel": 3}, 6, r"num_layers=8 does not split evenly into pipeline_parallel=3"),
    ({"pipeline_parallel": 2, "micro_batch_size": 4, "global_batch_size": 8}, 4,
     r"global_batch_size=8 gives 1 micro-batch\(es\) per step .* cannot fill pipeline_parallel=2 stages"),
    ({"pipeline_parallel": 2}, 3, r"world size 3 is not divisible by tensor_parallel=1 x pipeline_parallel=2"),
    ({"pipeline_parallel": 2, "virtual_pipeline_stages": 2}, 2, r"virtual_pipeline_stages=2 needs an interleaved schedule"),
    ({"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b"}, 2, r"set virtual_pipeline_stages to 2 or more"),
    ({"pipeline_parallel": 2, "device": "neuron"}, 2, r"pipeline_parallel > 1 is not available on device='neuron'"),
    ({"pipeline_schedule": "zb"}, 1, r"pipeline_schedule='zb': choose one of 1f1b, gpipe"),
])
def test_a_layout_that_cannot_run_is_refused_naming_the_field(change, world, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({**RUN, **change}).validate(world)
