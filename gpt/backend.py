"""What differs between devices: one table of names (DEVICES) behind one small interface (Backend).

Eager devices differ only in the names of the table: CPU, CUDA, and Trainium through TorchNeuron,
the native ``neuron`` device of PyTorch 2.13+ on Trn2/Trn3 (its own process-group and
torch.compile backends, DDP, FSDP2 and DTensor as on CUDA). The code reaches them through
``torch.accelerator`` and device-type strings; TorchNeuron has not run on the machines this
project is tested on.

Each device's compiler keeps its graphs in ``Config.compile_cache_dir`` on shared storage:
torch.compile's (inductor and triton, plus the artifacts the precompile run saved) or, on Trainium,
the Neuron compiler's per-node cache (``use_compile_cache``, ``save_compile_cache``).

The lazy XLA device is Trainium through torch-neuronx 2.x on torch_xla (Trn1), and XLA:CPU in CI.
Each training step is traced into one graph cut by ``torch_xla.sync()``; gradients are all-reduced
explicitly before the norm, the optimizer is torch_xla's sync-free AdamW, and the graphs come from
that trace (``neuron_parallel_compile`` on Trainium), not from torch.compile.
"""
from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpt.config import Config
from gpt.files import write_atomic

# Dense peak FLOP/s per device, from the vendors' data sheets, for MFU.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},   # SXM; PCIe is listed separately
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "trn1": {"bf16": 95e12, "fp16": 95e12, "fp32": 23.75e12},   # per NeuronCore-v2
    "trn2": {"bf16": 83.4e12, "fp16": 83.4e12, "fp32": 20.9e12},  # per NeuronCore-v3
}


def names_device(text: str, name: str) -> bool:
    """Whether ``text`` (a device's full name) names the device ``name``: a whole word, any case."""
    return re.search(rf"\b{re.escape(name)}\b", text, re.IGNORECASE) is not None


def peak_flops(device: str | None, precision: str) -> float | None:
    """PEAK_FLOPS of the device a name names (a device's full name such as "NVIDIA H100 80GB HBM3",
    or an accelerator such as "h100": whole words, any case, the longest entry first) at
    ``precision``; fp8 counts against the bf16 peak. None when no entry matches."""
    precision = "bf16" if precision == "fp8" else precision
    names = sorted((n for n in PEAK_FLOPS if names_device(device or "", n)), key=len, reverse=True)
    return PEAK_FLOPS[names[0]].get(precision) if names else None


@dataclass(frozen=True)
class DeviceKind:
    """The names by which one kind of device differs from the others."""

    device_type: str              # torch.device type, also autocast's and DeviceMesh's
    dist_backend: str             # torch.distributed backend
    compile_backend: str | None   # torch.compile backend; None where graphs come from the lazy trace
    fused_adamw: bool             # torch's fused AdamW, which skips a step on a device-side flag
    scalar_dtype: torch.dtype     # of the scalar arithmetic on the device (clip coefficient): float64
                                  # as Python computes it, where the device has it (Trainium has not)
    peak: str | None              # PEAK_FLOPS row; None: by the device's product name (CUDA), or unknown


# Keyed by torch device type. Config.device "neuron" is TorchNeuron where PyTorch has the native
# device, else torch-neuronx on torch_xla.
DEVICES: dict[str, DeviceKind] = {
    "cpu": DeviceKind("cpu", "gloo", "inductor", False, torch.float64, None),
    "cuda": DeviceKind("cuda", "nccl", "inductor", True, torch.float64, None),
    "neuron": DeviceKind("neuron", "neuron", "neuron", True, torch.float32, "trn2"),
    "xla": DeviceKind("xla", "xla", None, False, torch.float32, "trn1"),
}


