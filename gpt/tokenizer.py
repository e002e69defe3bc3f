"""A run's tokenizer files: GPT-2's ``vocab.json`` + ``merges.txt``, or a HuggingFace
``tokenizer.json`` (a Llama 3 or GPT-NeoX tokenizer file, for example), loaded as a
``tokenizers.Tokenizer``, with the end-of-text token that ends each document.

The end-of-text token of a tokenizer.json is the ``eos_token`` of the ``tokenizer_config.json``
beside it, as HuggingFace's AutoTokenizer (and so Megatron's HuggingFaceTokenizer) takes it;
without one, the first of EOD_TOKENS that the file adds as a special token, else the first in its
vocabulary.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EOD = "<|endoftext|>"
# Entries of GPT-2's vocabulary (50,000 merges, 256 bytes, the end-of-text token): the size a model
# has when no tokenizer says otherwise, and of the BPE trained when none is given.
GPT2_VOCAB_SIZE = 50257
# The end-of-text tokens of the common tokenizer files (GPT-2 and GPT-NeoX, Llama 3, SentencePiece
# conversions).
EOD_TOKENS = (EOD, "<|end_of_text|>", "</s>", "<eos>")


class TokenizerFileError(ValueError):
    """A tokenizer file that cannot be used; the message names it."""


def tokenizer_json_files(path: str | os.PathLike) -> list[str]:
    """What a tokenizer.json tokenizes with: the file, and the tokenizer_config.json beside it when
    there is one (it names the end-of-text token)."""
    config = Path(path).parent / "tokenizer_config.json"
    return [str(path), *([str(config)] if config.is_file() else [])]


def configured_eos(path: str | os.PathLike) -> str | None:
    """The ``eos_token`` of the tokenizer_config.json beside ``path`` (a string, or an object with
    its ``content``), or None."""
    config = Path(path).parent / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError) as e:
        raise TokenizerFileError(f"{config}: not a readable tokenizer_config.json ({e})") from e
    return eos.get("content") if isinstance(eos, dict) else eos


def end_of_text(tokenizer: Any, path: str | os.PathLike) -> tuple[str, int]:
    """The end-of-text token of the ``tokenizers.Tokenizer`` loaded from ``path``, and its id."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    configured = configured_eos(path)
    if configured is not None and configured not in vocab:
        raise TokenizerFileError(f"{path}: the eos_token {configured!r} of the tokenizer_config.json beside it is "
                                 "not in its vocabulary")
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    found = configured or next((name for name in EOD_TOKENS if name in special), None) or \
        next((name for name in EOD_TOKENS if name in vocab), None)
    if found is None:
        raise TokenizerFileError(f"{path}: none of the end-of-text tokens {', '.join(EOD_TOKENS)} is in its "
                                 "vocabulary, and no tokenizer_config.json beside it names an eos_token; the "
                                 "end-of-document id cannot be chosen")
    return found, vocab[found]


def vocabulary_size(tokenizer: Any) -> int:
    """Ids a model needs rows for: the largest id of the file, added tokens included, plus one."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def load_tokenizer_json(path: str | os.PathLike) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for unreadable files
        raise TokenizerFileError(f"{path}: not a HuggingFace tokenizer.json ({e})") from e


@dataclass(frozen=True)
class Loaded:
    """A ``tokenizers.Tokenizer`` (its methods are this object's) and its end-of-text id."""
    tokenizer: Any
    eod_id: int | None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)


def load_folder(folder: str | os.PathLike) -> Loaded:
    """The tokenizer a run folder's ``tokenizer/`` holds: its ``tokenizer.json`` when there is no
    GPT-2 pair, else ``vocab.json`` + ``merges.txt``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    if not (folder / "vocab.json").is_file() or not (folder / "merges.txt").is_file():
        return load_export(folder)
    tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Loaded(tok, tok.token_to_id(EOD))


def load_export(folder: str | os.PathLike) -> Loaded:
    """The ``tokenizer.json`` of a folder (an export, as HuggingFace loads it), with the end of text
    its tokenizer_config.json names (None when none can be told)."""
    path = Path(folder) / "tokenizer.json"
    tok = load_tokenizer_json(path)
    try:
        return Loaded(tok, end_of_text(tok, path)[1])
    except TokenizerFileError:
        return Loaded(tok, None)
