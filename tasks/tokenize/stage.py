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
import collections
import ctypes
import glob
import gzip
import lzma
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterator

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict

from gpt.data import IndexedDatasetWriter, best_dtype
from gpt.tokenizer import GPT2_VOCAB_SIZE, Tokenizer, TokenizerFileError, tokenizer_json_files
from tasks.cluster.run_context import log_to_stderr
from tasks.common.digest import digest, file_digest
from tasks.common.progress import Progress
from tasks.tokenize.bpe import TokenizeError, build_encoder, train_bpe
from tasks.tokenize.hf_encoder import HFEncoder, json_tokenizer, tokenizer_file

# What the stage reads: JSON lines, plain or compressed, and Parquet.
INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.xz", ".json.xz", ".jsonl.zst", ".json.zst",
                  ".parquet")
CHUNK_BYTES = 4 << 20
PARQUET_ROWS = 1024           # rows per batch read from a Parquet file (web documents: a few MB)
# The engine caches every distinct pretoken it meets, so on text whose words never stop varying it
# grows without bound (about 7 MB per MB of random words, on each encoding thread). Once this
# process has grown by more than this since its engine was built, a fresh engine takes over. On
# varied real text the cache earns its memory (a fresh engine encodes at half speed until it is
# warm again), so it may grow this far while the process stays under 1 GiB.
ENCODER_CACHE_BYTES = 256 << 20
# A 4 MiB chunk encodes in well under a second; a chunk not done after this long means a stuck engine.
CHUNK_TIMEOUT_S = 600.0
MAX_MESSAGES_PER_KIND = 20
SKIP_KINDS = ("malformed_json", "missing_key", "invalid_utf8", "empty_document", "blank_line")


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


# ---------------------------------------------------------------------------------- input

def expand_inputs(inputs: list[str] | str) -> list[str]:
    if isinstance(inputs, str):
        inputs = [inputs]
    files: list[str] = []
    for pattern in inputs:
        if glob.has_magic(pattern):
            matched = sorted(m for m in glob.glob(pattern) if os.path.isfile(m))
            if not matched:
                raise TokenizeError(f"--input {pattern}: no file matches")
            files.extend(matched)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise TokenizeError(f"--input {pattern}: file not found")
    if not files:
        raise TokenizeError("--input: no input files given")
    return files


