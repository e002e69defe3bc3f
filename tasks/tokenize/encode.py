"""The tokenize stage's encoding: the engines (gigatoken for GPT-2's pair, the ``tokenizers``
library's batch encoder for a tokenizer.json), chunks encoded on threads of this one process and
written strictly in input order, so the output is byte-identical for any worker count and memory
stays bounded by ``2 * workers`` in-flight chunks. Nothing is forked, so it is safe inside a flow
run's threads."""
from __future__ import annotations

import collections
import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import orjson

from gpt.data import IndexedDatasetWriter, best_dtype
from gpt.tokenizer import Tokenizer
from tasks.common.progress import Progress
from tasks.common.run_context import run_logger
from tasks.tokenize.bpe import TokenizeError, build_encoder
from tasks.tokenize.hf_encoder import HFEncoder
from tasks.tokenize.inputs import BadLine, Piece, read_pieces
from tasks.tokenize.outputs import no_document

# The engine caches every distinct pretoken it meets, so on text whose words never stop varying it
# grows without bound (about 7 MB per MB of random words, on each encoding thread). Once this
# process has grown by more than this since its engine was built, a fresh engine takes over. On
# varied real text the cache earns its memory (a fresh engine encodes at half speed until it is
# warm again), so it may grow this far while the process stays under 1 GiB.
ENCODER_CACHE_BYTES = 256 << 20
# A 4 MiB chunk encodes in well under a second; a chunk not done after this long means a stuck engine.
CHUNK_TIMEOUT_S = 600.0
MAX_MESSAGES_PER_KIND = 20
SKIP_KINDS = ("malformed_json", "missing_key", "invalid_utf8", "empty_document", "tokenizer_failed", "blank_line")


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
                 eod_id: int, dtype: np.dtype, name: str = "tokenizer", bos_ids: tuple[int, ...] = ()) -> None:
        self.new_engine, self.name = new_engine, name
        self.keys, self.append_eod, self.eod_id, self.dtype = keys, append_eod, eod_id, dtype
        self.bos_ids = np.asarray(bos_ids, dtype=dtype)
        self.engine = new_engine()
        self.base_rss = _rss_bytes()

    def renew_if_grown(self) -> None:
        """A fresh engine once the caches have grown past ENCODER_CACHE_BYTES (chunks in flight
        finish on the engine they started with)."""
        if _rss_bytes() - self.base_rss > ENCODER_CACHE_BYTES:
            self.engine = self.new_engine()
            _release_free_memory()          # what the old engine's caches held, once its chunks finish
            self.base_rss = _rss_bytes()

    def encode_keys(self, texts: dict[str, list[str]]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                                                               dict[int, str]]:
        """Each key's documents encoded; and the documents (by index) the tokenizer fails on, with
        why, which are left out of every key. The ``tokenizers`` library reports a failure inside
        its Rust code (a pre-tokenizer's regex that gives up on a document, say) as a panic, which
        Python sees as a BaseException: it is that document's problem, not the run's end."""
        encoded, failed = {}, {}
        for key, key_texts in texts.items():
            try:
                encoded[key] = self.encode(key_texts)
            except BaseException as e:      # noqa: BLE001 -- PanicException derives from BaseException
                if type(e).__name__ != "PanicException":
                    raise
                failed.update(self._failures(key_texts))
        if failed:
            encoded = {k: self.encode([t for i, t in enumerate(v) if i not in failed]) for k, v in texts.items()}
        return encoded, failed

    def _failures(self, texts: list[str]) -> dict[int, str]:
        failed = {}
        for i, text in enumerate(texts):
            try:
                self.engine([text])
            except BaseException as e:      # noqa: BLE001
                if type(e).__name__ != "PanicException":
                    raise
                failed[i] = f"the tokenizer {self.name} fails on this document ({str(e).splitlines()[0][:200]})"
        return failed

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Flat tokens (with the beginning-of-text ids before each document and EOD after it, if
        asked) and per-document lengths."""
        content, lengths = self.engine(texts)
        before, after = len(self.bos_ids), int(self.append_eod)
        if not before and not after:
            return content.astype(self.dtype), lengths
        framed = lengths + before + after
        out = np.empty(int(framed.sum()), dtype=self.dtype)
        starts = np.cumsum(framed) - framed
        keep = np.ones(out.size, dtype=bool)
        for i, token in enumerate(self.bos_ids):
            out[starts + i] = token
            keep[starts + i] = False
        if after:
            out[starts + framed - 1] = self.eod_id
            keep[starts + framed - 1] = False
        out[keep] = content
        return out, framed

    def chunk(self, data) -> dict:
        """Parse and encode one chunk (bytes of JSONL lines, or a batch of Parquet rows); problems are
        reported by line or row (0-based within the chunk)."""
        if not isinstance(data, bytes):
            return self.rows(data)
        keys = self.keys
        texts: dict[str, list[str]] = {k: [] for k in keys}
        document_lines: list[int] = []
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
                document_lines.append(i)
        encoded, failed = self.encode_keys(texts)
        problems = sorted(problems + [(document_lines[d], "tokenizer_failed", why) for d, why in failed.items()])
        return {"documents": len(document_lines) - len(failed), "bytes": len(data), "lines": len(lines),
                "encoded": encoded, "problems": problems}

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
        encoded, failed = self.encode_keys({k: [column[i] for i in keep] for k, column in zip(self.keys, columns)})
        problems = sorted(problems + [(keep[d], "tokenizer_failed", why) for d, why in failed.items()])
        return {"documents": len(keep) - len(failed), "bytes": batch.nbytes, "lines": batch.num_rows,
                "encoded": encoded, "problems": problems}


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


def bos_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The beginning-of-text ids the tokenizer's post-processor adds; TokenizeError when it adds none."""
    ids = tuple(tokenizer.bos_ids())
    if not ids:
        raise TokenizeError(f"tokenizer.add_bos_token: the tokenizer {tokenizer.tokenizer_file or '(GPT-2 BPE)'} adds "
                            "no beginning-of-text token to a document (its post-processor names none); drop "
                            "add_bos_token")
    return ids


def engine_factory(tokenizer: Tokenizer) -> tuple[Callable[[], Engine], bool]:
    """A maker of fresh engines for ``tokenizer``, and whether the engine runs its own threads (one
    chunk at a time then)."""
    if tokenizer.tokenizer_file:
        hf = HFEncoder(tokenizer)
        return (lambda: hf), True
    vocab_file, merge_file = tokenizer.vocab_file, tokenizer.merge_file
    return (lambda: _Gigatoken(vocab_file, merge_file)), False  # type: ignore[arg-type]


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
           allow_empty: bool = False, add_bos_token: bool = False) -> Encoded:
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
        encoder = _Encoder(new_engine, json_keys, append_eod, tokenizer.eod_id, best_dtype(tokenizer.vocab_size),
                           tokenizer.tokenizer_file or "GPT-2 BPE", bos_ids(tokenizer) if add_bos_token else ())
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
                    run_logger().info(f"{piece.where(line)}: skipped: {detail}")
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
