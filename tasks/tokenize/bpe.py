"""GPT-2's byte-level BPE: a vocab.json/merges.txt pair loaded and checked, the encoding engine
built from it, or a new one trained on text. ``<|endoftext|>`` is the end-of-document token."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from gpt.files import WriteError, as_os_error, writing
from gpt.tokenizer import GPT2_VOCAB_SIZE

EOD = "<|endoftext|>"


class TokenizeError(ValueError):
    """Bad input or arguments; the message names the file, line or flag."""



def load_vocab(vocab_file: str, merge_file: str) -> tuple[dict[str, int], int]:
    """The GPT-2 vocabulary and its end-of-document id; a clear error for unusable files."""
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            raise TokenizeError(f"{flag} {path}: file not found")
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizeError(f"{vocab_file}: not a GPT-2 vocab.json ({e})") from e
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizeError(f"{vocab_file}: expected a JSON object mapping tokens to ids")
    if EOD not in vocab:
        raise TokenizeError(f"{vocab_file}: no {EOD} entry; add it as the end-of-document token")
    return vocab, int(vocab[EOD])


def vocabulary_size(vocab: dict[str, int]) -> int:
    """Entries the model's embedding must hold for this vocabulary: its largest id plus one."""
    return max(vocab.values()) + 1


def build_hf_tokenizer(vocab_file: str, merge_file: str):
    """HuggingFace byte-level BPE from GPT-2 files, with no special tokens (EOD text stays text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as e:
        raise TokenizeError(f"{vocab_file} / {merge_file}: cannot build a BPE tokenizer ({e})") from e
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def build_encoder(vocab_file: str, merge_file: str):
    import gigatoken

    return gigatoken.Tokenizer(build_hf_tokenizer(vocab_file, merge_file))


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