def open_stream(path: str) -> IO[bytes]:
    """The decompressed bytes of ``path``, streamed (never written to disk)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".xz"):
        return lzma.open(path, "rb")
    if path.endswith(".zst"):
        return _ZstdFrames(path)
    return open(path, "rb")


class _ZstdFrames:
    """The decompressed bytes of a .zst file, frame after frame. A file that ends inside a frame
    raises EOFError (zstandard's stream reader would just stop there, dropping the rest silently)."""

    BLOCK = 1 << 20

    def __init__(self, path: str) -> None:
        import zstandard

        self._new = zstandard.ZstdDecompressor().decompressobj
        self._file = open(path, "rb")
        self._frame = self._new()
        self._in_frame = False
        self._buffer = bytearray()

    def read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            block = self._file.read(self.BLOCK)
            if not block:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                break
            while block:
                if self._frame.eof:
                    self._frame = self._new()
                self._buffer += self._frame.decompress(block)
                self._in_frame = not self._frame.eof
                block = self._frame.unused_data if self._frame.eof else b""
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def __enter__(self) -> "_ZstdFrames":
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


def read_parquet(path: str, columns: tuple[str, ...], rows: int = PARQUET_ROWS):
    """Batches of ``rows`` rows of a Parquet file's ``columns`` (pyarrow RecordBatches), streamed a
    row group at a time; a file that is not Parquet, is damaged or lacks a column is a
    TokenizeError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise TokenizeError(f"{path}: not a readable Parquet file ({e}); it is damaged or truncated: "
                            "download or write it again") from e
    with parquet:
        schema = parquet.schema_arrow
        for column in columns:
            if column not in schema.names:
                raise TokenizeError(f"{path}: no column {column!r} (--json-keys names the text columns); "
                                    f"its columns are {', '.join(schema.names)}")
            kind = schema.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
                raise TokenizeError(f"{path}: column {column!r} holds {kind}, not text; name a text column")
        try:
            yield from parquet.iter_batches(batch_size=rows, columns=list(columns), use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise TokenizeError(f"{path}: cannot read its rows ({e}); it is damaged or truncated: "
                                "download or write it again") from e


@dataclass(frozen=True)
class Piece:
    """An input file, or the lines of an uncompressed JSONL file in bytes ``[start, end)`` (both on
    line boundaries), as one array task of a sharded tokenize reads it."""
    path: str
    start: int = 0
    end: int | None = None

    def where(self, line: int) -> str:
        """Line ``line`` of this piece (counted from 1), for a message."""
        return where(self.path, line) if self.start == 0 else f"{self.path}: line {line} after byte {self.start}"


def splittable(path: str) -> bool:
    """Whether a file can be cut at any line: plain JSONL (compressed streams and Parquet cannot)."""
    return path.endswith((".jsonl", ".json"))


def read_pieces(piece: Piece, keys: tuple[str, ...]) -> Iterator:
    """What the encoder takes from one input: chunks of whole JSONL lines, or batches of Parquet rows."""
    if is_parquet(piece.path):
        return read_parquet(piece.path, keys)
    return read_chunks(piece.path, start=piece.start, end=piece.end)


def where(path: str, line: int) -> str:
    """A line of a JSONL file, or a row of a Parquet file (both counted from 1)."""
    return f"{path}: row {line}" if is_parquet(path) else f"{path}:{line}"


def read_chunks(path: str, chunk_bytes: int | None = None, *, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Pieces of whole lines of a file (of its bytes ``[start, end)`` when given: a plain file
    only), about ``chunk_bytes`` (default CHUNK_BYTES) each."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    rest = b""
    left = float("inf") if end is None else end - start
    try:
        with open_stream(path) as f:
            if start:
                f.seek(start)
            while left > 0 and (block := f.read(int(min(chunk_bytes, left)))):
                left -= len(block)
                data = rest + block if rest else block
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    rest = data
                    continue
                rest = data[cut:]
                yield data[:cut]
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise TokenizeError(f"{path}: cannot read or decompress ({e})") from e
    except Exception as e:
        if type(e).__module__.startswith("zstandard"):
            raise TokenizeError(f"{path}: cannot decompress ({e})") from e
        raise
    if rest:
        yield rest


# ---------------------------------------------------------------------------------- encode

def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _release_free_memory() -> None:
    """Hand freed heap memory back to the system (glibc keeps it otherwise, and resident memory
    would ratchet up with every engine rebuilt)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


Engine = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]   # documents -> flat ids, lengths


