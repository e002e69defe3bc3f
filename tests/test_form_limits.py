"""The form reaches only what the operator allows, and every bad value stops before anything runs.

Each case below was once accepted by the plan and failed late, or trained on the wrong thing, or
wrote where it should not. Through `make_plan` (what the UI's form and `--param` reach) and through
the command line (one `invalid parameters:` block, exit 2, no traceback).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flows.plan.boundary import AWS_PROFILES, INPUT_ROOTS, OUTPUT_ROOTS, S3_ALLOWED, S3_ENDPOINTS, Boundary
from flows.plan.build import make_plan
from flows.plan.params import (
    ClusterParams,
    DataParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
)
from tests.fixtures_disk import read_only

ROOT = Path(__file__).resolve().parent.parent


def _errors(root: Path, *, model: str = "tiny", data: DataParams | None = None, training: TrainingParams | None = None,
            cluster: ClusterParams | None = None, tokenizer: TokenizerParams | None = None, **output) -> list[str]:
    with pytest.raises(ParameterError) as e:
        make_plan(model, data or DataParams(), tokenizer or TokenizerParams(), training or TrainingParams(),
                  cluster or ClusterParams(), OutputParams(root=str(root), **output))
    return e.value.errors


def _cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.pretrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# ---------------------------------------------------------------- paths and names


@pytest.mark.parametrize("name", ["../escaped", "/tmp/elsewhere", "a/b", "data", ".", "..", ".hidden", "x" * 200])
def test_a_run_name_is_a_name_not_a_path(tmp_path, name):
    (line,) = [e for e in _errors(tmp_path / "root", run_name=name) if e.startswith("output.run_name")]
    assert f"{name!r} is not a name" in line
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/elsewhere").exists()


def test_the_output_root_and_local_inputs_stay_inside_the_operators_folders(tmp_path, monkeypatch):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "corpus").mkdir(parents=True)
    outside.mkdir()
    (allowed / "corpus" / "a.jsonl").write_text('{"text": "x"}\n')
    (outside / "secret.jsonl").write_text('{"text": "private"}\n')
    (allowed / "corpus" / "link.jsonl").symlink_to(outside / "secret.jsonl")   # a link leading out
    monkeypatch.setenv(INPUT_ROOTS, str(allowed))
    monkeypatch.setenv(OUTPUT_ROOTS, str(allowed / "runs"))
    text = "\n".join(_errors(outside / "runs"))
    assert f"output.root: {outside / 'runs'} is outside the output roots the operator allows" in text
    text = "\n".join(_errors(allowed / "runs", data=DataParams(sources=[
        str(outside / "secret.jsonl"), str(allowed / "corpus" / "link.jsonl"), "/etc/passwd",
        str(allowed / "corpus" / "a.jsonl")])))
    assert f"data.sources[0]: {outside / 'secret.jsonl'} is outside the folders the operator allows reading from" in text
    assert f"data.sources[1]: {allowed / 'corpus' / 'link.jsonl'} (a link to {outside / 'secret.jsonl'})" in text
    assert "data.sources[2]: /etc/passwd is outside" in text and "data.sources[3]" not in text
    text = "\n".join(_errors(allowed / "runs", tokenizer=TokenizerParams(vocab_file="/etc/passwd",
                                                                        merge_file="/etc/hostname")))
    assert "tokenizer.vocab_file: /etc/passwd is outside" in text and "tokenizer.merge_file: /etc/hostname" in text
    assert not (outside / "runs").exists()


def test_every_file_a_folder_input_reads_is_checked_after_its_links(tmp_path, monkeypatch):
    """A tokenizer folder or a HuggingFace folder inside the allowed roots whose files link out of
    them is refused, naming the file and where it leads."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "llama3").mkdir(parents=True)
    (allowed / "hf").mkdir()
    outside.mkdir()
    (outside / "tokenizer.json").write_text("{}")
    (outside / "model.safetensors").write_bytes(b"weights from elsewhere")
    (allowed / "llama3" / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    (allowed / "hf" / "config.json").write_text("{}")
    (allowed / "hf" / "model.safetensors").symlink_to(outside / "model.safetensors")
    monkeypatch.setenv(INPUT_ROOTS, str(allowed))
    monkeypatch.setenv(OUTPUT_ROOTS, str(allowed / "runs"))
    text = "\n".join(_errors(allowed / "runs", tokenizer=TokenizerParams(tokenizer_model=str(allowed / "llama3"))))
    assert (f"tokenizer.tokenizer_model: {allowed / 'llama3' / 'tokenizer.json'} (a link to "
            f"{outside / 'tokenizer.json'}) is outside the folders the operator allows") in text
    text = "\n".join(_errors(allowed / "runs", training=TrainingParams(overrides={"init_from_hf": str(allowed / "hf")})))
    assert (f"training.overrides.init_from_hf: {allowed / 'hf' / 'model.safetensors'} (a link to "
            f"{outside / 'model.safetensors'}) is outside the folders the operator allows") in text
    assert not (allowed / "runs").exists()


def test_a_run_never_reads_its_own_output_back_as_a_source(tmp_path):
    root = tmp_path / "runs"
    (root / "data" / "raw").mkdir(parents=True)
    (root / "data" / "raw" / "a.jsonl").write_text('{"text": "x"}\n')
    for source, how in ((root, "lies in"), (root / "data" / "raw" / "a.jsonl", "lies in"), (tmp_path, "holds")):
        (line,) = [e for e in _errors(root, data=DataParams(sources=[str(source)])) if e.startswith("data.sources")]
        assert f"{how} the output root {root}" in line


def test_s3_locations_and_endpoints_are_the_operators(tmp_path, monkeypatch):
    monkeypatch.setenv(S3_ALLOWED, "s3://corpora/public, s3://runs-bucket")
    monkeypatch.setenv(S3_ENDPOINTS, "http://minio.internal:9000/")
    text = "\n".join(_errors(tmp_path, data=DataParams(
        sources=["s3://corpora/public/a.jsonl", "s3://corpora/publicity/b.jsonl", "s3://attacker/x.jsonl"],
        endpoint_url="http://attacker.example:9000"),
        uri="s3://attacker/loot", endpoint_url="https://attacker.example"))
    assert "data.sources[0]" not in text
    assert "data.sources[1]: s3://corpora/publicity/b.jsonl is outside the S3 locations the operator allows" in text
    assert "data.sources[2]: s3://attacker/x.jsonl is outside" in text and "output.uri: s3://attacker/loot is outside" in text
    assert "data.endpoint_url: 'http://attacker.example:9000' is not an endpoint the operator allows" in text
    assert "output.endpoint_url: 'https://attacker.example' is not an endpoint" in text
    boundary = Boundary.from_env()
    assert boundary.endpoint("HTTP://MINIO.internal:9000") is None and boundary.s3_uri("s3://runs-bucket/gpt/") is None
    monkeypatch.delenv(S3_ENDPOINTS)
    assert "only AWS's own endpoints" in Boundary.from_env().endpoint("http://127.0.0.1:9000")
    assert Boundary.from_env().endpoint(None) is None
    monkeypatch.setenv(AWS_PROFILES, "corpora-reader")
    text = "\n".join(_errors(tmp_path, data=DataParams(profile="admin"), profile="corpora-reader"))
    assert "data.profile: 'admin' is not an AWS profile the operator allows (corpora-reader" in text
    assert "output.profile" not in text


def test_by_default_everything_under_the_current_folder_and_no_other_endpoint(tmp_path, monkeypatch):
    for name in (INPUT_ROOTS, OUTPUT_ROOTS, S3_ALLOWED, S3_ENDPOINTS, AWS_PROFILES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    boundary = Boundary.from_env()
    assert boundary.input_roots == boundary.output_roots == (tmp_path.resolve(),) and boundary.s3 is None
    assert make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(), ClusterParams(),
                     OutputParams(root="runs")).run_dir.parent == tmp_path / "runs"
    assert any(e.startswith("data.endpoint_url:") for e in _errors(tmp_path / "runs", data=DataParams(
        endpoint_url="http://127.0.0.1:9000")))


# ---------------------------------------------------------------- values and what they cost


@pytest.mark.parametrize("training, field, says", [
    (TrainingParams(overrides={"micro_batch_size": True}), "training.overrides.micro_batch_size", "whole number"),
    (TrainingParams(overrides={"lr": float("nan")}), "training.overrides.lr", "finite"),
    (TrainingParams(overrides={"clip_grad": float("inf")}), "training.overrides.clip_grad", "finite"),
    (TrainingParams(overrides={"seed": -1}), "training.overrides.seed", "between 0 and 2**32 - 1"),
    (TrainingParams(overrides={"num_layers": 24, "num_attention_heads": 5}), "training",
     "not divisible by num_attention_heads=5"),
    (TrainingParams(overrides={"model": "gpt3-1.3b"}), "training.overrides.model", "decided by the flow"),
    (TrainingParams(overrides={"compile": "yes"}), "training.overrides.compile", "true or false"),
], ids=["bool-as-number", "nan", "inf", "seed", "preset-shape", "preset-name", "text-as-bool"])
def test_values_that_were_accepted_but_wrong(tmp_path, training, field, says):
    errors = _errors(tmp_path, training=training)
    assert any(e.startswith(f"{field}:") and says in e for e in errors), errors


@pytest.mark.parametrize("fields", [{"micro_batch_size": True}, {"lr": float("inf")}, {"seq_length": 10**9},
                                    {"train_iters": 0}, {"tensor_parallel": -1}, {"seed": 2**40}])
def test_the_form_refuses_booleans_non_finite_and_out_of_range_numbers(fields):
    with pytest.raises(ValueError) as e:
        TrainingParams(**fields)
    assert list(fields)[0] in str(e.value)


def test_what_the_ranks_or_the_disk_cannot_hold_is_refused_before_anything_runs(tmp_path):
    (line,) = [e for e in _errors(tmp_path, model="gpt3-175b") if e.startswith("training:")]
    assert "each rank needs an estimated" in line and "this machine has" in line
    (line,) = [e for e in _errors(tmp_path, training=TrainingParams(train_samples=10**13)) if e.startswith("output.root")]
    assert f"{tmp_path} has" in line and "GiB free, but the run writes at least" in line and "data index" in line


def test_a_huggingface_folder_to_start_from_must_be_a_model_of_this_shape(tmp_path):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    errors = _errors(tmp_path, training=TrainingParams(overrides={"init_from_hf": str(folder)}))
    assert any(e.startswith("training.overrides.init_from_hf:") and "no model.safetensors" in e for e in errors)
    (folder / "model.safetensors").write_bytes(b"")
    errors = _errors(tmp_path, training=TrainingParams(overrides={"init_from_hf": str(folder)}))
    assert any("has no 'n_embd' field: it is not a GPT-2 or Llama model's configuration" in e for e in errors)
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral", "n_embd": 128}))
    errors = _errors(tmp_path, training=TrainingParams(overrides={"init_from_hf": str(folder)}))
    assert any("model_type='mistral'" in e for e in errors)
    (folder / "config.json").write_text(json.dumps({     # a Llama: another block than the tiny GPT's
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128}))
    errors = _errors(tmp_path, training=TrainingParams(overrides={"init_from_hf": str(folder)}))
    assert any("another shape (num_query_groups: 2 there, 4 here; ffn_hidden_size: 352 there, 512 here; "
               "position_embedding_type: rope there, learned_absolute here" in e for e in errors), errors
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 4, "n_head": 4,
                                                    "n_positions": 128, "vocab_size": 1000}))
    errors = _errors(tmp_path, training=TrainingParams(overrides={"init_from_hf": str(folder)}))
    assert any("another shape (hidden_size: 64 there, 128 here; ffn_hidden_size: 256 there, 512 here)" in e for e in errors)


