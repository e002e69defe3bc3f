"""The tokenize stage's encoding: the engines (gigatoken for GPT-2's pair, the ``tokenizers``
library's batch encoder for a tokenizer.json), chunks encoded on threads of this one process and
written strictly in input order, so the output is byte-identical for any worker count and memory
stays bounded by ``2 * workers`` in-flight chunks. Nothing is forked, so it is safe inside a flow
run's threads."""
from __future__ import annotations

import collections
import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import awkward as ak
import numpy as np
import orjson

from gpt.data import IndexedDatasetWriter, best_dtype
from gpt.tokenizer import Tokenizer
from native import jsonl
from tasks.common.progress import Progress
from tasks.common.run_context import run_logger
from tasks.tokenize.bpe import TokenizeError, gpt2_bpe
from tasks.tokenize.hf_encoder import HFEncoder
from tasks.tokenize.inputs import BadLine, Piece, read_pieces
from tasks.tokenize.outputs import no_document

# The engine caches every distinct pretoken it meets, so on text whose words never stop varying it
# grows without bound (about 7 MB per MB of random words, on each encoding thread). Once this
# process has grown by more than this since its last engine was built, each thread takes a fresh
# one. On varied real text the caches earn their memory (a fresh engine encodes at half speed until
# it is warm again), so they may grow this far, all threads together; each engine itself is about
# 34 MB (GPT-2's vocabulary), one per encoding thread.
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


Engine = Callable[[list[str] | ak.Array], tuple[np.ndarray, np.ndarray]]   # documents -> flat ids, lengths


class Problem(NamedTuple):
    """Why a line or row is skipped: its kind (one of SKIP_KINDS) and the detail its message gives."""
    kind: str
    detail: str


BLANK_LINE = Problem("blank_line", "blank line")


def _strings(text: np.ndarray, offsets: np.ndarray) -> ak.Array:
    """Documents as the engine takes them whole: their UTF-8 bytes in one buffer, and offsets."""
    chars = ak.contents.NumpyArray(text, parameters={"__array__": "char"})
    return ak.Array(ak.contents.ListOffsetArray(ak.index.Index64(offsets), chars, parameters={"__array__": "string"}))


class GigatokenEngine:
    """GPT-2's byte-level BPE (vocab.json and merges.txt, as gpt2_bpe reads them) on the gigatoken engine."""

    takes_buffers = True        # documents as one UTF-8 buffer and offsets (an awkward array of strings)

    def __init__(self, bpe: Any) -> None:
        import gigatoken

        self.engine = gigatoken.Tokenizer(bpe)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        layout = self.engine.encode_batch(texts, parallel=False).layout
        offsets = np.asarray(layout.offsets.data, dtype=np.int64)
        return np.asarray(layout.content.data)[offsets[0]:offsets[-1]], np.diff(offsets)


