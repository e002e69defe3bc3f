"""A GPT-2/GPT-3 or Llama language model in one file.

Pre-norm blocks, causal self-attention through scaled_dot_product_attention (q, k and v from one
fused projection), an MLP, a final norm and an output layer whose cross-entropy is taken a chunk of
tokens at a time (linear_cross_entropy): in training, the logits of a whole batch never exist. The
block is GPT-3's by default (learned positions, LayerNorm, a 4x GELU MLP, multi-head attention, the
output layer tied to the token embedding, biases) and Llama's with the Config's architecture fields
(rotary positions, RMSNorm, SwiGLU, grouped-query attention, an output layer of its own, no biases).
Parallelism, activation checkpointing and compilation are applied from outside (gpt.parallel).
This file holds the math, and only what lets a layout apply itself to it: a weight's initial value
by name (each rank keeps its part), a hook to put a split output layer back together
(``whole_output``), attention as a hook (``attend``: context parallel's ring goes there) over a
batch's ``Packing`` (the tokens' places, positions and documents), and blocks keyed by their global number, so that a pipeline stage is a GPT
holding some of them, whose embedding, or final norm and output layer, may be absent (None).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpt.config import Config


@dataclass(frozen=True)
class Packing:
    """Where the tokens of a batch sit, when that is not simply 0..T-1 of one causal sequence: each
    token's place in the whole sample (``index``; under context parallel a rank holds a share of
    the places), its position for the position embeddings (``positions``, restarting at each
    document with reset_position_ids), and the document of the packed sample it belongs to
    (``documents``, with reset_attention_mask: attention stays inside a document)."""
    index: torch.Tensor                  # (T,) places in the sample, increasing
    positions: torch.Tensor              # (B, T) or (T,)
    documents: torch.Tensor | None       # (B, T), or None: every token sees every earlier one

    def allowed(self) -> torch.Tensor:
        """(B or 1, T, T): which tokens each token may attend to."""
        return attention_mask(self.index, self.index, self.documents, self.documents)


def attention_mask(queries: torch.Tensor, keys: torch.Tensor, query_documents: torch.Tensor | None = None,
                   key_documents: torch.Tensor | None = None) -> torch.Tensor:
    """(B or 1, queries, keys): whether each query (by its place in the sample) may attend to each key:
    a key at an earlier or the same place, of the same document where documents are given."""
    mask = (queries[:, None] >= keys[None, :])[None]
    if query_documents is not None:
        mask = mask & (query_documents[:, :, None] == key_documents[:, None, :])
    return mask


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing | None) -> torch.Tensor:
    """Causal attention of q (B, heads, T, head_dim) over k and v (B, groups, T, head_dim) held
    whole on this rank, inside each document when the packing names documents."""
    gqa = q.shape[1] != k.shape[1]
    if packing is None or packing.documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=packing.allowed()[:, None], enable_gqa=gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h, heads, groups = config.hidden_size, config.num_attention_heads, config.num_query_groups
        self.head_dim = h // heads
        self.heads_per_group = heads // groups
        # q, k and v in one GEMM. The rows go group by group: the query heads of key/value group 0,
        # its key, its value, then group 1's (with one group per head: q, k, v of head 0, then of
        # head 1, ...). Tensor parallelism splits the rows into contiguous blocks, so each rank gets
        # whole groups.
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.head_dim, bias=config.add_bias_linear)
        self.c_proj = nn.Linear(h, h, bias=config.add_bias_linear)
        self.rotary_base = config.rotary_base if config.position_embedding_type == "rope" else None
        # Attention over q, k and v and the batch's packing; context parallel puts its ring here.
        self.attend: Callable[..., torch.Tensor] = local_attention

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, packing: Packing | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 groups: under tensor parallelism each rank holds only its share of them.
        qkv = self.qkv(x).view(B, T, -1, self.heads_per_group + 2, self.head_dim).permute(0, 2, 3, 1, 4)
        q = qkv[:, :, :-2].flatten(1, 2)                     # (B, query heads, T, head_dim)
        k, v = qkv[:, :, -2], qkv[:, :, -1]                  # (B, groups, T, head_dim)
        if self.rotary_base is not None:
            start = cache.length if cache is not None else 0
            positions = packing.positions if packing is not None else torch.arange(start, start + T, device=x.device)
            cos, sin = rotary(self.rotary_base, self.head_dim, positions)
            if positions.dim() == 2:                                 # per sample: (B, 1, T, head_dim)
                cos, sin = cos[:, None], sin[:, None]
            q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        if cache is not None:
            # Generation: a prompt (causal over itself) into an empty cache, then one token at a
            # time, which sees everything before it.
            k, v = cache.extend(k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=self.heads_per_group > 1)
        else:
            y = self.attend(q, k, v, packing)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def rotary(base: int, head_dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (positions' shape, head_dim) of the rotary angles of the positions: the angle of
    dimension pair i is position / base^(2i / head_dim); a pair is (i, i + head_dim / 2), the first
    and second half of a head (HuggingFace Llama's convention, so its weights load as they are)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated by the angles: each pair (a, b) to (a cos - b sin, b cos + a sin), in fp32."""
    x = x.float()
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q, k and v weights (out, in) or biases (out,) as the fused projection's, group by group."""
    return torch.cat([t.unflatten(0, (groups, -1)) for t in (q, k, v)], dim=1).flatten(0, 1)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's weight or bias as separate q, k and v (the inverse of fuse_qkv); one
    group per head unless ``groups`` says otherwise."""
    groups = groups or heads
    per_group = qkv.unflatten(0, (groups, heads // groups + 2, -1))
    q = per_group[:, :-2].flatten(0, 2)
    return q, per_group[:, -2].flatten(0, 1), per_group[:, -1].flatten(0, 1)


class KVCache:
    """Keys and values of the tokens seen so far, one layer's worth, for generation."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and k.shape[2] > 1:
            raise ValueError("KVCache: after the prompt, extend by one token at a time")
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class MLP(nn.Module):
    """GELU (tanh approximation) between two matrices, or SwiGLU: SiLU of a gate times the up
    projection (c_gate and c_fc), then the down projection."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        h, inner, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        self.c_gate = nn.Linear(h, inner, bias=bias) if config.swiglu else None
        self.c_fc = nn.Linear(h, inner, bias=bias)
        self.c_proj = nn.Linear(inner, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_gate is not None:
            return self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x))
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def norm(config: Config) -> nn.Module:
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_epsilon)


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, packing: Packing | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, packing)
        return x + self.mlp(self.ln_2(x))


# Logits held at once by the loss: tokens per chunk x padded vocabulary (512 MB in fp32).
LOGITS_PER_CHUNK = 2 ** 27


def default_chunk_tokens(padded_vocab: int) -> int:
    """Tokens per chunk of linear_cross_entropy when none is given."""
    return max(1, LOGITS_PER_CHUNK // padded_vocab)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``x @ weight.T`` over their first ``vocab`` columns, without
    ever holding every token's logits: ``chunk_tokens`` tokens at a time (default: as many as keep
    LOGITS_PER_CHUNK logits). x is (tokens, hidden), weight (padded vocabulary, hidden).

    The matmuls run in the autocast dtype when autocast is on, the softmax in fp32; the padding
    rows of ``weight`` only shape the matmuls and get no gradient. Training, the gradients are
    computed while each chunk's logits are at hand and kept for the backward pass, which only
    scales them: the plain path's three matmuls and no logits saved for backward.
    """
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, vocab, chunk, dtype)
    with torch.autocast(device, enabled=False):
        return _chunked_loss(x, weight, targets, vocab, chunk, dtype, None)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
        grads = torch.empty_like(x), torch.zeros_like(weight, dtype=torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            loss = _chunked_loss(x, weight, targets, vocab, chunk, dtype, grads)
        ctx.save_for_backward(*grads)
        ctx.weight_dtype, ctx.tokens = weight.dtype, x.shape[0]
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_weight = ctx.saved_tensors  # summed over the tokens: the mean divides here
        scale = grad_loss / ctx.tokens
        return grad_x * scale, (grad_weight * scale).to(ctx.weight_dtype), None, None, None, None


def _chunked_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int, chunk: int,
                  dtype: torch.dtype, grads: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The summed loss chunk by chunk, divided by the tokens; fills ``grads`` when given with the
    gradients of the summed loss (of x, of weight)."""
    n = x.shape[0]
    w = weight.to(dtype)
    total = torch.zeros((), device=x.device, dtype=torch.float32)
    for start in range(0, n, chunk):
        rows = slice(start, start + chunk)
        chunk_grads = None if grads is None else (grads[0][rows], grads[1])
        total += _chunk_loss(x[rows].to(dtype), targets[rows, None], w, vocab, chunk_grads)
    return total / n


def _chunk_loss(x: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, vocab: int,
                grads: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """One chunk's summed loss; writes its rows of the gradient of x and adds to the weight's when
    ``grads`` is given. Its logits are freed on return, before the next chunk's exist."""
    logits = (x @ w.t()).float()
    logits[:, vocab:] = float("-inf")  # padding columns: no probability, no gradient
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    loss = (lse - logits.gather(1, targets)).sum()
    if grads is not None:
        # d(summed loss)/d(logits) = softmax - one_hot(target), written over the logits. Not yet
        # divided by the tokens: in fp16, probabilities / tokens would flush to zero.
        probs = logits.sub_(lse).exp_()
        probs.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=probs.dtype))
        g = probs.to(x.dtype)
        grads[0].copy_(g @ w)
        grads[1].add_(g.t() @ x)
    return loss


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.padded_vocab_size()
        self.wte = nn.Embedding(self.vocab_size, config.hidden_size)
        self.wpe = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                    if config.position_embedding_type == "learned_absolute" else None)
        # Keyed by layer number: a pipeline stage holds some of them under their global names.
        self.h = nn.ModuleDict({str(i): Block(config) for i in range(config.num_layers)})
        self.ln_f: nn.Module | None = norm(config)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, self.vocab_size, bias=False)
        if tied(config):
            self.lm_head.weight = self.wte.weight
        # A pipeline's last stage hands its normalised hidden states to the schedule's loss function
        # (``loss``), which takes the targets; every other stage hands on what its last block made.
        self.emits_hidden = False
        # The output layer's whole weight from this rank's part, where a parallel layout splits the
        # vocabulary rows over ranks (gpt.parallel sets it).
        self.whole_output: Callable[[torch.Tensor], torch.Tensor] = _as_is
        if not self.wte.weight.is_meta:
            self.init_weights()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: list[KVCache] | None = None, packing: Packing | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) or, given targets, the mean cross-entropy loss. Both cover the real
        vocabulary only: the padding rows exist for the matmul shapes, never as predictions.
        ``cache`` (one KVCache per layer) continues a sequence for generation; ``packing`` says
        where the tokens sit when they are not one causal sequence 0..T-1 (documents, a context-
        parallel rank's share). A pipeline stage without the embedding takes hidden states for
        ``idx``; one without the output layer returns hidden states."""
        if self.wte is not None:
            x = self.wte(idx)
            if self.wpe is not None:
                start = cache[0].length if cache is not None else 0
                positions = packing.positions if packing is not None else torch.arange(
                    start, start + idx.shape[1], device=idx.device)
                x = x + self.wpe(positions)
        else:
            x = idx
        for i, block in enumerate(self.h.values()):
            x = block(x, packing=packing) if cache is None else block(x, cache[i])
        if self.ln_f is None:
            return x
        x = self.ln_f(x)
        if self.emits_hidden:
            return x
        if targets is None:
            return F.linear(x, self.output_weight())[..., :self.config.vocab_size]
        return self.loss(x, targets)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the output layer over the final normalised hidden states."""
        return linear_cross_entropy(hidden.flatten(0, 1), self.output_weight(), targets.flatten(),
                                    self.config.vocab_size)

    def output_weight(self) -> torch.Tensor:
        """The output layer's whole weight (the embedding's, where tied)."""
        return self.whole_output(self.lm_head.weight)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation of a whole model (gpt.parallel.build.init_weights: of a split one)."""
        for name, p in self.named_parameters():
            p.copy_(initial_weight(name, p.shape, self.config))


def tied(config: Config) -> bool:
    """Whether the output layer is the token embedding."""
    return not config.untie_embeddings_and_output_weights


# Our names of a block's layers -> LlamaForCausalLM's (q, k and v apart: see hf_llama_to_ours).
LLAMA_NAMES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj",
               "mlp.c_gate": "mlp.gate_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def hf_llama_to_ours(state_dict: dict[str, torch.Tensor], padded_vocab: int, config: Config) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict under our names and layout, the vocabulary padded to ``padded_vocab`` rows."""
    hf = {k.removeprefix("model."): v for k, v in state_dict.items()}
    pad = lambda t: F.pad(t, (0, 0, 0, padded_vocab - t.shape[0]))  # noqa: E731
    ours = {"wte.weight": pad(hf["embed_tokens.weight"]), "ln_f.weight": hf["norm.weight"]}
    if tied(config):
        ours["lm_head.weight"] = ours["wte.weight"]
    else:
        ours["lm_head.weight"] = pad(hf["lm_head.weight"])
    for i in range(config.num_layers):
        o, h = f"h.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            if h + f"self_attn.q_proj.{kind}" in hf:
                ours[o + f"attn.qkv.{kind}"] = fuse_qkv(*(hf[h + f"self_attn.{n}_proj.{kind}"] for n in "qkv"),
                                                       config.num_query_groups)
            for name, theirs in LLAMA_NAMES.items():
                if h + f"{theirs}.{kind}" in hf:
                    ours[o + f"{name}.{kind}"] = hf[h + f"{theirs}.{kind}"]
    return {k: v.contiguous() for k, v in ours.items()}


def hf_to_ours(state_dict: dict[str, torch.Tensor], padded_vocab: int, heads: int) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict under our names and layout, the embedding padded to ``padded_vocab`` rows."""
    ours: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias") or key == "lm_head.weight":
            continue  # causal-mask buffers; lm_head is tied to wte
        if key.endswith("attn.c_attn.weight") or key.endswith("attn.c_attn.bias"):
            # HF's Conv1D stores (in, out): q, k and v side by side along the last dimension.
            q, k, v = (t.t() if key.endswith("weight") else t for t in value.chunk(3, dim=-1))
            ours[key.replace(".c_attn.", ".qkv.")] = fuse_qkv(q, k, v, heads)      # one group per head
        elif key.endswith("c_proj.weight") or key.endswith("c_fc.weight"):
            ours[key] = value.t()
        elif key == "wte.weight":
            ours[key] = F.pad(value, (0, 0, 0, padded_vocab - value.shape[0]))
        else:
            ours[key] = value
    ours["lm_head.weight"] = ours["wte.weight"]
    return {k: v.contiguous() for k, v in ours.items()}


def plain_name(name: str) -> str:
    """Parameter name without the prefixes that compile or activation checkpointing insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def initial_weight(name: str, shape: torch.Size, config: Config) -> torch.Tensor:
    """The whole initial value of parameter ``name``, GPT-2's and Megatron's: N(0, init_method_std),
    the output layers of attention and MLP (residual projections) scaled by 1/sqrt(2 x layers), the
    norms at one and zero, biases zero. Drawn from a generator
    seeded by (seed, name), so it is the same whatever the parallel layout."""
    # Tied, the output layer is the embedding (on a pipeline's last stage, a copy of the first's).
    name = "wte.weight" if plain_name(name) == "lm_head.weight" and tied(config) else plain_name(name)
    if ".ln_" in name or name.startswith("ln_f"):
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = config.init_method_std / (math.sqrt(2 * config.num_layers) if name.endswith("c_proj.weight") else 1)
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * std


def _as_is(weight: torch.Tensor) -> torch.Tensor:
    return weight


@dataclass(frozen=True)
class Parameters:
    """A model's parameters by part, as one tensor-parallel rank of ``t`` holds them: its matrices
    split over the ranks (the embedding by vocabulary rows), norms and output biases whole."""
    block: int                  # one block: attention (grouped K/V), MLP (SwiGLU's gate), norms, biases
    layers: int
    embedding: int              # the token embedding
    positions: int              # learned positions, whole (none with rotary ones)
    final_norm: int
    output: int                 # an output layer of its own (none when it is the embedding)

    @property
    def total(self) -> int:
        return self.layers * self.block + self.embedding + self.positions + self.final_norm + self.output


def parameters(config: Config, t: int = 1) -> Parameters:
    """What GPT(config) holds, by part, counted from the configuration (nothing is built)."""
    h, groups, heads = config.hidden_size, config.num_query_groups, config.num_attention_heads
    qkv = (heads + 2 * groups) * (h // heads)
    inner = config.ffn_hidden_size * (2 if config.swiglu else 1)
    matrices = h * qkv + h * h + h * inner + config.ffn_hidden_size * h
    one_norm = (2 if config.normalization == "LayerNorm" else 1) * h
    biases = (qkv + inner) // t + 2 * h if config.add_bias_linear else 0
    embedding = config.padded_vocab_size() // t * h
    return Parameters(block=matrices // t + 2 * one_norm + biases, layers=config.num_layers, embedding=embedding,
                      positions=config.max_position_embeddings * h
                      if config.position_embedding_type == "learned_absolute" else 0,
                      final_norm=one_norm, output=0 if tied(config) else embedding)


def param_count(config: Config) -> int:
    """Number of parameters (tied weights once)."""
    return parameters(config).total