def _hf_errors(root: Path, folder: Path) -> list[str]:
    try:
        make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(overrides={"init_from_hf": str(folder)}),
                  ClusterParams(), OutputParams(root=str(root)))
    except ParameterError as e:
        return [line for line in e.errors if line.startswith("training.overrides.init_from_hf:")]
    return []


def test_a_huggingface_folders_weights_are_checked_against_its_model_from_their_headers(tmp_path):
    from safetensors.torch import save_file

    from gpt.config import Config
    from gpt.export import INDEX, hf_config, to_hf_state_dict
    from gpt.model import GPT

    config = Config(model="tiny", vocab_size=1000, device="cpu", precision="fp32", mock_data=True)
    tensors = to_hf_state_dict(GPT(config))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(config, 0)))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, held in shards.items():
        save_file({n: tensors[n] for n in held}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: file for file, held in shards.items() for n in held}}
    (folder / INDEX).write_text(json.dumps(index))
    assert _hf_errors(tmp_path, folder) == []

    second = folder / "model-00002-of-00002.safetensors"
    whole = second.read_bytes()
    second.write_bytes(whole[:-100])
    (line,) = _hf_errors(tmp_path, folder)
    assert f"{second}: truncated" in line and line.endswith("export the model again")
    second.unlink()
    (line,) = _hf_errors(tmp_path, folder)
    assert f"{second.name} is missing ({INDEX} names it)" in line
    second.write_bytes(whole)

    wrong = dict(tensors, **{"transformer.h.1.mlp.c_fc.weight": tensors["transformer.h.1.mlp.c_fc.weight"][:, :256]})
    (folder / INDEX).unlink()
    for file in shards:
        (folder / file).unlink()
    save_file({n: t.contiguous() for n, t in wrong.items() if n != "transformer.h.3.ln_2.bias"},
              str(folder / "model.safetensors"))
    (line,) = _hf_errors(tmp_path, folder)
    assert "transformer.h.1.mlp.c_fc.weight is [128, 256] where config.json makes [128, 512]" in line
    assert "transformer.h.3.ln_2.bias is in no weight file" in line

    (folder / INDEX).write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    (line,) = _hf_errors(tmp_path, folder)
    assert "weight_map must map each tensor's name to a file of this folder" in line
    (folder / INDEX).unlink()
    (folder / "config.json").write_text("[]")
    (line,) = _hf_errors(tmp_path, folder)
    assert f"{folder}: config.json holds a list, not a model's configuration" in line
    out = _cli("--root", str(tmp_path), "--set", f"init_from_hf={folder}")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "holds a list" in out.stderr, out.stderr


