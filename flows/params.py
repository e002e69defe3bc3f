"""Parameters of the pretrain flow: typed models the Prefect UI renders as a form, and their checks.

`check(...)` runs before any task is submitted and raises `ParameterError` listing every problem,
one line per field (`training.micro_batch_size: ...`), so a run with bad parameters fails at once.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpt.config import PRESETS, Config, ConfigError
from tasks.cluster import ClusterConfig, load_cluster
from tasks.index import parse_split
from tasks.sync import local_path

ModelName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the UI shows a choice list


SAMPLE_VOCAB_SIZE = 4096  # keeps the tiny model's output layer cheap on a CPU
# Config fields the flow sets itself: paths on shared storage and how the job is run.
FLOW_DECIDED = frozenset({"run_dir", "data_index", "compile_cache_dir", "precompile", "mock_data"})


class ParameterError(ValueError):
    """Invalid flow parameters; `errors` holds one message per field."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid parameters:\n" + "\n".join(f"  - {e}" for e in errors))


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WeightedPrefix(_Params):
    prefix: str = Field(description="Tokenized dataset (.bin/.idx pair) without the extension: a path "
                                    "or s3://bucket/key prefix, e.g. s3://corpora/pile/pile_text_document")
    weight: float = Field(1.0, gt=0, description="Relative blend weight")


class DataParams(_Params):
    sources: list[str] = Field(
        default_factory=list,
        description="JSONL inputs (.jsonl, .json, .gz, .xz, .zst): s3:// URIs or prefixes, local files, "
                    "folders or globs. Empty, with no prefixes: the bundled Shakespeare sample corpus.")
    prefixes: list[WeightedPrefix] = Field(
        default_factory=list, description="Already tokenized datasets to train on, with blend weights")
    weight: float = Field(1.0, gt=0, description="Blend weight of the data tokenized from `sources` "
                                                  "when `prefixes` are given too")
    json_keys: list[str] = Field(default_factory=lambda: ["text"], min_length=1,
                                 description="JSON fields holding the text")
    split: str = Field("969,30,1", description="train,valid,test proportions of documents")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 "
                                                       "(credentials come from the environment, never here)")
    profile: str | None = Field(None, description="AWS profile name for the S3 sources")
    no_sign_request: bool = Field(False, description="Read public buckets anonymously")


class TokenizerParams(_Params):
    vocab_file: str | None = Field(None, description="GPT-2 style vocab.json (path or s3:// URI). "
                                                     "Empty: a byte-level BPE is trained on the sources")
    merge_file: str | None = Field(None, description="GPT-2 style merges.txt (path or s3:// URI)")
    train_vocab_size: int | None = Field(
        None, ge=257, description="Entries of the BPE trained when no vocab_file is given (empty: 50257, "
                                  f"or {SAMPLE_VOCAB_SIZE} for the bundled sample corpus)")


class TrainingParams(_Params):
    """Empty fields take the model preset's value (e.g. tiny: 300 iterations, batch 8/16)."""
    train_iters: int | None = Field(None, ge=1, description="Iterations to train")
    train_samples: int | None = Field(None, ge=1, description="Samples to train, instead of train_iters")
    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per device per micro-step")
    global_batch_size: int | None = Field(None, ge=1, description="Sequences per optimizer step, all devices")
    seq_length: int | None = Field(None, ge=8, description="Sequence length")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size (tp)")
    data_parallel: int | None = Field(None, ge=1, description="Data-parallel size (dp); empty: the "
                                                            "cluster's tasks divided by tp. Must match.")
    data_parallel_mode: Literal["ddp", "fsdp"] = "ddp"
    device: Literal["auto", "cpu", "cuda", "neuron"] = Field(
        "auto", description="auto: what the cluster preset runs on (its device)")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: fp32 on CPU, bf16 on accelerators (fp16 on GPUs before Ampere), decided "
                            "from the cluster preset, not from the machine that runs the flow")
    lr: float | None = Field(None, gt=0, description="Peak learning rate")
    min_lr: float | None = Field(None, ge=0)
    compile: bool = Field(True, description="torch.compile the model; the precompile stage fills its cache first, so training starts without compiling")
    activation_checkpointing: bool = False
    benchmark: bool = Field(False, description="Benchmark mode: train only, no evaluation")
    seed: int = 1234
    log_interval: int | None = Field(None, ge=1)
    eval_interval: int | None = Field(None, ge=1)
    eval_iters: int | None = Field(None, ge=1)
    save_interval: int | None = Field(None, ge=1)
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description='Any other gpt Config field, e.g. {"lr_warmup_iters": 50}')


