"""Tokenize stage: ids equal HuggingFace byte-level BPE, worker-count independence, compression, bad input."""
from __future__ import annotations

import gzip
import json
import lzma
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import zstandard

from gpt.data import MMapIndexedDataset
from gpt.tokenizer import EOD, byte_level_bpe
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.stage import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRICKY = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "tabs\t\tand\n\n\nnewlines \r\n crlf",
    "unicode: héllo naïve café 日本語のテキスト 😀👍🏽 Ελληνικά русский",
    "numbers 1234567890 3.14159 and 'contractions' don't we'll they've",
    "      whitespace runs            before words",
    f"a literal {EOD} inside text stays text",
    "x" * 20000 + " " + "the quick brown fox " * 3000,
]


def write_jsonl(path, docs, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")
    return str(path)


def read_docs(prefix):
    ds = MMapIndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_ids_equal_hf_byte_level_bpe(tmp_path, shakespeare_jsonl, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    docs = [json.loads(line)["text"] for line in open(shakespeare_jsonl, encoding="utf-8")][:150] + TRICKY
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    m = tokenize([src], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges, append_eod=True, workers=1)
    ref = byte_level_bpe(vocab, merges)
    got = read_docs(m.prefixes["text"])
    assert m.documents == len(docs) and m.dtype == "uint16" and m.eod_id == json.load(open(vocab))[EOD]
    for doc, ids in zip(docs, got):
        assert ids[-1] == m.eod_id
        assert ids[:-1] == ref.encode(doc).ids
    # the literal end-of-text marker inside a document never becomes the EOD id
    assert m.eod_id not in got[len(docs) - 2][:-1]
    assert m.tokens == sum(map(len, got))


def test_worker_count_and_compression_do_not_change_output(tmp_path, shakespeare_jsonl, bpe_vocab, monkeypatch):
    vocab, merges = map(str, bpe_vocab)
    monkeypatch.setattr("tasks.tokenize.inputs.CHUNK_BYTES", 64 << 10)  # many chunks in flight at once
    raw = open(shakespeare_jsonl, "rb").read()
    raw = raw[:raw.index(b"\n", 3 << 20) + 1]
    paths = {"jsonl": tmp_path / "c.jsonl"}
    paths["jsonl"].write_bytes(raw)
    paths["gz"] = tmp_path / "c.jsonl.gz"
    paths["gz"].write_bytes(gzip.compress(raw))
    paths["xz"] = tmp_path / "c.jsonl.xz"
    paths["xz"].write_bytes(lzma.compress(raw, preset=0))
    paths["zst"] = tmp_path / "c.jsonl.zst"
    paths["zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    outputs = {}
    for name, workers in [("jsonl", 1), ("jsonl", 2), ("gz", 2), ("xz", 1), ("zst", 2)]:
        m = tokenize([str(paths[name])], str(tmp_path / f"{name}{workers}"), vocab_file=vocab, merge_file=merges,
                     workers=workers)
        prefix = m.prefixes["text"]
        outputs[(name, workers)] = (open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read())
    first = outputs[("jsonl", 1)]
    assert len(first[0]) > 500_000
    for key, value in outputs.items():
        assert value == first, key


def test_bad_lines_are_reported_and_counted(tmp_path, bpe_vocab, caplog):
    caplog.set_level("INFO", logger="tasks")
    vocab, merges = map(str, bpe_vocab)
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join([
        b'{"text": "good one"}',
        b'{"text": "broken',
        b'{"other": "no text key"}',
        b'{"text": "bad \xff\xfe utf8"}',
        b'{"text": ""}',
        b'{"text": 5}',
        b'{"text": "good two"}',
    ]) + b"\n")
    with caplog.at_level("INFO"):
        m = tokenize([str(src)], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges, workers=1)
    out = caplog.text       # the stage's log (the run's, inside a flow)
    assert m.documents == 2
    assert m.skipped == {"malformed_json": 1, "missing_key": 2, "invalid_utf8": 1, "empty_document": 1,
                         "tokenizer_failed": 0, "blank_line": 0}
    for line, word in [(2, "malformed JSON"), (3, "no string field 'text'"), (4, "invalid UTF-8"), (5, "empty"), (6, "no string field")]:
        assert f"{src}:{line}: skipped: " in out and word in out
    assert "Skipped lines: malformed_json=1, missing_key=2, invalid_utf8=1, empty_document=1" in out
    assert "tokenize: 2 documents, " in caplog.text
    with pytest.raises(TokenizeError, match=rf"{src}:2: malformed JSON"):
        tokenize([str(src)], str(tmp_path / "strict"), vocab_file=vocab, merge_file=merges, workers=2, strict=True)
    assert not list(tmp_path.glob("strict*"))


def test_json_the_parser_reads_as_pythons_json_does_or_refuses_by_name(tmp_path, bpe_vocab, caplog):
    """The JSONL parsers (the native reader, and orjson for the lines it leaves) against Python's
    ``json``: escapes, surrogate pairs and duplicate keys give the text ``json`` gives; a lone surrogate, which ``json`` reads into a string no
    tokenizer can take, is refused with its line; a line that is not an object has no text."""
    caplog.set_level("INFO", logger="tasks")
    vocab, merges = map(str, bpe_vocab)
    lines = [rb'{"text": "caf\u00e9 \"quoted\" \\ back\/slash \t tab \ud83d\ude00 pair"}',
             rb'{"text": "first", "text": "the last one wins"}',
             rb'{"text": "lone \ud800 surrogate"}',
             rb'["text", "an array"]',
             rb'{"text": 1e3}']
    src = tmp_path / "escapes.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    m = tokenize([str(src)], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges, append_eod=False, workers=1)
    ref = byte_level_bpe(vocab, merges)
    assert read_docs(m.prefixes["text"]) == [ref.encode(json.loads(raw)["text"]).ids for raw in lines[:2]]
    assert m.skipped["malformed_json"] == 1 and m.skipped["missing_key"] == 2
    assert f"{src}:3: skipped: malformed JSON (no matched low surrogate" in caplog.text
    for line in (4, 5):
        assert f"{src}:{line}: skipped: no string field 'text'" in caplog.text


JSON_LINES = [
    rb'{"text": "caf\u00e9 \"q\" \\ b\/s \t \ud83d\ude00 pair", "id": 12, "m": {"a": [1, 2.5e-3, true, null, "x"]}}',
    b'{"id": -0.5E+10, "text": "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80", "title": "T"}',
    rb'{"text": "first", "text": "last"}', rb'{"te\u0078t": "escaped key", "title": "t"}', rb'[1]', rb'null',
    rb'{"text": 5}', b'  {"text" : "spaces", "title": "t" }  \r', rb'{}', rb'{"text": "", "title": "t"}',
    rb'{"title": "only"}', rb'{"text": "x", "n": 1e999}', rb'{"text": "x", "n": 123456789012345678901234567890}',
    b'{"text": "x", "n": 2' + b'0' * 299 + b'e9}', b'{"text": "x", "n": 1' + b'0' * 299 + b'e8, "m": 1e-400}',
]
MUTATIONS = b'{}[]":,\\ueE+-.0123456789abcdeftnrlsux \t\r\x00\x1f\x7f\x80\xbf\xc0\xc3\xa9\xe2\xed\xa0\xf0\xf4\xf5\x0b\x0c'


@pytest.mark.parametrize("keys", [("text",), ("text", "title")])
def test_the_native_reader_reads_every_line_as_the_line_by_line_parser(bpe_vocab, keys):
    """Chunks of JSON lines, most of them damaged at random (bytes dropped, put in or changed, JSON's
    own and UTF-8's among them): the native reader's chunk gives the documents, ids and problems
    the line-by-line parser gives; it leaves it the lines it is not sure of (a duplicate key, an
    escaped key, a number that overflows, malformed lines) and reads most of the sound ones itself."""
    from native import jsonl
    from tasks.tokenize.bpe import gpt2_bpe
    from tasks.tokenize.encode import ChunkEncoder, GigatokenEngine

    rng = random.Random(0)
    vocab, merges = map(str, bpe_vocab)
    bpe = gpt2_bpe(vocab, merges)
    encoder = ChunkEncoder(lambda: GigatokenEngine(bpe), keys, True, 0, np.dtype(np.uint16))

    def damaged(line: bytes) -> bytes:
        line = bytearray(line)
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(line))
            roll = rng.random()
            if roll < 0.4 and line:
                del line[min(at, len(line) - 1)]
            elif roll < 0.8:
                line.insert(at, rng.choice(MUTATIONS))
            elif line:
                line[min(at, len(line) - 1)] = rng.choice(MUTATIONS)
        return bytes(line).replace(b"\n", b" ")

    native = 0
    for _ in range(1500):
        lines = [rng.choice(JSON_LINES) if rng.random() < 0.4 else damaged(rng.choice(JSON_LINES)) for _ in range(12)]
        data = b"\n".join(lines) + rng.choice([b"", b"\n"])
        ours, theirs = encoder.chunk(data), encoder.lines(data)
        for key in keys:    # (ids, lengths)
            assert all(map(np.array_equal, ours["encoded"][key], theirs["encoded"][key])), data
        del ours["encoded"], theirs["encoded"]
        assert ours == theirs, data
        native += int((jsonl.read(data, list(keys))[0] == jsonl.DOCUMENT).sum())
    assert native > 1000


def test_empty_and_missing_inputs(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(TokenizeError, match="empty input"):
        tokenize([str(empty)], str(tmp_path / "o"), vocab_file=vocab, merge_file=merges)
    only_bad = tmp_path / "bad.jsonl.gz"
    only_bad.write_bytes(gzip.compress(b'{"text": ""}\n'))
    with pytest.raises(TokenizeError, match="no usable document"):
        tokenize([str(only_bad)], str(tmp_path / "o"), vocab_file=vocab, merge_file=merges)
    with pytest.raises(TokenizeError, match="no file matches"):
        tokenize([str(tmp_path / "*.none")], str(tmp_path / "o"), vocab_file=vocab, merge_file=merges)
    with pytest.raises(TokenizeError, match="--vocab-file"):
        tokenize([str(only_bad)], str(tmp_path / "o"), vocab_file=str(tmp_path / "v.json"), merge_file=merges)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl.gz", "empty.jsonl"]


def test_several_keys_and_files(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "one", "title": "T1"}\n{"text": "two", "title": "T2"}\n')
    b = tmp_path / "b.jsonl"
    b.write_text('{"text": "three", "title": "T3"}\n')
    m = tokenize([str(tmp_path / "*.jsonl")], str(tmp_path / "out" / "c"), vocab_file=vocab, merge_file=merges,
                 json_keys=["text", "title"], append_eod=False)
    assert set(m.prefixes) == {"text", "title"} and m.documents == 3
    assert m.prefixes["title"].endswith("c_title_document")
    ref = byte_level_bpe(vocab, merges)
    assert read_docs(m.prefixes["title"]) == [ref.encode(t).ids for t in ("T1", "T2", "T3")]


def test_trains_a_bpe_when_no_vocab_is_given(tmp_path, shakespeare_jsonl):
    m = tokenize([str(shakespeare_jsonl)], str(tmp_path / "data" / "sp"), train_vocab_size=600, train_bytes=1 << 20)
    assert m.vocab_file == str(tmp_path / "data" / "vocab.json")
    assert open(m.merge_file, encoding="utf-8").readline().startswith("#version")
    vocab = json.load(open(m.vocab_file, encoding="utf-8"))
    assert len(vocab) == 600 and vocab[EOD] == 599 == m.eod_id and m.vocab_size == 600
    ref = byte_level_bpe(m.vocab_file, m.merge_file)
    first = json.loads(open(shakespeare_jsonl, encoding="utf-8").readline())["text"]
    assert read_docs(m.prefixes["text"])[0] == ref.encode(first).ids + [599]


def test_cli_matches_megatron_flags(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    src = write_jsonl(tmp_path / "in.jsonl", ["alpha beta", "gamma"])
    cmd = [sys.executable, "-m", "tasks.tokenize", "--input", src, "--output-prefix", str(tmp_path / "o"),
           "--vocab-file", vocab, "--merge-file", merges, "--tokenizer-type", "GPT2BPETokenizer",
           "--json-keys", "text", "--append-eod", "--workers", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    assert "tokenize: 2 documents, " in out.stderr
    manifest = json.loads(out.stdout.strip().splitlines()[-1])
    assert manifest["prefixes"]["text"] == str(tmp_path / "o_text_document")
    bad = subprocess.run(cmd[:4] + [str(tmp_path / "missing.jsonl")] + cmd[5:], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr


def test_prefect_tasks_are_cached_on_inputs(tmp_path, bpe_vocab, prefect_harness):
    from prefect import flow

    from tasks.index import index_task
    from tasks.tokenize.stage import tokenize_task

    vocab, merges = map(str, bpe_vocab)
    src = write_jsonl(tmp_path / "in.jsonl", ["some words here"] * 50)

    @flow
    def pipeline():
        states = [tokenize_task([src], str(tmp_path / "o"), vocab_file=vocab, merge_file=merges, return_state=True)
                  for _ in range(2)]
        prefix = states[0].result().prefixes["text"]
        states += [index_task([prefix], seq_length=8, seed=1, num_samples={"train": 10}, out_dir=str(tmp_path / "i"),
                              return_state=True) for _ in range(2)]
        return [s.name for s in states]

    names = pipeline()
    assert names == ["Completed", "Cached", "Completed", "Cached"]
    with open(src, "a") as f:  # new input: the cache no longer applies
        f.write(json.dumps({"text": "more"}) + "\n")
    assert pipeline()[:2] == ["Completed", "Cached"]


def test_tiny_chunks_and_engine_rebuilds_keep_ids(tmp_path, bpe_vocab, monkeypatch):
    vocab, merges = map(str, bpe_vocab)
    src = write_jsonl(tmp_path / "in.jsonl", TRICKY * 3)
    whole = tokenize([src], str(tmp_path / "a"), vocab_file=vocab, merge_file=merges, workers=1)
    monkeypatch.setattr("tasks.tokenize.inputs.CHUNK_BYTES", 1000)  # lines longer than a read block
    monkeypatch.setattr("tasks.tokenize.encode.ENCODER_CACHE_BYTES", -1)  # a fresh engine for every chunk
    pieces = tokenize([src], str(tmp_path / "b"), vocab_file=vocab, merge_file=merges, workers=2)
    assert pieces.documents == whole.documents == len(TRICKY) * 3
    assert read_docs(pieces.prefixes["text"]) == read_docs(whole.prefixes["text"])


def test_tokenize_task_in_a_flow_many_times_in_a_row_never_forks(tmp_path, bpe_vocab, monkeypatch, prefect_harness):
    """Forking inside a flow run's threads deadlocked here once; the stage must never fork."""
    import threading

    from prefect import flow

    from tasks.tokenize.stage import tokenize_task

    vocab, merges = map(str, bpe_vocab)
    src = write_jsonl(tmp_path / "in.jsonl", TRICKY * 20)

    def no_fork():
        raise AssertionError("the tokenize stage forked a process")

    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr("tasks.tokenize.inputs.CHUNK_BYTES", 16 << 10)  # many chunks in flight on both threads

    @flow
    def repeat(n: int) -> list[tuple[str, int]]:
        runs = []
        for i in range(n):
            state = tokenize_task([src], str(tmp_path / f"o{i}"), vocab_file=vocab, merge_file=merges, workers=2,
                                  return_state=True)
            runs.append((state.name, state.result().documents))
        return runs

    assert repeat(25) == [("Completed", len(TRICKY) * 20)] * 25
    assert not [t for t in threading.enumerate() if t.name.startswith("tokenize")]


@pytest.mark.parametrize("kind", ["gz", "xz", "zst", "zst-two-frames"])
def test_truncated_compressed_input_is_an_error_naming_the_file(tmp_path, bpe_vocab, kind):
    vocab, merges = map(str, bpe_vocab)
    raw = "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(3000)).encode()
    whole = {"gz": gzip.compress, "xz": lzma.compress, "zst": zstandard.ZstdCompressor().compress,
             "zst-two-frames": lambda b: (zstandard.ZstdCompressor().compress(b[:len(b) // 2])
                                          + zstandard.ZstdCompressor().compress(b[len(b) // 2:]))}[kind](raw)
    path = tmp_path / f"in.jsonl.{kind.split('-')[0]}"
    path.write_bytes(whole)
    full = tokenize([str(path)], str(tmp_path / "full"), vocab_file=vocab, merge_file=merges)
    assert full.documents == 3000
    path.write_bytes(whole[:len(whole) * 2 // 3])
    with pytest.raises(TokenizeError, match=rf"{path}: cannot (read or )?decompress"):
        tokenize([str(path)], str(tmp_path / "cut"), vocab_file=vocab, merge_file=merges)
    assert not list(tmp_path.glob("cut*"))


def test_output_folder_problems_are_clear_errors_and_leave_nothing(tmp_path, shakespeare_jsonl, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    blocked = tmp_path / "file"
    blocked.write_text("a file where a folder should be")
    with pytest.raises(TokenizeError, match=rf"--output-prefix {blocked}/out/c: cannot write in"):
        tokenize([str(shakespeare_jsonl)], str(blocked / "out" / "c"), vocab_file=vocab, merge_file=merges)
    if os.geteuid() != 0:
        pytest.skip("a small tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(TokenizeError, match="writing the output failed .*No space left on device"):
            tokenize([str(shakespeare_jsonl)], str(small / "c"), vocab_file=vocab, merge_file=merges)
        assert os.listdir(small) == []                     # no partial output, no temporary files
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_temporary_files_of_a_killed_tokenize_are_removed_by_the_next(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    src = write_jsonl(tmp_path / "in.jsonl", ["alpha beta"] * 10)
    dead = subprocess.Popen(["true"])
    dead.wait()                                              # a pid that no longer runs
    stale = [tmp_path / f"o_text_document.{ext}.tmp-{dead.pid}" for ext in ("bin", "idx")]
    for f in stale:
        f.write_bytes(b"left by a killed run")
    live = tmp_path / f"o_text_document.bin.tmp-{os.getpid()}-other"
    live.write_bytes(b"not ours to judge")
    tokenize([src], str(tmp_path / "o"), vocab_file=vocab, merge_file=merges)
    assert not any(f.exists() for f in stale) and live.exists()


def test_parquet_rows_tokenize_as_the_same_jsonl_lines(tmp_path, shakespeare_jsonl, bpe_vocab, caplog):
    """A Parquet file of several row groups, its text in one column beside others, gives the bytes
    the same documents give as JSONL; null and empty rows are skipped and named by row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocab, merges = map(str, bpe_vocab)
    docs = [json.loads(line)["text"] for line in open(shakespeare_jsonl, encoding="utf-8")][:300] + TRICKY
    column = docs[:10] + [None] + docs[10:20] + [""] + docs[20:]
    table = pa.table({"id": list(range(len(column))), "text": column})
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=64)
    with caplog.at_level("INFO"):
        from_parquet = tokenize([str(tmp_path / "in.parquet")], str(tmp_path / "pq"), vocab_file=vocab,
                                merge_file=merges, append_eod=True, workers=2)
    from_jsonl = tokenize([write_jsonl(tmp_path / "in.jsonl", docs)], str(tmp_path / "js"), vocab_file=vocab,
                          merge_file=merges, append_eod=True, workers=1)
    assert from_parquet.documents == from_jsonl.documents == len(docs)
    for suffix in (".bin", ".idx"):
        assert open(from_parquet.prefixes["text"] + suffix, "rb").read() == open(from_jsonl.prefixes["text"] + suffix,
                                                                                  "rb").read()
    assert (from_parquet.skipped["missing_key"], from_parquet.skipped["empty_document"]) == (1, 1)
    out = caplog.text
    assert f"{tmp_path / 'in.parquet'}: row 11: skipped: column 'text' is null" in out
    assert f"{tmp_path / 'in.parquet'}: row 22: skipped: column 'text' is empty" in out


def test_a_damaged_parquet_file_or_a_missing_column_is_an_error_naming_it(tmp_path, bpe_vocab):
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocab, merges = map(str, bpe_vocab)
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"content": [f"document number {i} " * 20 for i in range(3000)]}), path,
                   row_group_size=500)
    with pytest.raises(TokenizeError, match=rf"{path}: no column 'text' .*its columns are content"):
        tokenize([str(path)], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges)
    assert tokenize([str(path)], str(tmp_path / "out"), vocab_file=vocab, merge_file=merges,
                    json_keys=["content"]).documents == 3000
    whole = path.read_bytes()
    path.write_bytes(whole[:len(whole) // 2])          # the footer, which says where the rows are, is gone
    with pytest.raises(TokenizeError, match=rf"{path}: not a readable Parquet file .*damaged or truncated"):
        tokenize([str(path)], str(tmp_path / "cut"), vocab_file=vocab, merge_file=merges, json_keys=["content"])
    damaged = bytearray(whole)
    damaged[len(whole) // 2:len(whole) // 2 + 4000] = b"\xff" * 4000   # a row group's pages, footer intact
    path.write_bytes(bytes(damaged))
    with pytest.raises(TokenizeError, match=rf"{path}: .*damaged or truncated"):
        tokenize([str(path)], str(tmp_path / "bad"), vocab_file=vocab, merge_file=merges, json_keys=["content"])
    assert not list(tmp_path.glob("cut*")) and not list(tmp_path.glob("bad*"))


def _tokenizer_json(tmp_path, bpe_vocab, eod="<|end_of_text|>"):
    """A tokenizer.json as HuggingFace saves one: a byte-level BPE with an added end-of-text token."""
    from tokenizers import AddedToken

    tok = byte_level_bpe(*map(str, bpe_vocab))
    tok.add_special_tokens([AddedToken(eod, special=True)])
    path = tmp_path / "hf" / "tokenizer.json"
    path.parent.mkdir(exist_ok=True)
    tok.save(str(path))
    return path


@pytest.mark.timeout(120)
def test_a_document_the_tokenizer_fails_on_is_that_documents_problem_by_line_and_tokenizer(tmp_path, bpe_vocab):
    """A pre-tokenizer regex that gives up on a document (onig's retry limit) makes the Rust code
    of the ``tokenizers`` library panic: the document is skipped by its line, naming the
    tokenizer; the others are tokenized; no usable document left is one line."""
    path = _tokenizer_json(tmp_path, bpe_vocab)
    spec = json.loads(path.read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "(a|aa)+$"}, "behavior": "Isolated", "invert": False},
        spec["pre_tokenizer"]]}
    path.write_text(json.dumps(spec))
    pathological = "a" * 40 + "b"
    src = write_jsonl(tmp_path / "in.jsonl", ["good one", pathological, "good two", pathological, "good three"])

    def cli(source, prefix):
        return subprocess.run([sys.executable, "-m", "tasks.tokenize", "--input", source, "--output-prefix",
                               str(tmp_path / prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                               "--tokenizer-model", str(path.parent), "--workers", "2"],
                              capture_output=True, text=True, cwd=ROOT, timeout=100)

    out = cli(src, "out")
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout[out.stdout.index("{"):])
    assert m["documents"] == 3 and m["skipped"]["tokenizer_failed"] == 2
    for line in (2, 4):
        assert f"{src}:{line}: skipped: the tokenizer {path} fails on this document (" in out.stdout + out.stderr
    assert len(read_docs(m["prefixes"]["text"])) == 3
    bad = write_jsonl(tmp_path / "bad.jsonl", [pathological, pathological])
    out = cli(bad, "none")
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode != 0 and lines and "no usable document (skipped: tokenizer_failed=2)" in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout and not list(tmp_path.glob("none*"))


def test_a_huggingface_tokenizer_json_gives_its_ids_and_its_end_of_text(tmp_path, shakespeare_jsonl, bpe_vocab):
    from tokenizers import Tokenizer, models

    path = _tokenizer_json(tmp_path, bpe_vocab)
    ref = Tokenizer.from_file(str(path))
    docs = [json.loads(line)["text"] for line in open(shakespeare_jsonl, encoding="utf-8")][:100] + TRICKY
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    out = subprocess.run([sys.executable, "-m", "tasks.tokenize", "--input", src, "--output-prefix",
                          str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", str(path.parent), "--append-eod"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    m = json.loads(out.stdout)
    eod = ref.token_to_id("<|end_of_text|>")
    assert (m["eod_id"], m["vocab_size"], m["tokenizer_file"]) == (eod, ref.get_vocab_size(), str(path))
    got = read_docs(m["prefixes"]["text"])
    assert len(got) == len(docs)
    for doc, ids in zip(docs, got):
        assert ids == ref.encode(doc, add_special_tokens=False).ids + [eod]
    # Its vocabulary also holds GPT-2's <|endoftext|> as plain text: the special token is the one,
    # unless the tokenizer_config.json beside it names another eos_token, as AutoTokenizer reads it.
    assert ref.token_to_id("<|endoftext|>") is not None and eod != ref.token_to_id("<|endoftext|>")
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    configured = tokenize([src], str(tmp_path / "configured"), tokenizer_model=str(path.parent))
    assert configured.eod_id == ref.token_to_id("<|endoftext|>")
    bare = tmp_path / "bare.json"
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(bare))
    with pytest.raises(TokenizeError, match=rf"{bare}: none of the end-of-text tokens"):
        tokenize([src], str(tmp_path / "none"), tokenizer_model=str(bare))
    with pytest.raises(TokenizeError, match="replaces --vocab-file"):
        tokenize([src], str(tmp_path / "both"), tokenizer_model=str(path), vocab_file=str(bpe_vocab[0]),
                 merge_file=str(bpe_vocab[1]))


@pytest.mark.timeout(120)
def test_add_bos_token_begins_each_document_as_the_tokenizer_does_at_inference(tmp_path, bpe_vocab):
    """A tokenizer.json whose post-processor puts <|begin_of_text|> before the text (as Llama 3's does):
    with add_bos_token every document is that token, the text's ids and the end of text, the ids
    ``encode`` gives at inference; without it, the documents are as before. GPT-2's files, which add
    none, are one line naming the option."""
    from tokenizers import AddedToken, processors

    from gpt.tokenizer import Tokenizer

    path = _tokenizer_json(tmp_path, bpe_vocab)
    tok = Tokenizer.from_json(path).load()
    tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(path))
    docs = ["To be, or not to be", "that is the question"]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    framed = tokenize([str(src)], str(tmp_path / "bos" / "corpus"), tokenizer_model=str(path), append_eod=True,
                      add_bos_token=True)
    plain = tokenize([str(src)], str(tmp_path / "plain" / "corpus"), tokenizer_model=str(path), append_eod=True)
    eod = framed.eod_id
    got = [list(d) for d in MMapIndexedDataset(framed.prefixes["text"])]
    assert got == [tok.encode(d).ids + [eod] for d in docs] and all(d[0] == bos for d in got)
    assert [list(d) for d in MMapIndexedDataset(plain.prefixes["text"])] == [
        tok.encode(d, add_special_tokens=False).ids + [eod] for d in docs]
    assert framed.digest != plain.digest
    with pytest.raises(TokenizeError, match="tokenizer.add_bos_token: the tokenizer .* adds no beginning-of-text"):
        tokenize([str(src)], str(tmp_path / "gpt2" / "corpus"), vocab_file=str(bpe_vocab[0]),
                 merge_file=str(bpe_vocab[1]), add_bos_token=True)
