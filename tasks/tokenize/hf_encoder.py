"""A HuggingFace ``tokenizer.json`` (a Llama 3 or GPT-NeoX tokenizer file, for example) as the
tokenize stage's engine: batches of documents encoded by the ``tokenizers`` library's batch encoder,
which runs on its own threads. Special tokens are not added to a document: the end-of-document id
(gpt.tokenizer.Tokenizer's) is appended by the stage, as for GPT-2's files."""
from __future__ import annotations

import os

import numpy as np

from gpt.tokenizer import Tokenizer
from tasks.tokenize.bpe import TokenizeError, tokenizer_files_read


def tokenizer_file(model: str) -> str:
    """``model`` itself, or the ``tokenizer.json`` in the folder it names (as HuggingFace saves one)."""
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise TokenizeError(f"--tokenizer-model {model}: no tokenizer.json there; give the file, or the folder "
                            "that holds it")
    return path


def json_tokenizer(model: str) -> Tokenizer:
    """The tokenizer ``--tokenizer-model`` names, checked: its end of text must be known."""
    with tokenizer_files_read():
        return Tokenizer.from_json(tokenizer_file(model))


class HFEncoder:
    """Encodes batches of documents with a tokenizer.json."""

    takes_buffers = False       # documents as a list of str only

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer.load()

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The documents' ids, flat, and each one's length."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        content = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
        return content, lengths
