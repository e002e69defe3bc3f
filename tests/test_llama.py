"""The Llama block (rotary positions, RMSNorm, SwiGLU, grouped-query attention, an output layer of
its own) against transformers' LlamaForCausalLM: the same logits from the same weights, in and out
of a HuggingFace folder; its memory estimate and FLOPs against the model itself."""
from __future__ import annotations

import json

import pytest
import torch

from gpt.config import Config, ConfigError
from gpt.export import config_from_hf, hf_config, load_hf, to_hf_state_dict
from gpt.model import GPT, KVCache, fuse_qkv, split_qkv
from tests.fixtures_gpt import SMALL, curve, trained_alone

transformers = pytest.importorskip("transformers")


def random_llama(vocab: int, hidden: int, layers: int, heads: int, groups: int, ffn: int, tied: bool = False,
                 theta: float = 10000.0):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=groups,
                                      max_position_embeddings=64, rope_theta=theta, rms_norm_eps=1e-5,
                                      tie_word_embeddings=tied, attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():       # norms off their default ones, so that they are exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("vocab, hidden, layers, heads, groups, ffn, tied", [
    (300, 64, 2, 4, 2, 176, False),      # grouped K/V, vocabulary padded, untied
    (256, 64, 2, 8, 1, 96, False),       # one K/V head (multi-query)
    (1000, 96, 2, 6, 6, 256, True),      # one group per head, tied as Llama 3.2 1B
])
def test_logits_and_loss_match_transformers_llama(vocab, hidden, layers, heads, groups, ffn, tied, tmp_path):
    """A random-weight LlamaForCausalLM saved as HuggingFace saves it and loaded as ``init_from_hf``
    loads it: the same logits and loss (fp32, 1e-4); exported again, the same tensors."""
    hf = random_llama(vocab, hidden, layers, heads, groups, ffn, tied, theta=500000.0)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ours = load_hf(tmp_path / "hf").eval()
    assert ours.config.num_query_groups == groups and ours.config.untie_embeddings_and_output_weights is not tied
    assert (ours.lm_head.weight is ours.wte.weight) is tied and ours.wpe is None
    idx = torch.randint(0, vocab, (2, 64))
    with torch.no_grad():
        expected = hf(idx, labels=idx)
        got = ours(idx)
        loss = ours(idx[:, :-1], targets=idx[:, 1:])
    assert got.shape == expected.logits.shape
    torch.testing.assert_close(got, expected.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(loss, expected.loss, atol=1e-4, rtol=0)
    again = to_hf_state_dict(ours)
    theirs = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(again) == sorted(theirs)
    assert all(torch.equal(again[k], theirs[k]) for k in theirs)


def test_an_export_loads_in_transformers_with_the_same_logits_and_greedy_text(tmp_path):
    """Our tiny-llama, initialised as training initialises it, written as a HuggingFace folder:
    LlamaForCausalLM loads it with nothing of ours and gives the same logits and the same greedy
    continuation as our model with its KV cache."""
    from safetensors.torch import save_file

    config = Config(model="tiny-llama", vocab_size=500, mock_data=True, device="cpu", precision="fp32")
    ours = GPT(config).eval()
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(to_hf_state_dict(ours), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(config, eod_id=0)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    idx = torch.randint(0, 500, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=0)
        prompt = idx[:1, :8]
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        cache = [KVCache() for _ in ours.h]
        step, seq = ours(prompt, cache=cache)[:, -1], prompt
        for _ in range(12):
            nxt = step.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            step = ours(nxt, cache=cache)[:, -1]
    assert seq.tolist() == theirs.tolist()


def test_fused_qkv_goes_group_by_group_and_back():
    """The fused projection holds each K/V group's query heads, then its key, then its value, so a
    tensor-parallel rank's contiguous rows are whole groups."""
    heads, groups, hd = 8, 2, 3
    q, k, v = torch.randn(heads * hd, 5), torch.randn(groups * hd, 5), torch.randn(groups * hd, 5)
    fused = fuse_qkv(q, k, v, groups)
    assert [torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, groups), (q, k, v))] == [True] * 3
    first_rank = fused[: fused.shape[0] // 2]        # tensor parallel 2: the first group whole
    assert torch.equal(first_rank, torch.cat([q[: 4 * hd], k[:hd], v[:hd]]))


def test_the_defaults_are_gpt3s_block_and_llama_presets_have_the_published_sizes():
    gpt3 = Config(model="gpt3-125m", mock_data=True)
    assert (gpt3.position_embedding_type, gpt3.normalization, gpt3.swiglu, gpt3.num_query_groups,
            gpt3.ffn_hidden_size, gpt3.untie_embeddings_and_output_weights, gpt3.add_bias_linear) == \
        ("learned_absolute", "LayerNorm", False, 12, 3072, False, True)
    from gpt.model import param_count
    sizes = {m: param_count(Config(model=m, vocab_size=128256, mock_data=True))
             for m in ("llama3.2-1b", "llama3-8b", "llama3-70b", "llama3-405b")}
    # Meta's published counts: 1.24B, 8.03B, 70.6B, 405B (the vocabulary padded to 128 adds nothing: 128256 = 1002 x 128)
    assert [round(n / 1e9, 2) for n in sizes.values()] == [1.24, 8.03, 70.55, 405.85]


def test_a_tensor_parallel_size_that_splits_a_key_value_group_is_refused_naming_it():
    with pytest.raises(ConfigError, match="num_query_groups=8 is not divisible by tensor_parallel=16") as e:
        Config(model="llama3-70b", mock_data=True, tensor_parallel=16).validate(16)
    assert e.value.field == "num_query_groups"


def test_a_llama_folder_with_rope_scaling_is_refused_by_name():
    hf = random_llama(300, 64, 1, 4, 2, 96).config.to_dict()
    hf["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    with pytest.raises(ValueError, match="rope scaling"):
        config_from_hf(hf)


def test_memory_estimate_and_flops_follow_the_block():
    """The estimate's weights are the model's own count; SwiGLU's third matrix and the smaller K/V
    are in it, and an untied embedding (a lookup) does not count as FLOPs."""
    from gpt.memory import rank_memory
    from gpt.metrics import flops_per_token
    from gpt.model import param_count

    config = Config(model="llama3-8b", vocab_size=128256, mock_data=True, precision="bf16")
    assert rank_memory(config, 1).parameters == param_count(config)
    n = param_count(config)
    lookup = 128256 * 4096
    assert flops_per_token(config, n) == 6 * (n - lookup) + 12 * 32 * 4096 * 8192


# The Llama block at the size of the parallel tests: 4 query heads in 2 K/V groups, untied output.
LLAMA = {**SMALL, "model": "tiny-llama", "num_layers": 4, "num_query_groups": 2, "ffn_hidden_size": 64}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return trained_alone(tmp_path_factory, LLAMA)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, layout", [
    (2, {"tensor_parallel": 2}),
    (2, {"data_parallel_mode": "fsdp", "activation_checkpointing": True}),
    (2, {"pipeline_parallel": 2, "data_parallel_mode": "ddp"}),
    (4, {"pipeline_parallel": 2, "tensor_parallel": 2, "data_parallel_mode": "fsdp"}),
], ids=["tp2", "fsdp2", "pp2", "pp2-tp2"])
def test_layouts_train_as_one_process(world, layout, one_process, gpt_launcher, tmp_path):
    """Query heads and K/V groups split over tensor-parallel ranks, the untied output layer over the
    vocabulary, stages of a pipeline, sharded data parallel: the losses, gradient norms and
    validation losses of one process."""
    run_dir = tmp_path / "run"
    gpt_launcher.run({**LLAMA, **layout, "run_dir": str(run_dir)}, world_size=world)
    assert len(curve(run_dir)) == LLAMA["train_iters"]
    for kind, key in (("train", "lm_loss"), ("train", "grad_norm"), ("valid", "valid_loss")):
        assert curve(run_dir, kind, key) == pytest.approx(curve(one_process, kind, key), rel=1e-4), key


