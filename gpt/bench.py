"""Training-step throughput of one model on one device, printed as JSON.

    python -m gpt.bench --model gpt3-125m --micro-batch 8 --steps 20 --compile --compare-eager --peer
    python -m gpt.bench --model gpt3-1.3b --precision fp8 --compile --find-micro-batch

Times full training steps (forward, backward, clip, AdamW) on random tokens after untimed warmup
steps (which include compilation); reports the median step. Every row reports its peak memory: the
most that building the model and its warmup steps held above what was in use before (CUDA: tensors
allocated by torch; CPU: the process's resident set, its high-water mark restarted first).

``--compare-eager`` adds our eager model as a row and ``--peer`` HuggingFace's GPT2LMHeadModel of
the same shape (SDPA attention, compiled when ours is, fused AdamW on CUDA, bf16 where ours is fp8).
Their timed steps alternate with ours, so a busy machine slows all alike; the JSON holds the ratios
ours/eager and ours/HF. ``--find-micro-batch`` first looks for the largest micro-batch that fits,
doubling from ``--micro-batch`` while it fits and halving while it does not (out of memory on CUDA,
over ``--memory-cap-gib`` anywhere), then measures at that size. ``--profile DIR`` then records a few
more steps of our row with torch.profiler: DIR/trace.json.gz (chrome://tracing, Perfetto) and, in the
JSON, the device's busy share of the wall time and its time per step by kind of kernel.

``--pp N`` adds a "pipeline" row: the same model and batch in N pipeline stages, one process per
stage (gloo ranks sharing the CPU's threads equally, or one GPU each), timed after our one-process
row. It reports tokens/s, the schedule's bubble fraction and each stage's peak memory.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from gpt.backend import Backend, get_backend
from gpt.config import Config
from gpt.metrics import flops_per_token, mfu
from gpt.model import param_count
from gpt.optim import LossScaler, build_optimizer
from gpt.parallel.build import build_model, compile_scope
from gpt.parallel.dims import ParallelDims
from gpt.parallel.pipeline import Pipeline, bubble_fraction, build_pipeline
from gpt.parallel.process_group import free_port, gather_objects, init_distributed, shutdown
from gpt.tokenizer import GPT2_VOCAB_SIZE
from gpt.train import train_step


class _Row:
    """One model, its optimizer and a fixed batch of random tokens, ready to time training steps."""

    devices = 1

    def __init__(self, config: Config, backend: Backend, local_rank: int = 0) -> None:
        self.config = config
        self.backend = backend
        self.device = backend.device(local_rank)
        release_memory(backend)
        self._memory_before = backend.memory_in_use_bytes()
        backend.reset_peak_memory()
        torch.manual_seed(config.seed)
        self.model = self.build()
        self.optimizer = build_optimizer(self.model, config, backend)
        mb, seq = config.micro_batch_size, config.seq_length
        tokens = torch.randint(0, config.vocab_size, (config.global_batch_size // mb, mb, seq + 1), device=self.device)
        self.batches = [(t[:, :-1], t[:, 1:], None) for t in tokens]
        self.times: list[float] = []
        self.loss = float("nan")
        self.warmup_s = 0.0
        self.peak_memory = 0

    def build(self) -> nn.Module:
        raise NotImplementedError

    def train_step(self) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> float:
        t = time.perf_counter()
        self.loss = float(self.train_step())  # waits for the device
        return time.perf_counter() - t

    def warmup(self, steps: int) -> None:
        """``steps`` untimed steps (at least one); the row's peak memory is taken over them."""
        self.warmup_s = sum(self.step() for _ in range(max(1, steps)))
        self.peak_memory = self.backend.peak_memory_bytes() - self._memory_before

    def result(self) -> dict[str, Any]:
        c = self.config
        step_s = statistics.median(self.times)
        tokens_per_s = c.global_batch_size * c.seq_length / step_s
        peak = c.peak_flops or self.backend.peak_flops(c.precision)
        return {"compile": c.compile, "tokens_per_s": tokens_per_s, "step_time_ms": 1000 * step_s,
                "step_time_ms_mean": 1000 * statistics.fmean(self.times),
                "mfu": mfu(tokens_per_s, flops_per_token(c, param_count(c)), peak, self.devices),
                "peak_memory_bytes": self.peak_memory, "warmup_s": self.warmup_s, "final_loss": self.loss}


