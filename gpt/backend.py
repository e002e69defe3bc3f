"""What differs between CPU, CUDA and Trainium (torch-neuronx), behind one small interface.

The neuron path follows torch_xla's documented usage (XLA device, ``xm.optimizer_step`` which
all-reduces gradients across replicas, ``xm.mark_step`` to cut the lazy graph, bf16 through
``XLA_USE_BF16`` with stochastic rounding). It needs a Trainium host and has not run on the
machines this project is tested on.
"""
from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass

import torch

# Dense peak FLOP/s per device, from the vendors' data sheets, for MFU.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},   # SXM; PCIe is listed separately
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "trn1": {"bf16": 95e12, "fp16": 95e12, "fp32": 23.75e12},   # per NeuronCore-v2
    "trn2": {"bf16": 83.4e12, "fp16": 83.4e12, "fp32": 20.9e12},  # per NeuronCore-v3
}


@dataclass
class Backend:
    name: str              # "cpu" | "cuda" | "neuron"
    dist_backend: str      # torch.distributed backend
    mesh_device_type: str  # DeviceMesh device type

    def device(self, local_rank: int) -> torch.device:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)
            return torch.device("cuda", local_rank)
        if self.name == "neuron":
            import torch_xla.core.xla_model as xm
            return xm.xla_device()
        return torch.device("cpu")

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision == "fp32" or self.name == "neuron":  # neuron casts through XLA_USE_BF16
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.name, dtype=dtype)

    def fused_adamw(self) -> bool:
        return self.name == "cuda"

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.name == "neuron":
            import torch_xla.core.xla_model as xm
            xm.optimizer_step(optimizer)  # reduces gradients over replicas, then steps
        else:
            optimizer.step()

    def mark_step(self) -> None:
        """End of one iteration's lazy graph (neuron); nothing elsewhere."""
        if self.name == "neuron":
            import torch_xla.core.xla_model as xm
            xm.mark_step()

    def peak_flops(self, precision: str) -> float | None:
        """Peak FLOP/s of one device from PEAK_FLOPS, or None when unknown (CPU)."""
        if self.name == "cuda":
            name = torch.cuda.get_device_name()
            keys = sorted((k for k in PEAK_FLOPS if k in name), key=len, reverse=True)
            return PEAK_FLOPS[keys[0]][precision] if keys else None
        if self.name == "neuron":
            kind = "trn2" if "trn2" in os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "") else "trn1"
            return PEAK_FLOPS[kind][precision]
        return None

    def reset_peak_memory(self) -> None:
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Peak device memory since the last reset (CUDA) or the process's peak resident size (CPU)."""
        if self.name == "cuda":
            return torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def get_backend(device: str, precision: str = "fp32") -> Backend:
    """Resolve ``device`` ("auto" picks CUDA when present, then an XLA/Neuron device, then CPU)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "neuron" if _has_neuron() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'")
        return Backend("cuda", "nccl", "cuda")
    if device == "neuron":
        if not _has_neuron():
            raise RuntimeError("device='neuron' needs torch-neuronx (torch_xla); install it on a Trainium host")
        if precision == "bf16":
            # Must be set before torch_xla initialises its device.
            os.environ.setdefault("XLA_USE_BF16", "1")
            os.environ.setdefault("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1")
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process-group backend
        return Backend("neuron", "xla", "xla")
    return Backend("cpu", "gloo", "cpu")


def _has_neuron() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True
