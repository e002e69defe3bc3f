"""Data parallel inside each (tensor-parallel, pipeline) part: FSDP2 shards parameters, gradients
and optimizer state over the ``dp`` mesh dimension; DDP all-reduces gradients and keeps optimizer
state on every replica. Where torch's DDP module cannot apply (its model holds DTensors, or a
pipeline schedule runs it), the replicas average the gradients after the backward instead
(gpt.parallel.gradients.reduce_gradients over ``gradient_replicas``)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from gpt.config import Config, ConfigError
from gpt.distributed import DistEnv
from gpt.model import GPT


def fsdp(config: Config, env: DistEnv, device: torch.device) -> bool:
    """Whether the job shards with FSDP2 (more than one data-parallel replica on a device mesh)."""
    if env.dp_size > 1 and config.data_parallel_mode == "fsdp" and env.mesh is None:
        raise ConfigError(f"data_parallel_mode='fsdp': {device.type} devices train data parallel as "
                          "data_parallel_mode='ddp' (gradients all-reduced, optimizer state on every replica)")
    return env.dp_size > 1 and config.data_parallel_mode == "fsdp"


def shard(model: GPT, parts: list[GPT], env: DistEnv) -> None:
    """FSDP2 over the data-parallel ranks: each block, then each part (the whole model, or a pipeline
    stage) for what is left, on the (meta) model before it is allocated."""
    for block in model.h.values():
        fully_shard(block, mesh=env.mesh["dp"])
    for part in parts:
        fully_shard(part, mesh=env.mesh["dp"])


def wrap(parts: list[GPT], config: Config, env: DistEnv, device: torch.device) -> list[nn.Module]:
    """The parts in torch's DDP module where it applies; as they are otherwise."""
    if env.mesh is None or env.dp_size == 1 or config.data_parallel_mode != "ddp" or gradient_replicas(config, env):
        return list(parts)
    return [DistributedDataParallel(part, process_group=env.mesh["dp"].get_group(),
                                    device_ids=None if device.index is None else [device.index]) for part in parts]


def gradient_replicas(config: Config, env: DistEnv) -> dist.ProcessGroup | None:
    """The data-parallel group over which gpt.parallel.gradients.reduce_gradients averages the gradients as DDP
    would, where no DDP module wraps the model: pipeline stages (a schedule gives DDP no forward per
    backward) and tensor-parallel layers (DDP takes no DTensor). None where DDP, FSDP or nothing does it."""
    if env.mesh is None or env.dp_size == 1 or config.data_parallel_mode != "ddp":
        return None
    return env.mesh["dp"].get_group() if config.pipeline_parallel > 1 or config.tensor_parallel > 1 else None


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
