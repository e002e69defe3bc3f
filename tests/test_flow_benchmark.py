"""The benchmark flow: the quick suite's history line, regression flags, trends, an S3 history."""
from __future__ import annotations

import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.benchmark import QUICK, BenchmarkSpec, benchmark
from tasks import benchmark_history as bh


def _artifacts(state) -> dict:
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    return {a.key: a for a in arts if a.key}


def _record(metrics: dict[str, float], key: str = "cpu|2|None|0|0") -> dict:
    return {"time": bh.now(), "machine": {"key": key}, "metrics": metrics}


def test_quick_suite_appends_one_line_with_every_metric(prefect_harness, tmp_path):
    state = benchmark(suite=QUICK, history=str(tmp_path), return_state=True)
    assert state.is_completed(), state.message
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["errors"] == {} and set(record["results"]) == {s.key for s in QUICK}
    for spec in QUICK:  # every numeric figure each benchmark returned is in the line
        expected = {f"{spec.key}.{k}" for k in bh.flatten(record["results"][spec.key])}
        assert expected and expected <= set(record["metrics"])
    assert record["metrics"]["train-tiny.tokens_per_s"] > 0
    machine = record["machine"]
    assert machine["cpu_count"] >= 1 and machine["torch"] and "gpu" in machine and "gpu_driver" in machine
    assert len(machine["git_commit"] or "") in (0, 40)
    assert record["params"]["suite"][0]["name"] == "tokenize"
    arts = _artifacts(state)
    rows = json.loads(arts["benchmark-results"].data)
    assert {r["metric"] for r in rows} == set(record["metrics"]) and all(r["previous"] == "-" for r in rows)
    assert "data:image/png;base64," in arts["benchmark-trends"].data


def test_synthetic_regression_is_flagged_in_the_table(prefect_harness, tmp_path):
    key = bh.machine_facts()["key"]
    history = [_record({"train-tiny.tokens_per_s": 1e9, "train-tiny.step_time_ms": 1e-6}, key),
               _record({"train-tiny.tokens_per_s": 2e9, "train-tiny.step_time_ms": 1e-6}, "other|machine")]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    suite = [BenchmarkSpec(name="train", label="train-tiny",
                           params={"model": "tiny", "steps": 2, "warmup": 1, "vocab_size": 2048})]
    state = benchmark(suite=suite, history=str(tmp_path), regression_threshold=0.2, return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    assert {"train-tiny.tokens_per_s", "train-tiny.step_time_ms"} <= set(out["regressions"])
    rows = {r["metric"]: r for r in json.loads(_artifacts(state)["benchmark-results"].data)}
    tps = rows["train-tiny.tokens_per_s"]
    assert tps["flag"] == "REGRESSION" and tps["previous"] == "1e+09" and tps["vs previous"].startswith("-")
    assert tps["best"] == "1e+09"  # the other machine's 2e9 does not count
    assert rows["train-tiny.step_time_ms"]["flag"] == "REGRESSION"
    assert rows["train-tiny.params"]["flag"] == ""  # no direction, never flagged
    assert len((tmp_path / "history.jsonl").read_text().splitlines()) == 3


def test_compare_directions_threshold_and_best():
    past = [_record({"a.tokens_per_s": 100.0, "a.wall_s": 10.0, "a.count": 5.0}),
            _record({"a.tokens_per_s": 120.0, "a.wall_s": 8.0, "a.count": 5.0})]
    now = _record({"a.tokens_per_s": 110.0, "a.wall_s": 8.5, "a.count": 50.0, "a.new_mb_s": 1.0})
    rows = {r["metric"]: r for r in bh.compare(now, past, threshold=0.05)}
    assert rows["a.tokens_per_s"]["previous"] == 120.0 and rows["a.tokens_per_s"]["best"] == 120.0
    assert rows["a.tokens_per_s"]["regression"]                       # -8.3% < -5%
    assert rows["a.wall_s"]["best"] == 8.0 and rows["a.wall_s"]["regression"]  # +6.25% slower
    assert not rows["a.count"]["regression"]                           # unknown direction
    assert rows["a.new_mb_s"]["previous"] is None and not rows["a.new_mb_s"]["regression"]
    rows = {r["metric"]: r for r in bh.compare(now, past, threshold=0.10)}
    assert not any(r["regression"] for r in rows.values())


def test_history_in_s3(s3_server, monkeypatch):
    for k, v in s3_server.env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket()
    store = bh.History(f"s3://{bucket}/bench/cpu", endpoint_url=s3_server.endpoint_url)
    assert store.read() == []
    store.append(_record({"x.tokens_per_s": 1.0}))
    store.append(_record({"x.tokens_per_s": 2.0}))
    assert [r["metrics"]["x.tokens_per_s"] for r in store.read()] == [1.0, 2.0]
    body = s3_server.client().get_object(Bucket=bucket, Key="bench/cpu/history.jsonl")["Body"].read()
    assert len(body.decode().splitlines()) == 2


def test_a_broken_history_line_is_named(tmp_path):
    (tmp_path / "history.jsonl").write_text('{"metrics": {}}\nnot json\n')
    with pytest.raises(ValueError, match=r"history.jsonl:2: not a JSON line"):
        bh.History(str(tmp_path)).read()
