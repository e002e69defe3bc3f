"""Megatron's dataset index builders in C++ (native._index): the sample index over shuffled
documents and the greedy blending index; this thin wrapper picks the index dtypes."""
from __future__ import annotations

import numpy as np

from native._index import build_blending_indices, build_sample_idx_int32, build_sample_idx_int64

__all__ = ["build_sample_idx", "build_blending_indices", "sample_idx_dtype"]

_INT32_MAX = np.iinfo(np.int32).max


def sample_idx_dtype(num_document_idx: int, max_size: int) -> np.dtype:
    """int32 when every stored position and offset fits in it, else int64 (as megatron-core)."""
    return np.dtype(np.int32) if max(num_document_idx, max_size) <= _INT32_MAX else np.dtype(np.int64)


def build_sample_idx(
    sizes: np.ndarray,
    document_idx: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
) -> np.ndarray:
    """Sample index of shape [num_samples + 1, 2]: (position in ``document_idx``, token offset).

    ``sizes`` are the int32 sequence lengths, ``document_idx`` the int32/int64 document order
    over all epochs.
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    document_idx = np.ascontiguousarray(document_idx)
    if document_idx.dtype not in (np.int32, np.int64):
        document_idx = document_idx.astype(np.int64)
    max_size = int(sizes.max()) if sizes.size else 0
    build = build_sample_idx_int32 if sample_idx_dtype(len(document_idx), max_size) == np.int32 else build_sample_idx_int64
    return build(sizes, document_idx, int(seq_length), int(num_epochs), int(tokens_per_epoch),
                 bool(drop_last_partial_sequence), int(add_extra_token_to_sequence))
