"""Tensor parallelism as DTensor plans, on eager devices (CPU, CUDA, TorchNeuron): Megatron's split.

The fused q/k/v (group by group) and the MLP's first layer (and gate) split column-wise, the two
output projections row-wise, and the embedding by vocabulary rows; the output layer, tied or not,
holds vocabulary rows too and gathers them for the loss. A pipeline's last stage splits its copy of
the embedding the same way.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gpt.model import GPT, tied


def apply(model: GPT, tp_mesh: DeviceMesh) -> None:
    """Split a (meta) model's layers over ``tp_mesh``."""
    if model.wte is not None:
        parallelize_module(model, tp_mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        })
    if model.lm_head is not None and (model.wte is None or not tied(model.config)):
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel()})  # weight rows: Shard(0)
    for block in model.h.values():
        parallelize_module(block, tp_mesh, {
            "attn.qkv": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            **({"mlp.c_gate": ColwiseParallel()} if block.mlp.c_gate is not None else {}),
            "mlp.c_proj": RowwiseParallel(),
        })
    if model.wte is not None and model.lm_head is not None and tied(model.config):
        model.lm_head.weight = model.wte.weight  # both Shard(0) over the vocabulary: one tied parameter
    model.whole_output = _gathered


def _gathered(weight: torch.Tensor) -> torch.Tensor:
    return weight.full_tensor()
