"""Who averages and measures the gradients, over which ranks: the data-parallel replicas where no
DDP or FSDP module does it (XLA, gpt.parallel.xla's layers, pipeline stages and DTensor tensor
parallel without DDP), the global gradient norm over every shard of every rank and stage, and the
clipping it decides on the device.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class Replicas(Protocol):
    """A layout that averages its own gradients over the ranks holding the same parts
    (gpt.parallel.xla.Group)."""

    def average_over_replicas(self, grads: list[torch.Tensor]) -> None: ...


def reduce_gradients(optimizer: torch.optim.Optimizer, lazy: bool, tp: Replicas | None = None,
                     replicas: dist.ProcessGroup | None = None) -> None:
    """Average the gradients over the data-parallel replicas where the model does not (DDP and
    FSDP reduce inside backward). On XLA, and under gpt.parallel.xla's layers, the model is
    not wrapped, so it happens here: over the whole world, or over the ranks that hold the same
    part of every parameter. Where data parallel as DDP has no DDP module (pipeline stages,
    DTensor tensor parallel: gpt.parallel.dims.ParallelDims.gradient_replicas) it averages over ``replicas``."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if tp is not None:
        tp.average_over_replicas(grads)
    elif replicas is not None:
        average_over_group(grads, replicas)
    elif lazy:
        import torch_xla.runtime as xr
        average_on_xla(grads, [list(range(xr.world_size()))])


def average_over_group(grads: list[torch.Tensor], group: dist.ProcessGroup, bucket_elements: int = 2 ** 25) -> None:
    """Average eager tensors in place over a process group: a few large all-reduces of flattened
    buckets (of one dtype, up to ``bucket_elements``) rather than one per tensor. A DTensor's local
    shard is averaged: the replicas hold the same shard of it."""
    count = dist.get_world_size(group)
    if count < 2:
        return
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for grad in grads:
        if not buckets or size + grad.numel() > bucket_elements or grad.dtype != buckets[-1][0].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel()
    for bucket in buckets:
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(count)
        for grad, averaged in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            grad.copy_(averaged)


def average_on_xla(grads: list[torch.Tensor], replicas: list[list[int]]) -> None:
    """Average XLA tensors in place over each group of ``replicas`` (every group of the world, as XLA
    collectives name them), in buckets of ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB as torch_xla does when it is set."""
    import torch_xla.core.xla_model as xm

    count = len(replicas[0])
    if count < 2 or not grads:
        return
    bucket_mb = int(os.environ.get("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", "0"))
    if bucket_mb > 0:  # last layers first, so that their reduction can start during backward
        xm.all_reduce_bucketized_gradients(grads[::-1], scale=1.0 / count, groups=replicas, pin_layout=True,
                                           bucket_cap_mb=bucket_mb)
    else:
        xm.all_reduce(xm.REDUCE_SUM, grads, scale=1.0 / count, groups=replicas)


def grad_norm(parameters: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients, over every shard of every rank (and every pipeline stage's
    parameters, summed over ``pp_group``)."""
    from torch.distributed.tensor import DTensor  # DTensor's operators: only where a model trains

    with_grad = [p for p in parameters if p.grad is not None]
    sharded = [p.grad for p in with_grad if isinstance(p.grad, DTensor)]
    split = [p for p in with_grad if hasattr(p, "tp_shard")]  # by gpt.parallel.xla
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
