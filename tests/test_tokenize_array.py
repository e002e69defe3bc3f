"""Tokenize as a SLURM job array: shards of about equal bytes cut at line boundaries, each encoded
by one array task on the local SLURM cluster's two nodes, joined into the bytes one process writes;
a killed task runs again alone; bad input names its file and line."""
from __future__ import annotations

import gzip
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from gpt.data import MMapIndexedDataset
from tasks.cluster.config import load_cluster
from tasks.cluster.jobs import ReturnedError
from tasks.tokenize.array import join, shard_error, tokenize_on_cluster
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.inputs import BadLine, Piece
from tasks.tokenize.shards import Shard, plan_shards
from tasks.tokenize.stage import tokenize
from tasks.tokenize.vocabulary import resolve_tokenizer
from tests.run_folder import job_records
from tests.test_tokenize import _tokenizer_json

pytestmark = pytest.mark.timeout(300)


def _documents(shakespeare_jsonl: Path) -> list[str]:
    return [json.loads(line)["text"] for line in open(shakespeare_jsonl, encoding="utf-8")]


def _inputs(folder: Path, docs: list[str]) -> list[str]:
    """A large plain JSONL file (cut into pieces), a gzip one and a Parquet one (each whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    third = len(docs) // 3
    plain = folder / "a.jsonl"
    plain.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:2 * third] * 3))
    with gzip.open(folder / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[2 * third:])
    pq.write_table(pa.table({"text": docs[:third]}), folder / "c.parquet", row_group_size=50)
    return [str(plain), str(folder / "b.jsonl.gz"), str(folder / "c.parquet")]


def _same_bytes(a: str, b: str) -> None:
    for suffix in (".bin", ".idx"):
        assert Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes(), suffix


def test_shards_cut_at_lines_and_join_into_the_bytes_of_one_process(tmp_path, shakespeare_jsonl, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    files = _inputs(tmp_path / "in", _documents(shakespeare_jsonl))
    one = tokenize(files, str(tmp_path / "one" / "corpus"), vocab_file=vocab, merge_file=merges, workers=2)

    shards = plan_shards(files, 5)
    pieces = [p for s in shards for p in s]
    plain = Path(files[0]).read_bytes()
    cuts = [p.start for p in pieces if p.path == files[0]][1:]
    assert len(shards) >= 4 and cuts and all(plain[c - 1:c] == b"\n" for c in cuts)
    assert [p for p in pieces if p.path != files[0]] == [Piece(files[1]), Piece(files[2])]   # whole
    sizes = [sum((p.end or os.path.getsize(p.path)) - p.start for p in s) for s in shards[:3]]
    assert max(sizes) < 1.5 * min(sizes), sizes

    tokenizer = resolve_tokenizer(files, ("text",), vocab_file=vocab, merge_file=merges, tokenizer_model=None,
                                  train_vocab_size=0, train_bytes=0, out_dir=str(tmp_path))
    work = [Shard(i, tuple(s), str(tmp_path / "shards" / f"{i:05d}"), tokenizer, ("text",), True, False)
            for i, s in enumerate(shards)]
    records = [shard() for shard in work]
    assert all(shard.done() == record for shard, record in zip(work, records))
    out = {"text": str(tmp_path / "joined" / "corpus_text_document")}
    join(work, out)
    _same_bytes(out["text"], one.prefixes["text"])
    assert sum(r["documents"] for r in records) == one.documents

    Path(work[1].prefix + "_text_document.bin").write_bytes(b"\0" * 10)       # a damaged shard is not done
    assert work[1].done() is None and work[0].done() is not None


def test_every_plan_covers_each_file_once_in_order_cut_at_line_starts(tmp_path):
    rng = random.Random(0)
    for trial in range(200):
        files = []
        for i in range(rng.randint(1, 4)):
            path = tmp_path / f"{trial}-{i}{rng.choice(['.jsonl', '.jsonl', '.jsonl.gz'])}"
            lines = [b"x" * rng.randint(0, 300) for _ in range(rng.randint(0, 60))]
            path.write_bytes(b"\n".join(lines) + (b"\n" if rng.random() < 0.8 else b""))
            files.append(str(path))
        tasks = rng.randint(1, 300)
        shards = plan_shards(files, tasks)
        assert 0 < len(shards) <= tasks and all(shards), (files, tasks)
        for path in files:
            data, covered = Path(path).read_bytes(), 0
            for piece in (p for s in shards for p in s if p.path == path):
                end = piece.end if piece.end is not None else len(data)
                assert piece.start == covered < end and (piece.start == 0 or data[piece.start - 1] == ord("\n"))
                covered = end
            assert covered == len(data), (path, tasks)
    long = tmp_path / "long.jsonl"                     # a line across several shares leaves fewer shards
    long.write_bytes(b"y" * 312 + b"\n" + b"z" * 40 * 9 + b"\n")
    assert len(plan_shards([str(long)], 8)) == 2


def test_a_shard_of_only_bad_lines_is_empty_and_an_input_of_only_bad_lines_is_refused(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "no text key"}\n' * 3)
    tokenizer = resolve_tokenizer([str(bad)], ("text",), vocab_file=vocab, merge_file=merges, tokenizer_model=None,
                                  train_vocab_size=0, train_bytes=0, out_dir=str(tmp_path))
    record = Shard(0, (Piece(str(bad)),), str(tmp_path / "s"), tokenizer, ("text",), True, False)()
    assert (record["documents"], record["skipped"]["missing_key"]) == (0, 3)
    with pytest.raises(TokenizeError, match="no usable document"):
        tokenize_on_cluster([str(bad)], str(tmp_path / "out" / "c"), load_cluster("local"), vocab_file=vocab,
                            merge_file=merges)


def test_the_sync_jobs_cache_key_reads_its_options_as_the_in_process_stages(tmp_path):
    from prefect.utilities.callables import get_call_parameters

    from tasks.sync.stage import _sync_cache_key, sync_stage

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jsonl").write_text('{"text": "a"}\n')
    args = ([str(tmp_path / "src")], str(tmp_path / "dest"))
    cluster = {"cluster": load_cluster("local")}
    key = _sync_cache_key(get_call_parameters(sync_stage, args, {**cluster, "allowed_roots": [str(tmp_path)]}))
    assert key and key == _sync_cache_key(get_call_parameters(sync_stage, args, {"allowed_roots": [str(tmp_path)]}))
    checked = get_call_parameters(sync_stage, args, {**cluster, "allowed_roots": [str(tmp_path)], "verify_content": True})
    assert _sync_cache_key(checked) is None                 # verify_content reads everything again


def test_a_bad_line_in_a_later_piece_is_named_by_its_line_in_the_whole_file(tmp_path, bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": f"document number {i} " * 20}) for i in range(400)]
    lines[300] = '{"text": "cut short'
    path.write_text("\n".join(lines) + "\n")
    tokenizer = resolve_tokenizer([str(path)], ("text",), vocab_file=vocab, merge_file=merges, tokenizer_model=None,
                                  train_vocab_size=0, train_bytes=0, out_dir=str(tmp_path))
    shards = plan_shards([str(path)], 4)
    bad = len("\n".join(lines[:300])) + 1                          # where the bad line starts
    late = next(i for i, s in enumerate(shards) if 0 < s[0].start <= bad < s[0].end)
    shard = Shard(late, tuple(shards[late]), str(tmp_path / "s"), tokenizer, ("text",), True, True)
    outcome = shard()
    assert isinstance(outcome, ReturnedError) and "after byte" in str(outcome.error)
    error = shard_error(shard, outcome.error)
    assert isinstance(error, BadLine) and str(error).startswith(f"{path}:301: malformed JSON")
    assert not list(tmp_path.glob("s_*"))                           # nothing of the shard is kept


# ---------------------------------------------------------------------------------- on SLURM

def _cluster(slurm_cluster, **fields):
    return load_cluster(slurm_cluster["preset"], data_jobs=True, **fields)


def _megatron_reads(prefix: str, expected: MMapIndexedDataset) -> None:
    from benchmarks.index import megatron_core_path

    root = megatron_core_path()
    if root is None:
        pytest.skip("megatron-core could not be downloaded")
    import sys

    sys.path.insert(0, str(root))
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    finally:
        sys.path.remove(str(root))
    theirs = IndexedDataset(prefix, mmap=True)
    assert len(theirs) == len(expected) and (theirs.document_indices == expected.document_indices).all()
    for i in (0, len(expected) // 2, len(expected) - 1):
        assert theirs[i].tolist() == expected[i].tolist()


def test_a_four_task_array_on_two_nodes_writes_the_bytes_of_one_process(tmp_path, slurm_cluster, shakespeare_jsonl,
                                                                          bpe_vocab):
    vocab, merges = map(str, bpe_vocab)
    files = _inputs(tmp_path / "in", _documents(shakespeare_jsonl))
    one = tokenize(files, str(tmp_path / "one" / "corpus"), vocab_file=vocab, merge_file=merges)
    array = tokenize_on_cluster(files, str(tmp_path / "array" / "corpus"), _cluster(slurm_cluster),
                                vocab_file=vocab, merge_file=merges, tasks=4)
    _same_bytes(array.prefixes["text"], one.prefixes["text"])
    assert (array.documents, array.tokens, array.digest) == (one.documents, one.tokens, one.digest)
    jobs = job_records(tmp_path / "array" / "corpus.jobs")
    assert [j["job_id"].split("_")[1] for j in jobs] == ["0", "1", "2", "3"] and {j["final"] for j in jobs} == {"COMPLETED"}
    assert len({j["job_id"].split("_")[0] for j in jobs}) == 1                  # one array
    assert {s["nodes"] for j in jobs for s in j["states"] if s["nodes"]} == {"node1", "node2"}
    _megatron_reads(array.prefixes["text"], MMapIndexedDataset(one.prefixes["text"]))


def test_a_huggingface_tokenizer_json_on_parquet_shards_and_a_killed_task_reruns_alone(
        tmp_path, slurm_cluster, shakespeare_jsonl, bpe_vocab, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _documents(shakespeare_jsonl)
    folder = tmp_path / "in"
    folder.mkdir()
    files = []
    for i in range(4):
        files.append(str(folder / f"part-{i}.parquet"))
        pq.write_table(pa.table({"text": docs[i::4]}), files[-1], row_group_size=40)
    model = str(_tokenizer_json(tmp_path, bpe_vocab))
    one = tokenize(files, str(tmp_path / "one" / "corpus"), tokenizer_model=model)
    monkeypatch.setenv("GPT_FAULT", "shard=2")
    array = tokenize_on_cluster(files, str(tmp_path / "array" / "corpus"), _cluster(slurm_cluster),
                                tokenizer_model=model, tasks=4)
    _same_bytes(array.prefixes["text"], one.prefixes["text"])
    jobs = job_records(tmp_path / "array" / "corpus.jobs")
    assert [j["final"] for j in jobs] == ["COMPLETED", "COMPLETED", "FAILED", "COMPLETED", "COMPLETED"]
    assert jobs[-1]["job_id"].split("_")[0] != jobs[0]["job_id"].split("_")[0]     # shard 2 alone, again
    assert array.tokenizer_file == os.path.abspath(model) and array.eod_id == one.eod_id
    shutil.rmtree(tmp_path / "array")


def test_the_sync_job_mirrors_a_bucket_and_verifies_every_file_as_the_flow_process_does(tmp_path, slurm_cluster,
                                                                                       s3_server, prefect_harness):
    from tasks.sync import Remote, sync, sync_on_cluster

    bucket = s3_server.new_bucket(public=True)
    files = {f"data/part-{i}.jsonl": (json.dumps({"text": f"document {i} " * 50}) + "\n").encode() * (i + 1) * 100
             for i in range(5)}
    s3_server.put(bucket, "data/large.jsonl", b"x" * (6 << 20), part_size=5 << 20)      # a multipart ETag
    s3_server.put_tree(bucket, "", files)
    options = dict(endpoint_url=s3_server.endpoint_url, no_sign_request=True)
    here = sync([f"s3://{bucket}/data/"], str(tmp_path / "here"), **options)
    there = sync_on_cluster([f"s3://{bucket}/data/"], str(tmp_path / "there"), _cluster(slurm_cluster),
                            remote=Remote(**options))
    assert [(f.path, f.size, f.check) for f in there.files] == [(f.path, f.size, f.check) for f in here.files]
    assert {f.check for f in there.files} >= {"md5", "multipart-etag"}
    for f in here.files:
        assert (tmp_path / "there" / f.path).read_bytes() == (tmp_path / "here" / f.path).read_bytes()
    (job,) = job_records(tmp_path / "there.jobs")
    assert job["final"] == "COMPLETED" and job["name"] == "sync"


def test_the_flow_with_its_data_stages_as_jobs_and_a_tokenizer_json_trains_on_the_bytes_of_the_in_process_stages(
        tmp_path, slurm_cluster, s3_server, prefect_harness, shakespeare_jsonl, bpe_vocab):
    from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
    from flows.pretrain import pretrain
    from tasks.sync import sync

    bucket = s3_server.new_bucket(public=True)
    lines = Path(shakespeare_jsonl).read_text().splitlines(keepends=True)
    s3_server.put_tree(bucket, "", {f"corpus/part-{i}.jsonl": "".join(lines[i::3]).encode() for i in range(3)})
    model = _tokenizer_json(tmp_path, bpe_vocab)               # with no tokenizer_config.json: its own end-of-text
    s3_server.put(bucket, "llama/tokenizer.json", model)
    state = pretrain(                                 # the Llama block, as a Llama tokenizer.json asks
        model="tiny-llama",
        data=DataParams(sources=[f"s3://{bucket}/corpus/"], endpoint_url=s3_server.endpoint_url, no_sign_request=True),
        tokenizer=TokenizerParams(tokenizer_model=f"s3://{bucket}/llama/"),
        training=TrainingParams(train_iters=2, eval_interval=2, eval_iters=1, log_interval=1,
                                overrides={"lr_warmup_iters": 0}),
        cluster=ClusterParams(preset=slurm_cluster["preset"], overrides={"data_jobs": True, "data_array_tasks": 3}),
        output=OutputParams(root=str(tmp_path / "runs")), return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    [(_, prefix)] = out["dataset"]
    synced = sync([f"s3://{bucket}/corpus/"], str(tmp_path / "here"), endpoint_url=s3_server.endpoint_url,
                  no_sign_request=True)
    [local_model] = out["tokenizer"]
    assert Path(local_model).read_bytes() == model.read_bytes()
    one = tokenize(sorted(str(tmp_path / "here" / f.path) for f in synced.files), str(tmp_path / "one" / "corpus"),
                   tokenizer_model=str(model))
    _same_bytes(prefix, one.prefixes["text"])
    exported = Path(out["export"])                    # the export carries the tokenizer.json and its end of text
    assert (exported / "tokenizer.json").read_bytes() == model.read_bytes()
    assert json.loads((exported / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    hf_config = json.loads((exported / "config.json").read_text())
    assert hf_config["eos_token_id"] == one.eod_id and hf_config["architectures"] == ["LlamaForCausalLM"]
    names = [j["name"] for path in (tmp_path / "runs").rglob("*.jobs") for j in job_records(path)]
    assert sorted(names) == ["sync", "tokenize", "tokenize", "tokenize"], names
    assert [j["final"] for j in job_records(Path(out["run_dir"]))] == ["COMPLETED"]      # and training, as ever
