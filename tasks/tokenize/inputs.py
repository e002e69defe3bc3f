"""What the tokenize stage reads: JSON lines (plain, .gz, .xz, .zst) streamed in chunks of whole
lines, or Parquet read a batch of rows of the chosen columns at a time; the pieces a file is split
into for a job array's shards, and the place of a line in its file."""
from __future__ import annotations

import glob
import gzip
import lzma
import os
from dataclasses import dataclass
from typing import IO, Iterator

import orjson

from tasks.tokenize.bpe import TokenizeError

# What the stage reads: JSON lines, plain or compressed, and Parquet.
INPUT_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.xz", ".json.xz", ".jsonl.zst", ".json.zst",
                  ".parquet")
CHUNK_BYTES = 4 << 20
PARQUET_ROWS = 1024           # rows per batch read from a Parquet file (web documents: a few MB)


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

    def __reduce__(self) -> tuple:
        """Pickled by its fields (a job returns it to the process that submitted it)."""
        return BadLine, (self.piece, self.line, self.detail, self.index)
