"""Training-step throughput of one model on one device, printed as JSON.

    python -m gpt.bench --model gpt3-125m --micro-batch 8 --steps 20 --compile --compare-eager

Times full training steps (forward, backward, clip, AdamW) on random tokens after untimed warmup
steps (which include compilation); reports the median step. ``--compare-eager`` times an eager and
a compiled copy of the model in the same process, alternating their steps, and reports the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from gpt.backend import get_backend
from gpt.config import Config
from gpt.distributed import DistEnv, build_model
from gpt.metrics import flops_per_token, mfu
from gpt.model import param_count
from gpt.train import LossScaler, build_optimizer, train_step


class _Bench:
    """One model, optimizer and fixed batch of random tokens, ready to time training steps."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.backend = get_backend(config.device, config.precision)
        device = self.backend.device(0)
        torch.manual_seed(config.seed)
        self.model = build_model(config, DistEnv(0, 1, 0, None), device)
        self.optimizer = build_optimizer(self.model, config, self.backend)
        self.scaler = LossScaler(config.precision == "fp16")
        mb, seq = config.micro_batch_size, config.seq_length
        tokens = torch.randint(0, config.vocab_size, (config.global_batch_size // mb, mb, seq + 1), device=device)
        self.batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        self.times: list[float] = []
        self.loss = float("nan")
        self.warmup_s = 0.0

    def step(self) -> float:
        t = time.perf_counter()
        loss, _, _ = train_step(self.model, self.optimizer, self.batches, backend=self.backend,
                                precision=self.config.precision, clip_grad=self.config.clip_grad, scaler=self.scaler)
        self.loss = float(loss)  # waits for the device
        return time.perf_counter() - t

    def warmup(self, steps: int) -> None:
        self.warmup_s = sum(self.step() for _ in range(steps))

    def result(self) -> dict[str, Any]:
        c = self.config
        step_s = statistics.median(self.times)
        tokens_per_s = c.global_batch_size * c.seq_length / step_s
        peak = c.peak_flops or self.backend.peak_flops(c.precision)
        return {"compile": c.compile, "tokens_per_s": tokens_per_s, "step_time_ms": 1000 * step_s,
                "step_time_ms_mean": 1000 * statistics.fmean(self.times),
                "mfu": mfu(tokens_per_s, flops_per_token(c, param_count(c)), peak, 1),
                "warmup_s": self.warmup_s, "final_loss": self.loss}


def run(model: str = "tiny", micro_batch: int = 8, steps: int = 10, warmup: int = 3, grad_accum: int = 1,
        seq_length: int | None = None, vocab_size: int = 50257, device: str = "auto", precision: str | None = None,
        compile: bool = False, compare_eager: bool = False, activation_checkpointing: bool = False,
        peak_flops: float | None = None) -> dict[str, Any]:
    """Benchmark ``model``; with ``compare_eager`` the result holds "eager", "compiled" and their ratio.

    Comparing, both models are built and warmed up first, then their timed steps alternate, so a
    busy machine slows both alike.
    """
    backend = get_backend(device)
    precision = precision or ("fp32" if backend.name == "cpu" else "bf16")
    config = Config(model=model, micro_batch_size=micro_batch, global_batch_size=micro_batch * grad_accum,
                    seq_length=seq_length, vocab_size=vocab_size, device=backend.name, precision=precision,
                    compile=compile, activation_checkpointing=activation_checkpointing, peak_flops=peak_flops,
                    mock_data=True)
    config.validate(1)
    result: dict[str, Any] = {
        "model": model, "params": param_count(config), "device": _device_name(backend.name),
        "precision": precision, "micro_batch": micro_batch, "grad_accum": grad_accum,
        "seq_length": config.seq_length, "steps": steps, "warmup": warmup, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    configs = [Config(**{**config.to_dict(), "compile": c}) for c in (False, True)] if compare_eager else [config]
    backend.reset_peak_memory()
    benches = [_Bench(c) for c in configs]
    for b in benches:
        b.warmup(warmup)
    for _ in range(steps):
        for b in benches:
            b.times.append(b.step())
    result.update(peak_memory_bytes=backend.peak_memory_bytes(),  # all models of the run together
                  peak_memory_kind="cuda_max_allocated" if backend.name == "cuda" else "process_max_rss")
    if not compare_eager:
        return {**result, **benches[0].result()}
    eager, compiled = (b.result() for b in benches)
    return {**result, "eager": eager, "compiled": compiled,
            "compiled_vs_eager_tokens_per_s": compiled["tokens_per_s"] / eager["tokens_per_s"]}


def _device_name(kind: str) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name()
    return kind


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "neuron"])
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default: bf16 on accelerators, fp32 on CPU")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compare-eager", action="store_true", help="measure eager and compiled in one run")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s of the device, for MFU where the table has none")
    a = p.parse_args(argv)
    print(json.dumps(run(model=a.model, micro_batch=a.micro_batch, steps=a.steps, warmup=a.warmup,
                         grad_accum=a.grad_accum, seq_length=a.seq_length, vocab_size=a.vocab_size, device=a.device,
                         precision=a.precision, compile=a.compile, compare_eager=a.compare_eager,
                         activation_checkpointing=a.activation_checkpointing, peak_flops=a.peak_flops), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