class _Ours(_Row):
    def __init__(self, config: Config, backend: Backend, env: ParallelDims | None = None) -> None:
        self.env = env or ParallelDims(0, 1, 0, None)
        self.pipeline: Pipeline | None = None
        self.scaler = LossScaler(config.precision == "fp16", backend.device(self.env.local_rank))
        super().__init__(config, backend, self.env.local_rank)

    def build(self) -> nn.Module:
        return build_model(self.config, self.env, self.device)

    def train_step(self) -> torch.Tensor:
        loss, _, _ = train_step(self.model, self.optimizer, self.batches, backend=self.backend,
                                precision=self.config.precision, clip_grad=self.config.clip_grad, scaler=self.scaler,
                                pipeline=self.pipeline)
        return loss

    def result(self) -> dict[str, Any]:
        scope = compile_scope(self.config, self.device, self.env.world_size) if self.config.compile else None
        return {**super().result(), "compile_scope": scope}


class _Pipelined(_Ours):
    """This rank's stages of the model in ``config.pipeline_parallel`` stages, and its schedule."""

    def __init__(self, config: Config, backend: Backend, env: ParallelDims) -> None:
        self.devices = config.pipeline_parallel
        super().__init__(config, backend, env)

    def build(self) -> nn.Module:
        self.pipeline = build_pipeline(self.config, self.env, self.device)
        return self.pipeline.model

    def result(self) -> dict[str, Any]:
        c = self.config
        n = c.global_batch_size // c.micro_batch_size
        return {**super().result(), "pipeline_parallel": c.pipeline_parallel, "schedule": c.pipeline_schedule,
                "virtual_pipeline_stages": c.virtual_pipeline_stages, "micro_batches": n,
                "bubble_fraction": bubble_fraction(c.pipeline_schedule, c.pipeline_parallel,
                                                   c.virtual_pipeline_stages, n)}


