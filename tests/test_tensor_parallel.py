"""Tensor parallelism with explicit collectives (gpt/parallel/xla.py), the one XLA devices train
with: here on real gloo ranks running gpt.train, with the layers, the gradient norm and the
checkpoints of the XLA path and torch.distributed's collectives in place of XLA's (XLA:CPU has none;
tests/test_xla.py runs the same layers inside one XLA graph)."""
import json
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from gpt.export import find_checkpoint, load_checkpoint, to_hf_state_dict
from gpt.parallel import xla
from tests.fixtures_gpt import SMALL, read_metrics

# Every rank joins the process group as usual, then trains with gpt.parallel.xla's groups and
# no DeviceMesh, as on an XLA device; device 'neuron' (its configuration checks) computes on the CPU.
EXPLICIT = """
import gpt.parallel.process_group as _dist, gpt.parallel.dims as _dims, gpt.train as _train
from gpt.parallel import xla as _tp
from gpt.backend import DEVICES as _DEVICES, Backend as _Backend
_init = _dist.init_distributed
def _explicit(backend, tp_size, timeout_s, pp_size=1, data_parallel_mode="ddp", cp_size=1):
    env = _init(backend, 1, timeout_s)
    return _dims.ParallelDims(env.rank, env.world_size, env.local_rank, None,
                              _tp.new_group(env.rank, env.world_size, tp_size, lazy=False))
_train.init_distributed = _explicit
_train.get_backend = lambda device: _Backend(device, _DEVICES["cpu"])
"""
NEURON = {**SMALL, "device": "neuron"}
pytestmark = pytest.mark.timeout(300)


def curve(run) -> list[tuple[float, float]]:
    return [(r["lm_loss"], r["grad_norm"]) for r in read_metrics(run)]


@pytest.fixture(scope="module")
def one_process(one_rank_run):
    return one_rank_run[0]


@pytest.mark.parametrize("world", [2, 4], ids=["tp2", "tp2-dp2"])
def test_ranks_train_as_one_process(world, one_process, gpt_launcher, tmp_path):
    """Tensor parallel 2, alone and with 2 data-parallel replicas (the ranks holding the same parts
    average their gradients, each replica takes its half of the batch)."""
    run = tmp_path / "tp2"
    out = gpt_launcher.run({**NEURON, "run_dir": str(run), "tensor_parallel": 2}, world, prelude=EXPLICIT)
    assert json.loads(out.strip().splitlines()[-1])["status"] == "completed"
    ours, theirs = curve(run), curve(one_process)
    assert len(ours) == 8 and ours[-1][0] < ours[0][0]
    for (loss, norm), (loss_1, norm_1) in zip(ours, theirs):
        assert loss == pytest.approx(loss_1, rel=1e-5) and norm == pytest.approx(norm_1, rel=1e-5)
    valid = [r["valid_loss"] for r in read_metrics(run, "valid")]
    assert len(valid) == 2 and valid == pytest.approx([r["valid_loss"] for r in read_metrics(one_process, "valid")], rel=1e-5)


def test_checkpoint_keeps_each_part_and_resumes(one_process, gpt_launcher, tmp_path):
    run = tmp_path / "tp2"
    config = {**NEURON, "run_dir": str(run), "tensor_parallel": 2}
    gpt_launcher.run(config, 2, prelude=EXPLICIT)
    whole = curve(run)
    saved = FileSystemReader(str(run / "checkpoints" / "iter_0000004")).read_metadata().state_dict_metadata
    qkv = {key for key in saved if key.startswith("model.h.0.attn.qkv.weight")}
    assert qkv == {"model.h.0.attn.qkv.weight.tp0of2", "model.h.0.attn.qkv.weight.tp1of2"}
    assert saved["model.h.0.attn.qkv.weight.tp1of2"].size == (3 * 32 // 2, 32)
    assert "model.lm_head.weight.tp1of2" in saved and "model.lm_head.weight" not in saved  # tied: a part too
    assert "model.h.0.ln_1.weight" in saved and "model.wpe.weight" in saved  # replicated: saved once, whole
    assert any(key.endswith("h.0.mlp.c_proj.weight.tp1of2.exp_avg") for key in saved)

    shutil.rmtree(run / "checkpoints" / "iter_0000008")
    out = gpt_launcher.run(config, 2, prelude=EXPLICIT)
    assert "resumed from" in out and "iter_0000004" in out
    assert curve(run)[4:] == pytest.approx(whole[4:], rel=1e-6)

    # The parts join into the whole model (what gpt.export writes): that of one process.
    joined, single = (load_checkpoint(*find_checkpoint(r)).state_dict() for r in (run, one_process))
    assert joined.keys() == single.keys()
    for key in joined:
        torch.testing.assert_close(joined[key], single[key], rtol=1e-4, atol=1e-5, msg=key)


def test_another_tensor_parallel_size_is_refused_before_loading(gpt_launcher, tmp_path):
    run = tmp_path / "tp2"
    # 300 tokens: padded to 512 rows for tensor parallel 2 (a multiple of 128 x 2), to 384 without.
    config = {**SMALL, "run_dir": str(run), "vocab_size": 300, "train_iters": 4}
    gpt_launcher.run({**config, "device": "neuron", "tensor_parallel": 2}, 2, prelude=EXPLICIT)
    out = gpt_launcher.run(config, 1, expect_rc=2)
    assert "iter_0000004 cannot resume this run" in out and "tp0of2" in out, out[-2000:]
    # The export reads it whole, with the rows it was padded to, and writes the real vocabulary.
    model = load_checkpoint(*find_checkpoint(run))
    assert model.wte.weight.shape[0] == 512 and to_hf_state_dict(model)["transformer.wte.weight"].shape[0] == 300


def test_groups_are_consecutive_ranks_and_replicas_the_columns():
    group = xla.new_group(rank=5, world_size=8, size=4, lazy=True)
    assert (group.index, group.size) == (1, 4)
    assert group.replicas == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group.data_parallel == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # gpt.train.micro_batches gives data-parallel rank rank // tensor_parallel the same batch.
    assert all(len({r // 4 for r in replicas}) == 1 for replicas in group.replicas)


def test_training_starts_from_huggingface_weights_cut_into_parts(gpt_launcher, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32,
                                                              n_layer=2, n_head=4))
    hf.save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    out = gpt_launcher.run({**NEURON, "run_dir": str(run), "tensor_parallel": 2, "init_from_hf": str(tmp_path / "hf"),
                            "train_iters": 1, "lr": 1e-12, "min_lr": 0.0, "lr_warmup_iters": 0, "save_interval": 1},
                           2, prelude=EXPLICIT)
    assert "started from the HuggingFace weights" in out
    from gpt.export import load_hf

    trained, theirs = load_checkpoint(*find_checkpoint(run)), load_hf(tmp_path / "hf")
    for name in ("wte.weight", "h.1.attn.qkv.weight", "h.1.attn.c_proj.weight", "h.0.mlp.c_fc.bias"):
        torch.testing.assert_close(trained.get_parameter(name), theirs.get_parameter(name), atol=1e-6, rtol=0,
                                   msg=name)
