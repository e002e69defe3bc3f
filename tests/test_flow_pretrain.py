"""The pretrain flow in-process (prefect_test_harness): stages, artifacts, caching, early rejection."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.plan.params import (
    ClusterParams,
    DataParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
)
from flows.pretrain import pretrain


def _run(small_corpus: Path, root: Path, **training):
    return pretrain(
        data=DataParams(sources=[str(small_corpus)], split="80,10,10"),   # 150 documents: a test split too
        tokenizer=TokenizerParams(train_vocab_size=1024),
        training=TrainingParams(train_iters=6, eval_interval=3, eval_iters=1, log_interval=1, save_interval=3,
                                overrides={"lr_warmup_iters": 1}, **training),
        cluster=ClusterParams(preset="local"),
        output=OutputParams(root=str(root)),
        return_state=True,
    )


def _task_states(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


def _artifacts(flow_run_id) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {a.key: a for a in arts if a.key}


def test_runs_every_stage_then_skips_them_with_the_same_parameters(prefect_harness, small_corpus, tmp_path):
    state = _run(small_corpus, tmp_path)
    assert state.is_completed(), state.message
    out = state.result()
    states = _task_states(state.state_details.flow_run_id)
    assert {k: states[k] for k in ("sync", "tokenize", "index", "train", "report")} == dict.fromkeys(
        ("sync", "tokenize", "index", "train", "report"), "Completed")
    assert [s["stage"] for s in out["stages"]] == ["sync", "tokenize", "index", "precompile", "train", "export"]
    assert states["export"] == "Completed" and out["test_perplexity"] > 1
    hf = Path(out["export"])
    assert hf == Path(out["run_dir"]) / "hf" and (hf / "model.safetensors").is_file() and (hf / "tokenizer.json").is_file()
    assert out["train_loss"] < out["first_loss"]
    run_dir = Path(out["run_dir"])
    assert run_dir.parent == tmp_path and (run_dir / "loss.png").stat().st_size > 5000
    assert (run_dir / "checkpoints").is_dir() and Path(out["index"]).is_file()

    arts = _artifacts(state.state_details.flow_run_id)
    assert {"pretrain-dataset", "pretrain-summary", "pretrain-loss-curve", "pretrain-links", "pretrain-samples",
            "pretrain-plan"} <= set(arts)
    samples = arts["pretrain-samples"].data
    assert samples.count("greedy") == 3 and samples.count("sampled, seed 1234") == 3 and "To be, or not to be" in samples
    dataset = json.loads(arts["pretrain-dataset"].data)
    assert dataset[0]["documents"] == "150" and dataset[0]["dtype"] == "uint16"
    summary = {r["item"]: r["value"] for r in json.loads(arts["pretrain-summary"].data)}
    assert summary["iterations"] == "6 / 6" and summary["job ids"]
    assert {"stage sync (s)", "stage tokenize (s)", "stage index (s)", "stage train (s)"} <= set(summary)
    assert "tokens/s" in summary and "MFU" in summary and float(summary["held-out test perplexity"]) > 1

    again = _run(small_corpus, tmp_path)
    assert again.is_completed(), again.message
    states = _task_states(again.state_details.flow_run_id)
    assert [states[k] for k in ("sync", "tokenize", "index", "train", "export")] == ["Cached"] * 5
    assert "precompile" not in states           # trained to its length already: nothing to compile
    assert again.result()["run_dir"] == out["run_dir"] and again.result()["job_ids"] == out["job_ids"]

    # A different schedule reuses the data stages and trains into a new run folder.
    third = _run(small_corpus, tmp_path, seed=7)
    states = _task_states(third.state_details.flow_run_id)
    assert [states[k] for k in ("sync", "tokenize")] == ["Cached"] * 2 and states["train"] == "Completed"
    assert third.result()["run_dir"] != out["run_dir"]


def test_bad_parameters_fail_the_run_before_any_task(prefect_harness, tmp_path):
    state = pretrain(data=DataParams(sources=[str(tmp_path / "missing.jsonl")]),
                     training=TrainingParams(micro_batch_size=5), output=OutputParams(root=str(tmp_path)),
                     return_state=True)
    assert state.is_failed()
    with pytest.raises(ParameterError) as e:
        state.result()
    assert any(m.startswith("data.sources[0]:") for m in e.value.errors)
    assert any(m.startswith("training.global_batch_size:") for m in e.value.errors)
    assert _task_states(state.state_details.flow_run_id) == {}
    assert not any(tmp_path.iterdir())


def test_tokenized_prefixes_and_vocabulary_from_s3(prefect_harness, small_corpus, tmp_path, s3_server, monkeypatch):
    from tasks.tokenize.stage import tokenize

    for k, v in s3_server.env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    made = tokenize([str(small_corpus)], str(tmp_path / "tok" / "plays"), train_vocab_size=1024, workers=1)
    prefix = made.prefixes["text"]
    bucket = s3_server.new_bucket()
    for path in (prefix + ".bin", prefix + ".idx", made.vocab_file, made.merge_file):
        s3_server.put(bucket, f"tok/{Path(path).name}", Path(path))
    name = Path(prefix).name
    state = pretrain(
        data=DataParams(prefixes=[{"prefix": f"s3://{bucket}/tok/{name}", "weight": 1.0}], split="80,10,10",
                        endpoint_url=s3_server.endpoint_url),
        tokenizer=TokenizerParams(vocab_file=f"s3://{bucket}/tok/vocab.json", merge_file=f"s3://{bucket}/tok/merges.txt"),
        training=TrainingParams(train_iters=2, eval_interval=2, eval_iters=1, log_interval=1,
                                overrides={"lr_warmup_iters": 0}),
        output=OutputParams(root=str(tmp_path / "runs")), return_state=True)
    assert state.is_completed(), state.message
    out = state.result()
    assert [s["stage"] for s in out["stages"]] == ["sync-tokenizer", "sync-prefix-0", "index", "precompile", "train",
                                                   "export"]
    [(weight, local)] = out["dataset"]
    assert weight == 1.0 and Path(local + ".bin").read_bytes() == Path(prefix + ".bin").read_bytes()
    config = json.loads((Path(out["run_dir"]) / "config.json").read_text())
    assert config["vocab_size"] == made.vocab_size and config["data_index"] == out["index"]


def test_lost_outputs_are_rebuilt_and_changed_data_never_resumes_the_old_run(prefect_harness, small_corpus, tmp_path):
    src = tmp_path / "small_corpus.jsonl"
    src.write_text(small_corpus.read_text())
    root = tmp_path / "root"
    first = _run(src, root, compile=False)
    assert first.is_completed(), first.message
    prefix = first.result()["dataset"][0][1]

    Path(prefix + ".bin").unlink()                  # a cached stage's output is lost
    again = _run(src, root, compile=False)
    assert again.is_completed(), again.message
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[again.state_details.flow_run_id])))
    tokenize = sorted(r.state.name for r in runs if r.name.startswith("tokenize"))
    assert tokenize == ["Completed"]                # found stale by its cache policy, run again
    assert Path(prefix + ".bin").is_file()

    shutil.rmtree(first.result()["run_dir"])         # the run folder deleted: the same parameters train it again
    retrained = _run(src, root, compile=False)
    assert retrained.is_completed(), retrained.message
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[retrained.state_details.flow_run_id])))
    assert sorted(r.state.name for r in runs if r.name.startswith("train")) == ["Completed"]
    assert Path(retrained.result()["export"], "model.safetensors").is_file()

    with open(src, "a") as f:                        # new content at the same source path
        f.write(json.dumps({"text": "Entirely new words that the first run never saw. " * 30}) + "\n")
    changed = _run(src, root, compile=False)
    assert changed.is_failed()
    assert "holds checkpoints trained on" in changed.message and "set output.run_name" in changed.message.lower()
    states = _task_states(changed.state_details.flow_run_id)
    assert states["tokenize"] == "Completed" and states["index"] == "Completed"


def test_a_damaged_output_reruns_its_stage_alone_from_the_flow_and_from_the_stages_command_line(
        prefect_harness, small_corpus, tmp_path):
    """Each stage's own cache policy finds its recorded outputs damaged: the flow's rerun computes
    that stage again and takes every other from the cache; the stage's command line does the same
    with its own record (cached while intact, computed again once damaged)."""
    import subprocess
    import sys

    from tests.fixtures_gpt import ROOT

    src = tmp_path / "small_corpus.jsonl"
    src.write_text(small_corpus.read_text())
    first = _run(src, tmp_path / "root", compile=False)
    assert first.is_completed(), first.message
    index = Path(first.result()["index"])
    arrays = sorted(index.parent.glob("*.npy"))
    with open(arrays[0], "r+b") as f:            # an index array cut short
        f.truncate(64)
    again = _run(src, tmp_path / "root", compile=False)
    assert again.is_completed(), again.message
    states = _task_states(again.state_details.flow_run_id)
    assert {k: states[k] for k in ("sync", "tokenize", "index", "train", "export")} == {
        "sync": "Cached", "tokenize": "Cached", "index": "Completed", "train": "Cached", "export": "Cached"}
    assert arrays[0].stat().st_size > 64

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}

    def tokenize_cli() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tasks.tokenize", "--input", str(src), "--output-prefix",
                               str(tmp_path / "cli" / "plays"), "--vocab-size", "512", "--workers", "1"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)

    made = tokenize_cli()
    assert made.returncode == 0 and "cached: " not in made.stderr, made.stderr[-2000:]
    prefix = json.loads(made.stdout.splitlines()[-1])["prefixes"]["text"]
    assert "cached: " in tokenize_cli().stderr
    size = Path(prefix + ".bin").stat().st_size
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(size // 2)
    remade = tokenize_cli()
    assert remade.returncode == 0 and "cached: " not in remade.stderr and "gone or damaged" in remade.stderr
    assert Path(prefix + ".bin").stat().st_size == size

    def index_cli() -> dict:
        out = subprocess.run([sys.executable, "-m", "tasks.index", "--data-path", prefix, "--seq-length", "16",
                              "--train-samples", "50", "--out-dir", str(tmp_path / "cli" / "index")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.startswith("{"), out.stdout[:3000] + out.stderr[-3000:]
        return json.loads(out.stdout)

    assert index_cli()["cached"] is False and index_cli()["cached"] is True
    for array in (tmp_path / "cli" / "index").glob("*.npy"):
        array.unlink()
    assert index_cli()["cached"] is False and len(list((tmp_path / "cli" / "index").glob("*.npy"))) > 0


@pytest.mark.timeout(300)
def test_a_dry_run_records_the_plan_and_runs_nothing(prefect_harness, tmp_path):
    """From the UI (the flow's dry_run parameter): the plan artifact with the layout, the memory per
    rank and the estimate, and nothing synced, tokenized or written under the root. From the command
    line: the same rows printed, and no Prefect server started."""
    import subprocess
    import sys

    from tests.fixtures_gpt import ROOT

    root = tmp_path / "root"
    state = pretrain(model="tiny-llama", output=OutputParams(root=str(root)), dry_run=True, return_state=True)
    assert state.is_completed(), state.message
    rows = {r["item"]: r["value"] for r in state.result()["plan"]}
    assert rows["model"] == "tiny-llama" and rows["what happens"].startswith("dry run, nothing synced")
    assert "memory per rank" in rows and "tokens to train" in rows
    # the sample corpus's BPE bounds the vocabulary (4,096 entries), so the export is sized by it
    assert rows["vocabulary"] == "at most 4,096 (the BPE trained on the sources)"
    assert rows["export"].startswith("llama, 0.01 GiB of fp32 weights in 1 file(s)")
    table = _artifacts(state.state_details.flow_run_id)["pretrain-plan"]
    assert "dry run" in json.dumps(table.data)
    assert not root.exists()
    printed = subprocess.run([sys.executable, "-m", "flows.pretrain", "--model", "tiny-llama", "--root", str(root),
                              "--dry-run"], cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    assert "memory per rank: " in printed.stdout and "Starting temporary server" not in printed.stdout + printed.stderr
    # A shape of its own is named by it, from the preset it started from.
    custom = subprocess.run([sys.executable, "-m", "flows.pretrain", "--model", "tiny-llama", "--root", str(root),
                             "--set", "num_layers=2", "--dry-run"], cwd=ROOT,
                            env={k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
                            capture_output=True, text=True, timeout=120)
    assert custom.returncode == 0, custom.stderr
    assert "model: llama-2l-128h-4a-2g-352f (the other fields from preset tiny-llama)" in custom.stdout
    assert f"run folder: {root}/llama-2l-128h-4a-2g-352f-" in custom.stdout
    assert not root.exists()
