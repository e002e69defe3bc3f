"""Peak memory and time of the output layer + cross-entropy, forward and backward: the chunked
loss (gpt.model.linear_cross_entropy) against the full-logits path it replaced, in the same run.

    python -m benchmarks.loss [--tokens 4096] [--hidden 768] [--vocab N] [--device cpu]

Peak memory is what the loss held above its inputs (CUDA: tensors allocated by torch; CPU: the
process's resident set, its high-water mark restarted first), the gradients of x and the weight
included in both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gpt.backend import Backend, get_backend
from gpt.bench import release_memory
from gpt.model import default_chunk_tokens, linear_cross_entropy
from gpt.tokenizer import GPT2_VOCAB_SIZE


def _full_logits(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int) -> torch.Tensor:
    return F.cross_entropy((x @ weight.t())[:, :vocab].float(), targets)


def _measure(loss_fn: Callable[..., torch.Tensor], inputs: tuple, backend: Backend, precision: str) -> tuple[int, float]:
    x, weight, targets, vocab = inputs
    release_memory(backend)
    before = backend.memory_in_use_bytes()
    backend.reset_peak_memory()
    start = time.perf_counter()
    with backend.autocast(precision):
        loss = loss_fn(x, weight, targets, vocab)
    loss.backward()
    float(loss.detach())  # waits for the device
    elapsed = time.perf_counter() - start
    peak = backend.peak_memory_bytes() - before
    x.grad = weight.grad = None
    return peak, elapsed


def run(tokens: int = 4096, hidden: int = 768, vocab: int = GPT2_VOCAB_SIZE, padded_vocab: int | None = None,
        device: str = "cpu", precision: str = "fp32", repeats: int = 3, chunk_tokens: int | None = None) -> dict[str, Any]:
    """Both paths ``repeats`` times, alternating; the largest peak and the median time of each.
    ``chunk_tokens``: tokens per chunk of the chunked loss (default: its own choice)."""
    backend = get_backend(device)
    on = backend.device(0)
    padded = padded_vocab or -(-vocab // 128) * 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(on).requires_grad_()
    weight = (0.02 * torch.randn(padded, hidden, generator=g)).to(on).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(on)
    inputs = (x, weight, targets, vocab)
    paths = {"full_logits": _full_logits,
             "chunked": lambda *args: linear_cross_entropy(*args, chunk_tokens=chunk_tokens)}
    peaks: dict[str, list[int]] = {name: [] for name in paths}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            peak, elapsed = _measure(fn, inputs, backend, precision)
            peaks[name].append(peak)
            times[name].append(elapsed)
    result: dict[str, Any] = {
        "tokens": tokens, "hidden": hidden, "vocab": vocab, "padded_vocab": padded, "device": device,
        "chunk_tokens": chunk_tokens or default_chunk_tokens(padded),
        "precision": precision, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "fp32_logits_bytes": tokens * padded * 4,
        "peak_memory_kind": "process_rss" if backend.name == "cpu" else "allocated",
    }
    for name in paths:
        result[name] = {"peak_memory_bytes": max(peaks[name]), "time_ms": 1000 * statistics.median(times[name])}
    result["chunked_vs_full_peak_memory"] = result["chunked"]["peak_memory_bytes"] / result["full_logits"]["peak_memory_bytes"]
    result["chunked_vs_full_time"] = result["chunked"]["time_ms"] / result["full_logits"]["time_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the micro-batch (batch x sequence)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=GPT2_VOCAB_SIZE)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-tokens", type=int, help="tokens per chunk of the chunked loss")
    a = p.parse_args(argv)
    print(json.dumps(run(a.tokens, a.hidden, a.vocab, device=a.device, precision=a.precision, repeats=a.repeats,
                         chunk_tokens=a.chunk_tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
