"""What a run reads, checked once: its sources, tokenized prefixes and tokenizer, each where the
operator allows, and how its S3 objects are reached. ``check_inputs`` turns the form's data and
tokenizer into a ``DataPlan`` the data stages take as it is."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

from flows.plan.boundary import Boundary, check_prefix, check_source, refused
from flows.plan.params import SAMPLE_VOCAB_SIZE, DataParams, Problems, TokenizerParams
from gpt.tokenizer import GPT2_VOCAB_SIZE, Tokenizer, tokenizer_json_files
from tasks.common.uri import is_s3
from tasks.index import parse_split
from tasks.sync import Remote, local_path
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.hf_encoder import tokenizer_file
from tasks.tokenize.vocabulary import named_tokenizer


@dataclass(frozen=True)
class TokenizerPlan:
    """The run's tokenizer as named: files on this machine (paths resolved) or in S3, or none (a
    byte-level BPE is trained on the sources); and, when its files are here, the tokenizer itself."""
    vocab_file: str | None
    merge_file: str | None
    tokenizer_model: str | None         # a tokenizer.json (a folder named resolved to the file in it)
    add_bos_token: bool
    train_vocab_size: int | None        # as given: the BPE's entries when no files are named
    known: Tokenizer | None = None      # read at plan time from files on this machine

    @property
    def files(self) -> tuple[str | None, str | None, str | None]:
        return self.vocab_file, self.merge_file, self.tokenizer_model

    @property
    def remote_files(self) -> list[str]:
        return [f for f in self.files if f and is_s3(f)]


@dataclass(frozen=True)
class Prefix:
    uri: str                            # a .bin/.idx prefix: a local path (resolved) or an s3:// URI
    weight: float


@dataclass(frozen=True)
class DataPlan:
    """What the run trains on and how each piece is reached; the data stages take it as it is."""
    sources: tuple[str, ...]            # as given: s3:// URIs, local files, folders or globs
    prefixes: tuple[Prefix, ...]
    weight: float                       # of the tokenized sources in the blend
    json_keys: tuple[str, ...]
    split: str
    remote: Remote                      # how the sources', prefixes' and tokenizer's S3 objects are reached
    verify_content: bool
    tokenizer: TokenizerPlan
    readable: tuple[str, ...]           # the folders local sources may be read from

    @property
    def sample(self) -> bool:
        """No data named: the bundled Shakespeare sample."""
        return not self.sources and not self.prefixes

    @property
    def bpe_vocab_size(self) -> int:
        """The entries of the BPE trained when no tokenizer files are named."""
        return self.tokenizer.train_vocab_size or (GPT2_VOCAB_SIZE if self.sources else SAMPLE_VOCAB_SIZE)

    def vocabulary(self) -> tuple[int | None, str]:
        """The vocabulary the model needs rows for as far as the plan can tell (None: not before the
        data stages), and how it was told."""
        t = self.tokenizer
        if t.known is not None:
            return t.known.vocab_size, f"{t.known.vocab_size:,} (the tokenizer's)"
        if not any(t.files):
            return self.bpe_vocab_size, f"at most {self.bpe_vocab_size:,} (the BPE trained on the sources)"
        named = [f for f in t.files if f]
        where = "in S3" if all(is_s3(f) for f in named) else "not on this machine"
        return None, f"the tokenizer ({', '.join(named)}) is {where}; its size is known once the data stages ran"


def check_inputs(data: DataParams, tokenizer: TokenizerParams, root: Path, boundary: Boundary,
                 problems: Problems) -> DataPlan:
    """Sources, prefixes and tokenizer files exist and lie where the operator allows; local sources
    are not the output root's own. The plan of what the run reads."""
    for i, src in enumerate(data.sources):
        check_source(f"data.sources[{i}]", src, root, boundary, problems)
    for i, p in enumerate(data.prefixes):
        check_prefix(f"data.prefixes[{i}].prefix", p.prefix, root, boundary, problems)
    refused("data.endpoint_url", boundary.endpoint(data.endpoint_url), problems)
    refused("data.profile", boundary.profile(data.profile), problems)
    try:
        parse_split(data.split)
    except ValueError as e:
        problems.append(f"data.split: {e}")
    if data.prefixes and tokenizer.vocab_file is None and tokenizer.tokenizer_model is None:
        problems.append("tokenizer.vocab_file: data.prefixes were tokenized with some vocabulary; give its "
                        "vocab_file and merge_file, or its tokenizer_model (also used for the sources, so all "
                        "data agree)")
    return DataPlan(
        sources=tuple(data.sources),
        prefixes=tuple(Prefix(p.prefix if is_s3(p.prefix) else local_path(p.prefix), p.weight) for p in data.prefixes),
        weight=data.weight, json_keys=tuple(data.json_keys), split=data.split,
        remote=Remote(data.endpoint_url, data.no_sign_request, data.profile), verify_content=data.verify_content,
        tokenizer=_check_tokenizer(tokenizer, root, boundary, problems),
        readable=tuple([*map(str, boundary.input_roots), str(root)]))


