"""Tokenize stage: JSONL (.jsonl, .gz, .xz, .zst) or Parquet to Megatron ``<prefix>_<key>_document.bin/.idx``.

GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, encoded by gigatoken (the fastest engine
measured here; ids equal HuggingFace ``tokenizers``' byte-level BPE built from the same files), or
any HuggingFace ``tokenizer.json`` (tasks.tokenize.hf_encoder), encoded by the ``tokenizers`` library.
A literal ``<|endoftext|>`` inside a document is encoded as text: only ``--append-eod`` adds the
end-of-document id, so no document is ever cut by its own content.

Inputs are streamed in chunks of whole lines, or of rows for Parquet (whose columns the keys name,
read a batch of rows of the chosen columns at a time); threads of this one process parse and encode chunks
(nothing is forked, so it is safe inside a flow run's threads), and the results are written
strictly in input order, so the output is byte-identical for any worker count and memory stays
bounded by ``2 * workers`` in-flight chunks. Flags follow Megatron's
``tools/preprocess_data.py``::

    python -m tasks.tokenize --input 'data/*.jsonl.zst' --output-prefix out/corpus \\
        --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 2
    python -m tasks.tokenize --input 'data/*.parquet' --output-prefix out/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3/tokenizer.json --append-eod
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from gpt.tokenizer import GPT2_VOCAB_SIZE
from tasks.common.run_context import log_to_stderr, run_logger
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.encode import encode
from tasks.tokenize.inputs import Piece
from tasks.tokenize.outputs import (
    TokenizeManifest,
    manifest,
    nonzero_counts,
    output_prefixes,
    tokenize_cache_key,
)
from tasks.tokenize.vocabulary import inputs_and_tokenizer

if TYPE_CHECKING:
    from tasks.cluster.config import ClusterConfig


def tokenize(inputs: list[str] | str, output_prefix: str, *, vocab_file: str | None = None,
             merge_file: str | None = None, json_keys: tuple[str, ...] | list[str] = ("text",),
             append_eod: bool = True, workers: int | None = None, strict: bool = False,
             train_vocab_size: int = GPT2_VOCAB_SIZE, train_bytes: int = 256 << 20,
             tokenizer_model: str | None = None, add_bos_token: bool = False) -> TokenizeManifest:
    """Tokenize JSONL or Parquet files into one ``.bin/.idx`` pair per JSON key (Parquet: per column).

    ``tokenizer_model`` (a HuggingFace tokenizer.json, or its folder) encodes in place of GPT-2's
    files, on the ``tokenizers`` library's threads. Without any tokenizer, a byte-level BPE of
    ``train_vocab_size`` entries is trained on the first ``train_bytes`` of text and saved as
    ``vocab.json``/``merges.txt`` beside the output. ``strict`` stops at the first bad line
    instead of skipping it. ``add_bos_token`` puts the beginning-of-text token a tokenizer.json's
    post-processor adds (Llama 3's) before each document, as the model will see text at inference.
    """
    json_keys = tuple(json_keys)
    files, tokenizer = inputs_and_tokenizer(inputs, output_prefix, json_keys, vocab_file=vocab_file,
                                            merge_file=merge_file, tokenizer_model=tokenizer_model,
                                            train_vocab_size=train_vocab_size, train_bytes=train_bytes)
    prefixes = output_prefixes(output_prefix, json_keys)
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    encoded = encode([Piece(f) for f in files], prefixes, tokenizer, append_eod=append_eod, workers=workers,
                     strict=strict, add_bos_token=add_bos_token)
    if any(encoded.skipped.values()):
        run_logger().info("Skipped lines: %s", nonzero_counts(encoded.skipped))
    return manifest(files, prefixes, tokenizer, append_eod=append_eod, add_bos_token=add_bos_token,
                    documents=encoded.documents,
                    tokens=encoded.tokens, skipped=encoded.skipped)


def tokenize_stage(inputs: list[str] | str, output_prefix: str, *, cluster: ClusterConfig | None = None,
                   vocab_file: str | None = None, merge_file: str | None = None,
                   json_keys: tuple[str, ...] | list[str] = ("text",), append_eod: bool = True, strict: bool = False,
                   train_vocab_size: int = GPT2_VOCAB_SIZE, train_bytes: int = 256 << 20,
                   tokenizer_model: str | None = None, workers: int | None = None,
                   add_bos_token: bool = False) -> TokenizeManifest:
    """The stage as the flow runs it: in this process (on ``workers`` threads), or as a job array on
    the cluster's data partition when its preset says ``data_jobs: true`` (tasks.tokenize.array);
    the same outputs. The options are ``tokenize``'s, named as there, so that the cache key reads
    them alike."""
    options = dict(vocab_file=vocab_file, merge_file=merge_file, json_keys=json_keys, append_eod=append_eod,
                   strict=strict, train_vocab_size=train_vocab_size, train_bytes=train_bytes,
                   tokenizer_model=tokenizer_model, add_bos_token=add_bos_token)
    if cluster is not None and cluster.data_jobs:
        from tasks.tokenize.array import tokenize_on_cluster

        return tokenize_on_cluster(inputs, output_prefix, cluster, **options)
    return tokenize(inputs, output_prefix, workers=workers, **options)


def __getattr__(name: str) -> Any:
    """``tokenize_task``, the stage as a Prefect task, made on first use: a tokenize job on a node,
    and the command line with --no-cache, never import Prefect (a second and more of start-up)."""
    if name != "tokenize_task":
        raise AttributeError(name)
    from prefect import task

    from tasks.common.cache import StageCache

    global tokenize_task
    tokenize_task = task(tokenize_stage, name="tokenize", cache_policy=StageCache(key_of=tokenize_cache_key),
                         persist_result=True, log_prints=True)
    return tokenize_task


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tasks.tokenize",
                                description="JSONL or Parquet to Megatron .bin/.idx (GPT-2 BPE).")
    p.add_argument("--input", nargs="+", required=True,
                   help="JSONL files or globs (.jsonl, .gz, .xz, .zst), or Parquet files (.parquet)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json (omit with --merge-file to train a BPE)")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=["GPT2BPETokenizer", "HuggingFaceTokenizer"])
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a tokenizer.json, or the folder holding one")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="the JSON fields, or Parquet columns, to tokenize")
    p.add_argument("--append-eod", action="store_true", help="end each document with <|endoftext|>")
    p.add_argument("--add-bos-token", action="store_true",
                   help="begin each document with the beginning-of-text token the tokenizer.json adds (Llama 3's)")
    p.add_argument("--workers", type=int, default=None, help="encoding threads (default: all cores)")
    p.add_argument("--strict", action="store_true", help="fail on the first bad line instead of skipping it")
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE, help="size of the BPE trained when no vocab is given")
    p.add_argument("--no-cache", action="store_true",
                   help="tokenize even when the outputs of these inputs are there and intact (the stage's cache, "
                        "shared with the pretrain flow's runs on this machine)")
    a = p.parse_args(argv)
    if (a.tokenizer_type == "HuggingFaceTokenizer") != (a.tokenizer_model is not None):
        p.error("--tokenizer-type HuggingFaceTokenizer and --tokenizer-model go together")
    log_to_stderr()
    options = dict(inputs=a.input, output_prefix=a.output_prefix, vocab_file=a.vocab_file, merge_file=a.merge_file,
                   json_keys=a.json_keys, append_eod=a.append_eod, workers=a.workers, strict=a.strict,
                   train_vocab_size=a.vocab_size, tokenizer_model=a.tokenizer_model, add_bos_token=a.add_bos_token)
    try:
        if a.no_cache:
            m, was_cached = tokenize(**options), False
        else:
            from tasks.common.cache import cached

            m, was_cached = cached(__getattr__("tokenize_task"), **options)
    except TokenizeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if was_cached:
        print(f"cached: {a.output_prefix} holds these inputs tokenized, intact (--no-cache tokenizes again)",
              file=sys.stderr)
    print(m.model_dump_json())


if __name__ == "__main__":
    main()