@pytest.mark.parametrize("overrides, says", [
    ({"hang_timeout_s": 1e-9}, "training.overrides.hang_timeout_s: hang_timeout_s=1e-09: at least 5 s"),
    ({"collective_timeout_s": 0.5}, "training.overrides.collective_timeout_s: collective_timeout_s=0.5: at least 5 s"),
    ({"norm_epsilon": 1e300}, "training.overrides.norm_epsilon: norm_epsilon=1e+300: must lie between 0 and 1"),
    ({"spike_window": 50}, "training.overrides.spike_window: spike_window=50 is as long as the run (10 iterations)"),
])
def test_absurd_values_are_refused_with_the_bounds_that_make_sense(tmp_path, overrides, says):
    errors = _errors(tmp_path, training=TrainingParams(train_iters=10, overrides=overrides))
    assert any(e.startswith(says) for e in errors), errors


def test_a_shard_size_under_a_megabyte_is_refused_by_the_export(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gpt.export", str(tmp_path), str(tmp_path / "hf"), "--max-shard-size",
                          "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "'0.1': at least 1MB" in out.stderr, out.stderr


_ROLLBACK = {"kind": "loss spike", "iterations": [5], "losses": [9.0], "median": 3.0, "samples": [4, 3],
             "documents": [], "resumed_from": 0}


@pytest.mark.parametrize("file, text, says", [
    ("skipped.json", json.dumps({"rollbacks": [dict(_ROLLBACK, samples=[-5, 3])]}),
     "skipped.json: rollbacks.0.samples.0: input should be greater than or equal to 0 (it holds -5); restore it"),
    ("skipped.json", json.dumps({"rollbacks": [_ROLLBACK]})[:-20], "skipped.json: not JSON (Expecting"),
    ("skipped.json", json.dumps({"rollbacks": [dict(_ROLLBACK, samples=["4"])]}),
     "skipped.json: rollbacks.0.samples.0: input should be a valid integer"),
    ("jobs.json", json.dumps([{"job_id": 7}]), "jobs.json: 0.job_id: input should be a valid string (it holds 7)"),
    ("trackers.json", json.dumps({"mlflow": {"run_id": "a", "last_step": -1}}),
     "trackers.json: mlflow.last_step: input should be greater than or equal to 0"),
    ("trackers.json", "[]", "trackers.json: the top level: input should be a valid dictionary"),
])
def test_a_damaged_record_of_the_run_folder_is_refused_naming_the_file_and_the_field(tmp_path, file, text, says):
    run = tmp_path / "damaged"
    run.mkdir()
    (run / file).write_text(text)
    (line,) = _errors(tmp_path, run_name="damaged")
    assert line.startswith(f"output.run_name: {run / file}") and says in line, line
    assert (run / file).read_text() == text


def test_a_truncated_record_is_one_line_from_the_command_line(tmp_path):
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "skipped.json").write_text('{"rollbacks": [{"kind": "loss sp')
    out = _cli("--root", str(tmp_path), "--run-name", "damaged")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"output.run_name: {tmp_path / 'damaged' / 'skipped.json'}: not JSON" in out.stderr


