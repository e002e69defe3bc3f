"""What a run is: the fields that decide the model it trains. Two legs of one run may differ in
anything else (where and how it runs, how often it logs and saves, how long it trains), and the
second resumes the first's run folder; a change to one of these fields makes another run.

The run folder's name is a digest of the identity (unless ``output.run_name`` names it), and the
folder keeps it in ``run.json``, so that a later leg under the same name is compared field by field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flows.plan.params import DataParams, TokenizerParams
from gpt.config import ARCHITECTURE, Config, model_name
from gpt.files import write_json
from tasks.common.digest import digest

RECORD = "run.json"

# Config fields that decide the model trained: architecture, data order, optimizer, LR schedule.
DEFINING = ("seq_length", "max_position_embeddings", "global_batch_size", "seed", "lr", "min_lr",
            "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
# The init's spread, the schedule's warmup and decay and the batch's ramp-up follow the preset and
# the run's length unless given; given, they define the run.
SCHEDULE = ("init_method_std", "lr_warmup_iters", "lr_warmup_samples", "lr_decay_iters", "lr_decay_samples", "lr_wsd_decay_style",
            "lr_wsd_decay_iters", "lr_wsd_decay_samples", "rampup_batch_size")
# Where a new run starts from.
START = ("init_from", "init_from_optimizer", "init_from_hf")
# What a token of a packed sample sees (off unless given; given, they define the run).
PACKING = ("reset_attention_mask", "reset_position_ids")
# What the data is (credentials are not).
DATA = ("sources", "prefixes", "weight", "json_keys", "split", "endpoint_url")
# Fields that may change between legs of one run; the README's table lists both groups.
MAY_CHANGE = ("train_iters", "train_samples", "micro_batch_size", "tensor_parallel", "data_parallel",
              "pipeline_parallel", "context_parallel", "virtual_pipeline_stages", "pipeline_schedule",
              "data_parallel_mode", "device", "precision", "fp8_recipe", "fp8_layers", "compile", "compile_scope",
              "activation_checkpointing", "activation_checkpointing_scope", "log_interval", "eval_interval",
              "eval_iters", "save_interval", "keep_last", "async_save", "spike_factor", "spike_window", "nan_steps",
              "max_rollbacks", "benchmark", "peak_flops", "hang_timeout_s",
              "collective_timeout_s", "cluster.*")


# Tokenizer parameters added after runs began: they count in a run's identity only when given, so
# that runs started before them keep their folders.
ADDED_TOKENIZER = ("tokenizer_model", "add_bos_token")


def run_identity(data: DataParams, tokenizer: TokenizerParams, config: Config,
                 given: dict[str, Any], branch_from: str | None = None) -> dict[str, Any]:
    """The identity of the run these parameters train: ``config`` resolved from them, ``given``
    the Config fields the parameters set explicitly. A model of its own shape is named by it and
    keeps its whole architecture, and the preset its other fields came from. A run branched from
    another's checkpoint is that run's identity and the checkpoint it branched from."""
    training = {name: getattr(config, name) for name in DEFINING}
    training.update({name: given[name] for name in SCHEDULE + START + PACKING
                     if given.get(name) is not None and given[name] is not False})
    if branch_from:
        training["branch_from"] = branch_from
    called = model_name(config)
    shape = {} if called == config.model else {
        "shape": {"preset": config.model, **{field: getattr(config, field) for field in ARCHITECTURE}}}
    return {"model": called, **shape,
            "data": {name: v for name, v in data.model_dump(mode="json").items() if name in DATA},
            "tokenizer": {name: v for name, v in tokenizer.model_dump(mode="json").items()
                          if v not in (None, False) or name not in ADDED_TOKENIZER},
            "training": training}


def run_key(identity: dict[str, Any]) -> str:
    """The digest that names the run folder: the same identity finds the same folder."""
    return digest(identity, length=12)


def recorded(run_dir: Path) -> dict[str, Any] | None:
    """The identity a run folder was started with, or None (a new folder, or one started before
    run.json was kept)."""
    try:
        return json.loads((run_dir / RECORD).read_text())["identity"]
    except (OSError, ValueError, KeyError):
        return None


def record(run_dir: Path, identity: dict[str, Any]) -> None:
    write_json(run_dir / RECORD, {"identity": identity})


def differences(before: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``field: old -> new`` for each defining field that differs."""
    out = []
    for name in sorted(set(before) | set(now)):
        old, new = before.get(name), now.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            out += differences(old, new, f"{prefix}{name}.")
        elif old != new:
            out.append(f"{prefix}{name}: {_shown(old)} -> {_shown(new)}")
    return out


def _shown(value: Any) -> str:
    return "(not set)" if value is None else json.dumps(value)