@pytest.mark.timeout(300)
def test_the_explicit_tensor_parallel_of_xla_devices_trains_as_one_process(one_process, gpt_launcher, tmp_path):
    """gpt.parallel.xla's layers (the neuron path) with the gate, no biases and an output layer of its own."""
    from tests.test_tensor_parallel import EXPLICIT

    run_dir = tmp_path / "run"
    gpt_launcher.run({**LLAMA, "device": "neuron", "tensor_parallel": 2, "run_dir": str(run_dir)}, 2, prelude=EXPLICIT)
    for kind, key in (("train", "lm_loss"), ("train", "grad_norm"), ("valid", "valid_loss")):
        assert curve(run_dir, kind, key) == pytest.approx(curve(one_process, kind, key), rel=1e-5), key


@pytest.mark.timeout(300)
def test_a_run_resumes_under_other_layouts_and_exports_as_one_process(one_process, gpt_launcher, tmp_path):
    """Saved under a pipeline of 2, resumed under tensor parallel 2: the uninterrupted losses, and
    the same weights as one process's (the output layer apart from the embedding)."""
    from gpt.export import find_checkpoint, load_checkpoint

    run_dir = tmp_path / "run"
    for leg, (world, change) in enumerate([(2, {"pipeline_parallel": 2}), (2, {"tensor_parallel": 2})], start=1):
        out = gpt_launcher.run({**LLAMA, **change, "train_iters": 4 * leg, "lr_decay_iters": 8,
                                "run_dir": str(run_dir)}, world_size=world)
        if leg > 1:
            assert "at iteration 4" in out, out[-2000:]
    assert curve(run_dir) == pytest.approx(curve(one_process), rel=1e-4)
    ours, theirs = (load_checkpoint(*find_checkpoint(d)).state_dict() for d in (run_dir, one_process))
    assert ours.keys() == theirs.keys() and not torch.equal(ours["wte.weight"], ours["lm_head.weight"])
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)


def test_every_published_layout_runs_its_preset():
    """Each preset's default GPU layout (TP x PP) passes the plan's checks on 8 data-parallel replicas:
    the heads, the K/V groups and the layers split as the layout asks."""
    from gpt.config.presets import GPU_LAYOUTS

    for model, (tp, pp) in GPU_LAYOUTS.items():
        config = Config(model=model, mock_data=True, tensor_parallel=tp, pipeline_parallel=pp)
        assert config.problems(tp * pp * 8) == [], model
