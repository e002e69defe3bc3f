"""Parameters of the pretrain flow: the form the UI renders and the checks made before submitting."""
from __future__ import annotations

import json
import re

import pytest
from prefect import flow
from prefect.utilities.callables import parameter_schema
from pydantic import Field

from flows.cli import parse_args
from flows.plan.build import make_plan
from flows.plan.params import (
    ClusterParams,
    DataParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
    WeightedPrefix,
)
from flows.pretrain import pretrain
from gpt.config.presets import PRESETS


def _check(**kw):
    args = dict(model="tiny", data=DataParams(), tokenizer=TokenizerParams(), training=TrainingParams(),
                cluster=ClusterParams(), output=OutputParams())
    args.update(kw)
    return make_plan(**args)


def _errors(**kw) -> list[str]:
    with pytest.raises(ParameterError) as e:
        _check(**kw)
    return e.value.errors


def test_ui_form_schema_has_model_choices_and_nested_groups():
    schema = parameter_schema(pretrain.fn).model_dump()
    props = schema["properties"]
    assert list(props) == ["model", "data", "tokenizer", "training", "cluster", "output", "budget", "evaluation",
                           "phases", "dry_run"]
    assert props["phases"]["default"] == [] and "PhaseParams" in schema["definitions"]
    assert props["model"]["default"] == "tiny"
    model_enum = props["model"].get("enum") or schema["definitions"][props["model"]["$ref"].split("/")[-1]]["enum"]
    assert model_enum == list(PRESETS)
    definitions = schema["definitions"]
    assert {"DataParams", "TokenizerParams", "TrainingParams", "ClusterParams", "OutputParams",
            "WeightedPrefix", "BudgetParams"} <= set(definitions)
    training = definitions["TrainingParams"]["properties"]
    assert training["data_parallel_mode"]["enum"] == ["ddp", "fsdp"]
    assert "description" in props["data"] and "description" in definitions["DataParams"]["properties"]["sources"]
    json.dumps(schema)  # the server stores it as JSON


def test_defaults_are_the_embedded_run(tmp_path):
    plan = _check(output=OutputParams(root=str(tmp_path)))
    assert plan.config.model == "tiny" and plan.config.train_iters == PRESETS["tiny"]["train_iters"]
    assert plan.world_size == 1 and plan.run_dir.parent == tmp_path
    # The same parameters name the same run folder (a retry resumes it); a change names another.
    assert _check(output=OutputParams(root=str(tmp_path))).run_dir == plan.run_dir
    assert _check(output=OutputParams(root=str(tmp_path)), training=TrainingParams(seed=7)).run_dir != plan.run_dir


def test_every_bad_field_gets_its_own_message(tmp_path):
    errors = _errors(
        data=DataParams(sources=[str(tmp_path / "missing.jsonl")], split="a,b",
                        prefixes=[WeightedPrefix(prefix=str(tmp_path / "nope"))]),
        tokenizer=TokenizerParams(vocab_file=str(tmp_path / "vocab.json")),
        training=TrainingParams(train_iters=10, train_samples=100, data_parallel=3),
        cluster=ClusterParams(overrides={"nodes": 0}),
        output=OutputParams(uri="/local/folder"),
    )
    text = "\n".join(errors)
    assert "training: set train_iters or train_samples, not both" in text
    assert f"data.sources[0]: {tmp_path / 'missing.jsonl'} matches no file" in text
    assert f"data.prefixes[0].prefix: {tmp_path / 'nope'}.bin not found" in text
    assert "tokenizer: give both vocab_file and merge_file" in text
    assert "tokenizer.vocab_file:" in text and "not found" in text
    assert "data.split:" in text
    assert "cluster:" in text and "nodes" in text
    assert "output.uri: '/local/folder' is not an s3:// URI" in text
    assert len(errors) >= 8


def test_config_errors_name_the_training_field():
    errors = _errors(training=TrainingParams(micro_batch_size=3))
    assert errors == [e for e in errors if e.startswith("training.")]
    assert any(e.startswith("training.global_batch_size:") and "multiple of 3" in e for e in errors)
    errors = _errors(training=TrainingParams(tensor_parallel=3))
    assert any("tensor_parallel" in e and "divides the head count" in e for e in errors)
    errors = _errors(training=TrainingParams(overrides={"no_such_field": 1}))
    assert any("no_such_field" in e for e in errors)