class _Gigatoken:
    """GPT-2's vocab.json and merges.txt on the gigatoken engine."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.engine = build_encoder(vocab_file, merge_file)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        layout = self.engine.encode_batch(texts, parallel=False).layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        return np.asarray(layout.content.data)[offsets[0]:offsets[-1]], np.diff(offsets)


class _Encoder:
    """The engine and what to encode, shared by the encoding threads."""

    def __init__(self, new_engine: Callable[[], Engine], keys: tuple[str, ...], append_eod: bool,
                 eod_id: int, dtype: np.dtype) -> None:
        self.new_engine = new_engine
        self.keys, self.append_eod, self.eod_id, self.dtype = keys, append_eod, eod_id, dtype
        self.engine = new_engine()
        self.base_rss = _rss_bytes()

    def renew_if_grown(self) -> None:
        """A fresh engine once the caches have grown past ENCODER_CACHE_BYTES (chunks in flight
        finish on the engine they started with)."""
        if _rss_bytes() - self.base_rss > ENCODER_CACHE_BYTES:
            self.engine = self.new_engine()
            _release_free_memory()          # what the old engine's caches held, once its chunks finish
            self.base_rss = _rss_bytes()

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Flat tokens (with EOD after each document if asked) and per-document lengths."""
        content, lengths = self.engine(texts)
        if not self.append_eod:
            return content.astype(self.dtype), lengths
        n = len(lengths)
        out = np.empty(content.size + n, dtype=self.dtype)
        ends = np.cumsum(lengths + 1) - 1
        keep = np.ones(out.size, dtype=bool)
        keep[ends] = False
        out[keep] = content
        out[ends] = self.eod_id
        return out, lengths + 1

    def chunk(self, data) -> dict:
        """Parse and encode one chunk (bytes of JSONL lines, or a batch of Parquet rows); problems are
        reported by line or row (0-based within the chunk)."""
        if not isinstance(data, bytes):
            return self.rows(data)
        keys = self.keys
        texts: dict[str, list[str]] = {k: [] for k in keys}
        problems: list[tuple[int, str, str]] = []
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, raw in enumerate(lines):
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                if not raw.strip():
                    problems.append((i, "blank_line", "blank line"))
                    continue
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as u:
                    problems.append((i, "invalid_utf8", f"invalid UTF-8 at byte {u.start}"))
                    continue
                problems.append((i, "malformed_json", f"malformed JSON ({e})"))
                continue
            values = []
            for k in keys:
                v = obj.get(k) if isinstance(obj, dict) else None
                if not isinstance(v, str):
                    problems.append((i, "missing_key", f"no string field {k!r}"))
                    break
                if not v:
                    problems.append((i, "empty_document", f"field {k!r} is empty"))
                    break
                values.append(v)
            else:
                for k, v in zip(keys, values):
                    texts[k].append(v)
        encoded = {k: self.encode(texts[k]) for k in keys}
        return {"documents": len(texts[keys[0]]), "bytes": len(data), "lines": len(lines), "encoded": encoded,
                "problems": problems}

    def rows(self, batch) -> dict:
        """Encode a batch of Parquet rows: a row whose text is null or empty in any key's column is
        skipped, as a JSONL line without the key would be."""
        columns = [batch.column(k).to_pylist() for k in self.keys]
        problems: list[tuple[int, str, str]] = []
        keep = []
        for i, values in enumerate(zip(*columns)):
            bad = next(((k, v) for k, v in zip(self.keys, values) if not v), None)
            if bad is None:
                keep.append(i)
            elif bad[1] is None:
                problems.append((i, "missing_key", f"column {bad[0]!r} is null"))
            else:
                problems.append((i, "empty_document", f"column {bad[0]!r} is empty"))
        encoded = {k: self.encode([column[i] for i in keep]) for k, column in zip(self.keys, columns)}
        return {"documents": len(keep), "bytes": batch.nbytes, "lines": batch.num_rows, "encoded": encoded,
                "problems": problems}


def _encoded_chunks(encoder: _Encoder, items: Iterator[tuple[int, bytes]], workers: int,
                    timeout_s: float) -> Iterator[dict]:
    """Results of ``(file index, chunk)`` items in input order.

    ``workers`` threads of this process encode chunks side by side (the engine releases the GIL);
    at most ``2 * workers`` chunks are in flight, so memory stays bounded whatever the input
    size. Nothing is forked: the threads end when their queue is closed, and each wait for a
    result is bounded by ``timeout_s``.
    """
    if workers <= 1:
        for index, data in items:
            yield {"file": index, **encoder.chunk(data)}
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
    try:
        pending: collections.deque = collections.deque()
        for index, data in items:
            pending.append((index, pool.submit(encoder.chunk, data)))
            if len(pending) >= 2 * workers:
                yield _result(*pending.popleft(), timeout_s)
        while pending:
            yield _result(*pending.popleft(), timeout_s)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _result(index: int, future: Future, timeout_s: float) -> dict:
    try:
        return {"file": index, **future.result(timeout=timeout_s)}
    except FutureTimeout:
        raise TokenizeError(f"a chunk of input file #{index + 1} was not encoded within {timeout_s:.0f} s: "
                            "the tokenizer engine is stuck; rerun, and report it if it happens again") from None


# ---------------------------------------------------------------------------------- stage

def iter_texts(files: list[str], key: str, limit_bytes: int) -> Iterator[str]:
    seen = 0
    for path in files:
        for piece in read_pieces(Piece(path), (key,)):
            for v in _values(piece, key):
                if isinstance(v, str) and v:
                    yield v
                    seen += len(v)
                    if seen >= limit_bytes:
                        return


def _values(piece, key: str) -> Iterator:
    if not isinstance(piece, bytes):
        yield from piece.column(0).to_pylist()
        return
    for raw in piece.split(b"\n"):
        try:
            yield orjson.loads(raw).get(key)
        except (orjson.JSONDecodeError, AttributeError):
            continue


