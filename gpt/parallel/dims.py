"""Where a rank sits in the job: the parallel degrees (tensor, context, data, pipeline), its place
along each, the device mesh (or, on XLA devices, its tensor-parallel group), and over which ranks
its gradients are averaged and their global norm summed.

The mesh is (pp, dp, cp, tp), tensor-parallel ranks consecutive (within a node), then the ranks
that split a sequence (context parallel), then data parallel, then pipeline stages outermost
(across nodes): rank = ((pp index x dp + dp index) x cp + cp index) x tp + tp index. The context
and data dimensions are named only when their degree is above one.

Gradients are averaged over the replicas: the data-parallel ranks and, within each, the
context-parallel ranks, which hold the same weights and each a share of every sequence's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gpt.parallel import xla
from gpt.parallel.gradients import grad_norm, reduce_gradients


@dataclass
class ParallelDims:
    rank: int
    world_size: int
    local_rank: int
    mesh: DeviceMesh | None  # None when running as one process, and on XLA devices
    tp: xla.Group | None = None  # this rank's tensor-parallel group on XLA devices
    tp_size: int = 1
    pp_size: int = 1
    data_parallel_mode: str = "ddp"
    cp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp is not None:
            self.tp_size = self.tp.size

    @classmethod
    def build(cls, device_type: str, lazy: bool, rank: int, world_size: int, local_rank: int, tp_size: int,
              pp_size: int, data_parallel_mode: str = "ddp", cp_size: int = 1) -> ParallelDims:
        """The layout of a job whose process group is up: its mesh, or its XLA group on lazy devices
        (a DTensor there would mean GSPMD)."""
        if lazy:
            tp = xla.new_group(rank, world_size, tp_size, lazy=True) if tp_size > 1 else None
            return cls(rank, world_size, local_rank, None, tp, tp_size=tp_size, data_parallel_mode=data_parallel_mode)
        dp_size = world_size // (tp_size * pp_size * cp_size)
        sizes = {"pp": pp_size, "dp": dp_size, "cp": cp_size, "tp": tp_size}
        named = {name: size for name, size in sizes.items() if size > 1 or name in ("dp", "tp")}
        mesh = init_device_mesh(device_type, tuple(named.values()), mesh_dim_names=tuple(named))
        if cp_size > 1:
            mesh[("dp", "cp")]._flatten("replicas")
        return cls(rank, world_size, local_rank, mesh, tp_size=tp_size, pp_size=pp_size,
                   data_parallel_mode=data_parallel_mode, cp_size=cp_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size * self.cp_size)

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp_size * self.cp_size)) % self.dp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.dp_size)

    @property
    def replica_count(self) -> int:
        """Ranks holding the same weights and averaging their gradients: data x context parallel."""
        return self.dp_size * self.cp_size

    def replicas(self) -> DeviceMesh:
        """The mesh dimension of the replicas: data parallel, flattened with context parallel."""
        return self.mesh["replicas"] if self.cp_size > 1 else self.mesh["dp"]

    def context_group(self) -> dist.ProcessGroup | None:
        """The ranks that split this rank's sequences, or None without context parallel."""
        return self.mesh["cp"].get_group() if self.cp_size > 1 else None

    def gradient_replicas(self) -> dist.ProcessGroup | None:
        """The data-parallel group over which the gradients are averaged as DDP would, where no DDP
        module wraps the model: pipeline stages (a schedule gives DDP no forward per backward) and
        tensor-parallel layers (DDP takes no DTensor). None where DDP, FSDP or nothing does it."""
        if self.mesh is None or self.replica_count == 1 or self.data_parallel_mode != "ddp":
            return None
        return self.replicas().get_group() if self.pp_size > 1 or self.tp_size > 1 else None

    def average_gradients(self, optimizer: torch.optim.Optimizer, lazy: bool) -> None:
        """Average the gradients over the replicas where no DDP or FSDP module did in backward."""
        reduce_gradients(optimizer, lazy, self.tp, self.gradient_replicas())

    def grad_norm(self, parameters: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The global gradient norm over every shard of every rank (and stage, over ``pp_group``)."""
        return grad_norm(parameters, pp_group)