def test_every_config_problem_at_once_and_numbers_given_as_text():
    errors = _errors(training=TrainingParams(micro_batch_size=3, min_lr=5.0, train_iters=20,
                                            overrides={"lr_warmup_iters": 10_000}))
    assert any(e.startswith("training.global_batch_size:") for e in errors)
    assert any(e.startswith("training.min_lr:") for e in errors)
    assert any(e.startswith("training.overrides.lr_warmup_iters:") for e in errors)
    errors = _errors(training=TrainingParams(overrides={"weight_decay": "lots"}))
    assert errors == ["training.overrides.weight_decay: weight_decay='lots': expected a number"]
    params = parse_args(["--set", "lr=3e-4", "--set", "adam_eps=1e-8"])     # typed by their fields: floats
    plan = _check(training=params["training"])
    assert (plan.config.lr, plan.config.adam_eps) == (3e-4, 1e-8)


def test_data_parallel_must_match_the_cluster():
    errors = _errors(training=TrainingParams(data_parallel=2))
    assert any(e.startswith("training.data_parallel:") and "cluster runs 1" in e for e in errors)
    errors = _errors(cluster=ClusterParams(preset="no-such-preset"))
    assert any(e.startswith("cluster:") and "no-such-preset" in e for e in errors)


ONE_GPU = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 1}


