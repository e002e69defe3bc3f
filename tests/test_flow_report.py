"""Report helpers and the sample corpus, without a Prefect server."""
from __future__ import annotations

import json
import os

from tasks.report import loss_curve_png, read_metrics, summary_rows
from tasks.tokenize.sample_corpus import sample_corpus, split_documents


def test_sample_corpus_is_the_plays_cut_into_documents(tmp_path):
    path = sample_corpus(str(tmp_path), doc_chars=4000)
    docs = [json.loads(line) for line in open(path)]
    assert len(docs) > 1000
    titles = {d["title"] for d in docs}
    assert {"Hamlet, Prince of Denmark", "The Tempest"} & titles and len(titles) > 30
    assert len({d["id"] for d in docs}) == len(docs)
    assert any("To be, or not to be" in d["text"] for d in docs)
    mtime = os.stat(path).st_mtime_ns
    assert sample_corpus(str(tmp_path), doc_chars=4000) == path and os.stat(path).st_mtime_ns == mtime
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_split_documents_keeps_paragraphs_whole():
    text = "\n\n".join(f"paragraph {i} " + "x" * 50 for i in range(20))
    docs = split_documents(text, 200)
    assert "\n\n".join(docs) == text and all(len(d) < 400 for d in docs)
    # A short remainder joins the last document rather than standing alone (it may be the test split).
    tail = split_documents(text + "\n\nFinis.", 200)
    assert len(tail) == len(docs) and tail[-1].endswith("Finis.") and "\n\n".join(tail) == text + "\n\nFinis."


def test_loss_curve_and_summary_from_metrics(tmp_path):
    rows = [{"kind": "train", "iteration": i, "lm_loss": 8 - i / 10, "consumed_samples": 16 * i} for i in range(1, 31)]
    rows.append({"kind": "valid", "iteration": 30, "valid_loss": 5.5})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn": ')
    read = read_metrics(path)
    assert len(read) == 31  # the torn last line of a run still writing is ignored
    png = loss_curve_png(read, "tiny loss")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert loss_curve_png([], "empty") is None
    table = {r["item"]: r["value"] for r in summary_rows(
        {"status": "completed", "iteration": 30, "train_iters": 30, "train_loss": 5.0, "tokens_per_s": 1234.5,
         "mfu": 0.4123}, read, seq_length=128,
        stages=[{"stage": "tokenize", "state": "Cached", "seconds": 0.01}], job_ids=["17", "18"])}
    assert table["tokens trained"] == f"{30 * 16 * 128:,}"
    assert table["final valid loss"] == "5.5" and table["MFU"] == "41.23%"
    assert table["job ids"] == "17, 18" and table["stage tokenize (s)"] == "0.0 (cached)"
