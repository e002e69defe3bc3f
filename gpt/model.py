"""A GPT-2/GPT-3 language model in one file.

Learned position embeddings, pre-LayerNorm blocks, causal self-attention through
scaled_dot_product_attention, a 4x GELU MLP, a final LayerNorm and an output layer tied to the
token embedding. Parallelism, activation checkpointing and compilation are applied from outside
(gpt/distributed.py); this file knows nothing about them except how to initialise a shard.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from gpt.config import Config


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        h = config.hidden_size
        # q, k and v are separate layers so that tensor parallelism can split each by heads.
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.c_proj = nn.Linear(h, h)
        self.head_dim = h // config.num_attention_heads

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if cache is not None:
            # Generation: a prompt (causal over itself) into an empty cache, then one token at a
            # time, which sees everything before it.
            k, v = cache.extend(k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


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
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.padded_vocab_size()
        self.wte = nn.Embedding(self.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, self.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:
            self.init_weights(config.seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                cache: list[KVCache] | None = None) -> torch.Tensor:
        """Logits (B, T, vocab) or, given targets, the mean cross-entropy loss. Both cover the real
        vocabulary only: the padding rows exist for the matmul shapes, never as predictions.
        ``cache`` (one KVCache per layer) continues a sequence for generation."""
        start = cache[0].length if cache is not None else 0
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            x = block(x) if cache is None else block(x, cache[i])
        logits = self.lm_head(self.ln_f(x))[..., :self.config.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, N(0, 0.02) with residual projections scaled by 1/sqrt(2 x layers).

        Each tensor is drawn whole from a generator seeded by (seed, parameter name) and each rank
        keeps its own shard, so the weights are the same whatever the parallel layout.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            name = _plain_name(name)
            if ".ln_" in name or name.startswith("ln_f"):
                full = torch.ones(p.shape) if name.endswith("weight") else torch.zeros(p.shape)
            elif name.endswith("bias"):
                full = torch.zeros(p.shape)
            else:
                std = residual_std if name.endswith("c_proj.weight") else 0.02
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.randn(p.shape, generator=g) * std
            _copy_full(p, full)

    def load_hf_gpt2(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a HuggingFace GPT2LMHeadModel state dict (same sizes; vocab rows padded with zeros)."""
        self.load_state_dict(hf_to_ours(state_dict, self.vocab_size))


def hf_to_ours(state_dict: dict[str, torch.Tensor], padded_vocab: int) -> dict[str, torch.Tensor]:
    """A GPT2LMHeadModel state dict under our names, the embedding padded to ``padded_vocab`` rows."""
    ours: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if key.endswith(".attn.bias") or key.endswith(".attn.masked_bias") or key == "lm_head.weight":
            continue  # causal-mask buffers; lm_head is tied to wte
        if key.endswith("attn.c_attn.weight") or key.endswith("attn.c_attn.bias"):
            prefix, kind = key.rsplit(".c_attn.", 1)
            # HF's Conv1D stores (in, out): q, k and v side by side along the last dimension.
            for part, name in zip(value.chunk(3, dim=-1), ("q", "k", "v")):
                ours[f"{prefix}.{name}.{kind}"] = part.t() if kind == "weight" else part
        elif key.endswith("c_proj.weight") or key.endswith("c_fc.weight"):
            ours[key] = value.t()
        elif key == "wte.weight":
            ours[key] = F.pad(value, (0, 0, 0, padded_vocab - value.shape[0]))
        else:
            ours[key] = value
    ours["lm_head.weight"] = ours["wte.weight"]
    return {k: v.contiguous() for k, v in ours.items()}


def _plain_name(name: str) -> str:
    """Parameter name without the prefixes that compile or activation checkpointing insert."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(param.device)
    if isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def param_count(config: Config) -> int:
    """Number of parameters (tied weights once), counted on the meta device without allocation."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for p in model.parameters())
