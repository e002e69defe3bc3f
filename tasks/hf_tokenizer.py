"""A HuggingFace ``tokenizer.json`` (a Llama 3 or GPT-NeoX tokenizer file, for example) as the
tokenizer of the tokenize stage: the file checked, its end-of-text token found, its vocabulary size
read, and batches of documents encoded by the ``tokenizers`` library's batch encoder, which runs on
its own threads. Special tokens are not added to a document: the end-of-document id is appended by
the stage, as for GPT-2's files."""
from __future__ import annotations

import json
import os

import numpy as np

from tasks.bpe import TokenizeError

# The end-of-text tokens of the common tokenizer files (GPT-2 and GPT-NeoX, Llama 3, SentencePiece
# conversions). The end-of-document token is the ``eos_token`` of the tokenizer_config.json beside
# the file, as HuggingFace's AutoTokenizer (and so Megatron's HuggingFaceTokenizer) takes it; without
# one, the first of these that the file adds as a special token, else the first in its vocabulary.
EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def tokenizer_file(model: str) -> str:
    """``model`` itself, or the ``tokenizer.json`` in the folder it names (as HuggingFace saves one)."""
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise TokenizeError(f"--tokenizer-model {model}: no tokenizer.json there; give the file, or the folder "
                            "that holds it")
    return path


class HFTokenizer:
    """A tokenizer.json, loaded: its end-of-document id and vocabulary size, and a batch encoder."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.path = path
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for unreadable files
            raise TokenizeError(f"{path}: not a HuggingFace tokenizer.json ({e})") from e
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        configured = _configured_eos(path)
        if configured is not None and configured not in vocab:
            raise TokenizeError(f"{path}: the eos_token {configured!r} of the tokenizer_config.json beside it is "
                                "not in its vocabulary")
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        # a special token first (the file's own end-of-text marker), then one of the plain vocabulary
        found = configured or next((name for name in EOD_TOKENS if name in special), None) or \
            next((name for name in EOD_TOKENS if name in vocab), None)
        if found is None:
            raise TokenizeError(f"{path}: none of the end-of-text tokens {', '.join(EOD_TOKENS)} is in its "
                                "vocabulary, and no tokenizer_config.json beside it names an eos_token; the "
                                "end-of-document id cannot be chosen")
        self.eod_token, self.eod_id = found, vocab[found]
        self.vocab_size = max(vocab.values()) + 1

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The documents' ids, flat, and each one's length."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        content = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
        return content, lengths


def _configured_eos(path: str) -> str | None:
    """The ``eos_token`` of the tokenizer_config.json beside ``path`` (a string, or an object with
    its ``content``), or None."""
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (ValueError, AttributeError) as e:
        raise TokenizeError(f"{config}: not a readable tokenizer_config.json ({e})") from e
    return eos.get("content") if isinstance(eos, dict) else eos