class ClusterParams(_Params):
    preset: str = Field("local", description="Cluster preset name: a file of deployments/clusters/ or of the "
                                             "operator's GPT_CLUSTER_PRESET_DIRS")
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description='Fields to change, e.g. {"partition": "gpu", "nodes": 2}')


class OutputParams(_Params):
    root: str = Field("runs", description="Folder on storage every node sees: run folders go here, "
                                          "data, indices and compile caches in its data/ folder")
    run_name: str | None = Field(None, description="Run folder name (empty: model and a hash of the "
                                                    "parameters, so the same parameters resume the same run)")
    uri: str | None = Field(None, description="s3://bucket/prefix to upload the run folder to after training")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint for `uri`")
    profile: str | None = Field(None, description="AWS profile for `uri` (empty: data.profile, so sync and "
                                                  "upload use the same credentials)")


@dataclass(frozen=True)
class Plan:
    """Checked parameters turned into what the stages take."""
    config: Config              # vocab_size, data_index, run_dir and compile cache are filled in later
    cluster: ClusterConfig
    world_size: int
    root: Path
    run_dir: Path


def is_remote(uri: str) -> bool:
    return uri.startswith("s3://")


def _jsonable(params: dict[str, BaseModel | str]) -> dict:
    return {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in params.items()}


def params_key(**params: BaseModel | str) -> str:
    return hashlib.sha256(json.dumps(_jsonable(params), sort_keys=True).encode()).hexdigest()[:12]


