"""The optimizer's parts, each small and separate: the learning-rate schedule (Megatron's warmup,
then cosine, linear or constant decay to min_lr), fp16's dynamic loss scaling, and AdamW with weight
decay on matrices only."""
from __future__ import annotations

import math

import torch
from torch import nn

from gpt.backend import Backend
from gpt.config import Config


def lr_at(config: Config, iteration: int) -> float:
    """Learning rate of the ``iteration``-th optimizer step (1-based).

    Scheduled by iterations, or by the samples consumed once this step is done
    (``iteration x global_batch_size``) when the run is given in samples.
    """
    if config.train_iters is not None:
        x, warmup, decay = iteration, config.lr_warmup_iters, config.lr_decay_iters
    else:
        x, warmup, decay = iteration * config.global_batch_size, config.lr_warmup_samples, config.lr_decay_samples
    if warmup > 0 and x <= warmup:
        return config.lr * x / warmup
    if config.lr_decay_style == "constant":
        return config.lr
    if x >= decay:
        return config.min_lr
    ratio = (x - warmup) / (decay - warmup)
    if config.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_lr + coeff * (config.lr - config.min_lr)


# -- fp16 dynamic loss scaling ---------------------------------------------------------------
class LossScaler:
    """Dynamic loss scale for fp16: halve on a non-finite gradient, double after ``growth_interval``
    good steps. Kept on the device and decided from the global gradient norm, so all ranks agree
    without a host read. Scale 1 for bf16/fp32."""

    def __init__(self, enabled: bool, device: torch.device | str = "cpu", initial: float = 2.0 ** 16,
                 growth_interval: int = 1000) -> None:
        self.enabled = enabled
        self.scale = torch.tensor(initial if enabled else 1.0, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_interval = growth_interval

    def update(self, finite: torch.Tensor) -> None:
        if not self.enabled:
            return
        good = torch.where(finite, self.good_steps + 1, 0)
        grown = torch.where(good % self.growth_interval == 0, self.scale * 2.0, self.scale)
        self.scale = torch.where(finite, grown, torch.clamp(self.scale / 2.0, min=1.0))
        self.good_steps = good

    def load(self, scale: float, good_steps: int) -> None:
        if not self.enabled:  # a run that trained in fp16 before goes on in bf16 or fp32 without a scale
            return
        self.scale = torch.full_like(self.scale, scale)
        self.good_steps = torch.full_like(self.good_steps, good_steps)


def build_optimizer(model: nn.Module, config: Config, backend: Backend) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices (weights, embeddings) only, never on biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return backend.optimizer(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
