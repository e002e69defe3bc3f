"""One task of the tokenize array (tasks.tokenize.array) and the plan that cuts the inputs into shards.

What an array task imports on its node: the encoder (tasks.tokenize.encode), never Prefect.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from gpt.faults import FAULT
from gpt.files import write_json
from gpt.tokenizer import Tokenizer
from tasks.cluster.jobs import ReturnedError
from tasks.common.digest import file_digest
from tasks.common.secrets import hide_in_logs
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.encode import encode
from tasks.tokenize.inputs import Piece, splittable
from tasks.tokenize.outputs import output_prefixes

SCAN_BLOCK = 1 << 16      # bytes read at a time to find where a line starts


def plan_shards(files: list[str], tasks: int) -> list[list[Piece]]:
    """At most ``tasks`` shards of about equal bytes, in input order, none empty. A shard ends where
    its share of the bytes ends: inside a plain JSONL file at the first line that starts there or
    after; after a file that cannot be cut (compressed, Parquet). A piece that runs past several
    shares leaves fewer shards."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    ends = [-(-total * k // tasks) for k in range(1, tasks)]     # where each share ends, bytes from the start
    shards: list[list[Piece]] = []
    current: list[Piece] = []
    base = 0                               # bytes of the inputs before this file
    k = 0                                  # the next share end to reach
    for path, size in zip(files, sizes):
        start = 0
        while start < size:
            while k < len(ends) and ends[k] <= base + start:
                if current:
                    shards.append(current)
                    current = []
                k += 1
            end = size
            if k < len(ends) and ends[k] < base + size and splittable(path):
                end = line_start(path, ends[k] - base)           # > start: ends[k] > base + start
            current.append(Piece(path) if start == 0 and end == size else Piece(path, start, end))
            start = end
        base += size
    if current:
        shards.append(current)
    return shards


def line_start(path: str, offset: int) -> int:
    """Where the first line that starts at or after ``offset`` (> 0) begins (the file's size if none)."""
    with open(path, "rb") as f:
        f.seek(offset - 1)
        position = offset - 1
        while block := f.read(SCAN_BLOCK):
            found = block.find(b"\n")
            if found >= 0:
                return position + found + 1
            position += len(block)
    return position


def first_lines(path: str, offset: int) -> int:
    """How many lines lie before byte ``offset`` of ``path`` (read only to place an error)."""
    lines = 0
    with open(path, "rb") as f:
        while offset > 0 and (block := f.read(min(SCAN_BLOCK << 8, offset))):
            lines += block.count(b"\n")
            offset -= len(block)
    return lines


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one array task encodes, and where its outputs and record go."""

    index: int
    pieces: tuple[Piece, ...]
    prefix: str
    tokenizer: Tokenizer
    json_keys: tuple[str, ...]
    append_eod: bool
    strict: bool
    add_bos_token: bool = False

    @property
    def prefixes(self) -> dict[str, str]:
        return output_prefixes(self.prefix, self.json_keys)

    @property
    def record_path(self) -> Path:
        return Path(self.prefix + ".json")

    @property
    def nbytes(self) -> int:
        return sum((p.end if p.end is not None else os.path.getsize(p.path)) - p.start for p in self.pieces)

    def __call__(self) -> dict[str, Any] | ReturnedError:
        """Encode the shard on this node's cores; bad input is returned, not raised (running the
        task again would meet it again)."""
        hide_in_logs()
        cores = len(os.sched_getaffinity(0))
        started = time.perf_counter()
        try:
            encoded = encode(list(self.pieces), self.prefixes, self.tokenizer, append_eod=self.append_eod,
                             workers=cores, strict=self.strict, on_chunk=self._fault, allow_empty=True,
                             add_bos_token=self.add_bos_token)
        except TokenizeError as e:
            return ReturnedError(e)
        record = {"pieces": [dataclasses.asdict(p) for p in self.pieces], "documents": encoded.documents,
                  "tokens": encoded.tokens, "skipped": encoded.skipped, "problems": encoded.problems,
                  "lines": encoded.lines, "outputs": self._outputs(), "node": os.environ.get("SLURMD_NODENAME") or os.uname().nodename, "cores": cores,
                  "seconds": round(time.perf_counter() - started, 3)}
        write_json(self.record_path, record)
        return record

    def _fault(self) -> None:
        FAULT.kill_shard(self.index, Path(self.prefix + ".killed"))

    def _outputs(self) -> dict[str, list[Any]]:
        return {p: [os.path.getsize(p + ".bin"), file_digest(p + ".idx")] for p in self.prefixes.values()}

    def done(self) -> dict[str, Any] | None:
        """The shard's record when the shard is complete: its record there, for these pieces, and its
        files as the record describes them."""
        try:
            record = json.loads(self.record_path.read_text())
            if record["pieces"] != [dataclasses.asdict(p) for p in self.pieces] or record["outputs"] != self._outputs():
                return None
        except (OSError, ValueError, KeyError):
            return None
        return record


