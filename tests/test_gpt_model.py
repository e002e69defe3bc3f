"""Model parity with HuggingFace GPT-2, initialisation and deterministic data order."""
import numpy as np
import pytest
import torch

from gpt.config import Config
from gpt.data import MockGPTDataset
from gpt.export import ours_from_hf
from gpt.model import GPT
from gpt.parallel.dims import ParallelDims
from gpt.train import micro_batches


@pytest.mark.parametrize("vocab, hidden, layers, heads", [(300, 64, 3, 4), (256, 32, 2, 2), (1000, 96, 2, 6)])
def test_logits_and_loss_match_huggingface_gpt2(vocab, hidden, layers, heads):
    """Random-weight GPT-2s of several shapes, vocabularies that need padding (300, 1000) and one
    that does not (256): the same logits and the same loss, over the real vocabulary only."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=hidden, n_layer=layers, n_head=heads,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():  # move LayerNorms and biases off their 1/0 defaults so they are exercised
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    config = Config(vocab_size=vocab, seq_length=64, num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
    ours = GPT(config).eval()
    ours.load_state_dict(ours_from_hf(hf.state_dict(), config))
    assert ours.lm_head.weight is ours.wte.weight
    idx = torch.randint(0, vocab, (2, 64))
    with torch.no_grad():
        expected = hf(idx, labels=idx)
        got = ours(idx)
        loss = ours(idx[:, :-1], targets=idx[:, 1:])
    assert got.shape == expected.logits.shape                # no padding columns
    torch.testing.assert_close(got, expected.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(loss, expected.loss, atol=1e-4, rtol=0)


def test_generation_with_the_kv_cache_equals_recomputing_the_prefix():
    from gpt.model import KVCache

    config = Config(vocab_size=300, seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4)
    model = GPT(config).eval()
    prompt = torch.randint(0, 300, (1, 5))
    cache = [KVCache() for _ in model.h]
    with torch.no_grad():
        step = model(prompt, cache=cache)[:, -1]
        seq = prompt
        for _ in range(6):
            full = model(seq)[:, -1]
            torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
            nxt = full.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            step = model(nxt, cache=cache)[:, -1]
    assert cache[0].length == seq.shape[1]


def test_gpt2_initialisation():
    config = Config(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=1000)
    model = GPT(config)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.h["0"].attn.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2 x 8)
    assert model.h["0"].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(model.h["0"].ln_1.weight == 1) and torch.all(model.h["0"].attn.qkv.bias == 0)
    again = GPT(config)  # same seed, same weights; another seed, other weights
    assert torch.equal(again.h["3"].mlp.c_fc.weight, model.h["3"].mlp.c_fc.weight)
    other = GPT(Config(**{**config.to_dict(), "seed": 7}))
    assert not torch.equal(other.h["3"].mlp.c_fc.weight, model.h["3"].mlp.c_fc.weight)


def test_data_order_is_the_same_for_any_rank_count():
    config = Config(mock_data=True, seq_length=8, vocab_size=50, micro_batch_size=2, global_batch_size=8)
    data = MockGPTDataset(64, 8, 50, seed=3)
    single = micro_batches(data, 16, 8, config, ParallelDims(0, 1, 0, None), torch.device("cpu"))
    one = torch.cat([x for x, _, _ in single])
    assert torch.equal(one, torch.from_numpy(np.stack([data[i][:-1] for i in range(16, 24)])))
    ranks = [micro_batches(data, 16, 8, config, ParallelDims(r, 2, r, None), torch.device("cpu")) for r in range(2)]
    # Micro-step m: rank 0 then rank 1, each a contiguous slice.
    two = torch.cat([torch.cat([ranks[0][m][0], ranks[1][m][0]]) for m in range(2)])
    assert torch.equal(one, two)
    targets = torch.cat([y for _, y, _ in single])
    assert torch.equal(targets[:, :-1], one[:, 1:])
    # Same seed, same tokens; another seed, other tokens.
    assert np.array_equal(MockGPTDataset(64, 8, 50, seed=3)[5], data[5])
    assert not np.array_equal(MockGPTDataset(64, 8, 50, seed=4)[5], data[5])


def test_non_finite_step_is_skipped_and_fp16_scale_backs_off():
    from gpt.backend import get_backend
    from gpt.optim import LossScaler, build_optimizer
    from gpt.train import train_step
    config = Config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, mock_data=True)
    backend = get_backend("cpu")
    model = GPT(config)
    optimizer = build_optimizer(model, config, backend)
    tokens = torch.randint(0, 64, (2, 9))
    batches = [(tokens[:, :-1], tokens[:, 1:], None)]
    scaler = LossScaler(enabled=True)
    loss, norm, stepped = train_step(model, optimizer, batches, backend=backend, precision="fp16", clip_grad=1.0, scaler=scaler)
    assert stepped and torch.isfinite(loss) and scaler.scale == 2.0 ** 16
    with torch.no_grad():
        model.wpe.weight[0, 0] = float("nan")
    before = model.h["0"].mlp.c_fc.weight.clone()
    loss, norm, stepped = train_step(model, optimizer, batches, backend=backend, precision="fp16", clip_grad=1.0, scaler=scaler)
    assert not stepped and scaler.scale == 2.0 ** 15
    assert torch.equal(model.h["0"].mlp.c_fc.weight, before)  # the optimizer did not run
    assert all(p.grad is None for p in model.parameters())
