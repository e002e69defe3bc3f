"""The process group a job's ranks join, and the collectives the training loop calls (sums and
gathers of small values, the stop signal every rank agrees on). Where each rank sits in the layout
is gpt.parallel.dims; what each parallelism does to the model is gpt.parallel's.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
from typing import Any

import torch
import torch.distributed as dist

from gpt import heartbeat
from gpt.backend import Backend
from gpt.parallel.dims import ParallelDims


def init_distributed(backend: Backend, tp_size: int, timeout_s: float = 1800.0, pp_size: int = 1,
                     data_parallel_mode: str = "ddp", cp_size: int = 1) -> ParallelDims:
    """Join the process group described by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.
    A collective that cannot complete within ``timeout_s`` fails the rank (and so the job) rather
    than waiting forever.

    Without WORLD_SIZE (or with WORLD_SIZE=1) this is a plain single process, no process group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size == 1:
        return ParallelDims(rank, 1, local_rank, None, tp_size=tp_size, pp_size=pp_size,
                            data_parallel_mode=data_parallel_mode, cp_size=cp_size)
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
    return ParallelDims.build(backend.kind.device_type, backend.lazy, rank, world_size, local_rank, tp_size, pp_size,
                              data_parallel_mode, cp_size)


def free_port() -> int:
    """A TCP port free on this host now, for the rendezvous of ranks started here (MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_world(rank: int, world_size: int) -> None:
    """The process group the job joined is the one its launcher asked for: a group smaller than
    WORLD_SIZE would train data parallel on fewer ranks than planned, each unaware of the others."""
    seen = dist.get_world_size(), dist.get_rank()
    if seen != (world_size, rank):
        raise RuntimeError(
            f"the launcher asked for rank {rank} of WORLD_SIZE={world_size}, but the process group has rank "
            f"{seen[1]} of {seen[0]}. On Trainium start the ranks with torchrun, one launcher per node, so "
            "that torch_xla sets up Neuron's multi-process runtime")


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


class StopSignal:
    """Records SIGUSR2/SIGTERM; ``should_stop`` agrees on all ranks (one all-reduced flag)."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay with whoever owns them
            pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = True

    def should_stop(self, device: torch.device) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        flag = torch.tensor(float(self.received), device=device)
        return bool(all_reduce_sum(flag) > 0)