def test_a_read_only_output_root_is_named(disk):
    target = disk("1m")
    read_only(target)
    (line,) = [e for e in _errors(target) if e.startswith("output.root")]
    assert f"cannot write in {target} (Read-only file system)" in line


# ---------------------------------------------------------------- from the command line


@pytest.mark.parametrize("args, says", [
    (["--train-iters", "0"], "training.train_iters: Input should be greater than or equal to 1 (got 0)"),
    (["--tp", "-1"], "training.tensor_parallel: Input should be greater than or equal to 1"),
    (["--prefix", "abc", "X"], "data.prefixes[0].weight: Input should be a valid number"),
    (["--set", "lr=[1,2"], "training.overrides.lr: lr='[1,2': expected a number"),
    (["--set", "micro_batch_size=true"], "training.overrides.micro_batch_size: micro_batch_size='true': expected a whole number"),
    (["--set", "lr=nan"], "training.overrides.lr: lr='nan': must be a finite number"),
    (["--cluster-set", "srun_extra=--x"], "cluster.overrides.srun_extra: srun_extra='--x': expected JSON"),
    (["--run-name", "../../etc"], "output.run_name: '../../etc' is not a name"),
])
def test_the_command_line_answers_one_block_of_lines_and_exit_2(tmp_path, args, says):
    out = _cli("--root", str(tmp_path), *args)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "invalid parameters:\n" in out.stderr and says in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "data"] or not list(tmp_path.glob("*/checkpoints"))


