"""Data parallel inside each (tensor-parallel, pipeline) part: FSDP2 shards parameters, gradients
and optimizer state over the replicas (the ``dp`` mesh dimension, with the ``cp`` one where
sequences are split: gpt.parallel.dims); DDP all-reduces gradients and keeps optimizer
state on every replica. Where torch's DDP module cannot apply (its model holds DTensors, or a
pipeline schedule runs it), the replicas average the gradients after the backward instead
(gpt.parallel.dims.ParallelDims.average_gradients)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from gpt.config import Config, ConfigError
from gpt.model import GPT
from gpt.parallel.dims import ParallelDims


def fsdp(config: Config, env: ParallelDims, device: torch.device) -> bool:
    """Whether the job shards with FSDP2 (more than one data-parallel replica on a device mesh)."""
    if env.replica_count > 1 and config.data_parallel_mode == "fsdp" and env.mesh is None:
        raise ConfigError(f"data_parallel_mode='fsdp': {device.type} devices train data parallel as "
                          "data_parallel_mode='ddp' (gradients all-reduced, optimizer state on every replica)")
    return env.replica_count > 1 and config.data_parallel_mode == "fsdp"


def shard(model: GPT, parts: list[GPT], env: ParallelDims) -> None:
    """FSDP2 over the data-parallel ranks: each block, then each part (the whole model, or a pipeline
    stage) for what is left, on the (meta) model before it is allocated."""
    for block in model.h.values():
        fully_shard(block, mesh=env.replicas())
    for part in parts:
        fully_shard(part, mesh=env.replicas())


def wrap(parts: list[GPT], config: Config, env: ParallelDims, device: torch.device) -> list[nn.Module]:
    """The parts in torch's DDP module where it applies; as they are otherwise."""
    if env.mesh is None or env.replica_count == 1 or config.data_parallel_mode != "ddp" or env.gradient_replicas():
        return list(parts)
    return [DistributedDataParallel(part, process_group=env.replicas().get_group(),
                                    device_ids=None if device.index is None else [device.index]) for part in parts]


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
