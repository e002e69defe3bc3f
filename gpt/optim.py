"""The optimizer's parts, each small and separate: the learning-rate schedule (Megatron's warmup,
then cosine, linear or constant decay to min_lr, or WSD: stable, then a decay over the schedule's
last stretch), fp16's dynamic loss scaling, and AdamW with weight
decay on matrices only: the one each device steps best (torch_xla's sync-free AdamW on XLA, torch's
fused AdamW on accelerators, its foreach AdamW on CPU), whose step is skipped on a device-side flag."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gpt.backend import Backend
from gpt.config import Config


def lr_at(config: Config, iteration: int) -> float:
    """Learning rate of the ``iteration``-th optimizer step (1-based).

    Scheduled by iterations, or by the samples consumed once this step is done
    (``iteration x global_batch_size``, fewer during a batch-size ramp-up) when the run is given in samples.
    """
    if config.train_iters is not None:
        x, warmup, decay, wsd = iteration, config.lr_warmup_iters, config.lr_decay_iters, config.lr_wsd_decay_iters
    else:
        x, warmup, decay, wsd = (config.samples_after(iteration), config.lr_warmup_samples,
                                 config.lr_decay_samples, config.lr_wsd_decay_samples)
    if warmup > 0 and x <= warmup:
        return config.lr * x / warmup
    if config.lr_decay_style == "constant":
        return config.lr
    if x >= decay:
        return config.min_lr
    if config.lr_decay_style == "WSD":        # stable until the last ``wsd`` of the decay
        style, ratio = config.lr_wsd_decay_style, max(0.0, (x - (decay - wsd)) / wsd)
    else:
        style, ratio = config.lr_decay_style, (x - warmup) / (decay - warmup)
    return config.min_lr + _DECAYS[style](ratio) * (config.lr - config.min_lr)


# The share of (lr - min_lr) left at ``ratio`` of a decay, by its shape (Megatron's names).
_DECAYS = {
    "linear": lambda ratio: 1.0 - ratio,
    "cosine": lambda ratio: 0.5 * (1.0 + math.cos(math.pi * ratio)),
    "exponential": lambda ratio: 2.0 * 0.5 ** ratio - 1.0,
    "minus_sqrt": lambda ratio: 1.0 - math.sqrt(ratio),
}


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
    return _adamw(groups, backend, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


def optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, backend: Backend) -> None:
    """One optimizer step, or none where ``found_inf`` (a 0-dim float tensor) is 1: parameters
    and optimizer state stay as they were. The flag is read on the device, or on the CPU, which
    is the host (reading it waits for nothing there)."""
    if backend.lazy:
        optimizer.step(found_inf=found_inf)
        return
    if not backend.kind.fused_adamw:
        if not found_inf.item():
            optimizer.step()
        return
    from torch.distributed.tensor.experimental import implicit_replication

    optimizer.found_inf = found_inf  # torch's fused AdamW skips on it, as under GradScaler
    try:
        with implicit_replication():  # tensor parallel: sharded and replicated parameters in one call
            optimizer.step()
    finally:
        del optimizer.found_inf


def _adamw(groups: list[dict[str, Any]], backend: Backend, *, lr: float, betas: tuple[float, float],
           eps: float) -> torch.optim.Optimizer:
    """AdamW that ``optimizer_step`` can skip on a device-side flag: torch_xla's sync-free AdamW on XLA,
    torch's fused AdamW on accelerators, torch's foreach AdamW on CPU (as it always trained)."""
    if backend.lazy:
        from torch_xla.amp.syncfree import AdamW

        for group in groups:
            for param in group["params"]:
                # A parameter made by to_empty and written by copy_ (weight init) is updated by
                # the sync-free step out of sight: give it storage of its own first.
                param.data = param.data.clone()
        optimizer = AdamW(groups, lr=lr, betas=betas, eps=eps)
        _create_state(optimizer)
        optimizer.register_load_state_dict_post_hook(_state_to_parameter_device)
        return optimizer
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=backend.kind.fused_adamw or None)


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the sync-free optimizer's state with a skipped step, so that a checkpoint loads into
    its layout (loading into an empty optimizer would make torch's own step create another one)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step(found_inf=torch.ones((), device=params[0].device))
    for p in params:
        p.grad = None


def _state_to_parameter_device(optimizer: torch.optim.Optimizer) -> None:
    """torch loads the step counts to the host; the sync-free optimizer keeps them with the parameter."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(param.device)
