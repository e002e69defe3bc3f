"""A GPT with every configured parallelism applied, in torchtitan's order: float8 linears (torchao)
-> tensor parallel -> context parallel (attention around a ring) -> activation checkpointing -> compile -> data parallel (FSDP2 or DDP), then
allocated on the device with its weights initialised. Pipeline stages (gpt.parallel.pipeline)
take the same steps, each stage a data-parallel unit of its own.

Each weight is drawn whole, from a generator seeded by (seed, name), and each rank keeps its part
of it, so the weights are the same whatever the layout.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor, distribute_tensor

from gpt.backend import DEVICES
from gpt.config import Config, ConfigError
from gpt.model import GPT, initial_weight, tied
from gpt.parallel import context, data, tensor, xla
from gpt.parallel.dims import ParallelDims


def build_model(config: Config, env: ParallelDims, device: torch.device) -> nn.Module:
    """The GPT with every configured parallelism applied, weights initialised on ``device``."""
    with torch.device("meta"):
        model = GPT(config)
    apply_layers(model, config, env, device)
    (model,) = materialise(model, [model], config, env, device)
    return model


def apply_layers(model: GPT, config: Config, env: ParallelDims, device: torch.device) -> None:
    """What changes the layers of a (meta) model: float8, tensor parallel, activation checkpointing,
    per-block compilation."""
    if config.precision == "fp8":
        require_float8_device(device)
        convert_to_float8(model, config.fp8_recipe, config.fp8_layers)
    if env.mesh is not None and config.tensor_parallel > 1:
        tensor.apply(model, env.mesh["tp"])
    elif env.tp is not None:
        xla.apply(model, env.tp)
    if env.cp_size > 1:
        context.apply(model, env.context_group())
    if config.activation_checkpointing:
        apply_activation_checkpointing(model, config.activation_checkpointing_scope)
    if config.compile and compile_scope(config, device, env.world_size) == "blocks":
        for block in model.h.values():
            block.compile(backend=compile_backend(device))


def materialise(model: GPT, parts: list[GPT], config: Config, env: ParallelDims, device: torch.device) -> list[nn.Module]:
    """Compile each part whole (compile scope ``model``), shard the parts over the data-parallel ranks
    (FSDP2) or wrap them in DDP, allocate the model on ``device`` and initialise its weights. ``parts``
    is ``[model]``, or a pipeline rank's stages (views of its layers). Returns the parts as trained."""
    if config.compile and compile_scope(config, device, env.world_size) == "model":
        for part in parts:
            part.compile(backend=compile_backend(device))
    sharded = data.fsdp(config, env, device)
    if sharded:
        data.shard(model, parts, env)
    model.to_empty(device=device)
    if sharded:
        for part in parts:
            if part is not model:  # a pipeline stage: its own FSDP state takes the new parameters
                part.to_empty(device=device)
    if model.wte is not None and model.lm_head is not None and tied(config):
        model.lm_head.weight = model.wte.weight  # to_empty and the TP plans re-create parameters
    xla.mark(model)
    init_weights(model)
    return data.wrap(parts, config, env, device)


@torch.no_grad()
def init_weights(model: GPT) -> None:
    """GPT-2 initialisation (gpt.model.initial_weight) of a model in any layout: each parameter's
    whole tensor, of which this rank keeps its part."""
    for name, p in model.named_parameters():
        if hasattr(p, "tp_shard"):  # split by gpt.parallel.xla: only this rank's part goes to the device
            p.copy_(p.tp_shard.cut(initial_weight(name, p.tp_shard.whole_shape(p), model.config)).to(p.device))
        elif isinstance(p, DTensor):  # its shape is the whole tensor's
            full = initial_weight(name, p.shape, model.config).to(p.device)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(initial_weight(name, p.shape, model.config).to(p.device))


def compile_scope(config: Config, device: torch.device, world_size: int) -> str:
    """``config.compile_scope``, with ``auto`` decided for the job: the whole model as one graph for a
    single CUDA process (fewer launches and the loss fused in: 1.38x the tokens/s of per-block graphs
    for GPT-3 125M on an H100), one graph per block otherwise: with several ranks, where DDP's
    all-reduce overlaps the blocks' backward and FSDP2's hooks sit between them, and on CPU (same
    speed, half the compile time)."""
    if config.compile_scope != "auto":
        return config.compile_scope
    return "model" if device.type == "cuda" and world_size == 1 else "blocks"
def compile_backend(device: torch.device) -> str:
    """torch.compile's backend for the device, from gpt.backend.DEVICES."""
    backend = DEVICES[device.type].compile_backend
    if backend is None:
        raise ConfigError(f"compile=True: torch.compile does not apply on {device.type} devices, whose graphs come "
                          "from the lazy trace (neuron_parallel_compile on Trainium); set compile=False")
    return backend
def convert_to_float8(model: GPT, recipe: str, layers: str = "all", *, emulate: bool = False) -> None:
    """torchao float8 training for the blocks' Linear layers (the output layer stays in the autocast
    dtype): every one (``layers`` "all") or only those large enough for float8 to gain ("large",
    float8_gains). ``emulate`` computes float8 numerics with ordinary matmuls, on any device: no
    speed, for tests."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError("precision='fp8' needs torchao (pip install -r requirements.txt)") from e
    fp8 = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)

    def converted(module: nn.Module, name: str) -> bool:
        if not name.startswith("h."):
            return False
        return layers == "all" or not isinstance(module, nn.Linear) or float8_gains(recipe, *module.weight.shape)

    convert_to_float8_training(model, config=fp8, module_filter_fn=converted)


def float8_gains(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a Linear of this shape trains faster in float8 than in bf16 on Hopper: below these
    sizes the scaling and casts cost more than the faster matmul saves (torchao's H100 tables; the
    rowwise kernels need larger shapes)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not (k <= 4096 and n <= 1024)


def require_float8_device(device: torch.device) -> None:
    """Float8 matmuls need an NVIDIA GPU of the Hopper generation (sm90) or later."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"device {device.type}"
    raise ConfigError(f"precision='fp8' needs an NVIDIA GPU of the Hopper generation or later (sm90+); "
                      f"this job runs on {where}: use precision='bf16'")
def apply_activation_checkpointing(model: GPT, scope: str) -> None:
    """Recompute in the backward pass, instead of keeping, the activations of each whole block, or
    only of its attention or its MLP."""
    for key, block in model.h.items():
        if scope == "block":
            model.h[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        elif scope == "attention":
            block.attn = checkpoint_wrapper(block.attn, preserve_rng_state=False)
        else:
            block.mlp = checkpoint_wrapper(block.mlp, preserve_rng_state=False)
