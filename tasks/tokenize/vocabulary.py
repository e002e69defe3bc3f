"""Which tokenizer the tokenize stage encodes with: the one its flags name (GPT-2's pair, or a
tokenizer.json), checked, or a byte-level BPE trained on the inputs when none is named."""
from __future__ import annotations

import os
from typing import Any

from gpt.tokenizer import Tokenizer
from tasks.common.run_context import run_logger
from tasks.tokenize.bpe import TokenizeError, tokenizer_files_read, train_bpe
from tasks.tokenize.hf_encoder import json_tokenizer
from tasks.tokenize.inputs import expand_inputs, iter_texts
from tasks.tokenize.outputs import check_output_folder


def resolve_tokenizer(files: list[str], json_keys: tuple[str, ...], *, vocab_file: str | None, merge_file: str | None,
                      tokenizer_model: str | None, train_vocab_size: int, train_bytes: int,
                      out_dir: str) -> Tokenizer:
    """The tokenizer files, a BPE trained on the inputs and saved in ``out_dir`` when none is given."""
    named = named_tokenizer(vocab_file, merge_file, tokenizer_model)
    if named is not None:
        return named
    run_logger().info("No vocabulary given: training a %d-entry byte-level BPE on %s", train_vocab_size, ", ".join(files))
    vocab_file, merge_file = train_bpe(iter_texts(files, json_keys[0], train_bytes), out_dir, train_vocab_size)
    return named_tokenizer(vocab_file, merge_file, None)  # type: ignore[return-value]


def named_tokenizer(vocab_file: str | None, merge_file: str | None, tokenizer_model: str | None) -> Tokenizer | None:
    """The tokenizer the flags name, checked; None when they name none."""
    if (vocab_file is None) != (merge_file is None):
        raise TokenizeError("--vocab-file and --merge-file go together: give both, or neither to train a BPE")
    if tokenizer_model is not None and vocab_file is not None:
        raise TokenizeError("--tokenizer-model (HuggingFaceTokenizer) replaces --vocab-file and --merge-file: "
                            "give one or the other")
    if tokenizer_model is not None:
        return json_tokenizer(tokenizer_model)
    if vocab_file is None:
        return None
    with tokenizer_files_read():
        return Tokenizer.gpt2(vocab_file, merge_file)  # type: ignore[arg-type]


def inputs_and_tokenizer(inputs: list[str] | str, output_prefix: str, json_keys: tuple[str, ...],
                         **tokenizer: Any) -> tuple[list[str], Tokenizer]:
    """The input files and the tokenizer (``resolve_tokenizer``'s arguments), each checked, and the
    output folder made: what any way of running the stage starts from."""
    files = expand_inputs(inputs)
    if not json_keys:
        raise TokenizeError("--json-keys: give at least one key")
    if all(os.path.getsize(f) == 0 for f in files):
        raise TokenizeError(f"--input {', '.join(files)}: empty input, nothing to tokenize")
    out_dir = check_output_folder(output_prefix)
    return files, resolve_tokenizer(files, json_keys, out_dir=out_dir, **tokenizer)
