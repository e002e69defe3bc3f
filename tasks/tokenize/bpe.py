"""GPT-2's byte-level BPE in the tokenize stage: the encoding engine built from a vocab.json/merges.txt
pair, or a new pair trained on text. ``<|endoftext|>`` is the end-of-document token."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from gpt.files import WriteError, as_os_error, writing
from gpt.tokenizer import EOD, GPT2_VOCAB_SIZE, TokenizerFileError, byte_level_bpe


class TokenizeError(ValueError):
    """Bad input or arguments; the message names the file, line or flag."""


@contextlib.contextmanager
def tokenizer_files_read() -> Iterator[None]:
    """A tokenizer file that cannot be read (gpt.tokenizer's TokenizerFileError) is the stage's
    TokenizeError, with the same one-line message."""
    try:
        yield
    except TokenizerFileError as e:
        raise TokenizeError(str(e)) from e


def gpt2_bpe(vocab_file: str, merge_file: str) -> Any:
    """GPT-2's pair read as a byte-level BPE (what the stage's engines are built from); a file that
    cannot be read is a TokenizeError."""
    with tokenizer_files_read():
        return byte_level_bpe(vocab_file, merge_file)


def train_bpe(texts: Iterator[str], out_dir: str, vocab_size: int = GPT2_VOCAB_SIZE) -> tuple[str, str]:
    """Train a byte-level BPE and save it as GPT-2's ``vocab.json``/``merges.txt`` in ``out_dir``.

    ``<|endoftext|>`` takes the last id, as in GPT-2.
    """
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size - 1, min_frequency=2, show_progress=False)
    tmp_dir = Path(out_dir) / f".bpe-tmp-{os.getpid()}"
    vocab_file, merge_file = str(Path(out_dir) / "vocab.json"), str(Path(out_dir) / "merges.txt")
    try:
        with writing(vocab_file, [tmp_dir]), as_os_error(tmp_dir):
            tmp_dir.mkdir(parents=True, exist_ok=True)
            bpe.save_model(str(tmp_dir))
            vocab = json.loads((tmp_dir / "vocab.json").read_text(encoding="utf-8"))
            vocab[EOD] = len(vocab)
            (tmp_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp_dir / "merges.txt", merge_file)
            os.replace(tmp_dir / "vocab.json", vocab_file)
    except WriteError as e:
        raise TokenizeError(f"training a BPE: {e}") from e
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return vocab_file, merge_file