def test_the_command_line_answers_bad_input_before_a_prefect_server_starts(tmp_path):
    out = _cli("--root", str(tmp_path), "--model", "tinny")
    assert out.returncode == 2 and "model: 'tinny' is not a preset" in out.stderr, out.stderr[-2000:]
    assert "temporary Prefect server" not in out.stdout + out.stderr


def test_a_stage_that_fails_answers_one_line_and_keeps_its_traceback_in_the_run_folder(tmp_path):
    damaged = tmp_path / "corpus.parquet"
    damaged.write_bytes(b"not a parquet file")
    out = _cli("--root", str(tmp_path / "root"), "--source", str(damaged), "--run-name", "damaged")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stage tokenize failed: TokenizeError: {damaged}: not a readable Parquet file")
    assert "Traceback" not in out.stdout + out.stderr
    kept = tmp_path / "root" / "damaged" / "traceback.txt"
    assert f"(traceback in {kept})" in last and "Traceback (most recent call last)" in kept.read_text()


def test_optimizer_values_out_of_range_are_refused_at_plan_time_each_naming_its_field(tmp_path):
    errors = _errors(tmp_path / "root", training=TrainingParams(overrides={
        "lr": -1, "adam_beta1": 1.5, "adam_beta2": -0.1, "adam_eps": 0, "weight_decay": -3, "clip_grad": -1}))
    for field, text in (("training.overrides.lr", "lr=-1.0: must be positive"),
                        ("training.overrides.adam_beta1", "adam_beta1=1.5: must lie in [0, 1)"),
                        ("training.overrides.adam_beta2", "adam_beta2=-0.1: must lie in [0, 1)"),
                        ("training.overrides.adam_eps", "adam_eps=0.0: must be positive"),
                        ("training.overrides.weight_decay", "weight_decay=-3.0: must be >= 0"),
                        ("training.overrides.clip_grad", "clip_grad=-1.0: must be >= 0")):
        assert any(e.startswith(f"{field}: {text}") for e in errors), (field, errors)
    assert not any("min_lr" in e for e in errors), errors          # a field the user never set