def _check_tokenizer(tokenizer: TokenizerParams, root: Path, boundary: Boundary, problems: Problems) -> TokenizerPlan:
    """The tokenizer files named, each here and readable or in an allowed S3 location; read when here."""
    if (tokenizer.vocab_file is None) != (tokenizer.merge_file is None):
        problems.append("tokenizer: give both vocab_file and merge_file, or neither to train a BPE tokenizer")
    if tokenizer.add_bos_token and not tokenizer.tokenizer_model:
        problems.append("tokenizer.add_bos_token: GPT-2's files add no beginning-of-text token; it needs a "
                        "tokenizer_model (a tokenizer.json whose post-processor adds one, as Llama 3's does)")
    if tokenizer.tokenizer_model and tokenizer.vocab_file:
        problems.append("tokenizer.tokenizer_model: a tokenizer.json replaces vocab_file and merge_file; give one "
                        "or the other")
    here: dict[str, str | None] = {}
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(tokenizer, name)
        here[name] = value
        if not value:
            continue
        if is_s3(value):
            refused(f"tokenizer.{name}", boundary.s3_uri(value), problems)
            continue
        path = local_path(value)
        if not os.path.isfile(path) and not (name == "tokenizer_model"
                                             and os.path.isfile(os.path.join(path, "tokenizer.json"))):
            problems.not_here(f"tokenizer.{name}: {value} not found" + (
                " (a tokenizer.json, or the folder that holds one)" if name == "tokenizer_model" else ""))
            continue
        if refused(f"tokenizer.{name}", boundary.local_input(path, root), problems):
            continue
        if name == "tokenizer_model":      # the files read, links resolved: not only the folder named
            path = os.path.abspath(tokenizer_file(path))
            for read in tokenizer_json_files(path):
                refused(f"tokenizer.{name}", boundary.local_input(read, root), problems)
        here[name] = path
    plan = TokenizerPlan(here["vocab_file"], here["merge_file"], here["tokenizer_model"], tokenizer.add_bos_token,
                         tokenizer.train_vocab_size)
    named = [f for f in plan.files if f]
    if problems or not named or any(is_s3(f) or not os.path.isfile(f) for f in named):
        return plan
    try:
        return TokenizerPlan(*plan.files, plan.add_bos_token, plan.train_vocab_size,
                             known=named_tokenizer(*plan.files))
    except TokenizeError as e:
        problems.append(f"tokenizer: {e}")
        return plan


def container_reads(data: DataPlan, init_from: str | None, init_from_hf: str | None) -> dict[str, str]:
    """What the jobs read from the shared file system besides the output root (which they write, and
    which holds the rest: runs, synced data, caches), by the parameter that names it."""
    paths = {f"data.sources[{i}]": _fixed_part(local_path(src)) for i, src in enumerate(data.sources) if not is_s3(src)}
    paths.update({f"data.prefixes[{i}].prefix": p.uri for i, p in enumerate(data.prefixes) if not is_s3(p.uri)})
    paths.update({f"tokenizer.{name}": value for name, value in zip(("vocab_file", "merge_file", "tokenizer_model"),
                                                                    data.tokenizer.files) if value and not is_s3(value)})
    paths.update({field: value for field, value in (("training.init_from", init_from),
                                                     ("training.overrides.init_from_hf", init_from_hf))
                  if value and not is_s3(value)})
    return paths


def _fixed_part(path: str) -> str:
    """A glob's folder without wildcards (the path itself when it has none)."""
    while glob.has_magic(path):
        path = os.path.dirname(path)
    return path
