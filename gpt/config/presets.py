"""The named presets a Config starts from: GPT-3's sizes (the paper's Table 2.1, with its schedule),
Megatron-LM's scaling table, and Llama 3's published shapes; each block's architecture fields; the
tensor x pipeline layout each was published with on GPU clusters."""
from __future__ import annotations

from typing import Any

# GPT-3 paper schedule in samples of 2048 tokens (as Megatron's GPT-3 examples use it):
# 300B training tokens, 260B decay tokens, 375M warmup tokens.
_GPT3_SCHEDULE = {"train_samples": 146_484_375, "lr_decay_samples": 126_953_125, "lr_warmup_samples": 183_105}


def _gpt3(layers: int, hidden: int, heads: int, lr: float, batch: int) -> dict[str, Any]:
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": 2048,
            "micro_batch_size": 1, "global_batch_size": batch, "lr": lr, "min_lr": lr / 10, **_GPT3_SCHEDULE}


def _llama(layers: int, hidden: int, heads: int, groups: int, ffn: int, lr: float, tied: bool = False) -> dict[str, Any]:
    """Llama 3's block (Grattafiori et al., 2024, Table 3): rotary positions (base 500,000), RMSNorm,
    SwiGLU, grouped-query attention, no biases; 8192-token sequences, a batch of 4M tokens."""
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "num_query_groups": groups,
            "ffn_hidden_size": ffn, "seq_length": 8192, "micro_batch_size": 1, "global_batch_size": 512,
            "lr": lr, "min_lr": lr / 100, "train_iters": 1_200_000, "lr_warmup_iters": 8000, **LLAMA_BLOCK,
            "untie_embeddings_and_output_weights": not tied}


# The architecture fields and the GPT-3 block they describe (a preset that names none of them).
GPT3_BLOCK: dict[str, Any] = {"position_embedding_type": "learned_absolute", "rotary_base": 10000,
                              "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False,
                              "untie_embeddings_and_output_weights": False, "add_bias_linear": True}
LLAMA_BLOCK: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": 500000, "normalization": "RMSNorm",
                               "norm_epsilon": 1e-5, "swiglu": True, "add_bias_linear": False}

PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train a few hundred iterations on two CPU cores in a minute or two.
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
             "micro_batch_size": 8, "global_batch_size": 16, "lr": 2e-3, "min_lr": 2e-4,
             "train_iters": 300, "lr_warmup_iters": 30},
    # GPT-3 paper, Table 2.1 (1.3B with 16 heads as Megatron and NeMo use it; 13B with 5120 hidden).
    "gpt3-125m": _gpt3(12, 768, 12, 6e-4, 256),
    "gpt3-350m": _gpt3(24, 1024, 16, 3e-4, 256),
    "gpt3-760m": _gpt3(24, 1536, 16, 2.5e-4, 256),
    "gpt3-1.3b": _gpt3(24, 2048, 16, 2e-4, 512),
    "gpt3-2.7b": _gpt3(32, 2560, 32, 1.6e-4, 512),
    "gpt3-6.7b": _gpt3(32, 4096, 32, 1.2e-4, 1024),
    "gpt3-13b": _gpt3(40, 5120, 40, 1e-4, 1024),
    "gpt3-175b": {**_gpt3(96, 12288, 96, 0.6e-4, 1536), "init_method_std": 0.006},   # Megatron-LM's 175B example
    # Megatron-LM's scaling table (heads, hidden, layers, batch).
    "gpt-1.7b": _gpt3(24, 2304, 24, 2e-4, 512),
    "gpt-3.6b": _gpt3(30, 3072, 32, 1.6e-4, 512),
    "gpt-7.5b": _gpt3(36, 4096, 32, 1.2e-4, 512),
    "gpt-18.4b": _gpt3(40, 6144, 48, 1e-4, 1024),
    "gpt-39.1b": _gpt3(48, 8192, 64, 0.8e-4, 1536),
    "gpt-76.1b": _gpt3(60, 10240, 80, 0.6e-4, 1792),
    "gpt-145.6b": _gpt3(80, 12288, 96, 0.6e-4, 2304),
    "gpt-310.1b": _gpt3(96, 16384, 128, 0.6e-4, 2160),
    # The Llama block at this machine's size: grouped K/V (2 query heads per group), untied output.
    "tiny-llama": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
                   "ffn_hidden_size": 352, "seq_length": 128, "micro_batch_size": 8, "global_batch_size": 16,
                   "lr": 2e-3, "min_lr": 2e-4, "train_iters": 300, "lr_warmup_iters": 30, **LLAMA_BLOCK,
                   "rotary_base": 10000, "untie_embeddings_and_output_weights": True},
    # Llama 3.2 1B (tied embeddings) and Llama 3 / 3.1 8B, 70B, 405B: the published shapes.
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, 3e-4, tied=True),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 3e-4),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 1.5e-4),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 0.8e-4),
}

# The tensor x pipeline layout each preset was published with on GPU clusters: Megatron-LM's scaling
# table (Narayanan et al., 2021, Table 1) and its GPT-3 175B example. The flow trains a preset in it
# on a GPU cluster when a run sets neither size.
GPU_LAYOUTS: dict[str, tuple[int, int]] = {
    "gpt-1.7b": (1, 1), "gpt-3.6b": (2, 1), "gpt-7.5b": (4, 1), "gpt-18.4b": (8, 1), "gpt-39.1b": (8, 2),
    "gpt-76.1b": (8, 4), "gpt-145.6b": (8, 8), "gpt-310.1b": (8, 16), "gpt3-175b": (8, 16),
    # Llama 3: NeMo's recipes; 405B in 9 even stages of 14 layers (Meta's 16 stages are uneven, which
    # this pipeline does not split).
    "llama3.2-1b": (1, 1), "llama3-8b": (1, 1), "llama3-70b": (4, 4), "llama3-405b": (8, 9),
}
