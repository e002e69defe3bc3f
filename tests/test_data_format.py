"""MMIDIDX .bin/.idx: round trips, an independent reader, corrupt files, interrupted writes."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from gpt.data import (
    DTYPE_CODES,
    IndexedDatasetWriter,
    IndexFormatError,
    MMapIndexedDataset,
    MockGPTDataset,
    best_dtype,
)


def independent_read(prefix: str) -> tuple[np.dtype, list[np.ndarray], list[int]]:
    """Parse the pair from the documented layout alone, with struct and plain file reads."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", idx, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", idx, 17)
    n, d = struct.unpack_from("<QQ", idx, 18)
    pos = 34
    sizes = struct.unpack_from(f"<{n}i", idx, pos)
    pos += 4 * n
    pointers = struct.unpack_from(f"<{n}q", idx, pos)
    pos += 8 * n
    docs = list(struct.unpack_from(f"<{d}q", idx, pos))
    assert pos + 8 * d == len(idx)
    dtype = np.dtype({1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}[code])
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [np.frombuffer(data[p:p + s * dtype.itemsize], dtype=dtype) for p, s in zip(pointers, sizes)]
    return dtype, seqs, docs


@pytest.mark.parametrize("dtype", sorted({np.dtype(t).name for t in DTYPE_CODES.values()}))
def test_round_trip_every_dtype(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 120, size=n).astype(dtype) for n in (5, 0, 1, 300, 17)]
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    ds = MMapIndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(docs) and ds.num_documents == len(docs)
    assert ds.sizes.dtype == np.int32 and ds.document_indices.dtype == np.int64
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    np.testing.assert_array_equal(ds.get(3, offset=10, length=5), docs[3][10:15])
    # views into the mapping, not copies
    assert not ds[3].flags.owndata and not ds.sizes.flags.owndata
    ind_dtype, seqs, doc_idx = independent_read(prefix)
    assert ind_dtype == np.dtype(dtype).newbyteorder("<")
    assert doc_idx == list(range(len(docs) + 1))
    for s, d in zip(seqs, docs):
        np.testing.assert_array_equal(s, d)


def test_bulk_add_documents_and_range_check(tmp_path):
    prefix = str(tmp_path / "bulk")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_documents(np.arange(10, dtype=np.uint32), np.array([3, 7]))
    ds = MMapIndexedDataset(prefix)
    np.testing.assert_array_equal(ds[1], np.arange(3, 10))
    with pytest.raises(ValueError, match="do not fit uint16"):
        with IndexedDatasetWriter(str(tmp_path / "big"), np.uint16) as w:
            w.add_document(np.array([70000], dtype=np.int64))
    assert not list(tmp_path.glob("big*"))


def _write(prefix: str) -> None:
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([4, 5])


def test_corrupt_files_name_file_and_problem(tmp_path):
    p = str(tmp_path / "c")
    _write(p)
    idx = open(p + ".idx", "rb").read()
    cases = {
        "bad magic": b"NOTANIDX\x00" + idx[9:],
        "unsupported version": idx[:9] + struct.pack("<Q", 2) + idx[17:],
        "unknown dtype code": idx[:17] + b"\x09" + idx[18:],
        "truncated or corrupt": idx[:-4],
    }
    for message, content in cases.items():
        open(p + ".idx", "wb").write(content)
        with pytest.raises(IndexFormatError, match=message) as e:
            MMapIndexedDataset(p)
        assert p + ".idx" in str(e.value)
    open(p + ".idx", "wb").write(idx)
    open(p + ".bin", "ab").write(b"\x00\x00")
    with pytest.raises(IndexFormatError, match="truncated or mismatched") as e:
        MMapIndexedDataset(p)
    assert p + ".bin" in str(e.value)
    open(p + ".idx", "wb").write(idx[:10])
    with pytest.raises(IndexFormatError, match="header"):
        MMapIndexedDataset(p)
    with pytest.raises(FileNotFoundError, match="missing.idx"):
        MMapIndexedDataset(str(tmp_path / "missing"))


def test_moved_offsets_and_swapped_lengths_are_found_on_open(tmp_path):
    """Both keep the header, the file sizes and the token total right: only the offsets tell."""
    p = str(tmp_path / "c")
    with IndexedDatasetWriter(p, np.uint16) as w:
        for doc in ([1, 2, 3], [4, 5], [6]):
            w.add_document(doc)
    idx = bytearray(open(p + ".idx", "rb").read())
    header, n = 34, 3                        # magic 9, version 8, dtype 1, counts 8 + 8
    sizes_at, pointers_at = header, header + 4 * n
    moved = bytearray(idx)
    moved[pointers_at + 8:pointers_at + 16] = struct.pack("<q", 4)
    swapped = bytearray(idx)
    swapped[sizes_at:sizes_at + 8] = struct.pack("<ii", 2, 3)
    for content in (moved, swapped):
        open(p + ".idx", "wb").write(bytes(content))
        with pytest.raises(IndexFormatError, match="offsets do not match the sequence lengths") as e:
            MMapIndexedDataset(p)
        assert p + ".idx" in str(e.value)


def test_interrupted_write_leaves_nothing(tmp_path):
    p = str(tmp_path / "x")
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(p, np.uint16) as w:
            w.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_best_dtype():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32


def test_mock_dataset_is_deterministic():
    a, b = MockGPTDataset(10, 16, 100, seed=3), MockGPTDataset(10, 16, 100, seed=3)
    assert len(a) == 10
    x = a[4]
    assert x.dtype == np.int64 and x.shape == (17,) and x.max() < 100
    np.testing.assert_array_equal(x, b[4])
    assert not np.array_equal(a[4], a[5])
    assert not np.array_equal(x, MockGPTDataset(10, 16, 100, seed=4)[4])
    with pytest.raises(IndexError):
        a[10]
