"""The plan of one run, decided once: the flow's parameters checked and turned into the training job's
configuration, the cluster it runs on and where its files live, before any stage runs.

`make_plan(...)` is the one place the parameters are validated: it raises `ParameterError`
listing every problem, one line per field (`training.micro_batch_size: ...`). What only the data
stages can know (the vocabulary's size, the index) is added by `Plan.with_data`, the one place the
job's configuration is completed. Every stage receives its part of the plan; none changes it.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flows.layout import Layout
from flows.params import (
    ClusterParams,
    DataParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
    is_remote,
)
from gpt.config import PRESETS, Config, ConfigError
from tasks.cluster import FLOAT8_GPUS, ClusterConfig, load_cluster
from tasks.digest import digest
from tasks.index import parse_split
from tasks.precompile import cache_key
from tasks.sync import local_path

# Config fields the flow decides itself: paths on shared storage, how the job is run, and the
# vocabulary's size (the tokenizer's, known once the data stages ran).
FLOW_DECIDED = frozenset({"run_dir", "data_index", "compile_cache_dir", "precompile", "mock_data", "vocab_size"})


@dataclass(frozen=True)
class Plan:
    """What a run does: the training job's configuration, the cluster, and the folders."""
    config: Config
    cluster: ClusterConfig
    layout: Layout
    run_dir: Path

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def precompiles(self) -> bool:
        """A precompile stage fills a graph cache first: torch.compile's, or on Trainium
        neuron_parallel_compile's (torch.compile stays off there)."""
        return self.config.compile or self.config.device == "neuron"

    def with_data(self, vocab_size: int, data_index: str) -> Plan:
        """The plan with the job's configuration completed by what the data stages made."""
        config = dataclasses.replace(self.config, vocab_size=vocab_size, data_index=data_index)
        cache = str(self.layout.compile_cache(cache_key(config, self.cluster))) if self.precompiles else None
        return dataclasses.replace(self, config=dataclasses.replace(config, compile_cache_dir=cache))


def make_plan(model: str, data: DataParams, tokenizer: TokenizerParams, training: TrainingParams,
              cluster: ClusterParams, output: OutputParams) -> Plan:
    """Check every parameter (paths, tokenizer, gpt Config, cluster) and decide the plan.

    Raises ParameterError with one message per problem; nothing is submitted before this passes.
    """
    errors: list[str] = []
    if model not in PRESETS:
        errors.append(f"model: {model!r} is not a preset; choose one of {', '.join(PRESETS)}")
    for name in sorted(FLOW_DECIDED & set(training.overrides)):
        errors.append(f"training.overrides.{name}: decided by the flow (where runs, data and caches live "
                      "follows output.root and output.run_name; the vocabulary is the tokenizer's); remove it")
    if training.train_iters is not None and training.train_samples is not None:
        errors.append("training: set train_iters or train_samples, not both (clear train_iters to train by samples)")
    _check_paths(data, tokenizer, errors)
    if output.uri is not None and not is_remote(output.uri):
        errors.append(f"output.uri: {output.uri!r} is not an s3:// URI; write s3://BUCKET/PREFIX or leave it empty")

    where = None
    try:
        where = load_cluster(cluster.preset, **cluster.overrides)
    except (ValueError, OSError) as e:
        errors.append(f"cluster: {e}")
    layout = Layout(Path(output.root).expanduser().resolve())
    run_dir = layout.run(output.run_name or f"{model}-{_params_key(model, data, tokenizer, training, cluster)}")
    config = _job_config(model, training, where, run_dir, errors) if model in PRESETS else None
    if errors:
        raise ParameterError(errors)
    return Plan(config=config, cluster=where, layout=layout, run_dir=run_dir)


def _job_config(model: str, training: TrainingParams, where: ClusterConfig | None, run_dir: Path,
                errors: list[str]) -> Config | None:
    """The training job's gpt Config from the preset and the parameters, with every problem it
    would have on the cluster's ranks added to ``errors``."""
    fields = config_fields(training)
    fields["run_dir"] = str(run_dir)
    world_size = 1
    if where is not None:
        world_size = where.world_size
        fields["device"], fields["precision"] = job_device_and_precision(training, where, errors)
        if training.data_parallel is not None and training.data_parallel * training.tensor_parallel != world_size:
            errors.append(f"training.data_parallel: {training.data_parallel} x tensor_parallel "
                          f"{training.tensor_parallel} = {training.data_parallel * training.tensor_parallel} "
                          f"processes, but the cluster runs {world_size} (nodes x tasks_per_node); change one of them")
        if fields["device"] == "neuron":  # graphs come from neuron_parallel_compile; torch-neuronx has no torch.compile
            fields["compile"] = False
    try:
        config = Config.from_preset(model, **fields)
    except ConfigError as e:
        errors.append(f"{_config_field(str(e), training)}: {e}")
        return None
    except TypeError as e:
        errors.append(f"training.overrides: {e}; see gpt/config.py for the field names")
        return None
    # The data index is built later; stand mock data in for it while checking the rest.
    for problem in dataclasses.replace(config, mock_data=True).problems(world_size=world_size):
        errors.append(f"{_config_field(problem, training)}: {problem}")
    return config


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
    precision = cluster.default_precision() if training.precision == "auto" else training.precision
    if precision == "fp8" and (device != "cuda" or (cluster.accelerator or "").lower() not in FLOAT8_GPUS):
        errors.append(f"training.precision: fp8 needs NVIDIA GPUs of the Hopper generation or later, but cluster "
                      f"preset {cluster.name!r} runs on {cluster.accelerator or device}; use bf16, or a preset whose "
                      f"accelerator is one of {', '.join(sorted(FLOAT8_GPUS))}")
    return device, precision


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


def _config_field(message: str, training: TrainingParams) -> str:
    """The parameter a gpt ConfigError message is about, from the field name it starts with."""
    name = message.split("=")[0].split()[0] if message else ""
    if name in training.overrides:
        return f"training.overrides.{name}"
    if name in TrainingParams.model_fields:
        return f"training.{name}"
    return "training"


def _params_key(model: str, *groups: BaseModel) -> str:
    """The same parameters name the same run folder, so a rerun resumes it."""
    return digest(model, [g.model_dump(mode="json") for g in groups], length=12)