@dataclass(frozen=True)
class Backend:
    name: str          # Config.device: "cpu" | "cuda" | "neuron"
    kind: DeviceKind

    @property
    def lazy(self) -> bool:
        """XLA lazy tensors: work is traced and runs as one graph per ``sync``."""
        return self.kind.device_type == "xla"

    def device(self, local_rank: int) -> torch.device:
        if self.lazy:
            import torch_xla
            return torch_xla.device()
        if self.kind.device_type == "cpu":
            return torch.device("cpu")
        torch.accelerator.set_device_index(local_rank)
        return torch.device(self.kind.device_type, local_rank)

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16  # fp8: float8 linears inside bf16
        return torch.autocast(self.kind.device_type, dtype=dtype)

    def sync(self) -> None:
        """End of one step's lazy graph: it runs now (XLA); nothing elsewhere."""
        if self.lazy:
            import torch_xla
            torch_xla.sync()

    def to_host(self, data: Any) -> Any:
        """``data`` (tensors in any nesting of lists and dicts) with its XLA tensors copied to the
        host in one transfer; eager devices' tensors are left where they are."""
        if not self.lazy:
            return data
        import torch_xla.core.xla_model as xm
        return xm._maybe_convert_to_cpu(data)

    def read(self, values: list[torch.Tensor]) -> list[float]:
        """Scalars from the device as Python floats: one wait for the device, one transfer."""
        if not values:
            return []
        if self.lazy:
            return [float(v) for v in self.to_host(values)]
        return torch.stack([v.float() for v in values]).tolist()

    def peak_flops(self, precision: str) -> float | None:
        """Peak FLOP/s of one device from PEAK_FLOPS, or None when unknown (CPU). An fp8 run is
        measured against the bf16 peak, so that its MFU compares with a bf16 run's."""
        if self.kind.peak is not None:
            return peak_flops(self.kind.peak, precision)
        if self.kind.device_type == "cpu":
            return None
        return peak_flops(torch.get_device_module(self.kind.device_type).get_device_name(), precision)

    def memory_in_use_bytes(self) -> int:
        """Device memory held by tensors now (accelerators), or the process's resident size."""
        if self._accelerator():
            return torch.accelerator.memory_allocated()
        return _status_bytes("VmRSS")

    def reset_peak_memory(self) -> None:
        """Restart the peak that ``peak_memory_bytes`` reports (on the host: the resident set's
        high-water mark, through /proc/self/clear_refs)."""
        if self._accelerator():
            torch.accelerator.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")

    def peak_memory_bytes(self) -> int:
        """Peak device memory since the last reset (accelerators), or the process's peak resident size."""
        if self._accelerator():
            return torch.accelerator.max_memory_allocated()
        return _status_bytes("VmHWM")

    def _accelerator(self) -> bool:
        return self.kind.device_type not in ("cpu", "xla")


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (Linux), else the peak resident size getrusage reports."""
    with contextlib.suppress(OSError, StopIteration):
        line = next(row for row in Path("/proc/self/status").read_text().splitlines() if row.startswith(field + ":"))
        return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def get_backend(device: str) -> Backend:
    """Resolve ``device`` ("auto" picks an accelerator when present, then an XLA device, then CPU)."""
    if device == "auto":
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = ("neuron" if accelerator.type == "neuron" else "cuda") if accelerator is not None else \
            "neuron" if _has_torch_xla() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'")
        return Backend("cuda", DEVICES["cuda"])
    if device == "neuron":
        return Backend("neuron", _neuron_kind())
    return Backend("cpu", DEVICES["cpu"])


def _neuron_kind() -> DeviceKind:
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == "neuron":
        return DEVICES["neuron"]
    if _has_torch_xla():
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" process-group backend
        return DEVICES["xla"]
    raise RuntimeError("device='neuron' needs torch-neuronx: the native neuron device (PyTorch 2.13+, Trn2/Trn3) "
                       "or torch_xla (Trn1); install it on a Trainium host")


def _has_torch_xla() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def use_compile_cache(config: Config, backend: Backend, rank: int) -> bool:
    """Point the compilers at ``compile_cache_dir`` and preload saved artifacts. Returns True on a hit."""
    if not config.compile_cache_dir:
        return False
    root = Path(config.compile_cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    if backend.name == "neuron":
        # One cache per node (the Neuron cache's file locks are unreliable on NFS); a launcher that
        # already passed --cache_dir in NEURON_CC_FLAGS chose the same <root>/<node> layout.
        node_cache = root / (os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])
        flags = os.environ.get("NEURON_CC_FLAGS", "")
        if "--cache_dir" not in flags:
            os.environ["NEURON_CC_FLAGS"] = f"{flags} --cache_dir={node_cache}".strip()
        return any(node_cache.glob("**/*.neff"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    artifacts = root / f"artifacts-rank{rank}.bin"
    if artifacts.exists():
        torch.compiler.load_cache_artifacts(artifacts.read_bytes())
        return True
    return False


def save_compile_cache(config: Config, rank: int) -> None:
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    write_atomic(Path(config.compile_cache_dir) / f"artifacts-rank{rank}.bin", saved[0])