def test_device_and_precision_come_from_the_cluster_not_the_flow_host(tmp_path, monkeypatch, operator_preset):
    """A CPU-only head node submitting to a GPU partition trains in bf16 on CUDA."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)      # this host: no GPU
    gpu = _check(cluster=ClusterParams(preset="p4d-8gpu", overrides=ONE_GPU),
                 output=OutputParams(root=str(tmp_path)))
    assert (gpu.config.device, gpu.config.precision) == ("cuda", "bf16")
    volta = _check(cluster=ClusterParams(preset=operator_preset("p4d-8gpu", accelerator="v100"), overrides=ONE_GPU),
                   output=OutputParams(root=str(tmp_path)))
    assert (volta.config.device, volta.config.precision) == ("cuda", "fp16")
    trn = _check(cluster=ClusterParams(preset="trn1-32xl", overrides={"nodes": 1, "tasks_per_node": 1}), output=OutputParams(root=str(tmp_path)))
    assert (trn.config.device, trn.config.precision) == ("neuron", "bf16")
    assert not trn.config.compile and trn.precompiles   # graphs from neuron_parallel_compile, not torch.compile
    local = _check(output=OutputParams(root=str(tmp_path)))                # the local executor runs here
    assert (local.config.device, local.config.precision) == ("cpu", "fp32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    here = _check(output=OutputParams(root=str(tmp_path)))
    assert (here.config.device, here.config.precision) == ("cuda", "bf16")
    explicit = _check(cluster=ClusterParams(preset="p4d-8gpu", overrides=ONE_GPU),
                      training=TrainingParams(precision="fp32"), output=OutputParams(root=str(tmp_path)))
    assert explicit.config.precision == "fp32"
    errors = _errors(cluster=ClusterParams(preset="slurm-local"), training=TrainingParams(device="cuda"))
    assert any(e.startswith("training.device: 'cuda', but cluster preset 'slurm-local' runs on 'cpu'") for e in errors)
    errors = _errors(cluster=ClusterParams(preset=operator_preset("slurm-local", device="auto")))
    assert any("device='auto' is for the local executor only" in e for e in errors)
    errors = _errors(cluster=ClusterParams(preset="slurm-local", overrides={"device": "cuda"}))
    assert any("device is set only by the operator" in e for e in errors), errors


def test_prefixes_need_the_vocabulary(tmp_path):
    errors = _errors(data=DataParams(prefixes=[WeightedPrefix(prefix="s3://bucket/data/corpus_text_document")]))
    assert any(e.startswith("tokenizer.vocab_file:") for e in errors)


def test_pydantic_rejects_wrong_types_with_the_field_name():
    with pytest.raises(Exception) as e:
        TrainingParams(micro_batch_size=0)
    assert "micro_batch_size" in str(e.value)
    with pytest.raises(Exception) as e:
        DataParams(sorces=["x"])  # a typo is an error, not silently ignored
    assert "sorces" in str(e.value)


def test_cli_flags_map_to_parameters(tmp_path):
    params = parse_args(["--model", "gpt3-125m", "--source", "s3://b/a.jsonl", "--source", "/data/b.jsonl",
                         "--prefix", "0.3", "s3://b/p_text_document", "--train-samples", "1000",
                         "--micro-batch-size", "2", "--global-batch-size", "64", "--tp", "2", "--dp", "4",
                         "--set", "lr_warmup_samples=10", "--cluster", "slurm-local",
                         "--cluster-set", "partition=gpu", "--cluster-set", "nodes=2", "--benchmark",
                         "--root", str(tmp_path), "--output-uri", "s3://out/run"])
    assert params["model"] == "gpt3-125m"
    assert params["data"].sources == ["s3://b/a.jsonl", "/data/b.jsonl"]
    assert params["data"].prefixes == [WeightedPrefix(weight=0.3, prefix="s3://b/p_text_document")]
    t = params["training"]
    assert (t.train_samples, t.micro_batch_size, t.global_batch_size, t.tensor_parallel, t.data_parallel,
            t.benchmark) == (1000, 2, 64, 2, 4, True)
    assert t.overrides == {"lr_warmup_samples": 10}
    assert params["cluster"].preset == "slurm-local"
    assert params["cluster"].overrides == {"partition": "gpu", "nodes": 2}
    assert params["output"].uri == "s3://out/run" and params["output"].root == str(tmp_path)
    assert parse_args([])["data"] == DataParams()
    assert parse_args(["--train-vocab-size", "2048"])["tokenizer"].train_vocab_size == 2048


def test_a_layout_that_cannot_fit_is_refused_before_the_queue_naming_one_that_would(tmp_path, monkeypatch,
                                                                                    operator_preset):
    """GPT-3 175B on 16 p4d nodes (128 A100s), tensor parallel 8 with FSDP and micro-batch 4: the plan
    refuses it with the arithmetic and names a change that fits, which then plans; Megatron's layout
    (TP 8 x PP 16) plans with its mesh, schedule and bubble in the plan's rows."""
    import flows.plan.build
    from flows.plan.artifact import plan_rows

    monkeypatch.setattr(flows.plan.build, "disk_problem", lambda *a: None)   # a 175B checkpoint is 1.9 TB: not this disk
    p4d = ClusterParams(preset="p4d-8gpu", overrides={"nodes": 16})                       # A100 40 GB
    p4de = ClusterParams(preset=operator_preset("p4d-8gpu", accelerator="a100-80gb"), overrides={"nodes": 16})
    out = OutputParams(root=str(tmp_path))
    tried = dict(tensor_parallel=8, data_parallel_mode="fsdp", micro_batch_size=4)
    (line,) = [e for e in _errors(model="gpt3-175b", cluster=p4de, output=out, training=TrainingParams(**tried))
               if e.startswith("training:")]
    assert "each rank needs an estimated" in line and "model state" in line and \
        "but 80 GiB per device (accelerator a100-80gb)" in line, line
    change = dict(item.split("=") for item in re.search(r"this layout would fit: (.*?) \(the fields", line).group(1).split(", "))
    _check(model="gpt3-175b", cluster=p4de, output=out, training=TrainingParams(**{**tried, **change}))
    megatron = TrainingParams(tensor_parallel=8, pipeline_parallel=16)
    (line,) = [e for e in _errors(model="gpt3-175b", cluster=p4d, output=out, training=megatron)
               if e.startswith("training:")]
    assert "GiB on the first stage" in line and "but 40 GiB per device (accelerator a100-40gb)" in line, line
    megatron = _check(model="gpt3-175b", cluster=p4de, output=out, training=megatron)
    rows = {r["item"]: r["value"] for r in plan_rows(megatron, "a new run")}
    assert rows["parallel"] == ("pp 16 x dp 1 (ddp) x tp 8; schedule 1f1b, 16 stages of 6 layers, 1536 micro-batches "
                                "per step, bubble 1.0%"), rows["parallel"]
    assert "GiB on the first stage" in rows["memory per rank"]
    errors = _errors(model="gpt3-175b", cluster=p4d, output=out, training=TrainingParams(
        tensor_parallel=8, pipeline_parallel=16, micro_batch_size=1, global_batch_size=8))
    assert any(e.startswith("training.global_batch_size:") and "cannot fill pipeline_parallel=16" in e for e in errors), errors


