"""A HuggingFace ``tokenizer.json`` (a Llama 3 or GPT-NeoX tokenizer file, for example) as the
tokenizer of the tokenize stage: the file checked, its end-of-text token found, its vocabulary size
read, and batches of documents encoded by the ``tokenizers`` library's batch encoder, which runs on
its own threads. Special tokens are not added to a document: the end-of-document id (gpt.tokenizer's
end-of-text token) is appended by the stage, as for GPT-2's files."""
from __future__ import annotations

import os

import numpy as np

from gpt.tokenizer import TokenizerFileError, end_of_text, load_tokenizer_json, vocabulary_size
from tasks.tokenize.bpe import TokenizeError


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
        self.path = path
        try:
            self.tokenizer = load_tokenizer_json(path)
            self.eod_token, self.eod_id = end_of_text(self.tokenizer, path)
        except TokenizerFileError as e:
            raise TokenizeError(str(e)) from e
        self.vocab_size = vocabulary_size(self.tokenizer)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The documents' ids, flat, and each one's length."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        content = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
        return content, lengths
