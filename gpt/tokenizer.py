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


def _gpt2_vocabulary(vocab_file: str, merge_file: str, eod_required: bool) -> dict[str, int]:
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            raise TokenizerFileError(f"{flag} {path}: file not found")
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"{vocab_file}: not a GPT-2 vocab.json ({e})") from e
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerFileError(f"{vocab_file}: expected a JSON object mapping tokens to ids")
    if eod_required and EOD not in vocab:
        raise TokenizerFileError(f"{vocab_file}: no {EOD} entry; add it as the end-of-document token")
    return vocab


def byte_level_bpe(vocab_file: str, merge_file: str) -> Any:
    """GPT-2's byte-level BPE as a ``tokenizers.Tokenizer``, with no special tokens (the end-of-text
    token in a text stays text)."""
    from tokenizers import Tokenizer as Library
    from tokenizers import decoders, models, pre_tokenizers

    try:
        tok = Library(models.BPE.from_file(vocab_file, merge_file))
    except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for unreadable files
        raise TokenizerFileError(f"{vocab_file} / {merge_file}: cannot build a BPE tokenizer ({e})") from e
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@dataclass(frozen=True)
class Tokenizer:
    """A run's tokenizer: GPT-2's pair or a tokenizer.json, with its end-of-document id and the
    vocabulary size a model needs, both decided here. Small enough to hand to a job on another node;
    ``load()`` gives the ``tokenizers.Tokenizer`` that encodes and decodes."""
    vocab_file: str | None
    merge_file: str | None
    tokenizer_file: str | None
    eod_id: int | None
    vocab_size: int

    @classmethod
    def gpt2(cls, vocab_file: str, merge_file: str, *, eod_required: bool = True) -> Tokenizer:
        """GPT-2's pair; without ``eod_required`` one with no end-of-text entry has none."""
        vocab = _gpt2_vocabulary(vocab_file, merge_file, eod_required)
        eod_id = int(vocab[EOD]) if EOD in vocab else None
        return cls(os.path.abspath(vocab_file), os.path.abspath(merge_file), None, eod_id, max(vocab.values()) + 1)

    @classmethod
    def from_json(cls, path: str | os.PathLike, *, eod_required: bool = True) -> Tokenizer:
        """A tokenizer.json; without ``eod_required`` one whose end of text cannot be told has none."""
        tok = load_tokenizer_json(path)
        try:
            eod_id: int | None = end_of_text(tok, path)[1]
        except TokenizerFileError:
            if eod_required:
                raise
            eod_id = None
        return cls(None, None, os.path.abspath(path), eod_id, vocabulary_size(tok))

    @classmethod
    def in_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """What a run's ``tokenizer/`` folder or an export holds: its tokenizer.json (an export's end
        of text is the one its tokenizer_config.json names, None when it names none), else GPT-2's pair."""
        folder = Path(folder)
        if (folder / "tokenizer.json").is_file():
            return cls.from_json(folder / "tokenizer.json", eod_required=False)
        return cls.gpt2(str(folder / "vocab.json"), str(folder / "merges.txt"), eod_required=False)

    @property
    def files(self) -> list[str]:
        return [name for name, _ in self.named_files()]

    def named_files(self) -> list[tuple[str, str]]:
        """(file, its name in a tokenizer folder) for each file this tokenizer is made of."""
        if self.tokenizer_file is None:
            return [(self.vocab_file, "vocab.json"), (self.merge_file, "merges.txt")]  # type: ignore[list-item]
        return list(zip(tokenizer_json_files(self.tokenizer_file), ("tokenizer.json", "tokenizer_config.json")))

    def bos_ids(self) -> list[int]:
        """The ids the tokenizer's post-processor puts before a document's text (Llama 3's
        ``<|begin_of_text|>``); empty for GPT-2's pair and for a tokenizer.json that adds none."""
        if self.tokenizer_file is None:
            return []
        tok = self.load()
        plain = tok.encode("a", add_special_tokens=False).ids
        framed = tok.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), 0)
        return framed[:at]

    def load(self) -> Any:
        if self.tokenizer_file is not None:
            return load_tokenizer_json(self.tokenizer_file)
        return byte_level_bpe(self.vocab_file, self.merge_file)  # type: ignore[arg-type]