def test_a_zero_layout_size_is_refused_not_trained_as_one(tmp_path):
    errors = _errors(tmp_path / "root", training=TrainingParams(overrides={"pipeline_parallel": 0}))
    assert any(e.startswith("training.overrides.pipeline_parallel: pipeline_parallel=0: must be a positive integer")
               for e in errors), errors


def test_a_run_name_with_a_trailing_newline_is_not_a_name(tmp_path):
    (line,) = [e for e in _errors(tmp_path / "root", run_name="evil\n") if e.startswith("output.run_name")]
    assert "'evil\\n' is not a name" in line


def test_an_operator_cap_that_does_not_parse_stops_the_run_before_any_stage(tmp_path):
    out = _cli("--root", str(tmp_path), "--train-iters", "2", "--no-compile", env={"GPT_BUDGET_NODE_HOURS": "abc"})
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "budget: GPT_BUDGET_NODE_HOURS='abc' where the flow runs is not a positive number" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr and not (tmp_path / "data").exists()


@pytest.mark.timeout(300)
def test_files_left_out_of_tokenizing_and_a_run_without_evaluation_are_said_not_passed_over(tmp_path):
    from tasks.tokenize.sample_corpus import sample_corpus

    corpus = tmp_path / "corpus"
    sample_corpus(str(corpus))
    (corpus / "notes.txt").write_text("how this corpus was collected\n")
    (corpus / ".sync-manifest.json").write_text('{"text": "a user file named as the sync names its manifest"}\n')
    with open(next(corpus.glob("*.jsonl")), "ab") as f:
        documents = sum(1 for _ in open(next(corpus.glob("*.jsonl")), "rb"))
        f.write(b'{"body": "no text field"}\n' * documents)
    out = _cli("--source", str(corpus), "--split", "100,0,0", "--train-vocab-size", "2048", "--train-iters", "2",
               "--no-compile",
               "--root", str(tmp_path / "root"), "--set", "eval_interval=100000", cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "warning: data.sources: 1 synced file(s) are not JSONL or Parquet and are not tokenized: notes.txt" in text
    assert ("warning: data.sources: 1 file(s) are named as the sync names its own files and are not copied; rename "
            f"them if they are data: {corpus / '.sync-manifest.json'}") in text
    assert re.search(r"warning: data.sources: [\d,]+ of [\d,]+ lines \(\d+%\) were skipped \(missing_key=", text), text[-3000:]
    assert "warning: data.split '100,0,0' gives the valid split no share: the run trains without evaluation" in text
