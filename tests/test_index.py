"""Index stage: native builders against slow references, split/epoch/shuffle semantics, blending, GPTDataset."""
from __future__ import annotations

import bisect
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from gpt import token_stats
from gpt.data import GPTDataset, IndexedDatasetWriter, MMapIndexedDataset
from native._index import build_sample_idx_int64
from native.index import build_blending_indices, build_sample_idx, sample_idx_dtype
from tasks.index import build_indices, parse_data_path, parse_split, split_bounds


def reference_sample_idx(sizes, doc_idx, seq, epochs, tokens_per_epoch, drop_last=True, extra=1):
    """Sample k starts at stream position k*seq; it is recorded as the document holding its last
    token (position k*seq + extra - 1) and the start's offset from that document's start."""
    total = epochs * tokens_per_epoch - extra
    n = total // seq if drop_last else math.ceil(total / seq)
    lengths = [int(sizes[d]) for d in doc_idx]
    ends = list(np.cumsum(lengths))
    out = [(0, 0)]
    for k in range(1, n + 1):
        last = k * seq + extra - 1
        if last >= ends[-1]:
            j = len(doc_idx) - 1
            out.append((j, lengths[j] - extra))
        else:
            j = bisect.bisect_right(ends, last)
            out.append((j, k * seq - (ends[j] - lengths[j])))
    return np.array(out)


def random_case(rng, num_docs, max_size, epochs):
    sizes = rng.integers(1, max_size, num_docs).astype(np.int32)
    doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int32)
    return sizes, doc_idx, int(sizes.sum())


@pytest.mark.parametrize("seed", range(6))
def test_build_sample_idx_matches_reference(seed):
    rng = np.random.default_rng(seed)
    for num_docs, max_size, seq, epochs in [(50, 300, 64, 1), (7, 20, 128, 3), (1, 5000, 100, 1),
                                            (1, 50, 16, 4), (200, 3, 8, 2), (30, 1000, 2, 1)]:
        sizes, doc_idx, tpe = random_case(rng, num_docs, max_size, epochs)
        for drop_last in (True, False):
            for extra in (1, 0):
                if tpe * epochs - extra < seq and drop_last:
                    continue
                got = build_sample_idx(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)
                want = reference_sample_idx(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)
                assert got.dtype == np.int32
                np.testing.assert_array_equal(got, want, err_msg=f"{num_docs=} {seq=} {epochs=} {drop_last=} {extra=}")


def test_build_sample_idx_int64_range():
    # totals beyond int32; every stored value still fits, both builders must agree with the reference
    sizes = np.array([2_000_000_000, 1_900_000_000, 1_500_000_000], dtype=np.int32)
    doc_idx = np.array([2, 0, 1], dtype=np.int64)
    tpe = int(sizes.astype(np.int64).sum())
    want = reference_sample_idx(sizes, doc_idx, 1 << 28, 1, tpe)
    np.testing.assert_array_equal(build_sample_idx(sizes, doc_idx, 1 << 28, 1, tpe), want)
    got64 = build_sample_idx_int64(sizes, doc_idx, 1 << 28, 1, tpe)
    assert got64.dtype == np.int64
    np.testing.assert_array_equal(got64, want)
    assert sample_idx_dtype(2**31 - 1, 10) == np.int32
    assert sample_idx_dtype(2**31, 10) == np.int64


def test_build_sample_idx_rejects_bad_arguments():
    sizes = np.array([10, 10], dtype=np.int32)
    with pytest.raises(ValueError, match="seq_length"):
        build_sample_idx(sizes, np.array([0, 1], np.int32), 0, 1, 20)
    with pytest.raises(ValueError, match="outside sizes"):
        build_sample_idx(sizes, np.array([0, 2], np.int32), 4, 1, 20)
    with pytest.raises(ValueError, match="document_idx is empty"):
        build_sample_idx(sizes, np.array([], np.int32), 4, 1, 20)