class BadLine(TokenizeError):
    """``--strict``: the first bad line (of ``pieces[index]``, its ``line``-th)."""

    def __init__(self, piece: Piece, line: int, detail: str, index: int = 0) -> None:
        super().__init__(f"{piece.where(line)}: {detail} (--strict stops at the first bad line)")
        self.piece, self.line, self.detail, self.index = piece, line, detail, index


def engine_factory(tokenizer: Tokenizer) -> tuple[Callable[[], Engine], bool]:
    """A maker of fresh engines for ``tokenizer``, and whether the engine runs its own threads (one
    chunk at a time then)."""
    if tokenizer.tokenizer_file:
        hf = HFEncoder(tokenizer)
        return (lambda: hf), True
    vocab_file, merge_file = tokenizer.vocab_file, tokenizer.merge_file
    return (lambda: _Gigatoken(vocab_file, merge_file)), False  # type: ignore[arg-type]


def resolve_tokenizer(files: list[str], json_keys: tuple[str, ...], *, vocab_file: str | None, merge_file: str | None,
                      tokenizer_model: str | None, train_vocab_size: int, train_bytes: int,
                      out_dir: str) -> Tokenizer:
    """The tokenizer files, a BPE trained on the inputs and saved in ``out_dir`` when none is given."""
    named = named_tokenizer(vocab_file, merge_file, tokenizer_model)
    if named is not None:
        return named
    print(f"No vocabulary given: training a {train_vocab_size}-entry byte-level BPE on {', '.join(files)}", flush=True)
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
    try:
        return Tokenizer.gpt2(vocab_file, merge_file)  # type: ignore[arg-type]
    except TokenizerFileError as e:
        raise TokenizeError(str(e)) from e


@dataclass
class Encoded:
    """What ``encode`` wrote: documents, lines skipped by kind, the first messages about them (piece
    index, line within the piece, kind, detail) and each piece's line count."""
    documents: int
    tokens: int
    skipped: dict[str, int]
    problems: list[tuple[int, int, str, str]]
    lines: list[int]


def encode(pieces: list[Piece], prefixes: dict[str, str], tokenizer: Tokenizer, *, append_eod: bool,
           workers: int, strict: bool, on_chunk: Callable[[], None] = lambda: None,
           allow_empty: bool = False) -> Encoded:
    """Encode ``pieces`` in order into one ``.bin/.idx`` pair per key of ``prefixes``, written under
    temporary names and renamed once complete; ``on_chunk`` runs after each chunk is written. No
    usable document is an error unless ``allow_empty`` (a shard of a larger input)."""
    json_keys = tuple(prefixes)
    new_engine, own_threads = engine_factory(tokenizer)
    workers = 1 if own_threads else workers
    writers = {k: IndexedDatasetWriter(prefixes[k], best_dtype(tokenizer.vocab_size)) for k in json_keys}
    out = Encoded(0, 0, {kind: 0 for kind in SKIP_KINDS}, [], [0] * len(pieces))
    progress = Progress("tokenize", "documents", log_every_s=2.0)
    try:
        items = ((i, chunk) for i, piece in enumerate(pieces) for chunk in read_pieces(piece, json_keys))
        encoder = _Encoder(new_engine, json_keys, append_eod, tokenizer.eod_id, best_dtype(tokenizer.vocab_size))
        for result in _encoded_chunks(encoder, items, workers, CHUNK_TIMEOUT_S):
            encoder.renew_if_grown()
            piece = pieces[result["file"]]
            first_line = out.lines[result["file"]] + 1
            out.lines[result["file"]] += result["lines"]
            for i, kind, detail in result["problems"]:
                line = first_line + i
                if strict:
                    raise BadLine(piece, line, detail, result["file"])
                out.skipped[kind] += 1
                if kind != "blank_line" and out.skipped[kind] <= MAX_MESSAGES_PER_KIND:
                    out.problems.append((result["file"], line, kind, detail))
                    print(f"{piece.where(line)}: skipped: {detail}", flush=True)
            for k, (tokens, lengths) in result["encoded"].items():
                writers[k].add_documents(tokens, lengths)
            out.documents += result["documents"]
            on_chunk()
            progress.add(result["bytes"], items=result["documents"])
            progress.show()
        progress.show(final=True)
        if out.documents == 0 and not allow_empty:
            raise no_document(sorted({p.path for p in pieces}), out.skipped)
        for w in writers.values():
            w.finalize()
    except OSError as e:
        for w in writers.values():
            w.abort()
        raise TokenizeError(f"--output-prefix {next(iter(prefixes.values()))}: writing the output failed "
                            f"({e.strerror or e}); nothing was kept: free space (or fix the folder) and run it again") from e
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    out.tokens = writers[json_keys[0]].num_tokens
    return out


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


