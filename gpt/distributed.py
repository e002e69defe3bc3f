"""Process group, device mesh and parallelism applied to a plain GPT from outside.

Order, as in torchtitan: float8 linears (torchao) -> tensor parallel (DTensor plans) -> activation
checkpointing -> compile -> data parallel (FSDP2 ``fully_shard`` or DDP). The model file stays free of parallel code.
Pipeline stages (gpt/pipeline.py) take the same steps, each stage a data-parallel unit of its own.

The mesh is (pp, dp, tp), tensor-parallel ranks consecutive (within a node), then data parallel,
then pipeline stages outermost (across nodes): rank = (pp index x dp + dp index) x tp + tp index.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from gpt import heartbeat, tensor_parallel
from gpt.backend import DEVICES, Backend
from gpt.config import Config, ConfigError
from gpt.model import GPT


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    mesh: DeviceMesh | None  # None when running as one process, and on XLA devices
    tp: tensor_parallel.Group | None = None  # this rank's tensor-parallel group on XLA devices
    tp_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp is not None:
            self.tp_size = self.tp.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.dp_size)


def init_distributed(backend: Backend, tp_size: int, timeout_s: float = 1800.0, pp_size: int = 1) -> DistEnv:
    """Join the process group described by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.
    A collective that cannot complete within ``timeout_s`` fails the rank (and so the job) rather
    than waiting forever.

    Without WORLD_SIZE (or with WORLD_SIZE=1) this is a plain single process, no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        return DistEnv(rank, 1, local_rank, None, tp_size=tp_size, pp_size=pp_size)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set; the launcher must export it")
    backend.device(local_rank)  # select this rank's device before the process group starts
    if not dist.is_initialized():
        kind = backend.kind
        # torch_xla takes rank and world size from its runtime (set up by torchrun), not from here.
        init_method = "xla://" if kind.dist_backend == "xla" else "env://"
        dist.init_process_group(kind.dist_backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    check_world(rank, world_size)
    if backend.lazy:  # a DTensor there would mean GSPMD: tensor parallel with explicit collectives
        tp = tensor_parallel.new_group(rank, world_size, tp_size, lazy=True) if tp_size > 1 else None
        return DistEnv(rank, world_size, local_rank, None, tp, tp_size=tp_size)
    dp_size = world_size // (tp_size * pp_size)
    if pp_size > 1:
        mesh = init_device_mesh(backend.kind.device_type, (pp_size, dp_size, tp_size), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh(backend.kind.device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return DistEnv(rank, world_size, local_rank, mesh, tp_size=tp_size, pp_size=pp_size)


def check_world(rank: int, world_size: int) -> None:
    """The process group the job joined is the one its launcher asked for: a group smaller than
    WORLD_SIZE would train data parallel on fewer ranks than planned, each unaware of the others."""
    seen = dist.get_world_size(), dist.get_rank()
    if seen != (world_size, rank):
        raise RuntimeError(
            f"the launcher asked for rank {rank} of WORLD_SIZE={world_size}, but the process group has rank "
            f"{seen[1]} of {seen[0]}. On Trainium start the ranks with torchrun, one launcher per node, so "
            "that torch_xla sets up Neuron's multi-process runtime")


def compile_scope(config: Config, device: torch.device, world_size: int) -> str:
    """``config.compile_scope``, with ``auto`` decided for the job: the whole model as one graph for a
    single CUDA process (fewer launches and the loss fused in: 1.38x the tokens/s of per-block graphs
    for GPT-3 125M on an H100), one graph per block otherwise: with several ranks, where DDP's
    all-reduce overlaps the blocks' backward and FSDP2's hooks sit between them, and on CPU (same
    speed, half the compile time)."""
    if config.compile_scope != "auto":
        return config.compile_scope
    return "model" if device.type == "cuda" and world_size == 1 else "blocks"


def build_model(config: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """The GPT with every configured parallelism applied, weights initialised on ``device``."""
    with torch.device("meta"):
        model = GPT(config)
    apply_layers(model, config, env, device)
    (model,) = materialise(model, [model], config, env, device)
    return model


def apply_layers(model: GPT, config: Config, env: DistEnv, device: torch.device) -> None:
    """What changes the layers of a (meta) model: float8, tensor parallel, activation checkpointing,
    per-block compilation."""
    if config.precision == "fp8":
        require_float8_device(device)
        convert_to_float8(model, config.fp8_recipe)
    if env.mesh is not None and config.tensor_parallel > 1:
        apply_tensor_parallel(model, env.mesh["tp"])
    elif env.tp is not None:
        tensor_parallel.apply(model, env.tp)
    if config.activation_checkpointing:
        apply_activation_checkpointing(model, config.activation_checkpointing_scope)
    if config.compile and compile_scope(config, device, env.world_size) == "blocks":
        for block in model.h.values():
            block.compile(backend=compile_backend(device))


def materialise(model: GPT, parts: list[GPT], config: Config, env: DistEnv, device: torch.device) -> list[nn.Module]:
    """Compile each part whole (compile scope ``model``), shard the parts over the data-parallel ranks
    (FSDP2) or wrap them in DDP, allocate the model on ``device`` and initialise its weights. ``parts``
    is ``[model]``, or a pipeline rank's stages (views of its layers). Returns the parts as trained."""
    dp = env.dp_size
    if config.compile and compile_scope(config, device, env.world_size) == "model":
        for part in parts:
            part.compile(backend=compile_backend(device))
    if env.mesh is None and dp > 1 and config.data_parallel_mode == "fsdp":
        raise ConfigError(f"data_parallel_mode='fsdp': {device.type} devices train data parallel as "
                          "data_parallel_mode='ddp' (gradients all-reduced, optimizer state on every replica)")
    if env.mesh is not None and dp > 1 and config.data_parallel_mode == "fsdp":
        dp_mesh = env.mesh["dp"]
        for block in model.h.values():
            fully_shard(block, mesh=dp_mesh)
        for part in parts:
            fully_shard(part, mesh=dp_mesh)
    model.to_empty(device=device)
    if env.mesh is not None and dp > 1 and config.data_parallel_mode == "fsdp":
        for part in parts:
            if part is not model:  # a pipeline stage: its own FSDP state takes the new parameters
                part.to_empty(device=device)
    if model.wte is not None and model.lm_head is not None:
        model.lm_head.weight = model.wte.weight  # to_empty and the TP plans re-create parameters
    tensor_parallel.mark(model)
    model.init_weights(config.seed)
    if env.mesh is not None and dp > 1 and config.data_parallel_mode == "ddp" and gradient_replicas(config, env) is None:
        return [DistributedDataParallel(part, process_group=env.mesh["dp"].get_group(),
                                        device_ids=None if device.index is None else [device.index]) for part in parts]
    return parts


def gradient_replicas(config: Config, env: DistEnv) -> dist.ProcessGroup | None:
    """The data-parallel group over which Backend.reduce_gradients averages the gradients as DDP
    would, where no DDP module wraps the model: pipeline stages (a schedule gives DDP no forward per
    backward) and tensor-parallel layers (DDP takes no DTensor). None where DDP, FSDP or nothing does it."""
    if env.mesh is None or env.dp_size == 1 or config.data_parallel_mode != "ddp":
        return None
    return env.mesh["dp"].get_group() if config.pipeline_parallel > 1 or config.tensor_parallel > 1 else None


def compile_backend(device: torch.device) -> str:
    """torch.compile's backend for the device, from gpt.backend.DEVICES."""
    backend = DEVICES[device.type].compile_backend
    if backend is None:
        raise ConfigError(f"compile=True: torch.compile does not apply on {device.type} devices, whose graphs come "
                          "from the lazy trace (neuron_parallel_compile on Trainium); set compile=False")
    return backend


def convert_to_float8(model: GPT, recipe: str, *, emulate: bool = False) -> None:
    """torchao float8 training for the blocks' Linear layers (the output layer, tied to the embedding,
    stays in the autocast dtype). ``emulate`` computes float8 numerics with ordinary matmuls, on any
    device: no speed, for tests."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError("precision='fp8' needs torchao (pip install -r requirements.txt)") from e
    fp8 = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=fp8, module_filter_fn=lambda module, name: name.startswith("h."))


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


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron's split: the fused q/k/v (head by head) and fc column-wise, projections row-wise, the
    embedding by vocabulary rows (the tied output layer gathers them for the loss; a pipeline's last
    stage splits its copy of the embedding the same way)."""
    if model.wte is not None:
        parallelize_module(model, tp_mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        })
    elif model.lm_head is not None:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel()})  # weight rows: Shard(0)
    for block in model.h.values():
        parallelize_module(block, tp_mesh, {
            "attn.qkv": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        })
    if model.wte is not None and model.lm_head is not None:
        model.lm_head.weight = model.wte.weight  # both Shard(0) over the vocabulary: one tied parameter


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction for all but the last micro-batch."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def grad_norm(parameters: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients, over every shard of every rank (and every pipeline stage's
    parameters, summed over ``pp_group``)."""
    with_grad = [p for p in parameters if p.grad is not None]
    sharded = [p.grad for p in with_grad if isinstance(p.grad, DTensor)]
    split = [p for p in with_grad if hasattr(p, "tp_shard")]  # by gpt.tensor_parallel
    plain = [p.grad for p in with_grad if not isinstance(p.grad, DTensor) and not hasattr(p, "tp_shard")]
    norms = []
    if sharded:
        norms.append(torch.nn.utils.get_total_norm(sharded).full_tensor())
    if split:
        squares = torch.nn.utils.get_total_norm([p.grad for p in split]) ** 2
        norms.append(split[0].tp_shard.group.all_reduce(squares).sqrt())
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain))
    norm = torch.linalg.vector_norm(torch.stack(norms))
    if pp_group is not None:
        squares = norm.float() ** 2
        dist.all_reduce(squares, group=pp_group)
        norm = squares.sqrt()
    return norm



def scale_grads(parameters: list[nn.Parameter], factor: float | torch.Tensor) -> None:
    """Multiply every gradient by ``factor`` (a 0-dim tensor applies to sharded gradients too)."""
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)


def clip_grads(parameters: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients down to ``max_norm`` where their global ``norm`` exceeds it, with the
    coefficient computed on the device (no host read), in the norm's dtype."""
    scale_grads(parameters, torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0))


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over all ranks (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        heartbeat.enter("collective")
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_floats(value: float, device: torch.device) -> list[float]:
    """``value`` from every rank, in rank order (this rank's alone without a process group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out = torch.zeros(dist.get_world_size(), dtype=torch.float32, device=device)
    dist.all_gather_into_tensor(out, torch.tensor([value], dtype=torch.float32, device=device))
    return out.tolist()


def gather_objects(value: Any) -> list[Any]:
    """A small picklable ``value`` from every rank, in rank order."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown(finished: bool) -> None:
    """Leave the process group. After a run every rank finished, wait for all of them first: a
    rank that tears down while its peer still talks to it can take the peer down at exit. After
    an error, leave at once (the others may be inside another collective)."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