class ChunkEncoder:
    """What to encode and how, shared by the encoding threads; each thread encodes on an engine of
    its own: an engine's cache of pretokens has one lock, so threads sharing one wait on each other
    (two threads on one engine encode no faster than one)."""

    def __init__(self, new_engine: Callable[[], Engine], keys: tuple[str, ...], append_eod: bool,
                 eod_id: int, dtype: np.dtype, name: str = "tokenizer", bos_ids: tuple[int, ...] = ()) -> None:
        self.new_engine, self.name = new_engine, name
        self.keys, self.append_eod, self.eod_id, self.dtype = keys, append_eod, eod_id, dtype
        self.bos_ids = np.asarray(bos_ids, dtype=dtype)
        self.generation = 0                 # engines of an earlier one are renewed at their next use
        self.local, self.building = threading.local(), threading.Lock()
        self.base_rss: int | None = None    # taken after the last engine built

    @property
    def engine(self) -> Engine:
        """This thread's engine, built on its first use and again at its first use once renewed."""
        local = self.local
        if getattr(local, "generation", None) != self.generation:
            generation, local.engine = self.generation, None       # the old engine's caches go first
            with self.building:     # a build holds the GIL: one at a time, the first thread encodes sooner
                local.engine, local.generation = self.new_engine(), generation
                self.base_rss = None        # an engine built is not cache grown: measured again
        return local.engine

    def renew_if_grown(self) -> None:
        """Fresh engines once the caches have grown past ENCODER_CACHE_BYTES since the last engine
        was built: each thread takes one at its next use."""
        base = self.base_rss                # read once: a thread that builds an engine resets it
        if base is None:
            _release_free_memory()          # what the earlier engines' caches held
            self.base_rss = _rss_bytes()
        elif _rss_bytes() - base > ENCODER_CACHE_BYTES:
            self.generation += 1
            self.base_rss = None

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
        reported by line or row (0-based within the chunk). The native reader takes the lines it is
        sure of with the GIL released, and hands the engine their texts as one buffer per key; the
        lines it leaves are read here, and a chunk where one of those is a document is read here whole."""
        if not isinstance(data, bytes):
            return self.rows(data)
        status, starts, fields = jsonl.read(data, list(self.keys))
        problems: list[tuple[int, str, str]] = []
        for i in np.flatnonzero(status != jsonl.DOCUMENT).tolist():
            read = BLANK_LINE if status[i] == jsonl.BLANK else self.line(data[starts[i]:starts[i + 1]].removesuffix(b"\n"))
            if not isinstance(read, Problem):
                return self.lines(data)
            problems.append((i, *read))
        texts = {k: _strings(*field) if self.engine.takes_buffers else _strings(*field).to_list()
                 for k, field in zip(self.keys, fields)}
        return self.encoded(texts, np.flatnonzero(status == jsonl.DOCUMENT).tolist(), problems, len(data), len(status))

    def lines(self, data: bytes) -> dict:
        """A chunk read line by line here."""
        texts: dict[str, list[str]] = {k: [] for k in self.keys}
        document_lines: list[int] = []
        problems: list[tuple[int, str, str]] = []
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, raw in enumerate(lines):
            read = self.line(raw)
            if isinstance(read, Problem):
                problems.append((i, *read))
                continue
            for k, v in zip(self.keys, read):
                texts[k].append(v)
            document_lines.append(i)
        return self.encoded(texts, document_lines, problems, len(data), len(lines))

    def line(self, raw: bytes) -> list[str] | Problem:
        """One JSON line's texts, one per key, or what is wrong with it."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            if not raw.strip():
                return BLANK_LINE
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as u:
                return Problem("invalid_utf8", f"invalid UTF-8 at byte {u.start}")
            return Problem("malformed_json", f"malformed JSON ({e})")
        values = []
        for k in self.keys:
            v = obj.get(k) if isinstance(obj, dict) else None
            if not isinstance(v, str):
                return Problem("missing_key", f"no string field {k!r}")
            if not v:
                return Problem("empty_document", f"field {k!r} is empty")
            values.append(v)
        return values

    def encoded(self, texts: dict, document_lines: list[int], problems: list[tuple[int, str, str]], size: int,
                lines: int) -> dict:
        """A chunk's documents encoded, with its problems and the documents the tokenizer fails on."""
        encoded, failed = self.encode_keys(texts)
        problems = sorted(problems + [(document_lines[d], "tokenizer_failed", why) for d, why in failed.items()])
        return {"documents": len(document_lines) - len(failed), "bytes": size, "lines": lines,
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
        texts = {k: [column[i] for i in keep] for k, column in zip(self.keys, columns)}
        return self.encoded(texts, keep, problems, batch.nbytes, batch.num_rows)


def _encoded_chunks(encoder: ChunkEncoder, items: Iterator[tuple[int, bytes]], workers: int,
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
    bpe = gpt2_bpe(tokenizer.vocab_file, tokenizer.merge_file)   # type: ignore[arg-type] -- read once, for every engine
    return (lambda: GigatokenEngine(bpe)), False


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
        encoder = ChunkEncoder(new_engine, json_keys, append_eod, tokenizer.eod_id, best_dtype(tokenizer.vocab_size),
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