def test_a_preset_trains_in_its_published_layout_on_a_gpu_cluster_unless_the_run_sets_one(tmp_path, monkeypatch,
                                                                                           operator_preset):
    import flows.plan.build

    monkeypatch.setattr(flows.plan.build, "disk_problem", lambda *a: None)   # a 175B checkpoint is 1.9 TB: not this disk
    out = OutputParams(root=str(tmp_path))
    p4d = ClusterParams(preset=operator_preset("p4d-8gpu", accelerator="a100-80gb"), overrides={"nodes": 16})   # as published
    megatron = _check(model="gpt3-175b", cluster=p4d, output=out)
    assert (megatron.config.tensor_parallel, megatron.config.pipeline_parallel) == (8, 16)   # Megatron's example
    table = _check(model="gpt-39.1b", cluster=p4d, output=out)
    assert (table.config.tensor_parallel, table.config.pipeline_parallel) == (8, 2)           # its scaling table
    own = _check(model="gpt-39.1b", cluster=p4d, output=out, training=TrainingParams(tensor_parallel=8,
                                                                                    data_parallel_mode="fsdp"))
    assert (own.config.tensor_parallel, own.config.pipeline_parallel) == (8, 1)
    one_node = _errors(model="gpt3-175b", cluster=ClusterParams(preset="p4d-8gpu", overrides={"nodes": 1}), output=out)
    assert any(e.startswith("training:") and "each rank needs an estimated" in e for e in one_node), one_node
    cpu = _check(model="tiny", output=out)
    assert (cpu.config.tensor_parallel, cpu.config.pipeline_parallel) == (1, 1)


def test_device_memory_comes_from_the_preset_or_a_name_that_fixes_it_never_a_guess(tmp_path, monkeypatch,
                                                                                   operator_preset):
    import flows.plan.build
    from flows.plan.artifact import plan_rows

    monkeypatch.setattr(flows.plan.build, "disk_problem", lambda *a: None)
    out = OutputParams(root=str(tmp_path))
    gpu = {"nodes": 16}
    for operator, shown in (({"accelerator": "a100"}, "not checked: accelerator a100 does not say how much memory"),
                            ({"accelerator": "a100", "device_memory_gib": 80}, "80 GiB per device (device_memory_gib"),
                            ({"accelerator": "h100-sxm-80gb"}, "80 GiB per device (accelerator h100-sxm-80gb)"),
                            ({"accelerator": "h200"}, "141 GiB per device (every h200)")):
        plan = _check(model="gpt3-175b", cluster=ClusterParams(preset=operator_preset("p4d-8gpu", **operator),
                                                               overrides=gpu),
                      output=out, training=TrainingParams(tensor_parallel=8, pipeline_parallel=16))
        assert {r["item"]: r["value"] for r in plan_rows(plan, "a new run")}["device memory"].startswith(shown)
    (line,) = [e for e in _errors(model="gpt3-175b", output=out, training=TrainingParams(tensor_parallel=8, pipeline_parallel=16),
                                  cluster=ClusterParams(preset=operator_preset("p4d-8gpu", device_memory_gib=32),
                                                        overrides=gpu))
               if e.startswith("training:")]
    assert "but 32 GiB per device (device_memory_gib of the cluster preset)" in line