def _vocab_size(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return len(json.load(f))


def _check_paths(data: DataParams, tokenizer: TokenizerParams, errors: list[str]) -> None:
    for i, src in enumerate(data.sources):
        if not is_remote(src) and not glob.glob(local_path(src)):
            errors.append(f"data.sources[{i}]: {src} matches no file or folder; give an existing path, "
                          "a glob or an s3:// URI")
    for i, p in enumerate(data.prefixes):
        if not is_remote(p.prefix):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(local_path(p.prefix) + ext):
                    errors.append(f"data.prefixes[{i}].prefix: {local_path(p.prefix)}{ext} not found; give the "
                                  "prefix without .bin/.idx")
    if (tokenizer.vocab_file is None) != (tokenizer.merge_file is None):
        errors.append("tokenizer: give both vocab_file and merge_file, or neither to train a BPE tokenizer")
    for name in ("vocab_file", "merge_file"):
        value = getattr(tokenizer, name)
        if value and not is_remote(value) and not os.path.isfile(local_path(value)):
            errors.append(f"tokenizer.{name}: {value} not found")
    if data.prefixes and tokenizer.vocab_file is None:
        errors.append("tokenizer.vocab_file: data.prefixes were tokenized with some vocabulary; give its "
                      "vocab_file and merge_file (also used for the sources, so all data agree)")
    try:
        parse_split(data.split)
    except ValueError as e:
        errors.append(f"data.split: {e}")


def config_fields(training: TrainingParams) -> dict[str, Any]:
    """The gpt Config fields these parameters set; the preset fills the rest (device and precision
    come from the cluster: see `job_device_and_precision`)."""
    t = training
    fields: dict[str, Any] = {
        "tensor_parallel": t.tensor_parallel, "data_parallel_mode": t.data_parallel_mode,
        "compile": t.compile, "activation_checkpointing": t.activation_checkpointing,
        "benchmark": t.benchmark, "seed": t.seed,
    }
    for name in ("train_iters", "train_samples", "micro_batch_size", "global_batch_size", "seq_length",
                 "lr", "min_lr", "log_interval", "eval_interval", "eval_iters", "save_interval"):
        if getattr(t, name) is not None:
            fields[name] = getattr(t, name)
    fields.update(t.overrides)
    return fields


def job_device_and_precision(training: TrainingParams, cluster: ClusterConfig, errors: list[str]) -> tuple[str, str]:
    """What the training job runs on, decided from the cluster it is submitted to (never from the
    machine that runs the flow), and its precision: the parameter's, or fp32 on CPU, bf16 on
    accelerators, fp16 on GPUs before Ampere."""
    device = cluster.job_device
    if training.device not in ("auto", device):
        errors.append(f"training.device: {training.device!r}, but cluster preset {cluster.name!r} runs on {device!r}; "
                      f"leave training.device auto, or choose a preset (or cluster.overrides.device) for {training.device}")
    return device, cluster.default_precision() if training.precision == "auto" else training.precision


def _config_field(message: str, training: TrainingParams) -> str:
    """The parameter a gpt ConfigError message is about, from the field name it starts with."""
    name = message.split("=")[0].split()[0] if message else ""
    if name in training.overrides:
        return f"training.overrides.{name}"
    if name in TrainingParams.model_fields:
        return f"training.{name}"
    return "training"


def check(model: str, data: DataParams, tokenizer: TokenizerParams, training: TrainingParams,
          cluster: ClusterParams, output: OutputParams) -> Plan:
    """Check every parameter (paths, tokenizer, gpt Config, cluster) and return the plan.

    Raises ParameterError with one message per problem; nothing is submitted before this passes.
    """
    errors: list[str] = []
    if model not in PRESETS:
        errors.append(f"model: {model!r} is not a preset; choose one of {', '.join(PRESETS)}")
    for name in sorted(FLOW_DECIDED & set(training.overrides)):
        errors.append(f"training.overrides.{name}: decided by the flow (where runs, data and caches live "
                      "follows output.root and output.run_name); remove it")
    if training.train_iters is not None and training.train_samples is not None:
        errors.append("training: set train_iters or train_samples, not both (clear train_iters to train by samples)")
    _check_paths(data, tokenizer, errors)

    cluster_cfg, world_size = None, 1
    try:
        cluster_cfg = load_cluster(cluster.preset, **cluster.overrides)
        world_size = cluster_cfg.world_size
    except (ValueError, OSError) as e:
        errors.append(f"cluster: {e}")

    tp = training.tensor_parallel
    if training.data_parallel is not None and cluster_cfg is not None and training.data_parallel * tp != world_size:
        errors.append(f"training.data_parallel: {training.data_parallel} x tensor_parallel {tp} = "
                      f"{training.data_parallel * tp} processes, but the cluster runs {world_size} "
                      f"(nodes x tasks_per_node); change one of them")

    config = None
    if model in PRESETS:
        fields = config_fields(training)
        if cluster_cfg is not None:
            fields["device"], fields["precision"] = job_device_and_precision(training, cluster_cfg, errors)
        if tokenizer.vocab_file and not is_remote(tokenizer.vocab_file) and os.path.isfile(local_path(tokenizer.vocab_file)):
            try:
                fields.setdefault("vocab_size", _vocab_size(local_path(tokenizer.vocab_file)))
            except (OSError, ValueError) as e:
                errors.append(f"tokenizer.vocab_file: {tokenizer.vocab_file} is not a JSON vocabulary ({e})")
        try:
            config = Config.from_preset(model, **fields)
            # The data index is built later; stand mock data in for it while checking the rest.
            for problem in dataclasses.replace(config, mock_data=True).problems(world_size=world_size):
                errors.append(f"{_config_field(problem, training)}: {problem}")
        except ConfigError as e:
            errors.append(f"{_config_field(str(e), training)}: {e}")
        except TypeError as e:
            errors.append(f"training.overrides: {e}; see gpt/config.py for the field names")
    if output.uri is not None and not is_remote(output.uri):
        errors.append(f"output.uri: {output.uri!r} is not an s3:// URI; write s3://BUCKET/PREFIX or leave it empty")
    if errors:
        raise ParameterError(errors)

    root = Path(output.root).expanduser().resolve()
    key = params_key(model=model, data=data, tokenizer=tokenizer, training=training, cluster=cluster)
    run_dir = root / (output.run_name or f"{model}-{key}")
    return Plan(config=config, cluster=cluster_cfg, world_size=world_size, root=root, run_dir=run_dir)
