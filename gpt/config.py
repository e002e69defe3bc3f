"""One configuration object for the model, the data, the schedule and the run, plus named presets.

Presets fill the fields left as ``None``; anything passed explicitly wins. ``validate(world_size)``
catches impossible combinations before anything is submitted, with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt.tokenizer import GPT2_VOCAB_SIZE

# GPT-3 paper schedule in samples of 2048 tokens (as Megatron's GPT-3 examples use it):
# 300B training tokens, 260B decay tokens, 375M warmup tokens.
_GPT3_SCHEDULE = {"train_samples": 146_484_375, "lr_decay_samples": 126_953_125, "lr_warmup_samples": 183_105}


def _gpt3(layers: int, hidden: int, heads: int, lr: float, batch: int) -> dict[str, Any]:
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": 2048,
            "micro_batch_size": 1, "global_batch_size": batch, "lr": lr, "min_lr": lr / 10, **_GPT3_SCHEDULE}


def _llama(layers: int, hidden: int, heads: int, groups: int, ffn: int, lr: float, tied: bool = False) -> dict[str, Any]:
    """Llama 3's block (Grattafiori et al., 2024, Table 3): rotary positions (base 500,000), RMSNorm,
    SwiGLU, grouped-query attention, no biases; 8192-token sequences, a batch of 4M tokens."""
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "num_query_groups": groups,
            "ffn_hidden_size": ffn, "seq_length": 8192, "micro_batch_size": 1, "global_batch_size": 512,
            "lr": lr, "min_lr": lr / 100, "train_iters": 1_200_000, "lr_warmup_iters": 8000, **LLAMA_BLOCK,
            "untie_embeddings_and_output_weights": not tied}


# The architecture fields and the GPT-3 block they describe (a preset that names none of them).
GPT3_BLOCK: dict[str, Any] = {"position_embedding_type": "learned_absolute", "rotary_base": 10000,
                              "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False,
                              "untie_embeddings_and_output_weights": False, "add_bias_linear": True}
LLAMA_BLOCK: dict[str, Any] = {"position_embedding_type": "rope", "rotary_base": 500000, "normalization": "RMSNorm",
                               "norm_epsilon": 1e-5, "swiglu": True, "add_bias_linear": False}

# What a model is: its size and its block. Weights fit a model only of the same shape.
ARCHITECTURE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                *GPT3_BLOCK)


def shape_differences(theirs: Config, ours: Config, also: tuple[str, ...] = ()) -> list[str]:
    """Where two models' shapes differ (and the fields ``also`` named), as ``field: theirs there,
    ours here``; learned positions count, rotary ones hold no weights."""
    names = [*ARCHITECTURE, *also]
    if ours.position_embedding_type == "learned_absolute":
        names.append("max_position_embeddings")
    return [f"{n}: {getattr(theirs, n)} there, {getattr(ours, n)} here" for n in names
            if getattr(theirs, n) != getattr(ours, n)]



def block_family(config: Config) -> str:
    """``gpt3`` for GPT-3's block (learned positions, LayerNorm, GELU), ``llama`` for Llama's (rotary
    positions, RMSNorm, SwiGLU), ``custom`` for any other mix of the block's fields."""
    if (config.position_embedding_type, config.normalization, config.swiglu) == ("learned_absolute", "LayerNorm", False):
        return "gpt3"
    if (config.position_embedding_type, config.normalization, config.swiglu) == ("rope", "RMSNorm", True):
        return "llama"
    return "custom"


def shape_name(config: Config) -> str:
    """A model named by what it is: its block's family, layers, hidden size and heads, then its
    key/value groups and MLP width where they are not one per head and 4 x hidden
    (``llama-16l-2048h-32a-8g-8192f``)."""
    name = f"{block_family(config)}-{config.num_layers}l-{config.hidden_size}h-{config.num_attention_heads}a"
    if config.num_query_groups != config.num_attention_heads:
        name += f"-{config.num_query_groups}g"
    if config.ffn_hidden_size != 4 * config.hidden_size:
        name += f"-{config.ffn_hidden_size}f"
    return name


def model_name(config: Config) -> str:
    """The preset's name where the model has its preset's architecture, else the name of its shape:
    a run never carries a preset's name on another model."""
    preset = Config(model=config.model, mock_data=True)
    return config.model if all(getattr(config, n) == getattr(preset, n) for n in ARCHITECTURE) else shape_name(config)


