"""The training job's gpt Config, decided from the model preset, the form's training fields and
the cluster it is submitted to (device, precision and the published layout come from there, never
from the machine that plans), with every problem it would have on the cluster's ranks named by the
field that sets it."""
from __future__ import annotations

import dataclasses
from typing import Any

from flows.plan.params import TrainingParams
from gpt.config import Config, ConfigError
from gpt.config.presets import GPU_LAYOUTS
from tasks.cluster.config import FLOAT8_GPUS, ClusterConfig

# Config fields the flow decides itself: paths on shared storage, how the job is run, and the
# vocabulary's size (the tokenizer's, known once the data stages ran); the model is a parameter.
FLOW_DECIDED = frozenset({"model", "run_dir", "data_index", "data_offset", "compile_cache_dir", "precompile", "mock_data",
                          "vocab_size", "init_from", "tensorboard_dir"})
# Training fields the cluster the job is submitted to decides (their "auto"), never the machine that plans.
FROM_CLUSTER = frozenset({"device", "precision"})


def job_config(model: str, training: TrainingParams, where: ClusterConfig | None,
               errors: list[str]) -> Config | None:
    """The training job's gpt Config from the preset and the parameters, with every problem it
    would have on the cluster's ranks added to ``errors``."""
    fields = config_fields(training)
    world_size = 1
    if where is not None:
        world_size = where.world_size
        fields["device"], fields["precision"] = job_device_and_precision(training, where, errors)
        fields["tensor_parallel"], fields["pipeline_parallel"] = tp, pp = model_parallel(model, fields, where)
        cp = fields.get("context_parallel") or 1
        ranks = (training.data_parallel or 1) * tp * pp * cp
        if training.data_parallel is not None and ranks != world_size:
            errors.append(f"training.data_parallel: {training.data_parallel} x tensor_parallel {tp} x "
                          f"pipeline_parallel {pp} x context_parallel {cp} = {ranks} processes, but the cluster "
                          f"runs {world_size} (nodes x tasks_per_node); change one of them")
        if fields["device"] == "neuron":  # graphs come from neuron_parallel_compile; torch-neuronx has no torch.compile
            fields["compile"] = False
    try:
        config = Config.from_preset(model, **{k: v for k, v in fields.items() if k not in FLOW_DECIDED})
    except ConfigError as e:
        errors.append(f"{config_field(e.field, training)}: {e}")
        return None
    except TypeError as e:
        errors.append(f"training.overrides: {e}; see gpt/config.py for the field names")
        return None
    # The data index is built later; stand mock data in for it while checking the rest.
    problems = dataclasses.replace(config, mock_data=True).problems(world_size=world_size)
    for field, problem in problems:
        errors.append(f"{config_field(field, training)}: {problem}")
    if not problems and "spike_window" in fields and config.spike_factor and config.spike_window >= config.total_iters:
        errors.append(f"{config_field('spike_window', training)}: spike_window={config.spike_window} is as long as the "
                      f"run ({config.total_iters} iterations): spike detection would never start; shorten it, or set "
                      "spike_factor=0 to train without it")
        return None
    return None if problems else config


def model_parallel(model: str, fields: dict[str, Any], cluster: ClusterConfig) -> tuple[int, int]:
    """(tensor_parallel, pipeline_parallel): the run's (its parameters or overrides, ``fields``), or
    with neither set the preset's published layout on a GPU cluster whose ranks it divides
    (gpt.config.presets.GPU_LAYOUTS), else no model parallel."""
    tp, pp = fields.get("tensor_parallel"), fields.get("pipeline_parallel")
    if tp is not None or pp is not None:
        return 1 if tp is None else tp, 1 if pp is None else pp
    tp, pp = GPU_LAYOUTS.get(model, (1, 1))
    if cluster.job_device == "cuda" and cluster.world_size % (tp * pp) == 0:
        return tp, pp
    return 1, 1


def config_fields(training: TrainingParams) -> dict[str, Any]:
    """The gpt Config fields these parameters set: each training field named as a Config field, when
    given, and the overrides; the preset fills the rest (device and precision come from the cluster:
    see `job_device_and_precision`)."""
    config = {f.name for f in dataclasses.fields(Config)}
    fields = {name: value for name in type(training).model_fields
              if name in config and name not in FROM_CLUSTER and (value := getattr(training, name)) is not None}
    fields.update(training.overrides)
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
    if precision == "fp8" and (device != "cuda" or cluster.generation not in FLOAT8_GPUS):
        errors.append(f"training.precision: fp8 needs NVIDIA GPUs of the Hopper generation or later, but cluster "
                      f"preset {cluster.name!r} runs on {cluster.accelerator or device}; use bf16, or a preset whose "
                      f"accelerator is one of {', '.join(sorted(FLOAT8_GPUS))}")
    return device, precision



def config_field(name: str, training: TrainingParams) -> str:
    """The parameter that sets the Config field ``name`` ("" for the configuration as a whole)."""
    if name in training.overrides:
        return f"training.overrides.{name}"
    if name in TrainingParams.model_fields:
        return f"training.{name}"
    return "training"
