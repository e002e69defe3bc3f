"""What keeps a configuration from running, each problem naming its field and what to change:
types first (the rest computes with the values), then choices and ranges, the block's shapes, the
layout over the ranks, the pipeline, the schedule, and everything else. ``Checked`` gives the Config
its ``problems`` and ``validate``; the choices and the schedule's fields are this module's."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

# A problem of a configuration: the field it is about ("" for the whole) and what to change.
Problem = tuple[str, str]

SCHEDULE_ITERS = ("train_iters", "lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters")
SCHEDULE_SAMPLES = ("train_samples", "lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_samples")
CHOICES = {
    "lr_decay_style": ("cosine", "linear", "constant", "WSD"),
    "lr_wsd_decay_style": ("exponential", "linear", "cosine", "minus_sqrt"),
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
# The shortest hang and collective limits: the follower reads the ranks' heartbeats every 2 s.
HANG_TIMEOUT_FLOOR_S = 5.0


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and what to change, ``field``
    is that field ("" for the configuration as a whole)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def field_kind(f: dataclasses.Field) -> type | None:
    """bool, int or float: the kind of value a field holds, when it is one of those (not a list of them)."""
    if "list" in str(f.type):
        return None
    return next((k for k in (bool, int, float) if k.__name__ in str(f.type)), None)


class Checked:
    """The checks of a configuration's fields (a Config is one)."""

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
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                found.append((name, f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}"))
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                     "vocab_size", "micro_batch_size", "global_batch_size", "tensor_parallel", "pipeline_parallel", "context_parallel",
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
        found += self._context_problems()
        model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if world_size % model_parallel:
            found.append(("", f"world size {world_size} is not divisible by tensor_parallel={self.tensor_parallel} x "
                         f"pipeline_parallel={self.pipeline_parallel} x context_parallel={self.context_parallel}; use a "
                         f"number of ranks that is a multiple of {model_parallel} (world = pipeline x data x context x "
                         "tensor parallel)"))
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
        found += self._ramp_problems(dp)
        found += self._other_problems(dp)
        return found

    def _ramp_problems(self, dp: int) -> list[Problem]:
        """rampup_batch_size: three positive whole numbers, steps that reach global_batch_size, and
        every batch of the ramp a whole number of micro-batches on each data-parallel rank."""
        ramp = self.rampup_batch_size
        if ramp is None:
            return []
        name, shape = "rampup_batch_size", "[start, increment, samples] (Megatron's --rampup-batch-size)"
        if (not isinstance(ramp, (list, tuple)) or len(ramp) != 3
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in ramp)):
            return [(name, f"{name}={ramp!r}: expected three positive whole numbers {shape}")]
        start, increment, _ = ramp
        unit, pp = self.micro_batch_size * dp, self.pipeline_parallel
        if start > self.global_batch_size or (self.global_batch_size - start) % increment:
            return [(name, f"{name}={list(ramp)}: the batch grows from {start} by {increment} to global_batch_size="
                           f"{self.global_batch_size}; choose a start and an increment that reach it")]
        if start % unit or increment % unit:
            return [(name, f"{name}={list(ramp)}: every batch of the ramp must split into micro_batch_size="
                           f"{self.micro_batch_size} x data-parallel size {dp}: make start and increment multiples "
                           f"of {unit}")]
        if self.device == "neuron":
            return [(name, f"{name} is not available on device='neuron': each batch size of the ramp is another "
                           "compiled graph (neuron_parallel_compile extracts one step's); train without it there")]
        if pp > 1 and start // unit < pp:
            return [(name, f"{name}={list(ramp)}: the first batch gives {start // unit} micro-batch(es), which cannot "
                           f"fill pipeline_parallel={pp} stages; start at {unit * pp} or more")]
        return []

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
        if not 0 < self.init_method_std < 1:
            found.append(("init_method_std", f"init_method_std={self.init_method_std}: must lie between 0 and 1 "
                                             "(0.02 is GPT-2's and Megatron's default)"))
        if not 0 < self.norm_epsilon < 1:
            found.append(("norm_epsilon", f"norm_epsilon={self.norm_epsilon}: must lie between 0 and 1 (a small "
                                          "number added to the variance, such as 1e-5)"))
        return found

    def _context_problems(self) -> list[Problem]:
        """Context parallel and document masking: where they apply."""
        cp, found = self.context_parallel, []
        if cp > 1 and self.seq_length % (2 * cp):
            found.append(("context_parallel", f"context_parallel={cp} gives each rank one chunk from each end of a "
                          f"sequence: seq_length={self.seq_length} must be a multiple of 2 x {cp} = {2 * cp}"))
        packed = self.reset_attention_mask or self.reset_position_ids
        for name, used in (("context_parallel", cp > 1), ("reset_attention_mask", packed)):
            if used and self.pipeline_parallel > 1:
                found.append((name, f"{name} is not available with pipeline_parallel={self.pipeline_parallel}: the "
                              "pipeline's stages pass hidden states only; set pipeline_parallel=1 (tensor, context "
                              "and data parallel apply)"))
            if used and self.device == "neuron":
                found.append((name, f"{name} is not available on device='neuron' (the torch_xla path has not been "
                              "proven with it); train it on GPUs or CPUs"))
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
            value, kind = getattr(self, f.name), field_kind(f)
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
        own, other = (SCHEDULE_ITERS, SCHEDULE_SAMPLES) if self.train_iters is not None else (SCHEDULE_SAMPLES, SCHEDULE_ITERS)
        for name in other[1:]:
            if getattr(self, name) is not None:
                found.append((name, f"{name} is set but the schedule counts by {own[0]}; use {', '.join(own[1:])} "
                                  f"or schedule by {other[0]}"))
        total, warmup, decay, wsd = (getattr(self, n) for n in own)
        if total < 1:
            found.append((own[0], f"{own[0]}={total}: must be at least 1" +
                         (f" iteration (train_samples must reach global_batch_size={self.global_batch_size})" if own is SCHEDULE_SAMPLES else "")))
        if self.train_samples is not None and self.train_samples < self.global_batch_size:
            found.append(("train_samples", f"train_samples={self.train_samples} is less than one global batch ({self.global_batch_size}); raise it"))
        if warmup < 0 or decay < 1:
            found.append((own[1], f"{own[1]}={warmup} must be >= 0 and {own[2]}={decay} must be >= 1"))
        if warmup > decay:
            found.append((own[1], f"{own[1]}={warmup} is longer than {own[2]}={decay}; shorten the warmup"))
        if self.lr_decay_style == "WSD" and wsd is None:
            found.append((own[3], f"lr_decay_style=WSD decays over the last {own[3]} of {own[2]}: set it (Megatron's "
                                  f"--{own[3].replace('_', '-')})"))
        elif self.lr_decay_style == "WSD" and not 1 <= wsd <= decay:
            found.append((own[3], f"{own[3]}={wsd}: the decay lies within {own[2]}={decay}: between 1 and {decay}"))
        elif self.lr_decay_style != "WSD" and wsd is not None:
            found.append((own[3], f"{own[3]} is set but lr_decay_style={self.lr_decay_style}: set lr_decay_style=WSD "
                                  "for a warmup-stable-decay schedule, or remove it"))
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
        if self.data_offset and (self.data_offset % self.global_batch_size or
                                 self.data_offset >= self.total_iters * self.global_batch_size):
            found.append(("data_offset", f"data_offset={self.data_offset}: must be a whole number of global batches "
                                         f"({self.global_batch_size}) before the run's end"))
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
        if self.hang_timeout_s is not None and self.hang_timeout_s < HANG_TIMEOUT_FLOOR_S:
            found.append(("hang_timeout_s", f"hang_timeout_s={self.hang_timeout_s}: at least {HANG_TIMEOUT_FLOOR_S:g} s "
                                            "(the follower reads the ranks' heartbeats every few seconds; a shorter "
                                            "limit calls a healthy job hung), or empty to follow the step time"))
        if self.collective_timeout_s < HANG_TIMEOUT_FLOOR_S:
            found.append(("collective_timeout_s", f"collective_timeout_s={self.collective_timeout_s}: at least "
                                                  f"{HANG_TIMEOUT_FLOOR_S:g} s"))
        if self.spike_factor < 0 or 0 < self.spike_factor <= 1:
            found.append(("spike_factor", f"spike_factor={self.spike_factor}: must be above 1 (a multiple of the "
                          "median loss), or 0 to turn spike detection off"))
        for name, least in (("spike_window", 1), ("nan_steps", 0), ("max_rollbacks", 0)):
            if getattr(self, name) < least:
                found.append((name, f"{name}={getattr(self, name)}: must be >= {least}"))
        if self.peak_flops is not None and self.peak_flops <= 0:
            found.append(("peak_flops", f"peak_flops={self.peak_flops}: must be positive (FLOP/s per device)"))
        return found