def nearest_preset(config: Config) -> str:
    """The preset of this model's block family whose size is nearest to its own: where the fields a
    model of its own shape leaves empty (learning rate, batch, schedule) come from."""
    def size(c: Config) -> float:
        return c.num_layers * c.hidden_size ** 2
    family = block_family(config)
    candidates = [Config(model=name, mock_data=True) for name in PRESETS]
    same = [c for c in candidates if block_family(c) == family] or candidates
    return min(same, key=lambda c: abs(math.log(size(c) / size(config)))).model


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to train a few hundred iterations on two CPU cores in a minute or two.
    "tiny": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128,
             "micro_batch_size": 8, "global_batch_size": 16, "lr": 2e-3, "min_lr": 2e-4,
             "train_iters": 300, "lr_warmup_iters": 30},
    # GPT-3 paper, Table 2.1 (1.3B with 16 heads as Megatron and NeMo use it; 13B with 5120 hidden).
    "gpt3-125m": _gpt3(12, 768, 12, 6e-4, 256),
    "gpt3-350m": _gpt3(24, 1024, 16, 3e-4, 256),
    "gpt3-760m": _gpt3(24, 1536, 16, 2.5e-4, 256),
    "gpt3-1.3b": _gpt3(24, 2048, 16, 2e-4, 512),
    "gpt3-2.7b": _gpt3(32, 2560, 32, 1.6e-4, 512),
    "gpt3-6.7b": _gpt3(32, 4096, 32, 1.2e-4, 1024),
    "gpt3-13b": _gpt3(40, 5120, 40, 1e-4, 1024),
    "gpt3-175b": _gpt3(96, 12288, 96, 0.6e-4, 1536),
    # Megatron-LM's scaling table (heads, hidden, layers, batch).
    "gpt-1.7b": _gpt3(24, 2304, 24, 2e-4, 512),
    "gpt-3.6b": _gpt3(30, 3072, 32, 1.6e-4, 512),
    "gpt-7.5b": _gpt3(36, 4096, 32, 1.2e-4, 512),
    "gpt-18.4b": _gpt3(40, 6144, 48, 1e-4, 1024),
    "gpt-39.1b": _gpt3(48, 8192, 64, 0.8e-4, 1536),
    "gpt-76.1b": _gpt3(60, 10240, 80, 0.6e-4, 1792),
    "gpt-145.6b": _gpt3(80, 12288, 96, 0.6e-4, 2304),
    "gpt-310.1b": _gpt3(96, 16384, 128, 0.6e-4, 2160),
    # The Llama block at this machine's size: grouped K/V (2 query heads per group), untied output.
    "tiny-llama": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
                   "ffn_hidden_size": 352, "seq_length": 128, "micro_batch_size": 8, "global_batch_size": 16,
                   "lr": 2e-3, "min_lr": 2e-4, "train_iters": 300, "lr_warmup_iters": 30, **LLAMA_BLOCK,
                   "rotary_base": 10000, "untie_embeddings_and_output_weights": True},
    # Llama 3.2 1B (tied embeddings) and Llama 3 / 3.1 8B, 70B, 405B: the published shapes.
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, 3e-4, tied=True),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 3e-4),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 1.5e-4),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 0.8e-4),
}

# The tensor x pipeline layout each preset was published with on GPU clusters: Megatron-LM's scaling
# table (Narayanan et al., 2021, Table 1) and its GPT-3 175B example. The flow trains a preset in it
# on a GPU cluster when a run sets neither size.
GPU_LAYOUTS: dict[str, tuple[int, int]] = {
    "gpt-1.7b": (1, 1), "gpt-3.6b": (2, 1), "gpt-7.5b": (4, 1), "gpt-18.4b": (8, 1), "gpt-39.1b": (8, 2),
    "gpt-76.1b": (8, 4), "gpt-145.6b": (8, 8), "gpt-310.1b": (8, 16), "gpt3-175b": (8, 16),
    # Llama 3: NeMo's recipes; 405B in 9 even stages of 14 layers (Meta's 16 stages are uneven, which
    # this pipeline does not split).
    "llama3.2-1b": (1, 1), "llama3-8b": (1, 1), "llama3-70b": (4, 4), "llama3-405b": (8, 9),
}