def tokenize(inputs: list[str] | str, output_prefix: str, *, vocab_file: str | None = None,
             merge_file: str | None = None, json_keys: tuple[str, ...] | list[str] = ("text",),
             append_eod: bool = True, workers: int | None = None, strict: bool = False,
             train_vocab_size: int = GPT2_VOCAB_SIZE, train_bytes: int = 256 << 20,
             tokenizer_model: str | None = None) -> TokenizeManifest:
    """Tokenize JSONL or Parquet files into one ``.bin/.idx`` pair per JSON key (Parquet: per column).

    ``tokenizer_model`` (a HuggingFace tokenizer.json, or its folder) encodes in place of GPT-2's
    files, on the ``tokenizers`` library's threads. Without any tokenizer, a byte-level BPE of
    ``train_vocab_size`` entries is trained on the first ``train_bytes`` of text and saved as
    ``vocab.json``/``merges.txt`` beside the output. ``strict`` stops at the first bad line
    instead of skipping it.
    """
    json_keys = tuple(json_keys)
    files, tokenizer = inputs_and_tokenizer(inputs, output_prefix, json_keys, vocab_file=vocab_file,
                                            merge_file=merge_file, tokenizer_model=tokenizer_model,
                                            train_vocab_size=train_vocab_size, train_bytes=train_bytes)
    prefixes = output_prefixes(output_prefix, json_keys)
    workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    encoded = encode([Piece(f) for f in files], prefixes, tokenizer, append_eod=append_eod, workers=workers,
                     strict=strict)
    if any(encoded.skipped.values()):
        print(f"Skipped lines: {nonzero_counts(encoded.skipped)}", flush=True)
    return manifest(files, prefixes, tokenizer, append_eod=append_eod, documents=encoded.documents,
                    tokens=encoded.tokens, skipped=encoded.skipped)


def manifest(files: list[str], prefixes: dict[str, str], tokenizer: Tokenizer, *, append_eod: bool,
             documents: int, tokens: int, skipped: dict[str, int]) -> TokenizeManifest:
    """The manifest of a complete output, however it was written (in this process or joined from shards)."""
    stamp = {
        "inputs": [[os.path.abspath(f), os.path.getsize(f)] for f in files],
        "tokenizer": [file_digest(path) for path in tokenizer.files],
        "args": [list(prefixes), append_eod], "outputs": [file_digest(p + ".idx") for p in prefixes.values()],
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


def tokenize_cache_key(context, parameters: dict) -> str:
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


def __getattr__(name: str) -> Any:
    """``tokenize_task``, the stage as a Prefect task, made on first use: the command line never
    imports Prefect (a second and more of start-up)."""
    if name != "tokenize_task":
        raise AttributeError(name)
    from prefect import task

    global tokenize_task
    tokenize_task = task(tokenize, name="tokenize", cache_key_fn=tokenize_cache_key, persist_result=True,
                         log_prints=True)
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
    p.add_argument("--workers", type=int, default=None, help="encoding threads (default: all cores)")
    p.add_argument("--strict", action="store_true", help="fail on the first bad line instead of skipping it")
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE, help="size of the BPE trained when no vocab is given")
    a = p.parse_args(argv)
    if (a.tokenizer_type == "HuggingFaceTokenizer") != (a.tokenizer_model is not None):
        p.error("--tokenizer-type HuggingFaceTokenizer and --tokenizer-model go together")
    log_to_stderr()
    try:
        m = tokenize(a.input, a.output_prefix, vocab_file=a.vocab_file, merge_file=a.merge_file,
                     json_keys=a.json_keys, append_eod=a.append_eod, workers=a.workers, strict=a.strict,
                     train_vocab_size=a.vocab_size, tokenizer_model=a.tokenizer_model)
    except TokenizeError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(m.model_dump_json())


if __name__ == "__main__":
    main()