class _HuggingFace(_Row):
    """transformers' GPT2LMHeadModel of our shape, trained the way its users do: loss from ``labels``,
    clip, AdamW with our parameter groups."""

    def build(self) -> nn.Module:
        import transformers

        c = self.config
        hf = transformers.GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
                                     n_layer=c.num_layers, n_head=c.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(hf).to(self.device)
        if c.compile:
            model.compile()
        return model

    def train_step(self) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for x, _, _ in self.batches:
            with self.backend.autocast(self.config.precision):
                loss = self.model(input_ids=x, labels=x).loss / len(self.batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def run(model: str = "tiny", micro_batch: int = 8, steps: int = 10, warmup: int = 3, grad_accum: int = 1,
        seq_length: int | None = None, vocab_size: int = GPT2_VOCAB_SIZE, device: str = "auto", precision: str | None = None,
        compile: bool = False, compile_scope: str = "auto", compare_eager: bool = False, peer: bool = False,
        activation_checkpointing: bool = False, activation_checkpointing_scope: str = "block",
        fp8_recipe: str = "tensorwise", fp8_layers: str = "all", find_micro_batch: bool = False, memory_cap_gib: float | None = None,
        peak_flops: float | None = None, profile_dir: str | None = None, profile_steps: int = 3,
        pipeline_parallel: int = 1, pipeline_schedule: str = "1f1b", virtual_pipeline_stages: int = 1) -> dict[str, Any]:
    """Benchmark ``model``: our row's figures at the top level; with ``compare_eager`` an "eager" row,
    with ``peer`` an "hf" row, with ``pipeline_parallel`` > 1 a "pipeline" row, and our tokens/s over
    theirs. Compiling with ``compare_eager``, our row is the compiled model."""
    backend = get_backend(device)
    precision = precision or ("fp32" if backend.name == "cpu" else "bf16")
    config = Config(model=model, micro_batch_size=micro_batch, global_batch_size=micro_batch * grad_accum,
                    seq_length=seq_length, vocab_size=vocab_size, device=backend.name, precision=precision,
                    fp8_recipe=fp8_recipe, fp8_layers=fp8_layers, compile=compile or compare_eager, compile_scope=compile_scope,
                    activation_checkpointing=activation_checkpointing,
                    activation_checkpointing_scope=activation_checkpointing_scope, peak_flops=peak_flops, mock_data=True)
    config.validate(1)
    staged = dataclasses.replace(config, pipeline_parallel=pipeline_parallel, pipeline_schedule=pipeline_schedule,
                                 virtual_pipeline_stages=virtual_pipeline_stages)
    if pipeline_parallel > 1:
        check_stages(staged, backend)
    result: dict[str, Any] = {
        "model": model, "params": param_count(config), "device": _device_name(backend.name), "precision": precision,
        **({"fp8_recipe": fp8_recipe, "fp8_layers": fp8_layers} if precision == "fp8" else {}),
        "grad_accum": grad_accum, "seq_length": config.seq_length, "steps": steps, "warmup": max(1, warmup),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "peak_memory_kind": "cuda_allocated" if backend.name == "cuda" else "process_rss",
    }
    if find_micro_batch:
        cap = None if memory_cap_gib is None else int(memory_cap_gib * 2 ** 30)
        search = search_micro_batch(config, backend, cap)
        result["micro_batch_search"] = search
        config = dataclasses.replace(config, micro_batch_size=search["largest"],
                                     global_batch_size=search["largest"] * grad_accum)
        staged = dataclasses.replace(staged, micro_batch_size=config.micro_batch_size,
                                     global_batch_size=config.global_batch_size)
    result["micro_batch"] = config.micro_batch_size
    rows = _rows(config, backend, compare_eager, peer, result)
    _measure(list(rows.values()), warmup, steps)
    if profile_dir:
        result["profile"] = profile(rows["ours"], profile_steps, profile_dir)
        # the profiler slows the host: the device's busy time over the unprofiled step is the share that counts
        result["profile"]["device_busy_of_timed_step"] = (result["profile"]["device_busy_ms_per_step"]
                                                          / (1000 * statistics.median(rows["ours"].times)))
    measured = {name: row.result() for name, row in rows.items()}
    if pipeline_parallel > 1:
        del rows  # the one-process rows' memory goes before the stages start
        release_memory(backend)
        measured["pipeline"] = measure_pipeline(staged, backend, warmup, steps)
    result.update(measured.pop("ours"))
    for name, row in measured.items():
        result[name] = row
        result[f"ours_vs_{name}_tokens_per_s"] = result["tokens_per_s"] / row["tokens_per_s"]
    return result


def _rows(config: Config, backend: Any, compare_eager: bool, peer: bool, result: dict[str, Any]) -> dict[str, _Row]:
    """What is measured side by side: our model, and as asked the eager one and HuggingFace's (said
    as skipped in ``result`` where transformers is missing)."""
    rows: dict[str, _Row] = {"ours": _Ours(config, backend)}
    if compare_eager:
        rows["eager"] = _Ours(dataclasses.replace(config, compile=False), backend)
    if peer and _has_transformers():
        rows["hf"] = _HuggingFace(dataclasses.replace(config, precision="bf16" if config.precision == "fp8"
                                                      else config.precision), backend)
    elif peer:
        result["hf"] = {"skipped": "transformers is not importable (pip install transformers)"}
    return rows


def _measure(rows: list[_Row], warmup: int, steps: int) -> None:
    """Warm every row up in turn (its peak memory taken alone), then alternate their timed steps."""
    for row in rows:
        row.warmup(warmup)
    for _ in range(steps):
        for row in rows:
            row.times.append(row.step())


def check_stages(config: Config, backend: Backend) -> None:
    """What the pipeline row needs, checked before any row is measured: a layout that divides (the
    message names the field) and a device per stage."""
    pp = config.pipeline_parallel
    config.validate(pp)
    if backend.name not in ("cpu", "cuda"):
        raise ValueError(f"pipeline_parallel={pp} (--pp): the benchmark starts its stages on cpu or cuda only")
    if backend.name == "cuda" and torch.cuda.device_count() < pp:
        raise ValueError(f"pipeline_parallel={pp} (--pp) needs {pp} GPUs, one per stage; "
                         f"this machine has {torch.cuda.device_count()}")


def measure_pipeline(config: Config, backend: Backend, warmup: int, steps: int) -> dict[str, Any]:
    """The pipeline row, measured by ``config.pipeline_parallel`` processes started here: gloo ranks
    on the CPU, each with its share of this process's threads, or NCCL ranks on one GPU each."""
    pp = config.pipeline_parallel
    threads = max(1, torch.get_num_threads() // pp)
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_pipeline_rank, args=(pp, free_port(), threads, config, backend.name, warmup, steps, results),
                       nprocs=pp, start_method="spawn")
    return results.get()


def _pipeline_rank(rank: int, pp: int, port: int, threads: int, config: Config, device: str, warmup: int,
                   steps: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(pp), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    backend = get_backend(device)
    env = init_distributed(backend, 1, pp_size=pp)
    try:
        row = _Pipelined(config, backend, env)
        _measure([row], warmup, steps)
        result = row.result()
        peaks = gather_objects(row.peak_memory)
        losses = gather_objects(row.loss)
    except BaseException:
        shutdown(finished=False)    # at once: the other stages may wait for this one in a send
        raise
    shutdown(finished=True)
    if rank == 0:  # the step times agree (the schedule joins the stages); the loss is the last stage's
        results.put({**result, "threads_per_stage": threads, "final_loss": losses[-1],
                     "peak_memory_bytes": max(peaks), "peak_memory_bytes_per_stage": peaks})


# Kernel names by what they do, first match wins (cuBLAS/CUTLASS GEMMs, SDPA's flash/efficient kernels,
# the fused optimizer, Inductor's generated Triton kernels).
KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "splitk", "triton_tem")),
                ("optimizer", ("multi_tensor", "adam", "foreach")),
                ("collective", ("nccl",)),
                ("triton", ("triton",)),
                ("copy", ("memcpy", "memset", "copy")))


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def profile(row: _Row, steps: int, out_dir: str) -> dict[str, Any]:
    """``steps`` training steps of ``row`` under torch.profiler: the trace in ``out_dir``; the wall
    time per step, the device's busy share of it, and device time per step by kernel kind and for the
    longest kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if row.backend.name == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            row.step()
        wall_us = 1e6 * (time.perf_counter() - start)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(out_dir) / "trace.json.gz"))
    kernels = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU
               and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in kernels)
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1000 / steps
    longest = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:15]
    return {"steps": steps, "wall_ms_per_step": wall_us / 1000 / steps,
            "device_busy_ms_per_step": busy_us / 1000 / steps,
            "device_busy_fraction": busy_us / wall_us if wall_us else 0.0,
            "device_ms_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "longest_kernels": [{"name": e.key[:120], "ms_per_step": e.self_device_time_total / 1000 / steps,
                                 "calls_per_step": e.count / steps} for e in longest],
            "trace": str(Path(out_dir) / "trace.json.gz")}


def search_micro_batch(config: Config, backend: Backend, memory_cap: int | None) -> dict[str, Any]:
    """The largest micro-batch that fits: one training step of our model at ``config``'s micro-batch,
    then at twice that while it fits, or at half while it does not. Fitting means no out-of-memory
    error and, with ``memory_cap``, a peak memory of at most that many bytes. Returns the largest
    size and the peak memory of every size tried (None: out of memory)."""
    if memory_cap is None and backend.name != "cuda":
        raise ValueError(f"find_micro_batch on {backend.name} needs memory_cap_gib (--memory-cap-gib): only CUDA "
                         "reports running out of memory; elsewhere the system would start killing processes")
    tried: dict[int, int | None] = {}

    def fits(micro_batch: int) -> bool:
        tried[micro_batch] = _peak_memory_of_one_step(config, backend, micro_batch)
        return tried[micro_batch] is not None and (memory_cap is None or tried[micro_batch] <= memory_cap)

    largest = config.micro_batch_size
    if fits(largest):
        while fits(2 * largest):
            largest *= 2
    else:
        while largest > 1 and not fits(largest // 2):
            largest //= 2
        if largest == 1:
            raise ValueError(f"micro-batch 1 does not fit ({_fit_limit(backend, memory_cap)}): shorten seq_length, "
                             "turn on activation_checkpointing, or use tensor parallelism")
        largest //= 2
    return {"largest": largest, "memory_cap_bytes": memory_cap,
            "peak_memory_bytes": {str(mb): peak for mb, peak in sorted(tried.items())}}


def _peak_memory_of_one_step(config: Config, backend: Backend, micro_batch: int) -> int | None:
    row: _Row | None = None
    try:
        row = _Ours(dataclasses.replace(config, micro_batch_size=micro_batch, global_batch_size=micro_batch), backend)
        row.warmup(1)
        peak = row.peak_memory
    except torch.OutOfMemoryError:
        peak = None
    row = None  # the model, its optimizer and (after an error) the traceback's tensors go before the next size
    release_memory(backend)
    torch.compiler.reset()  # each size compiles afresh, with static shapes
    return peak


def release_memory(backend: Backend) -> None:
    """Hand freed memory back (CUDA's cache, glibc's heap), so that what is in use is what is held."""
    gc.collect()
    if backend.name == "cuda":
        torch.cuda.empty_cache()
    elif backend.name == "cpu" and sys.platform == "linux":
        ctypes.CDLL(None).malloc_trim(0)


def _fit_limit(backend: Backend, memory_cap: int | None) -> str:
    return f"peak memory cap {memory_cap} bytes" if memory_cap is not None else f"out of {backend.name} memory"


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _device_name(kind: str) -> str:
    if kind == "cuda":
        return torch.cuda.get_device_name()
    return kind


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--micro-batch", type=int, default=8, help="micro-batch size (where --find-micro-batch starts)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps first, at least one (compilation and the peak memory happen here)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "neuron"])
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp8"],
                   help="default: bf16 on accelerators, fp32 on CPU; fp8: torchao float8 linears (Hopper or later)")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    p.add_argument("--fp8-layers", default="all", choices=["all", "large"],
                   help="float8 for every block linear, or only those large enough to gain (small ones stay bf16)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-scope", default="auto", choices=["auto", "blocks", "model"],
                   help="one graph per block, or the whole forward with the loss (auto: model on CUDA, blocks elsewhere)")
    p.add_argument("--compare-eager", action="store_true", help="also measure our eager model (ours is compiled)")
    p.add_argument("--peer", action="store_true", help="also measure HuggingFace's GPT2LMHeadModel of the same shape")
    p.add_argument("--activation-checkpointing", nargs="?", const="block", choices=["block", "attention", "mlp"],
                   help="recompute activations in backward: of whole blocks (no value), or only attention or mlp")
    p.add_argument("--find-micro-batch", action="store_true", help="measure at the largest micro-batch that fits")
    p.add_argument("--memory-cap-gib", type=float, help="with --find-micro-batch: the peak memory allowed (needed on CPU)")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s of the device, for MFU where the table has none")
    p.add_argument("--profile", metavar="DIR", help="then profile a few steps of our row: trace and kernel times")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--pp", type=int, default=1, help="also measure the model in this many pipeline stages")
    p.add_argument("--pipeline-schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb"])
    p.add_argument("--virtual-pipeline-stages", type=int, default=1)
    a = p.parse_args(argv)
    try:
        result = run(model=a.model, micro_batch=a.micro_batch, steps=a.steps, warmup=a.warmup, grad_accum=a.grad_accum,
                     seq_length=a.seq_length, vocab_size=a.vocab_size, device=a.device, precision=a.precision,
                     compile=a.compile, compile_scope=a.compile_scope, compare_eager=a.compare_eager, peer=a.peer,
                     activation_checkpointing=a.activation_checkpointing is not None,
                     activation_checkpointing_scope=a.activation_checkpointing or "block", fp8_recipe=a.fp8_recipe,
                     fp8_layers=a.fp8_layers,
                     find_micro_batch=a.find_micro_batch, memory_cap_gib=a.memory_cap_gib, peak_flops=a.peak_flops,
                     profile_dir=a.profile, profile_steps=a.profile_steps, pipeline_parallel=a.pp,
                     pipeline_schedule=a.pipeline_schedule, virtual_pipeline_stages=a.virtual_pipeline_stages)
    except ValueError as e:  # ConfigError too: the message names the option
        p.error(str(e))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