_SCHEDULE_ITERS = ("train_iters", "lr_warmup_iters", "lr_decay_iters")
_SCHEDULE_SAMPLES = ("train_samples", "lr_warmup_samples", "lr_decay_samples")
_CHOICES = {
    "lr_decay_style": ("cosine", "linear", "constant"),
    "data_parallel_mode": ("fsdp", "ddp"),
    "device": ("auto", "cpu", "cuda", "neuron"),
    "precision": ("fp32", "bf16", "fp16", "fp8"),
    "fp8_recipe": ("tensorwise", "rowwise"),
    "fp8_layers": ("all", "large"),
    "compile_scope": ("auto", "blocks", "model"),
    "activation_checkpointing_scope": ("block", "attention", "mlp"),
    "pipeline_schedule": ("1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb"),
    "position_embedding_type": ("learned_absolute", "rope"),
    "normalization": ("LayerNorm", "RMSNorm"),
}
_INTERLEAVED = ("interleaved-1f1b", "interleaved-zb")


# A problem of a configuration: the field it is about ("" for the whole) and what to change.
Problem = tuple[str, str]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and what to change, ``field``
    is that field ("" for the configuration as a whole)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelSection:
    """The architecture."""
    model: str = "tiny"                        # preset name: fills every field left as None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    seq_length: int | None = None
    max_position_embeddings: int | None = None  # defaults to seq_length
    vocab_size: int = GPT2_VOCAB_SIZE          # tokenizer size; the model pads it (padded_vocab_size)
    # The block, named as Megatron-LM names it; a preset fills what is left as None (GPT3_BLOCK when
    # the preset names none of them).
    position_embedding_type: str | None = None  # "learned_absolute" (GPT-3) or "rope" (rotary, Llama)
    rotary_base: int | None = None             # rope's theta
    normalization: str | None = None           # "LayerNorm" or "RMSNorm"
    norm_epsilon: float | None = None
    swiglu: bool | None = None                 # SiLU-gated MLP of three matrices instead of GELU's two
    ffn_hidden_size: int | None = None         # the MLP's inner size (default 4 x hidden_size)
    num_query_groups: int | None = None        # key/value heads, each shared by a group of query heads (default: one per head)
    untie_embeddings_and_output_weights: bool | None = None
    add_bias_linear: bool | None = None        # biases in the linear layers


@dataclass(frozen=True)
class DataSection:
    """What the run reads."""
    data_index: str | None = None              # index manifest JSON written by tasks.index
    mock_data: bool = False                    # random tokens instead (gpt.data.MockGPTDataset)


@dataclass(frozen=True)
class ScheduleSection:
    """Batches, length, learning rate and the optimizer."""
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    train_iters: int | None = None             # exactly one of these two; the lr_* schedule
    train_samples: int | None = None           # fields count in the same unit
    lr: float | None = None
    min_lr: float | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass(frozen=True)