def reference_blending(weights, size):
    counts = [0] * len(weights)
    index, sample = [], []
    for i in range(size):
        pos = max(float(i), 1.0)
        errors = [w * pos - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return index, sample


def test_build_blending_indices_matches_reference():
    for weights, size in [([0.3, 0.7], 1000), ([0.2, 0.5, 0.3], 777), ([1.0], 10), ([0.25] * 4, 4096)]:
        di, dsi = np.zeros(size, np.int16), np.zeros(size, np.int64)
        build_blending_indices(di, dsi, np.array(weights), len(weights), size, False)
        want_i, want_s = reference_blending(weights, size)
        assert di.tolist() == want_i and dsi.tolist() == want_s
        counts = np.bincount(di, minlength=len(weights)) / size
        np.testing.assert_allclose(counts, weights, atol=2 / size)


def test_split_parsing():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("100,0,0") == [1.0, 0.0, 0.0]
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    for bad in ("a,b", "0,0,0", "1,2,3,4", "-1,2,3"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)
    bounds = split_bounds(parse_split("969,30,1"), 1000)
    assert bounds == [0, 969, 999, 1000]
    assert split_bounds(parse_split("1,1,1"), 10)[-1] == 10
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path("a b") == [(None, "a"), (None, "b")]
    with pytest.raises(ValueError, match="data_path"):
        parse_data_path(["0.3", "a", "b"])


def write_dataset(prefix, num_docs, low, high, seed):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(num_docs):
            w.add_document(rng.integers(low, high, rng.integers(1, 200)))
    return MMapIndexedDataset(prefix)


def expected_samples(part, data, seq):
    """Every sample rebuilt from the flat token stream of the documents in document_index order."""
    stream = np.concatenate([np.asarray(data[int(d)], dtype=np.int64) for d in part.document_index])
    starts = np.asarray(part.shuffle_index, dtype=np.int64) * seq
    return [stream[s:s + seq + 1] for s in starts]


def test_gpt_dataset_samples_follow_the_indices(tmp_path):
    data = write_dataset(str(tmp_path / "a"), 300, 0, 5000, 0)
    seq = 32
    m = build_indices([str(tmp_path / "a")], split="90,8,2", seq_length=seq, seed=7,
                      num_samples={"train": 5000, "valid": 40, "test": 0}, out_dir=str(tmp_path / "idx"))
    assert m.num_samples["test"] == 0 and m.num_samples["train"] >= 5000 and m.num_samples["valid"] >= 40
    bounds = split_bounds(parse_split("90,8,2"), 300)
    for split in ("train", "valid"):
        ds = GPTDataset.from_index(m.path, split)
        assert len(ds) == m.num_samples[split]
        part = ds.parts[0]
        # the split's documents only, each epoch a permutation of them
        docs = np.asarray(part.document_index)
        s = ("train", "valid").index(split)
        assert docs.min() >= bounds[s] and docs.max() < bounds[s + 1]
        n = bounds[s + 1] - bounds[s]
        assert len(docs) % n == 0
        want = expected_samples(part, data, seq)
        for i in range(len(ds)):
            got = ds[i]
            assert got.dtype == np.int64 and got.shape == (seq + 1,)
            np.testing.assert_array_equal(got, want[i])
    # several epochs were needed for train; shuffling makes the order differ from document order
    assert not np.array_equal(np.asarray(GPTDataset.from_index(m.path, "train").parts[0].shuffle_index[:50]),
                              np.arange(50))
    assert len(GPTDataset.from_index(m.path, "test")) == 0


def test_indices_are_cached_and_deterministic(tmp_path):
    write_dataset(str(tmp_path / "a"), 100, 0, 5000, 1)
    kwargs = dict(split="100,0,0", seq_length=16, seed=3, num_samples={"train": 300}, out_dir=str(tmp_path / "idx"))
    m1 = build_indices([str(tmp_path / "a")], **kwargs)
    files = {p: os.stat(p).st_mtime_ns for p in (tmp_path / "idx").glob("*.npy")}
    assert len(files) == 3 and all(len(p.name.split("-")[0]) == 32 for p in files)
    m2 = build_indices([str(tmp_path / "a")], **kwargs)
    assert m1 == m2
    assert {p: os.stat(p).st_mtime_ns for p in (tmp_path / "idx").glob("*.npy")} == files
    other = build_indices([str(tmp_path / "a")], **{**kwargs, "out_dir": str(tmp_path / "idx2")})
    a, b = GPTDataset.from_index(m1.path, "train"), GPTDataset.from_index(other.path, "train")
    for i in (0, 17, 299):
        np.testing.assert_array_equal(a[i], b[i])
    m3 = build_indices([str(tmp_path / "a")], **{**kwargs, "seed": 4})
    assert m3.digest != m1.digest
    assert not np.array_equal(GPTDataset.from_index(m3.path, "train")[0], a[0])


def test_blended_prefixes(tmp_path):
    write_dataset(str(tmp_path / "low"), 200, 0, 1000, 2)
    write_dataset(str(tmp_path / "high"), 200, 1000, 2000, 3)
    seq = 16
    m = build_indices([(0.3, str(tmp_path / "low")), (0.7, str(tmp_path / "high"))], split="100,0,0",
                      seq_length=seq, seed=5, num_samples={"train": 1000}, out_dir=str(tmp_path / "idx"))
    ds = GPTDataset.from_index(m.path, "train")
    assert len(ds) == 1000 == m.num_samples["train"]
    from_high = sum(int(ds[i].max() >= 1000) for i in range(len(ds)))
    assert abs(from_high - 700) <= 2
    want_i, want_s = reference_blending([0.3, 0.7], 1000)
    assert np.asarray(ds.dataset_index).tolist() == want_i
    for i in (0, 1, 2, 500, 999):
        part = ds.parts[want_i[i]]
        np.testing.assert_array_equal(ds[i], part.sample(want_s[i]))
        assert (ds[i] >= 1000).all() == (want_i[i] == 1)


def test_bad_arguments_are_named(tmp_path):
    write_dataset(str(tmp_path / "a"), 10, 0, 100, 4)
    with pytest.raises(ValueError, match="num_samples"):
        build_indices([str(tmp_path / "a")], seq_length=8, seed=1, num_samples={"training": 1}, out_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope.idx"):
        build_indices([str(tmp_path / "nope")], seq_length=8, seed=1, num_samples={"train": 1}, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="positive"):
        build_indices([(0.0, str(tmp_path / "a"))], seq_length=8, seed=1, num_samples={"train": 1}, out_dir=str(tmp_path))


def test_cli(tmp_path):
    write_dataset(str(tmp_path / "a"), 50, 0, 100, 6)
    out = subprocess.run([sys.executable, "-m", "tasks.index", "--data-path", str(tmp_path / "a"), "--seq-length", "8",
                          "--train-samples", "100", "--valid-samples", "5", "--out-dir", str(tmp_path / "idx")],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    result = json.loads(out.stdout)
    assert result["num_samples"]["train"] >= 100
    assert len(GPTDataset.from_index(result["path"], "valid")) >= 5


def test_token_ids_beyond_the_vocabulary_are_refused_naming_both_files(tmp_path, monkeypatch):
    from flows.plan.build import make_plan
    from flows.plan.params import (
        ClusterParams,
        DataParams,
        OutputParams,
        ParameterError,
        TokenizerParams,
        TrainingParams,
    )
    from gpt.tokenizer import Tokenizer

    prefix = str(tmp_path / "big_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(40):
            w.add_document(np.arange(i, i + 30) * 100)         # ids up to 6,800
    os.remove(prefix + token_stats.SUFFIX)                     # a pair tokenized elsewhere: its ids are read
    reads = []
    monkeypatch.setattr(MMapIndexedDataset, "max_token_id", lambda self: reads.append(self.prefix) or 6800)
    index = build_indices([prefix], seq_length=8, seed=1, num_samples={"train": 10}, out_dir=str(tmp_path / "i"))
    assert index.max_token_ids == {prefix: 6800}
    again = build_indices([prefix], seq_length=8, seed=1, num_samples={"train": 20}, out_dir=str(tmp_path / "i"))
    assert again.max_token_ids == {prefix: 6800} and len(reads) == 1   # the .bin is read once per content
    monkeypatch.undo()
    assert MMapIndexedDataset(prefix).max_token_id() == 6800
    plan = make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(), ClusterParams(),
                     OutputParams(root=str(tmp_path / "runs")))
    plan.training_job(Tokenizer("vocab.json", "merges.txt", None, 0, vocab_size=6801), index)
    with pytest.raises(ParameterError) as e:
        plan.training_job(Tokenizer("/data/gpt2/vocab.json", "merges.txt", None, 0, vocab_size=4096), index)
    assert e.value.errors == [f"data: {prefix}.bin holds token id 6800, but the vocabulary /data/gpt2/vocab.json has "
                              "only 4096 entries: the data was tokenized with another vocabulary; give that vocabulary "
                              "or tokenize again"]


def test_the_index_stage_takes_a_pair_tokenized_here_from_its_writers_record_without_opening_its_bin(
        tmp_path, bpe_vocab):
    from tasks.tokenize.stage import tokenize

    vocab, merges = map(str, bpe_vocab)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} of the corpus, " * (i % 7 + 1)}) + "\n"
                              for i in range(300)))
    tokenized = tokenize([str(source)], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges, append_eod=True)
    prefix = tokenized.prefixes["text"]
    seen = token_stats.recorded(prefix)
    data = MMapIndexedDataset(prefix)
    assert seen["max_token_id"] == data.max_token_id() and seen["tokens"] == data.num_tokens == tokenized.tokens
    assert seen["documents"] == data.num_documents == 300 and seen["fingerprint"] == token_stats.fingerprint(prefix)
    opened = _opened_during(lambda: build_indices([prefix], seq_length=16, seed=1, num_samples={"train": 50},
                                                  out_dir=str(tmp_path / "idx")), prefix + ".bin")
    index, bins = opened
    assert bins == [] and index.max_token_ids == {prefix: seen["max_token_id"]}
    # The same pair rewritten in place by another tool that keeps its size and times (rsync -t
    # --inplace): the record no longer holds, the .bin is read.
    before = os.stat(prefix + ".bin")
    tokens = np.fromfile(prefix + ".bin", dtype=data.dtype)
    tokens[0] = 50_000
    tokens.tofile(prefix + ".bin")
    os.utime(prefix + ".bin", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert token_stats.recorded(prefix) is None
    index, bins = _opened_during(lambda: build_indices([prefix], seq_length=16, seed=1, num_samples={"train": 50},
                                                       out_dir=str(tmp_path / "idx")), prefix + ".bin")
    assert bins and index.max_token_ids == {prefix: 50_000}


def _opened_during(call, path: str) -> tuple:
    """What ``call`` returns, and each time it opened ``path`` (Python's audit event ``open``: builtin
    ``open``, ``os.open`` and numpy's memmap, which opens by path)."""
    opened: list[str] = []
    watching = [True]

    def hook(event: str, args: tuple) -> None:
        if watching[0] and event == "open" and args and str(args[0]) == path:
            opened.append(event)
    sys.addaudithook(hook)
    try:
        return call(), opened
    finally:
        watching[0] = False
