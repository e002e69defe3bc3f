"""The chunked output layer + cross-entropy: the plain path's loss and gradients without its logits;
whole-model compile and selective activation checkpointing compute the same model."""
import pytest
import torch
import torch.nn.functional as F

from gpt.config import Config
from gpt.model import GPT, linear_cross_entropy, plain_name
from gpt.parallel.build import build_model
from gpt.parallel.dims import ParallelDims


def _plain(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy((x @ weight.t())[:, :vocab].float(), targets)


def _inputs(tokens: int, hidden: int, padded: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    weight = (0.2 * torch.randn(padded, hidden, generator=g)).requires_grad_()
    return x, weight, torch.randint(0, vocab, (tokens,), generator=g)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tokens, hidden, vocab, padded, chunk", [
    (64, 32, 300, 384, 16),        # padded vocabulary, even chunks
    (50, 48, 1000, 1024, 7),       # padded, a short last chunk
    (33, 16, 256, 256, None),      # no padding, one chunk (the default size)
    (128, 64, 50257, 50304, 40),   # GPT-2's vocabulary
])
def test_loss_and_gradients_equal_the_plain_path(tokens, hidden, vocab, padded, chunk):
    x, weight, targets = _inputs(tokens, hidden, padded, vocab)
    expected = _plain(x, weight, targets, vocab)
    gx, gw = torch.autograd.grad(expected, (x, weight))
    loss = linear_cross_entropy(x, weight, targets, vocab, chunk)
    got_gx, got_gw = torch.autograd.grad(loss * 1.0, (x, weight))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_gx, gx, atol=1e-5, rtol=0)
    torch.testing.assert_close(got_gw, gw, atol=1e-5, rtol=0)
    assert torch.count_nonzero(got_gw[vocab:]) == 0        # padding rows take no part
    with torch.no_grad():                                  # evaluation: the loss alone
        torch.testing.assert_close(linear_cross_entropy(x, weight, targets, vocab, chunk), expected, atol=1e-5, rtol=0)


@pytest.mark.timeout(60)
def test_scaled_loss_scales_the_gradients_and_bf16_autocast_matches():
    x, weight, targets = _inputs(96, 32, 384, 300, seed=1)
    (g_plain,) = torch.autograd.grad(_plain(x, weight, targets, 300) / 4, (weight,))
    (g_chunked,) = torch.autograd.grad(linear_cross_entropy(x, weight, targets, 300, 32) / 4, (weight,))
    torch.testing.assert_close(g_chunked, g_plain, atol=1e-6, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _plain(x, weight, targets, 300)
        loss = linear_cross_entropy(x, weight, targets, 300, 32)
    assert loss.dtype == torch.float32
    gx, gw = torch.autograd.grad(expected, (x, weight))
    got_gx, got_gw = torch.autograd.grad(loss, (x, weight))
    assert got_gx.dtype == x.dtype and got_gw.dtype == weight.dtype
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=0)
    torch.testing.assert_close(got_gx, gx, atol=1e-3, rtol=2e-2)
    torch.testing.assert_close(got_gw, gw, atol=1e-3, rtol=2e-2)


@pytest.mark.timeout(60)
def test_fp16_gradients_survive_many_tokens():
    """Under fp16 autocast with a loss scale, as fp16 training runs: probabilities divided by 8,192
    tokens would flush to zero in fp16; the gradients must still match the plain path's."""
    x, weight, targets = _inputs(8192, 32, 4096, 4000, seed=2)
    scale = 2.0 ** 16
    grads = []
    for loss_fn in (_plain, lambda *a: linear_cross_entropy(*a, chunk_tokens=1024)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(x, weight, targets, 4000)
        grads.append([g / scale for g in torch.autograd.grad(loss * scale, (x, weight))])
    (gx, gw), (got_gx, got_gw) = grads
    torch.testing.assert_close(got_gx, gx, atol=1e-6, rtol=2e-2)
    torch.testing.assert_close(got_gw, gw, atol=1e-6, rtol=2e-2)


@pytest.mark.timeout(60)
def test_backward_keeps_no_logits():
    """What autograd keeps for the backward pass: the plain path keeps (tokens, vocab) logits, the
    chunked one only gradients of the size of its inputs."""
    tokens, hidden, vocab, padded = 512, 32, 4000, 4096
    x, weight, targets = _inputs(tokens, hidden, padded, vocab)

    def saved_bytes(loss_fn) -> int:
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(x, weight, targets, vocab).backward()
        return sum(saved)

    logits = tokens * vocab * 4
    assert saved_bytes(_plain) >= logits
    chunked = saved_bytes(lambda *a: linear_cross_entropy(*a, chunk_tokens=64))
    assert chunked <= (tokens + padded) * hidden * 4 < logits / 10


def _model_loss_and_grads(config: Config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_model(config, ParallelDims(0, 1, 0, None), torch.device("cpu"))
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=torch.Generator().manual_seed(5))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {plain_name(n): p.grad for n, p in model.named_parameters()}


_SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=300, mock_data=True,
              device="cpu", precision="fp32")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", [
    {"compile": True, "compile_scope": "model"},
    {"activation_checkpointing": True, "activation_checkpointing_scope": "attention"},
    {"activation_checkpointing": True, "activation_checkpointing_scope": "mlp"},
], ids=["whole-model-compile", "checkpoint-attention", "checkpoint-mlp"])
def test_model_variants_compute_the_eager_model(variant):
    loss, grads = _model_loss_and_grads(Config(**_SMALL))
    got_loss, got_grads = _model_loss_and_grads(Config(**_SMALL, **variant))
    assert got_grads.keys() == grads.keys()
    torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=0)
    for name, g in grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_config_refuses_unknown_scopes():
    from gpt.config import ConfigError
    with pytest.raises(ConfigError, match="compile_scope='layers': choose one of auto, blocks, model"):
        Config(**_SMALL, compile_scope="layers").validate()
    with pytest.raises(ConfigError, match="activation_checkpointing_scope='ffn': choose one of block, attention, mlp"):
        Config(**_SMALL, activation_checkpointing_scope="ffn").validate()


def test_fused_qkv_splits_into_whole_heads():
    """A plain split of the fused projection's rows into blocks, as column-parallel sharding does,
    gives each block the q, k and v of its own heads."""
    from gpt.model import fuse_qkv, split_qkv
    heads, hidden = 4, 32
    q, k, v = (torch.randn(hidden, hidden) for _ in range(3))
    fused = fuse_qkv(q, k, v, heads)
    assert [torch.equal(a, b) for a, b in zip(split_qkv(fused, heads), (q, k, v))] == [True] * 3
    for rank, block in enumerate(fused.chunk(2)):          # tensor parallel 2: heads 0-1, then 2-3
        rows = slice(rank * hidden // 2, (rank + 1) * hidden // 2)
        assert [torch.equal(a, b[rows]) for a, b in zip(split_qkv(block, heads // 2), (q, k, v))] == [True] * 3
    model = GPT(Config(**_SMALL))
    assert model.h["0"].attn.qkv.weight.shape == (3 * hidden, hidden)