class ParallelSection:
    """How the work is laid out over ranks and run on each device."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1                 # pipeline stages (ranks along the pipeline)
    virtual_pipeline_stages: int = 1           # stages per pipeline rank (interleaved schedules)
    pipeline_schedule: str = "1f1b"            # "1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb"
    data_parallel_mode: str = "ddp"            # "ddp" or "fsdp" (FSDP2 fully_shard)
    device: str = "auto"
    precision: str = "bf16"                    # fp8: bf16 autocast with torchao float8 linears (Hopper or later)
    fp8_recipe: str = "tensorwise"             # torchao float8 scaling: "tensorwise" or "rowwise"
    fp8_layers: str = "all"                    # "all" blocks' linears, or only those "large" enough to gain (gpt.parallel.build)
    compile: bool = False
    compile_scope: str = "auto"                # "blocks": each block a graph; "model": the whole forward and loss; "auto": model for one CUDA process
    activation_checkpointing: bool = False
    activation_checkpointing_scope: str = "block"  # recompute in backward: the whole "block", "attention" or "mlp"
    compile_cache_dir: str | None = None       # torch.compile caches: loaded at start, filled by precompile
    precompile: bool = False                   # compile-only run: precompile_iters steps, no checkpoints/metrics
    precompile_iters: int = 3


@dataclass(frozen=True)
class RunSection:
    """Where the run keeps its files, how often it logs, evaluates and saves, where it starts from
    and when it counts as hung."""
    seed: int = 1234
    run_dir: str = "runs/default"              # config.json, metrics.jsonl, tensorboard/, checkpoints/
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    save_interval: int = 100
    keep_last: int = 2
    async_save: bool = True                    # training goes on while a checkpoint is written (not on XLA devices)
    benchmark: bool = False                    # no evaluation
    peak_flops: float | None = None            # per device, for MFU; default from gpt.backend.PEAK_FLOPS
    init_from_hf: str | None = None            # a HuggingFace GPT-2 or Llama folder (gpt.export) to start from
    init_from: str | None = None               # a checkpoint folder of another run to start a new run from
    init_from_optimizer: bool = False          # with init_from: its optimizer state too, not only the weights
    hang_timeout_s: float | None = None        # no rank advancing this long: hung (None: from the step time)
    collective_timeout_s: float = 1800.0       # a collective waiting this long fails the job
    spike_factor: float = 10.0                 # a loss above this x the median of the last spike_window: a spike (0: off)
    spike_window: int = 100
    nan_steps: int = 5                         # this many non-finite losses in a row: rolled back like a spike (0: off)
    max_rollbacks: int = 3                     # rollbacks around spikes before the run fails with the report


SECTIONS = {"model": ModelSection, "data": DataSection, "schedule": ScheduleSection, "parallel": ParallelSection,
            "run": RunSection}


@dataclass(frozen=True)
class Config(RunSection, ParallelSection, ScheduleSection, DataSection, ModelSection):
    """Every field of every section, by its own name (``config.lr``, ``config.tensor_parallel``);
    ``section(name)`` gives one section's fields."""

    def section(self, name: str) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SECTIONS[name])}

    def __post_init__(self) -> None:
        """Completes the fields left empty from the preset; once built, a Config does not change
        (``dataclasses.replace`` makes another)."""
        self._coerce_numbers()
        if self.model not in PRESETS:
            raise ConfigError(f"model={self.model!r} is not a preset; choose one of {', '.join(PRESETS)}", "model")
        preset = PRESETS[self.model]
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "micro_batch_size", "global_batch_size", "lr", "min_lr"):
            if getattr(self, name) is None:
                self._set(name, preset[name])
        for name, default in GPT3_BLOCK.items():
            if getattr(self, name) is None:
                self._set(name, preset.get(name, default))
        for name, default in (("ffn_hidden_size", 4 * self.hidden_size if isinstance(self.hidden_size, int) else None),
                              ("num_query_groups", self.num_attention_heads)):
            if getattr(self, name) is None:
                self._set(name, preset.get(name, default) if self.hidden_size == preset["hidden_size"] else default)
        self._fill_schedule(preset)
        if self.max_position_embeddings is None:
            self._set("max_position_embeddings", self.seq_length)

    def _coerce_numbers(self) -> None:
        """Numbers given as text (a form field, ``--set lr=3e-4`` read as YAML 1.1) become numbers,
        and whole numbers given for a float field floats (1 and 1.0 are one value); text that is
        no number, or no finite one, is an error naming the field."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _kind(f)
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                self._set(f.name, float(value))
            if not isinstance(value, str) or kind is None:
                continue
            try:
                number = {"true": True, "false": False}[value.strip().lower()] if kind is bool else float(value)
            except (KeyError, ValueError):
                raise ConfigError(f"{f.name}={value!r}: expected {'true or false' if kind is bool else 'a number'}",
                                  f.name) from None
            if kind is not bool and not math.isfinite(number):
                raise ConfigError(f"{f.name}={value!r}: must be a finite number", f.name)
            if kind is int:
                if number != int(number):
                    raise ConfigError(f"{f.name}={value!r}: expected a whole number", f.name)
                number = int(number)
            self._set(f.name, number)

    def _fill_schedule(self, preset: dict[str, Any]) -> None:
        """The preset's length (and its decay) when no length is given; the preset's warmup, at most a
        tenth of the decay, when none is given; the decay is the run's length unless given."""
        if self.train_iters is None and self.train_samples is None:
            for n in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples"):
                if n in preset and getattr(self, n) is None:
                    self._set(n, preset[n])
        for kind in (_SCHEDULE_ITERS, _SCHEDULE_SAMPLES):
            length = getattr(self, kind[2]) if getattr(self, kind[2]) is not None else getattr(self, kind[0])
            if getattr(self, kind[0]) is not None and getattr(self, kind[1]) is None and kind[1] in preset:
                self._set(kind[1], min(preset[kind[1]], length // 10))
        if self.lr_warmup_iters is None and self.train_iters is not None:
            self._set("lr_warmup_iters", 0)
        if self.lr_warmup_samples is None and self.train_samples is not None:
            self._set("lr_warmup_samples", 0)
        if self.lr_decay_iters is None and self.train_iters is not None:
            self._set("lr_decay_iters", self.train_iters)
        if self.lr_decay_samples is None and self.train_samples is not None:
            self._set("lr_decay_samples", self.train_samples)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)   # only while __post_init__ completes the fields

    # -- construction and serialisation ------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> Config:
        return cls.from_dict({"model": name, **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown config field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(names))}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Config:
        data = read_config_file(path)
        try:
            return cls.from_dict(data)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{path}: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        from gpt.files import write_json

        write_json(path, self.to_dict())

    # -- derived values ----------------------------------------------------------------------
    def padded_vocab_size(self, tp: int | None = None) -> int:
        """Vocabulary padded like Megatron: a multiple of 128 x tensor-parallel size."""
        multiple = 128 * (self.tensor_parallel if tp is None else tp)
        return -(-self.vocab_size // multiple) * multiple

    @property
    def total_iters(self) -> int:
        if self.train_iters is not None:
            return self.train_iters
        return self.train_samples // self.global_batch_size

    def num_samples(self) -> dict[str, int]:
        """Samples each split must provide, by Megatron's formula."""
        g = self.global_batch_size
        iters = self.total_iters
        eval_runs = iters // self.eval_interval + 1
        train = self.train_samples if self.train_samples is not None else iters * g
        return {"train": train, "valid": eval_runs * self.eval_iters * g, "test": self.eval_iters * g}

    # -- validation --------------------------------------------------------------------------
    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError naming every problem that keeps this from running on ``world_size`` ranks."""
        found = self.problems(world_size)
        if found:
            raise ConfigError("; ".join(message for _, message in found), found[0][0] if len(found) == 1 else "")

    def problems(self, world_size: int = 1) -> list[Problem]:
        """Every problem of this configuration on ``world_size`` ranks: the field it is about ("" for
        the configuration as a whole) and a message naming it."""
        found = self._type_problems()
        if found:
            return found            # the checks below compare and compute with these values
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                found.append((name, f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}"))
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                     "vocab_size", "micro_batch_size", "global_batch_size", "tensor_parallel", "pipeline_parallel",
                     "virtual_pipeline_stages", "ffn_hidden_size", "num_query_groups", "rotary_base", "log_interval",
                     "eval_interval", "eval_iters", "save_interval", "keep_last", "precompile_iters"):
            if any(field == name for field, _ in found):
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                found.append((name, f"{name}={getattr(self, name)!r}: must be a positive integer"))
        if world_size < 1:
            found.append(("", f"world size {world_size} must be at least 1"))
        if found:
            return found            # the checks below do arithmetic on these
        if self.hidden_size % self.num_attention_heads:
            found.append(("hidden_size", f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                         f"{self.num_attention_heads}; change one so that heads divide the hidden size"))
        if self.num_attention_heads % self.tensor_parallel:
            found.append(("num_attention_heads", f"num_attention_heads={self.num_attention_heads} is not divisible by tensor_parallel="
                         f"{self.tensor_parallel}; pick a tensor_parallel that divides the head count"))
        found += self._block_problems()
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if world_size % model_parallel:
            found.append(("", f"world size {world_size} is not divisible by tensor_parallel={self.tensor_parallel} x "
                         f"pipeline_parallel={self.pipeline_parallel}; use a number of ranks that is a multiple "
                         f"of {model_parallel} (world = pipeline x data x tensor parallel)"))
            return found + self._schedule_problems()
        dp = world_size // model_parallel
        found += self._pipeline_problems(dp)
        if self.global_batch_size % (self.micro_batch_size * dp):
            found.append(("global_batch_size", f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
                         f"{self.micro_batch_size} x data-parallel size {dp}; make global_batch_size a multiple "
                         f"of {self.micro_batch_size * dp}"))
        if self.seq_length > self.max_position_embeddings:
            found.append(("seq_length", f"seq_length={self.seq_length} is longer than max_position_embeddings="
                         f"{self.max_position_embeddings}; raise max_position_embeddings or shorten seq_length"))
        found += self._schedule_problems()
        found += self._other_problems(dp)
        return found

    def _block_problems(self) -> list[Problem]:
        found: list[Problem] = []
        groups, heads, tp = self.num_query_groups, self.num_attention_heads, self.tensor_parallel
        if heads % groups:
            found.append(("num_query_groups", f"num_query_groups={groups} does not divide num_attention_heads={heads}: "
                         "each key/value head serves the same number of query heads"))
        elif groups % tp:
            found.append(("num_query_groups", f"num_query_groups={groups} is not divisible by tensor_parallel={tp}: each "
                         "tensor-parallel rank holds whole key/value groups; pick a tensor_parallel that divides "
                         f"{groups}"))
        if self.ffn_hidden_size % tp:
            found.append(("ffn_hidden_size", f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by tensor_parallel={tp}"))
        if self.position_embedding_type == "rope" and (self.hidden_size // heads) % 2:
            found.append(("position_embedding_type", f"rope rotates pairs of a head's dimensions: the head size "
                         f"{self.hidden_size // heads} (hidden_size / num_attention_heads) must be even"))
        if self.norm_epsilon <= 0:
            found.append(("norm_epsilon", f"norm_epsilon={self.norm_epsilon}: must be positive"))
        return found

    def _pipeline_problems(self, dp: int) -> list[Problem]:
        pp, virtual = self.pipeline_parallel, self.virtual_pipeline_stages
        found: list[Problem] = []
        if pp == 1 and virtual == 1:
            return found
        stages = pp * virtual
        if self.num_layers % stages:
            found.append(("num_layers", f"num_layers={self.num_layers} does not split evenly into pipeline_parallel={pp} x "
                         f"virtual_pipeline_stages={virtual} = {stages} stages; pick stages that divide the layers"))
        interleaved = self.pipeline_schedule in _INTERLEAVED
        if interleaved and virtual < 2:
            found.append(("pipeline_schedule", f"pipeline_schedule={self.pipeline_schedule!r} runs several stages per rank: set "
                         "virtual_pipeline_stages to 2 or more, or use pipeline_schedule='1f1b'"))
        if not interleaved and virtual > 1:
            found.append(("virtual_pipeline_stages", f"virtual_pipeline_stages={virtual} needs an interleaved schedule: set "
                         "pipeline_schedule='interleaved-1f1b' (or 'interleaved-zb')"))
        per_step = self.global_batch_size // (self.micro_batch_size * dp)
        if pp > 1 and per_step < pp:
            found.append(("global_batch_size", f"global_batch_size={self.global_batch_size} gives {per_step} micro-batch(es) per step "
                         f"(/ micro_batch_size={self.micro_batch_size} / data-parallel size {dp}), which cannot fill "
                         f"pipeline_parallel={pp} stages: raise global_batch_size or lower micro_batch_size to "
                         f"give at least {pp}"))
        elif pp > 1 and interleaved and per_step % pp:
            found.append(("global_batch_size", f"global_batch_size={self.global_batch_size} gives {per_step} micro-batches per step, "
                         f"not a multiple of pipeline_parallel={pp} as the interleaved schedules need: make "
                         f"global_batch_size a multiple of {self.micro_batch_size * dp * pp}"))
        if pp > 1 and self.device == "neuron":
            found.append(("pipeline_parallel", "pipeline_parallel > 1 is not available on device='neuron': the torch_xla path trains "
                         "with tensor and data parallel only; set pipeline_parallel=1 and raise tensor_parallel"))
        return found

    def _type_problems(self) -> list[Problem]:
        """Booleans where booleans are meant; finite numbers, never booleans, where numbers are."""
        found: list[Problem] = []
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _kind(f)
            if value is None and "None" not in str(f.type):
                found.append((f.name, f"{f.name} must be set (it has no empty value)"))
                continue
            if value is None or kind is None:
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    found.append((f.name, f"{f.name}={value!r}: expected true or false"))
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                found.append((f.name, f"{f.name}={value!r}: expected {'a whole number' if kind is int else 'a number'}"))
            elif not math.isfinite(value):
                found.append((f.name, f"{f.name}={value!r}: must be a finite number"))
        return found

    def _schedule_problems(self) -> list[Problem]:
        if (self.train_iters is None) == (self.train_samples is None):
            return [("", "set exactly one of train_iters and train_samples "
                    f"(got train_iters={self.train_iters}, train_samples={self.train_samples})")]
        found: list[Problem] = []
        own, other = (_SCHEDULE_ITERS, _SCHEDULE_SAMPLES) if self.train_iters is not None else (_SCHEDULE_SAMPLES, _SCHEDULE_ITERS)
        for name in other[1:]:
            if getattr(self, name) is not None:
                found.append((name, f"{name} is set but the schedule counts by {own[0]}; use {', '.join(own[1:])} "
                                  f"or schedule by {other[0]}"))
        total, warmup, decay = (getattr(self, n) for n in own)
        if total < 1:
            found.append((own[0], f"{own[0]}={total}: must be at least 1" +
                         (f" iteration (train_samples must reach global_batch_size={self.global_batch_size})" if own is _SCHEDULE_SAMPLES else "")))
        if self.train_samples is not None and self.train_samples < self.global_batch_size:
            found.append(("train_samples", f"train_samples={self.train_samples} is less than one global batch ({self.global_batch_size}); raise it"))
        if warmup < 0 or decay < 1:
            found.append((own[1], f"{own[1]}={warmup} must be >= 0 and {own[2]}={decay} must be >= 1"))
        if warmup > decay:
            found.append((own[1], f"{own[1]}={warmup} is longer than {own[2]}={decay}; shorten the warmup"))
        return found

    def _other_problems(self, dp: int) -> list[Problem]:
        found: list[Problem] = []
        if self.lr <= 0:
            found.append(("lr", f"lr={self.lr}: must be positive"))
        elif not 0 <= self.min_lr <= self.lr:
            found.append(("min_lr", f"min_lr={self.min_lr} must lie between 0 and lr={self.lr}"))
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                found.append((name, f"{name}={getattr(self, name)}: must lie in [0, 1)"))
        if self.adam_eps <= 0:
            found.append(("adam_eps", f"adam_eps={self.adam_eps}: must be positive (it keeps AdamW's division finite)"))
        if self.data_index is None and not self.mock_data:
            found.append(("", "no training data: set data_index to an index manifest (tasks.index) or mock_data=True"))
        if self.data_index is not None and self.mock_data:
            found.append(("", "both data_index and mock_data are set; keep one"))
        if self.data_index is not None and not Path(self.data_index).is_file():
            found.append(("data_index", f"data_index={self.data_index!r}: no such file; build it with tasks.index"))
        if self.device == "neuron" and self.data_parallel_mode == "fsdp":
            found.append(("device", "device='neuron' trains data parallel as data_parallel_mode='ddp' (gradients all-reduced, "
                         "optimizer state on every replica); set data_parallel_mode='ddp'"))
        if self.precompile and not self.compile_cache_dir:
            found.append(("precompile", "precompile=True needs compile_cache_dir, where the compiled graphs are stored"))
        if self.clip_grad < 0:
            found.append(("clip_grad", f"clip_grad={self.clip_grad}: must be >= 0 (0 turns clipping off)"))
        if self.weight_decay < 0:
            found.append(("weight_decay", f"weight_decay={self.weight_decay}: must be >= 0"))
        if self.precision == "fp8" and self.device in ("cpu", "neuron"):
            found.append(("precision", f"precision='fp8' needs an NVIDIA GPU of the Hopper generation or later (float8 matmuls), "
                         f"not device={self.device!r}; use bf16 there"))
        if self.precision == "fp8" and self.hidden_size % 16:
            found.append(("precision", f"precision='fp8' needs hidden_size divisible by 16 (float8 matmul shapes), not "
                         f"{self.hidden_size}; use bf16 or another hidden_size"))
        if not 0 <= self.seed < 2 ** 32:
            found.append(("seed", f"seed={self.seed}: must lie between 0 and 2**32 - 1 (numpy's generators take no other)"))
        if self.init_from and self.init_from_hf:
            found.append(("init_from", "init_from and init_from_hf are both set: a new run starts from one of them"))
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0 or self.collective_timeout_s <= 0:
            found.append(("hang_timeout_s", "hang_timeout_s and collective_timeout_s must be positive (seconds)"))
        if self.spike_factor < 0 or 0 < self.spike_factor <= 1:
            found.append(("spike_factor", f"spike_factor={self.spike_factor}: must be above 1 (a multiple of the "
                          "median loss), or 0 to turn spike detection off"))
        for name, least in (("spike_window", 1), ("nan_steps", 0), ("max_rollbacks", 0)):
            if getattr(self, name) < least:
                found.append((name, f"{name}={getattr(self, name)}: must be >= {least}"))
        if self.peak_flops is not None and self.peak_flops <= 0:
            found.append(("peak_flops", f"peak_flops={self.peak_flops}: must be positive (FLOP/s per device)"))
        return found


def _kind(f: dataclasses.Field) -> type | None:
    """bool, int or float: the kind of value a field holds, when it is one of those."""
    return next((k for k in (bool, int, float) if k.__name__ in str(f.type)), None)


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping of Config fields in a JSON file, or YAML when the name ends in .yaml/.yml (needs PyYAML)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e})") from e
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml  # only YAML configs need it
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError as e:
        raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install PyYAML); or use a .json file") from e
    except Exception as e:  # the parsers' own messages carry the line number
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields at the top level")
    return data


# -- KEY=VALUE overrides ----------------------------------------------------------------------------
_NULL = ("", "null", "none", "~")


def split_assignment(text: str) -> tuple[str, str | None]:
    """``name=value`` as (name, value); (text, None) where there is no ``=``. The one reading of an
    assignment: ``--set KEY=VALUE``, ``--cluster-set``, and long options written ``--flag=value``."""
    name, sep, value = text.partition("=")
    return (name, value) if sep else (text, None)


def parse_overrides(items: Iterable[str], fields: Mapping[str, Any] | None = None,
                    flag: str = "--set") -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``KEY=VALUE`` texts (``--set lr=3e-4``) as values typed by their field: a number for a numeric
    field, true or false for a boolean, the text for a text field, JSON for a list or a mapping,
    ``null`` (or nothing) for an optional one. ``fields`` maps names to types (default: Config's).
    A name that is no field keeps its text, for the checks that list unknown fields. Returns the
    values and the problems as (field, message) pairs; the message names ``flag``."""
    fields = config_field_types() if fields is None else fields
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for item in items:
        key, text = split_assignment(item)
        key = key.strip()
        if text is None or not key:
            problems.append(("", f"{flag} {item!r}: expected KEY=VALUE"))
            continue
        try:
            values[key] = typed_value(text, fields[key]) if key in fields else text
        except ValueError as e:
            problems.append((key, f"{key}={text!r}: {e}"))
    return values, problems


def typed_value(text: str, kind: Any) -> Any:
    """``text`` as a value of type ``kind``; ValueError says what was expected."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in _NULL:
            return None
        (kind, *rest) = [a for a in args if a is not type(None)]
        if rest:
            return text
    if kind is bool:
        try:
            return {"true": True, "false": False}[text.strip().lower()]
        except KeyError:
            raise ValueError("expected true or false") from None
    if kind in (int, float):
        try:
            number = float(text)
        except ValueError:
            raise ValueError("expected a whole number" if kind is int else "expected a number") from None
        if not math.isfinite(number):
            raise ValueError("must be a finite number")
        if kind is int and number != int(number):
            raise ValueError("expected a whole number")
        return int(number) if kind is int else number
    if typing.get_origin(kind) in (list, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"expected JSON ({e.msg})") from None
        if not isinstance(value, typing.get_origin(kind)):
            raise ValueError(f"expected a JSON {'list' if typing.get_origin(kind) is list else 'object'}")
        return value
    return text


def config_field_types() -> dict[str, Any]:
    """Config's fields by name, with their types."""
    return typing.get_type_hints(Config)

