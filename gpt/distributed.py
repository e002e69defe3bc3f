"""Process group, device mesh and parallelism applied to a plain GPT from outside.

Order, as in torchtitan: tensor parallel (DTensor plans) -> activation checkpointing -> compile
-> data parallel (FSDP2 ``fully_shard`` or DDP). The model file stays free of parallel code.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from gpt.backend import Backend
from gpt.config import Config
from gpt.model import GPT


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    mesh: DeviceMesh | None  # None when running as one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: Backend, tensor_parallel: int) -> DistEnv:
    """Join the process group described by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.

    Without WORLD_SIZE (or with WORLD_SIZE=1) this is a plain single process, no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        return DistEnv(rank, 1, local_rank, None)
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set; the launcher must export it")
    backend.device(local_rank)  # select this rank's GPU before NCCL starts
    if not dist.is_initialized():
        init_method = "xla://" if backend.dist_backend == "xla" else "env://"
        dist.init_process_group(backend.dist_backend, init_method=init_method, rank=rank, world_size=world_size)
    mesh = None
    if backend.name != "neuron":
        mesh = init_device_mesh(backend.mesh_device_type, (world_size // tensor_parallel, tensor_parallel),
                                mesh_dim_names=("dp", "tp"))
    return DistEnv(rank, world_size, local_rank, mesh)


def build_model(config: Config, env: DistEnv, device: torch.device) -> nn.Module:
    """The GPT with every configured parallelism applied, weights initialised on ``device``."""
    with torch.device("meta"):
        model = GPT(config)
    if env.mesh is not None and config.tensor_parallel > 1:
        apply_tensor_parallel(model, env.mesh["tp"])
    if config.activation_checkpointing:
        for i, block in enumerate(model.h):
            model.h[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if config.compile:
        for block in model.h:
            block.compile()
    dp = env.world_size // config.tensor_parallel
    if env.mesh is not None and dp > 1 and config.data_parallel_mode == "fsdp":
        dp_mesh = env.mesh["dp"]
        for block in model.h:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    model.to_empty(device=device)
    model.lm_head.weight = model.wte.weight  # to_empty and the TP plans re-create parameters
    model.init_weights(config.seed)
    if env.mesh is not None and dp > 1 and config.data_parallel_mode == "ddp":
        model = DistributedDataParallel(model, process_group=env.mesh["dp"].get_group(),
                                        device_ids=[device.index] if device.type == "cuda" else None)
    return model


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Megatron's split: q/k/v and fc column-wise, projections row-wise, vocab-parallel embedding/output."""
    parallelize_module(model, tp_mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.h:
        parallelize_module(block, tp_mesh, {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        })
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


def grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients, over every shard of every rank."""
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = []
    if sharded:
        norms.append(torch.nn.utils.get_total_norm(sharded).full_tensor())
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain))
    return torch.linalg.vector_norm(torch.stack(norms))


def scale_grads(parameters: list[nn.Parameter], factor: float) -> None:
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(factor)


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a small tensor over all ranks (identity for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


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
