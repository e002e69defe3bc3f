"""One configuration object for the model, the data, the schedule, the layout and the run, in
sections, each field named as Megatron-LM names it.

A named preset (gpt.config.presets) fills the fields left as ``None``; anything passed explicitly
wins. ``validate(world_size)`` catches impossible combinations before anything is submitted, with a
message naming the field (gpt.config.checks); ``KEY=VALUE`` text becomes typed fields by the one
rule of gpt.config.overrides.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt.config.checks import SCHEDULE_ITERS, SCHEDULE_SAMPLES, Checked, ConfigError, field_kind
from gpt.config.presets import GPT3_BLOCK, PRESETS
from gpt.config.ramp import batch_size_at, iterations_for, samples_after
from gpt.tokenizer import GPT2_VOCAB_SIZE

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
    data_offset: int = 0                       # samples the run consumed before the index's first one
                                               # (a phase's first iteration x global_batch_size)
    reset_attention_mask: bool = False         # each document of a packed sample attends only to itself
    reset_position_ids: bool = False           # positions restart at each document of a packed sample


@dataclass(frozen=True)
class ScheduleSection:
    """Batches, length, learning rate and the optimizer."""
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    train_iters: int | None = None             # exactly one of these two; the lr_* schedule
    train_samples: int | None = None           # fields count in the same unit
    rampup_batch_size: list[int] | None = None  # [start, increment, samples]: the global batch grows from
                                               # start by increment over the first samples (Megatron's)
    lr: float | None = None
    min_lr: float | None = None
    lr_warmup_iters: int | None = None
    lr_warmup_samples: int | None = None
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_decay_style: str = "cosine"             # or WSD: warmup, then stable at lr, then a decay over the
    lr_wsd_decay_style: str = "exponential"    # last lr_wsd_decay_iters (or _samples) of lr_decay_*,
    lr_wsd_decay_iters: int | None = None      # shaped as Megatron's --lr-wsd-decay-style
    lr_wsd_decay_samples: int | None = None
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
    context_parallel: int = 1                  # ranks splitting every sequence (ring attention)
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
    init_method_std: float | None = None       # initial weights N(0, std), output layers std / sqrt(2 x
                                               # layers); the preset's, else 0.02 (GPT-2's, Megatron's)
    run_dir: str = "runs/default"              # config.json, metrics.jsonl, tensorboard/, checkpoints/
    tensorboard_dir: str | None = None         # TensorBoard's events written here too (Megatron's --tensorboard-dir)
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
class Config(Checked, RunSection, ParallelSection, ScheduleSection, DataSection, ModelSection):
    """Every field of every section, by its own name (``config.lr``, ``config.tensor_parallel``, as
    Megatron's flags name them), and each section whole, typed (``config.schedule.lr``,
    ``config.architecture.hidden_size``): code that reads one part of the configuration takes that
    section. ``section(name)`` gives one section's fields as a mapping."""

    def section(self, name: str) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SECTIONS[name])}

    def _part(self, section: type[Any]) -> Any:
        return section(**{f.name: getattr(self, f.name) for f in dataclasses.fields(section)})

    @property
    def architecture(self) -> ModelSection:
        return self._part(ModelSection)

    @property
    def data(self) -> DataSection:
        return self._part(DataSection)

    @property
    def schedule(self) -> ScheduleSection:
        return self._part(ScheduleSection)

    @property
    def parallel(self) -> ParallelSection:
        return self._part(ParallelSection)

    @property
    def run(self) -> RunSection:
        return self._part(RunSection)

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
        if self.init_method_std is None:
            self._set("init_method_std", preset.get("init_method_std", 0.02))
        if self.max_position_embeddings is None:
            self._set("max_position_embeddings", self.seq_length)

    def _coerce_numbers(self) -> None:
        """Numbers given as text (a form field, ``--set lr=3e-4`` read as YAML 1.1) become numbers,
        and whole numbers given for a float field floats (1 and 1.0 are one value); text that is
        no number, or no finite one, is an error naming the field."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), field_kind(f)
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
        for kind in (SCHEDULE_ITERS, SCHEDULE_SAMPLES):
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
        return iterations_for(self.train_samples, self.ramp, self.global_batch_size)

    @property
    def ramp(self) -> tuple[int, int, int] | None:
        """rampup_batch_size as (start, increment, samples), or None."""
        return None if self.rampup_batch_size is None else tuple(self.rampup_batch_size)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts once ``consumed_samples`` are trained."""
        return self.global_batch_size if self.ramp is None else batch_size_at(consumed_samples, self.ramp,
                                                                                self.global_batch_size)

    def samples_after(self, iterations: int) -> int:
        """Samples consumed once ``iterations`` steps are done (fewer per step during a ramp-up)."""
        return samples_after(iterations, self.ramp, self.global_batch_size)

    def batch_of(self, iteration: int) -> int:
        """The global batch of step ``iteration`` (1-based)."""
        return self.samples_after(iteration) - self.samples_after(iteration - 1)

    def num_samples(self) -> dict[str, int]:
        """Samples each split must provide, by Megatron's formula."""
        g = self.global_batch_size
        iters = self.total_iters
        eval_runs = iters // self.eval_interval + 1
        train = (self.train_samples if self.train_samples is not None else self.samples_after(iters)) - self.data_offset
        return {"train": train, "valid": eval_runs * self.eval_iters * g, "test": self.eval_iters * g}

    # -- validation --------------------------------------------------------------------------


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
