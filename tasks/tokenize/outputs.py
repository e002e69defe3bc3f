"""What the tokenize stage writes: ``<prefix>_<key>_document.bin/.idx`` per JSON key, and its
manifest; the stage's cache key (its inputs' identity, arguments and tokenizer files)."""
from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from gpt.data import MMapIndexedDataset, best_dtype
from gpt.tokenizer import Tokenizer, tokenizer_json_files
from tasks.common.digest import digest, file_digest
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.hf_encoder import tokenizer_file
from tasks.tokenize.inputs import expand_inputs


class TokenizeManifest(BaseModel):
    """What ``tokenize`` wrote. ``tokens`` counts the first JSON key's output (EOD ids included);
    ``digest`` hashes the inputs' identity, the tokenizer files, the arguments and the outputs."""

    model_config = ConfigDict(frozen=True)
    prefixes: dict[str, str]
    documents: int
    tokens: int
    dtype: str
    skipped: dict[str, int]
    files: list[str]
    vocab_file: str | None
    merge_file: str | None
    vocab_size: int
    eod_id: int
    digest: str
    tokenizer_file: str | None = None       # a HuggingFace tokenizer.json, in place of vocab and merges

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.vocab_file, self.merge_file, self.tokenizer_file, self.eod_id, self.vocab_size)

    def intact(self) -> bool:
        """Every .bin/.idx pair still reads as the format says, and the tokenizer files are there."""
        try:
            for prefix in self.prefixes.values():
                MMapIndexedDataset(prefix)
        except (OSError, ValueError):
            return False
        return all(os.path.isfile(f) for f in (self.vocab_file, self.merge_file, self.tokenizer_file) if f)


def output_prefixes(output_prefix: str, json_keys: tuple[str, ...]) -> dict[str, str]:
    return {k: f"{os.path.abspath(output_prefix)}_{k}_document" for k in json_keys}


def check_output_folder(output_prefix: str) -> str:
    """The output folder, made; a TokenizeError when it cannot be written."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise TokenizeError(f"--output-prefix {output_prefix}: cannot write in {out_dir} ({e.strerror or e}); "
                            "choose a folder you can write to") from None
    return out_dir


def manifest(files: list[str], prefixes: dict[str, str], tokenizer: Tokenizer, *, append_eod: bool,
             documents: int, tokens: int, skipped: dict[str, int], add_bos_token: bool = False) -> TokenizeManifest:
    """The manifest of a complete output, however it was written (in this process or joined from shards)."""
    stamp = {
        "inputs": [[os.path.abspath(f), os.path.getsize(f)] for f in files],
        "tokenizer": [file_digest(path) for path in tokenizer.files],
        "args": [list(prefixes), append_eod, *(["add_bos_token"] if add_bos_token else [])], "outputs": [file_digest(p + ".idx") for p in prefixes.values()],
    }
    return TokenizeManifest(
        prefixes=prefixes, documents=documents, tokens=tokens, dtype=best_dtype(tokenizer.vocab_size).name,
        skipped=skipped,
        files=[os.path.abspath(f) for f in files], vocab_file=tokenizer.vocab_file, merge_file=tokenizer.merge_file,
        vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id, digest=digest(stamp, length=32),
        tokenizer_file=tokenizer.tokenizer_file,
    )


def no_document(files: list[str], skipped: dict[str, int]) -> TokenizeError:
    return TokenizeError(f"--input {', '.join(files)}: no usable document (skipped: {nonzero_counts(skipped)})")


def nonzero_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items() if v) or "none"


def tokenize_cache_key(parameters: dict) -> str:
    """Arguments, input file sizes and mtimes, and the tokenizer files' contents; not where or on
    how many cores and tasks it runs, which changes nothing in the outputs."""
    files = expand_inputs(parameters["inputs"])
    stamp = {
        "args": {k: v for k, v in parameters.items() if k not in ("workers", "cluster", "tasks")},
        "inputs": [[os.path.abspath(f), os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
        "tokenizer": [file_digest(p) for p in (parameters.get("vocab_file"), parameters.get("merge_file"),
                                               *(tokenizer_json_files(tokenizer_file(parameters["tokenizer_model"]))
                                                 if parameters.get("tokenizer_model") else []))
                      if p],
    }
    return "tokenize-" + digest(stamp, length=32)
