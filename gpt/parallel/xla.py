"""Tensor parallelism with explicit collectives, for XLA's lazy tensors (Trainium through torch-neuronx).

On eager devices tensor parallelism is DTensor's (gpt.parallel.tensor). On an
XLA device a DTensor means GSPMD, which the Neuron compiler does not train with; there the layers
below split the same weights the same way, Megatron's way, and call the collectives themselves:

- the fused q/k/v projection and the MLP's first layer split their output rows (whole heads per
  rank); their input is the replicated activation, whose gradient is summed over the group;
- the attention and MLP output projections split their input columns; their partial outputs are
  summed over the group before the (replicated) bias;
- the token embedding splits its vocabulary rows: each rank looks up the tokens it holds and the
  lookups are summed; the tied output layer gathers the rows for the loss.

Every rank of a group holds the same activations between the blocks, so the replicated parameters
(LayerNorms, position embedding, output biases) get the same gradient on each. The ranks of a group
are consecutive (rank = data-parallel index x size + index in the group), as in the DTensor mesh.
A parameter held in shards carries ``tp_shard`` (a Shard): the dimension it is split along and its group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpt.model import GPT, tied
from gpt.parallel.gradients import average_on_xla, average_over_group


@dataclass(frozen=True)
class Group:
    """This rank's tensor-parallel group: its index in the group and the group's size. ``replicas``
    lists every group of the world (XLA collectives name them all). On eager devices
    ``process_group`` is the group's torch.distributed group and ``replica_process_group`` that of
    the ranks holding the same parts as this one; on XLA both are None."""

    index: int
    size: int
    replicas: list[list[int]]
    lazy: bool
    process_group: dist.ProcessGroup | None = None
    replica_process_group: dist.ProcessGroup | None = None

    @property
    def data_parallel(self) -> list[list[int]]:
        """The groups of ranks that hold the same part of every parameter: one per index in a group."""
        return [list(ranks) for ranks in zip(*self.replicas)]

    def average_over_replicas(self, grads: list[torch.Tensor]) -> None:
        """Average the gradients in place over the ranks that hold the same parts."""
        if self.lazy:
            average_on_xla(grads, self.data_parallel)
            return
        if len(self.replicas) > 1:
            average_over_group(grads, self.replica_process_group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group, as a new tensor."""
        if self.lazy:
            import torch_xla.core.xla_model as xm
            return xm.all_reduce(xm.REDUCE_SUM, t, groups=self.replicas, pin_layout=False)
        out = t.clone()
        dist.all_reduce(out, group=self.process_group)
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """The group's tensors concatenated along dimension 0, in group order."""
        if self.lazy:
            import torch_xla.core.xla_model as xm
            return xm.all_gather(t, dim=0, groups=self.replicas, pin_layout=False)
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=self.process_group)
        return out


def new_group(rank: int, world_size: int, size: int, lazy: bool) -> Group:
    """This rank's group of ``size`` consecutive ranks. Every rank must call it, in the same order
    (it creates the eager devices' process groups)."""
    tp = [list(range(start, start + size)) for start in range(0, world_size, size)]
    group = Group(rank % size, size, tp, lazy)
    if lazy:
        return group
    mine = {}
    for kind, all_groups in (("process_group", tp), ("replica_process_group", group.data_parallel)):
        for ranks in all_groups:  # dist.new_group is collective: every rank creates every group
            created = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = created
    return dataclasses.replace(group, **mine)


@dataclass(frozen=True)
class Shard:
    """How a parameter is split: along ``dim``, one of ``group.size`` equal parts per rank."""

    dim: int
    group: Group

    def whole_shape(self, part: torch.Tensor) -> torch.Size:
        shape = list(part.shape)
        shape[self.dim] *= self.group.size
        return torch.Size(shape)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor."""
        return full.chunk(self.group.size, dim=self.dim)[self.group.index]

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole tensor from the group's parts (split along dimension 0); its gradient is this
        rank's rows of the whole gradient, which every rank of the group computes alike."""
        if self.dim != 0:
            raise ValueError("Shard.gather: only parameters split along dimension 0 are gathered")
        return _GatherRows.apply(part, self.group)


class _CopyToGroup(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: its gradient summed over the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_reduce(grad), None


class _SumOverGroup(torch.autograd.Function):
    """Forward: the partial outputs summed over the group. Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.rows = group, part.shape[0]
        return group.all_gather(part)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(0, ctx.group.index * ctx.rows, ctx.rows), None


class ColumnParallelLinear(nn.Module):
    """A Linear whose output features are split over the group; the output stays split."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features // group.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // group.size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)

    def shards(self) -> dict[str, int]:
        return {"weight": 0, "bias": 0} if self.bias is not None else {"weight": 0}


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the group; the output is whole on every rank."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = True) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _SumOverGroup.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def shards(self) -> dict[str, int]:
        return {"weight": 1}


class VocabParallelEmbedding(nn.Module):
    """An Embedding whose vocabulary rows are split over the group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group) -> None:
        super().__init__()
        self.group = group
        self.rows = num_embeddings // group.size
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.group.index * self.rows
        held = (local >= 0) & (local < self.rows)
        found = F.embedding(torch.where(held, local, 0), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return _SumOverGroup.apply(found, self.group)

    def shards(self) -> dict[str, int]:
        return {"weight": 0}


PARALLEL = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def apply(model: GPT, group: Group) -> None:
    """Replace the model's (meta) layers with their split versions; ``mark`` the parameters once
    they exist on the device."""
    config = model.config
    hidden, inner, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
    model.wte = VocabParallelEmbedding(model.vocab_size, hidden, group)
    for block in model.h.values():
        block.attn.qkv = ColumnParallelLinear(hidden, block.attn.qkv.out_features, group, bias)
        block.attn.c_proj = RowParallelLinear(hidden, hidden, group, bias)
        block.mlp.c_fc = ColumnParallelLinear(hidden, inner, group, bias)
        if block.mlp.c_gate is not None:
            block.mlp.c_gate = ColumnParallelLinear(hidden, inner, group, bias)
        block.mlp.c_proj = RowParallelLinear(inner, hidden, group, bias)
    if tied(config):
        model.lm_head.weight = model.wte.weight
    else:
        model.lm_head = ColumnParallelLinear(hidden, model.vocab_size, group, bias=False)
    model.whole_output = _gathered


def _gathered(weight: torch.Tensor) -> torch.Tensor:
    return weight.tp_shard.gather(weight)


def mark(model: nn.Module) -> None:
    """Give every split parameter its ``tp_shard``."""
    for module in model.modules():
        if isinstance(module, PARALLEL):
            for name, dim in module.shards().items():
                getattr(module, name).tp_shard = Shard(dim, module.group)


def sharded_names(model: nn.Module) -> dict[str, Shard]:
    """The model's split parameters by name, under each name of a tied one."""
    return {name: p.tp_shard for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "tp_shard")}
