"""Token datasets: Megatron's MMIDIDX ``.bin/.idx`` pair, the GPT sample dataset and a mock one.

``.idx`` layout (little-endian): 9-byte magic ``MMIDIDX\\x00\\x00``; ``<Q`` version (1); ``<B`` dtype
code; ``<Q`` sequence count N; ``<Q`` document-index count D; int32[N] sequence lengths;
int64[N] byte offsets of each sequence in ``.bin``; int64[D] document indices (first 0, last N).
``.bin`` holds the token arrays back to back in that dtype. Files written here load in
Megatron-LM / NeMo unchanged, and theirs load here.

The GPT dataset reads the ``.npy`` indices that ``tasks.index`` builds (document, sample and
shuffle indices, plus blending indices when several prefixes are weighted) through a JSON
manifest; every array is memory-mapped, so every rank shares one copy in the page cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpt.files import process_alive
from gpt.token_stats import record, recorded

MAGIC = b"MMIDIDX\x00\x00"
COPY_BLOCK = 16 << 20     # bytes per read when a .bin is copied into another
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexFormatError(ValueError):
    """A ``.bin/.idx`` pair that is truncated, corrupt or inconsistent."""


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks: uint16 below 65,500 entries, int32 otherwise."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _dtype_code(dtype: np.dtype | type) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(
            f"dtype {np.dtype(dtype)} has no MMIDIDX code; use one of "
            f"{sorted(str(np.dtype(t)) for t in DTYPE_CODES.values())}"
        ) from None


class MMapIndexedDataset:
    """Read-only view of ``<prefix>.bin/.idx``: memory-mapped, never copied.

    ``sizes`` (int32), ``pointers`` (int64 byte offsets) and ``document_indices`` (int64) are views
    into the mapped ``.idx``; ``self[i]`` and ``get`` return views into the mapped ``.bin``.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: not found (expected the pair {self.prefix}.bin/.idx)")
        idx_size = os.path.getsize(self.idx_path)
        if idx_size < _HEADER.size:
            raise IndexFormatError(
                f"{self.idx_path}: truncated: {idx_size} bytes, shorter than the {_HEADER.size}-byte header"
            )
        with open(self.idx_path, "rb") as f:
            magic, version, code, n, d = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC:
            raise IndexFormatError(f"{self.idx_path}: bad magic {magic!r}, expected {MAGIC!r}: not an MMIDIDX index")
        if version != VERSION:
            raise IndexFormatError(f"{self.idx_path}: unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexFormatError(f"{self.idx_path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 12 * n + 8 * d
        if idx_size != expected:
            raise IndexFormatError(
                f"{self.idx_path}: {idx_size} bytes, but the header's {n} sequences and {d} document "
                f"indices need {expected}: the file is truncated or corrupt"
            )
        self.idx_bytes = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(self.idx_bytes, dtype=np.int32, count=n, offset=_HEADER.size)
        self.pointers = np.frombuffer(self.idx_bytes, dtype=np.int64, count=n, offset=_HEADER.size + 4 * n)
        self.document_indices = np.frombuffer(self.idx_bytes, dtype=np.int64, count=d, offset=_HEADER.size + 12 * n)
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexFormatError(
                f"{self.idx_path}: document indices must start at 0 and end at the sequence count {n}; "
                f"found {d} entries" + (f" from {self.document_indices[0]} to {self.document_indices[-1]}" if d else "")
            )
        bin_size = os.path.getsize(self.bin_path)
        tokens = int(self.sizes.sum(dtype=np.int64))
        if n and int(self.sizes.min()) < 0:
            raise IndexFormatError(f"{self.idx_path}: negative sequence length")
        if tokens * self.dtype.itemsize != bin_size:
            raise IndexFormatError(
                f"{self.bin_path}: {bin_size} bytes, but {self.idx_path} lists {tokens} tokens of "
                f"{self.dtype} ({tokens * self.dtype.itemsize} bytes): the pair is truncated or mismatched"
            )
        step = self.dtype.itemsize
        if n and (self.pointers[0] != 0 or int(self.pointers[-1]) + int(self.sizes[-1]) * step != bin_size
                  or not np.array_equal(self.pointers[1:], self.pointers[:-1] + self.sizes[:-1].astype(np.int64) * step)):
            bad = int(np.argmax(self.pointers[1:] != self.pointers[:-1] + self.sizes[:-1].astype(np.int64) * step)) + 1
            raise IndexFormatError(f"{self.idx_path}: sequence offsets do not match the sequence lengths (first at "
                                   f"sequence {bad if n > 1 else 0}): the index is corrupt; tokenize the data again")
        if d > 1 and bool(np.any(np.diff(self.document_indices) < 0)):
            raise IndexFormatError(f"{self.idx_path}: document indices go backwards: the index is corrupt")

    @functools.cached_property
    def _bin(self) -> np.ndarray:
        """The ``.bin``, mapped on first use (building indices reads only the ``.idx``), while it is
        still the size the ``.idx`` was checked against."""
        if os.path.getsize(self.bin_path) != self.num_tokens * self.dtype.itemsize:
            raise IndexFormatError(f"{self.bin_path} changed size since {self.idx_path} was read: read the pair again")
        return np.memmap(self.bin_path, dtype=np.uint8, mode="r") if self.num_tokens else np.empty(0, np.uint8)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def max_token_id(self, block: int = 1 << 26) -> int:
        """The largest token id in the ``.bin`` (-1 when empty), read in blocks of ``block`` tokens."""
        tokens = self._bin.view(self.dtype) if self._bin.size else np.empty(0, self.dtype)
        return max((int(tokens[i:i + block].max()) for i in range(0, tokens.size, block)), default=-1)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` as a view into the mapped ``.bin``."""
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.bin_path}: sequence {i} has {size} tokens; [{offset}, {offset + length}) is out of range")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)


def write_index(path: str | os.PathLike, sizes: np.ndarray, document_indices: np.ndarray, dtype: np.dtype | type) -> None:
    """Write an ``.idx`` for sequences of ``sizes`` tokens stored back to back in ``.bin``."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    document_indices = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _dtype_code(dtype), len(sizes), len(document_indices)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(document_indices.astype("<i8").tobytes())


def _remove_stale_temps(prefix: str) -> None:
    """Remove ``<prefix>.bin/.idx.tmp-<pid>`` left by a writer that was killed (its process is gone)."""
    folder, name = os.path.split(prefix)
    for entry in os.listdir(folder or "."):
        stem, _, pid = entry.rpartition(".tmp-")
        if stem in (name + ".bin", name + ".idx") and pid.isdigit() and not process_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, entry))


def _append_file(source: Any, out: Any) -> None:
    """Append the rest of ``source`` to ``out`` (both open files): copied by the kernel where it can,
    file system to file system (a reflink where the file system shares blocks), else read and written."""
    out.flush()
    expected = out.seek(0, os.SEEK_END) + os.fstat(source.fileno()).st_size - source.tell()
    try:
        while os.copy_file_range(source.fileno(), out.fileno(), COPY_BLOCK):
            pass
    except OSError:
        out.seek(0, os.SEEK_END)
        shutil.copyfileobj(source, out, COPY_BLOCK)
    if out.seek(0, os.SEEK_END) != expected:
        raise OSError(f"{source.name}: {out.tell()} bytes where {expected} were expected after copying it into "
                      f"{out.name}")


class IndexedDatasetWriter:
    """Writes ``<prefix>.bin/.idx`` under temporary names and renames them on ``finalize``.

    Use as a context manager: an exception (or interrupt) removes the temporary files, so no
    partial pair ever appears under the final name.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(self.prefix)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = self.prefix + ".bin" + suffix
        self._idx_tmp = self.prefix + ".idx" + suffix
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []  # sequence count after each document
        self._sequences = 0
        self._tokens = 0
        self._max_token_id = -1

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document made of one sequence."""
        arr = np.asarray(tokens)
        self.add_documents(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` documents whose tokens lie back to back in ``tokens``."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} but {tokens.size} tokens were given")
        hi = int(tokens.max()) if tokens.size else -1
        self._max_token_id = max(self._max_token_id, hi)
        if tokens.dtype != self.dtype:
            if tokens.size and self.dtype.kind in "iu":
                info = np.iinfo(self.dtype)
                lo = int(tokens.min())
                if lo < info.min or hi > info.max:
                    raise ValueError(f"{self.prefix}: token ids [{lo}, {hi}] do not fit {self.dtype}; choose a wider dtype")
            tokens = tokens.astype(self.dtype)
        self._bin.write(np.ascontiguousarray(tokens).data)
        self._sizes.append(lengths.astype(np.int32))
        self._doc_ends.append(self._sequences + np.arange(1, len(lengths) + 1, dtype=np.int64))
        self._sequences += len(lengths)
        self._tokens += tokens.size

    def add_dataset(self, prefix: str | os.PathLike) -> None:
        """Append every document of another ``<prefix>.bin/.idx`` of this dtype, its tokens copied
        byte for byte: the result is what adding its documents one by one would write."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{other.idx_path} holds {other.dtype} tokens; this output holds {self.dtype}")
        with open(other.bin_path, "rb") as f:
            _append_file(f, self._bin)
        seen = recorded(other.prefix)
        self._max_token_id = max(self._max_token_id, seen["max_token_id"] if seen else other.max_token_id())
        self._sizes.append(np.array(other.sizes, dtype=np.int32))
        self._doc_ends.append(self._sequences + np.asarray(other.document_indices[1:], dtype=np.int64))
        self._sequences += len(other.sizes)
        self._tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the ``.idx``, move both files to their final names, and record what was written
        beside them (gpt.token_stats)."""
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.empty(0, np.int32)
        doc_idx = np.concatenate([np.zeros(1, np.int64), *self._doc_ends])
        write_index(self._idx_tmp, sizes, doc_idx, self.dtype)
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")
        record(self.prefix, documents=self.num_documents, tokens=self._tokens, max_token_id=self._max_token_id)

    def abort(self) -> None:
        """Drop the temporary files."""
        self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def num_documents(self) -> int:
        return sum(len(d) for d in self._doc_ends)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _load_npy(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


@dataclass(frozen=True)
class IndexedPart:
    """One prefix's indices for one split; file names are relative to the manifest's folder.
    ``first``: the position of its order it starts at (a later phase of a run goes on with the
    order an earlier one drew from)."""
    prefix: str
    description: str
    document_index: str
    sample_index: str
    shuffle_index: str
    first: int = 0


@dataclass(frozen=True)
class Blend:
    """For each sample of a blended split: which part, and which sample of that part."""
    dataset_index: str
    dataset_sample_index: str


@dataclass(frozen=True)
class IndexedSplit:
    datasets: list[IndexedPart]
    blend: Blend | None
    num_samples: int
    skipped: list[int] = dataclasses.field(default_factory=list)   # positions of the order left out, ascending


@dataclass(frozen=True)
class DataIndex:
    """The index manifest (``<digest>-index.json``): written by tasks.index, read by GPTDataset."""
    seq_length: int
    add_extra_token: int
    seed: int
    split: str
    splits: dict[str, IndexedSplit]
    version: int = 1
    built_with: dict[str, Any] = dataclasses.field(default_factory=dict)   # tasks.index.build_indices' arguments

    def files(self) -> list[str]:
        """Every index file the manifest names."""
        out = [getattr(p, k) for s in self.splits.values() for p in s.datasets
               for k in ("document_index", "sample_index", "shuffle_index")]
        return out + [getattr(s.blend, k) for s in self.splits.values() if s.blend
                      for k in ("dataset_index", "dataset_sample_index")]

    def drawn_from(self) -> list[Any]:
        """What the samples are drawn from, whatever their number: each prefix by its content
        (its fingerprint), the split, seed and sequence length. Two indices with the same answer
        order the same text the same way."""
        parts = sorted({json.dumps({k: d[k] for k in ("prefix", "files", "split", "split_name")}, sort_keys=True)
                        for s in self.splits.values() for d in (json.loads(p.description) for p in s.datasets)})
        return [self.seq_length, self.seed, self.split, parts]

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        for split in raw["splits"].values():         # a part from the start of its order is written as before
            for part in split["datasets"]:
                if not part["first"]:
                    del part["first"]
        return json.dumps(raw, indent=1, sort_keys=True)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "DataIndex":
        try:
            raw = json.loads(Path(path).read_text())
            splits = {name: IndexedSplit([IndexedPart(**p) for p in s["datasets"]],
                                         Blend(**s["blend"]) if s.get("blend") else None, s["num_samples"],
                                         s.get("skipped", []))
                      for name, s in raw["splits"].items()}
            return cls(raw["seq_length"], raw.get("add_extra_token", 1), raw["seed"], raw["split"], splits,
                       raw.get("version", 1), raw.get("built_with", {}))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: cannot read the index manifest ({e}); build it with `python -m tasks.index`") from e


class _SplitPart:
    """One prefix's samples within a split: the document, sample and shuffle indices over its tokens."""

    def __init__(self, part: IndexedPart, root: Path, seq_length: int, add_extra_token: int) -> None:
        self.data = MMapIndexedDataset(part.prefix)
        self.document_index = _load_npy(root / part.document_index)
        self.sample_index = _load_npy(root / part.sample_index)
        self.shuffle_index = _load_npy(root / part.shuffle_index)
        self.first = part.first
        self.length = seq_length + add_extra_token
        self.add_extra_token = add_extra_token

    def __len__(self) -> int:
        return len(self.shuffle_index) - self.first

    def documents(self, i: int) -> list[int]:
        """The documents (their index in the prefix) sample ``i`` draws tokens from."""
        j = int(self.shuffle_index[self.first + i])
        first, last = int(self.sample_index[j][0]), int(self.sample_index[j + 1][0])
        return [int(d) for d in self.document_index[first:last + 1]]

    def pieces(self, i: int) -> np.ndarray:
        """The lengths of the document pieces sample ``i`` is made of, in order."""
        j = int(self.shuffle_index[self.first + i])
        doc_beg, off_beg = (int(x) for x in self.sample_index[j])
        doc_end, off_end = (int(x) for x in self.sample_index[j + 1])
        if doc_beg == doc_end:
            return np.array([off_end - off_beg + self.add_extra_token])
        sizes = self.data.sizes[self.document_index[doc_beg:doc_end + 1]].astype(np.int64)
        sizes[0] -= off_beg
        sizes[-1] = off_end + self.add_extra_token
        return sizes

    def sample(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[self.first + i])
        doc_beg, off_beg = (int(x) for x in self.sample_index[j])
        doc_end, off_end = (int(x) for x in self.sample_index[j + 1])
        docs = self.document_index
        if doc_beg == doc_end:
            out = self.data.get(int(docs[doc_beg]), off_beg, off_end - off_beg + self.add_extra_token)
            return out.astype(np.int64)
        pieces = [self.data.get(int(docs[doc_beg]), off_beg)]
        pieces += [self.data.get(int(docs[k])) for k in range(doc_beg + 1, doc_end)]
        pieces.append(self.data.get(int(docs[doc_end]), 0, off_end + self.add_extra_token))
        return np.concatenate(pieces).astype(np.int64)


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens in the order fixed by the indices ``tasks.index`` built.

    The order depends only on the indices (seed, split, sequence length, sample counts), never on
    the number of ranks reading them. A split that received no documents or samples has length 0.
    Positions the split skips (samples rolled back around a loss spike) are left out: sample ``i``
    is the ``i``-th position of the order that is not skipped, so every sample before the first
    skipped one keeps its place and every later one moves up.
    """

    def __init__(self, parts: list[_SplitPart], seq_length: int, num_samples: int,
                 dataset_index: np.ndarray | None = None, dataset_sample_index: np.ndarray | None = None,
                 skipped: list[int] = ()) -> None:
        self.parts = parts
        self.seq_length = seq_length
        self.num_samples = num_samples - len(skipped)
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        # The j-th skipped position has (position - j) kept positions before it.
        self._kept_before_skip = np.asarray(sorted(skipped), dtype=np.int64) - np.arange(len(skipped))

    @classmethod
    def from_index(cls, manifest_path: str | os.PathLike, split: str) -> "GPTDataset":
        manifest_path = Path(manifest_path)
        manifest = DataIndex.read(manifest_path)
        if split not in manifest.splits:
            raise ValueError(f"{manifest_path}: no split {split!r}; it holds {sorted(manifest.splits)}")
        entry = manifest.splits[split]
        root = manifest_path.parent
        parts = [_SplitPart(p, root, manifest.seq_length, manifest.add_extra_token) for p in entry.datasets]
        if entry.blend:
            dataset_index = _load_npy(root / entry.blend.dataset_index)
            dataset_sample_index = _load_npy(root / entry.blend.dataset_sample_index)
            return cls(parts, manifest.seq_length, len(dataset_index), dataset_index, dataset_sample_index,
                       entry.skipped)
        return cls(parts, manifest.seq_length, len(parts[0]) if parts else 0, skipped=entry.skipped)

    def __len__(self) -> int:
        return self.num_samples

    def position(self, i: int) -> int:
        """Sample ``i``'s position in the order before any was skipped: the sample's id, which a
        rollback names and skips."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a dataset of {self.num_samples} samples")
        return i + int(np.searchsorted(self._kept_before_skip, i, side="right"))

    def _part_sample(self, position: int) -> tuple[_SplitPart, int]:
        if self.dataset_index is None:
            return self.parts[0], position
        return self.parts[int(self.dataset_index[position])], int(self.dataset_sample_index[position])

    def documents(self, i: int) -> tuple[str, list[int]]:
        """The prefix and the documents (by their index in it) that sample ``i`` is made of."""
        part, j = self._part_sample(self.position(i))
        return part.data.prefix, part.documents(j)

    def __getitem__(self, i: int) -> np.ndarray:
        part, j = self._part_sample(self.position(i))
        return part.sample(j)

    def pieces(self, i: int) -> np.ndarray:
        """The lengths of the documents' pieces sample ``i`` is packed from, in order (they sum to
        its seq_length + 1 tokens): where attention and positions restart with reset_attention_mask
        and reset_position_ids."""
        part, j = self._part_sample(self.position(i))
        return part.pieces(j)


class MockGPTDataset:
    """Random tokens, no files: sample ``i`` depends only on ``(seed, i)``."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 1234) -> None:
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def position(self, i: int) -> int:
        return i

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a dataset of {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)

    def pieces(self, i: int) -> np.ndarray:
        """One document per sample."""
        return np.array([self.seq_length + 1])