@pytest.mark.timeout(120)
def test_a_dry_run_plans_for_a_cluster_whose_files_and_disk_this_machine_lacks(tmp_path):
    """Sources and tokenizer files on the cluster's /fsx, which this machine has not, and checkpoints
    larger than its disk: a dry run plans it, a warning row naming each; a real run refuses them as
    before. What the plan can check itself (the memory per rank here) still refuses a dry run."""
    import os
    import subprocess
    import sys

    from tests.fixtures_gpt import ROOT

    fsx = f"/fsx-{tmp_path.name}"          # a folder this machine has not
    env = {**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
           "GPT_OUTPUT_ROOTS": fsx, "GPT_INPUT_ROOTS": fsx}
    flags = ["--model", "gpt3-175b", "--cluster", "p4d-8gpu", "--cluster-set", "nodes=128", "--tp", "8", "--pp", "32",
             "--root", f"{fsx}/gpt", "--source", f"{fsx}/corpora/oscar/*.jsonl.zst",
             "--vocab-file", f"{fsx}/gpt2/vocab.json", "--merge-file", f"{fsx}/gpt2/merges.txt"]

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.pretrain", *flags, *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=100)

    planned = run("--dry-run")
    assert planned.returncode == 0, planned.stderr
    warnings = [line.split("warning: ", 1)[1] for line in planned.stdout.splitlines() if "warning: " in line]
    assert [w.split(":")[0] for w in warnings] == ["data.sources[0]", "tokenizer.vocab_file", "tokenizer.merge_file",
                                                   "output.root"], planned.stdout
    assert "matches no file" in warnings[0] and "but the run writes at least 1,953" in warnings[3]
    assert f"vocabulary: 50,257 assumed (GPT-2's): the tokenizer ({fsx}/gpt2/vocab.json" in planned.stdout
    assert "memory per rank: " in planned.stdout and "node-hours: " in planned.stdout
    assert not os.path.exists(fsx)

    refused = run()
    assert refused.returncode == 2
    assert [line.split(":")[0] for line in refused.stderr.splitlines()[1:]] == [
        "  - data.sources[0]", "  - tokenizer.vocab_file", "  - tokenizer.merge_file", "  - output.root"]
    too_big = run("--dry-run", "--micro-batch-size", "4")      # four times the activations: refused still
    assert too_big.returncode == 2 and "training: each rank needs an estimated" in too_big.stderr


@pytest.mark.parametrize("model", ["gpt3-125m", "llama3-8b"])
def test_the_disk_floor_counts_the_parameters_of_the_model_the_job_builds(tmp_path, model, operator_preset):
    """The checkpoint the plan reserves disk for holds the built model's parameters (GQA, SwiGLU and an
    output layer of its own counted) at 12 bytes each: the fp32 weight and AdamW's two moments."""
    import torch

    from flows.plan.sizes import CHECKPOINT_BYTES, written_bytes
    from gpt.model import GPT

    plan = _check(model=model, training=TrainingParams(train_iters=10),
                  cluster=ClusterParams(preset=operator_preset("p4d-8gpu", device_memory_gib=1e5), overrides={"nodes": 4}),
                  output=OutputParams(root=str(tmp_path)), dry_run=True)     # it may not fit this disk
    with torch.device("meta"):
        built = GPT(plan.config)
    assert written_bytes(plan.config)[1] == CHECKPOINT_BYTES * sum(p.numel() for p in built.parameters())
    assert CHECKPOINT_BYTES == 12


class Training(TrainingParams):
    """The training group with one more field, named as a Config field."""
    weight_decay: float | None = Field(None, ge=0, description="AdamW's decoupled weight decay")


@flow
def _with_it(training: Training = Training()) -> None:
    """A flow whose form has the added field."""


def test_the_form_the_flags_and_the_config_are_one_description(tmp_path):
    """The pretrain flow takes the form (FORM), the command line's flags are made from it, and a
    training field named as a Config field reaches the job: a field added to a copy of the training
    group is in the UI's schema, is a flag, and sets the Config, with nothing else written."""
    import inspect
    import typing

    from flows.plan.params import FORM
    from gpt.config import Config

    hints = typing.get_type_hints(pretrain.fn)
    assert {name: hints[name] for name in FORM} == FORM and list(FORM) == list(inspect.signature(pretrain.fn).parameters)
    schema = parameter_schema(_with_it.fn).model_dump()
    assert schema["definitions"]["Training"]["properties"]["weight_decay"]["description"] == \
        "AdamW's decoupled weight decay"
    form = {**FORM, "training": Training}
    params = parse_args(["--training.weight_decay", "0.05", "--tp", "1", "--root", str(tmp_path)], form)
    assert params["training"] == Training(weight_decay=0.05, tensor_parallel=1)
    with pytest.raises(ParameterError, match=r"training.weight_decay: Input should be greater than or equal to 0"):
        parse_args(["--training.weight_decay", "-1"], form)
    plan = _check(training=params["training"], output=params["output"])
    assert plan.config.weight_decay == 0.05 and Config.from_preset("tiny").weight_decay != 0.05
