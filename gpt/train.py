"""The training loop: ``gpt.train.main(config)`` on every rank, or ``python -m gpt.train --config FILE``.

Resumes from the newest complete checkpoint in ``<run_dir>/checkpoints``. SIGUSR2 or SIGTERM
(what SLURM sends before preemption or the time limit) makes every rank stop at the same
iteration boundary, save a checkpoint and return ``status == "interrupted"``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpt.backend import Backend, get_backend
from gpt.checkpoint import Checkpointer
from gpt.config import Config, ConfigError, read_config_file
from gpt.data import GPTDataset, MockGPTDataset
from gpt.files import write_atomic
from gpt.distributed import (
    DistEnv, all_reduce_sum, build_model, grad_norm, gradient_sync, init_distributed, scale_grads, shutdown,
)
from gpt.metrics import MetricsWriter, flops_per_token, mfu, train_line, valid_line
from gpt.model import param_count

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; run again to resume


# -- learning-rate schedule ------------------------------------------------------------------
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
    good steps. Decisions use the global gradient norm, so all ranks agree. Scale 1 for bf16/fp32."""

    def __init__(self, enabled: bool, initial: float = 2.0 ** 16, growth_interval: int = 1000) -> None:
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.good_steps = 0
        self.growth_interval = growth_interval

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.good_steps = 0
            self.scale = max(1.0, self.scale / 2.0)


# -- one optimizer step ----------------------------------------------------------------------
def build_optimizer(model: nn.Module, config: Config, backend: Backend) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (weights, embeddings) only, never on biases or norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps, fused=backend.fused_adamw() or None)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
               *, backend: Backend, precision: str, clip_grad: float, scaler: LossScaler) -> tuple[torch.Tensor, float, bool]:
    """Accumulate gradients over the micro-batches, clip, step. Returns (mean loss, grad norm, stepped).

    A step whose gradient norm is not finite is skipped on every rank.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros((), device=micro_batches[0][0].device)
    for i, (x, y) in enumerate(micro_batches):
        with gradient_sync(model, i == len(micro_batches) - 1), backend.autocast(precision):
            loss = model(x, y) / len(micro_batches)
        (loss * scaler.scale if scaler.enabled else loss).backward()
        total += loss.detach()
    if scaler.enabled:
        scale_grads(params, 1.0 / scaler.scale)
    norm = float(grad_norm(params))
    finite = math.isfinite(norm)
    scaler.update(finite)
    if finite:
        if clip_grad > 0 and norm > clip_grad:
            scale_grads(params, clip_grad / (norm + 1e-6))
        backend.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    backend.mark_step()
    return total, norm, finite


# -- data ------------------------------------------------------------------------------------
def micro_batches(dataset, start: int, count: int, config: Config, env: DistEnv,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the global batch of ``count`` samples beginning at ``start``.

    Micro-step m covers samples [start + m*mb*dp, start + (m+1)*mb*dp); data-parallel rank r takes
    its contiguous slice of it. The order is the same for any number of ranks.
    """
    tp = config.tensor_parallel
    dp, dp_rank, mb = env.world_size // tp, env.rank // tp, config.micro_batch_size
    out = []
    for m in range(count // (mb * dp)):
        first = start + m * mb * dp + dp_rank * mb
        rows = np.stack([dataset[i % len(dataset)] for i in range(first, first + mb)]).astype(np.int64)
        tokens = torch.from_numpy(rows).to(device, non_blocking=True)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def load_datasets(config: Config) -> tuple[Any, Any, Any]:
    """The train, valid and test splits."""
    need = config.num_samples()
    if config.mock_data:
        return tuple(MockGPTDataset(need[split], config.seq_length, config.vocab_size, config.seed + i)
                     for i, split in enumerate(("train", "valid", "test")))
    train = GPTDataset.from_index(config.data_index, "train")
    valid = GPTDataset.from_index(config.data_index, "valid")
    test = GPTDataset.from_index(config.data_index, "test")
    if len(train) < need["train"]:
        raise ConfigError(f"data_index={config.data_index}: the train split holds {len(train)} samples but the run "
                          f"needs {need['train']}; rebuild the index with num_samples=Config.num_samples()")
    if len(train[0]) != config.seq_length + 1:
        raise ConfigError(f"data_index={config.data_index} was built for seq_length={len(train[0]) - 1} but "
                          f"seq_length={config.seq_length}; rebuild the index or change seq_length")
    return train, valid, test


@torch.no_grad()
def evaluate(model: nn.Module, dataset, config: Config, env: DistEnv, device: torch.device,
             backend: Backend, iters: int) -> float | None:
    """Mean loss over the first ``iters`` global batches of the split (the same ones every time)."""
    if len(dataset) == 0:
        return None
    g = config.global_batch_size
    total = torch.zeros((), device=device)
    count = 0
    for k in range(iters):
        for x, y in micro_batches(dataset, k * g, g, config, env, device):
            with backend.autocast(config.precision):
                total += model(x, y).float()
            count += 1
    backend.mark_step()
    # Each tensor-parallel rank holds the same loss: divide by the world, not the data-parallel size.
    return float(all_reduce_sum(total / count)) / env.world_size


# -- stopping on a signal --------------------------------------------------------------------
class StopSignal:
    """Records SIGUSR2/SIGTERM; ``should_stop`` agrees on all ranks (one all-reduced flag)."""

    SIGNALS = (signal.SIGUSR2, signal.SIGTERM)

    def __init__(self) -> None:
        self.received = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay with whoever owns them
            pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.received = True

    def should_stop(self, device: torch.device) -> bool:
        flag = torch.tensor(float(self.received), device=device)
        return bool(all_reduce_sum(flag) > 0)


def load_hf_weights(model: nn.Module, config: Config) -> None:
    """Every rank loads the whole HuggingFace state dict and keeps its own shard of it."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from gpt.export import config_from_hf
    from gpt.model import hf_to_ours

    folder = Path(config.init_from_hf)
    theirs = config_from_hf(json.loads((folder / "config.json").read_text()))
    shape = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads")
    differ = [f"{n}: {getattr(theirs, n)} there, {getattr(config, n)} here" for n in shape
              if getattr(theirs, n) != getattr(config, n)]
    if theirs.max_position_embeddings != config.max_position_embeddings:
        differ.append(f"positions: {theirs.max_position_embeddings} there, {config.max_position_embeddings} here")
    if differ:
        raise ConfigError(f"init_from_hf={folder}: the model there has another shape ({'; '.join(differ)})")
    weights = hf_to_ours(load_file(str(folder / "model.safetensors")), config.padded_vocab_size())
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


# -- compile cache ---------------------------------------------------------------------------
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


# -- main --------------------------------------------------------------------------------------
def main(config: Config) -> dict[str, Any]:
    """Train (or resume) on this rank; returns the run summary on every rank."""
    start = time.time()
    backend = get_backend(config.device, config.precision)
    env = init_distributed(backend, config.tensor_parallel)
    finished = False
    try:
        config.validate(env.world_size)
        summary = _run(config, backend, env, start)
        finished = True
        return summary
    finally:
        shutdown(finished)


def _run(config: Config, backend: Backend, env: DistEnv, start: float) -> dict[str, Any]:
    device = backend.device(env.local_rank)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    cache_hit = use_compile_cache(config, backend, env.rank) if config.compile else False
    train_data, valid_data, test_data = load_datasets(config)
    model = build_model(config, env, device)
    optimizer = build_optimizer(model, config, backend)
    scaler = LossScaler(config.precision == "fp16")
    state = {"iteration": 0, "consumed_samples": 0, "skipped": 0, "nan": 0,
             "loss_scale": scaler.scale, "good_steps": 0}
    run_dir = Path(config.run_dir)
    ckpt = Checkpointer(run_dir / "checkpoints", config.keep_last, env.rank)
    log = print if env.is_main else (lambda *a, **k: None)
    latest = None
    if not config.precompile:
        latest, state = ckpt.resume(model, optimizer, state, log=log)
    if latest is not None:
        scaler.scale, scaler.good_steps = state["loss_scale"], state["good_steps"]
    elif config.init_from_hf:
        load_hf_weights(model, config)
        log(f"started from the HuggingFace weights in {config.init_from_hf}", flush=True)
    if env.is_main and not config.precompile:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.save(run_dir / "config.json")
    metrics = MetricsWriter(str(run_dir), env.is_main and not config.precompile, state["iteration"])
    if latest is not None:
        log(f"resumed from {latest} at iteration {state['iteration']}", flush=True)

    total_iters = config.total_iters
    end_iter = min(total_iters, state["iteration"] + config.precompile_iters) if config.precompile else total_iters
    g, seq = config.global_batch_size, config.seq_length
    flops_token = flops_per_token(config, param_count(config))
    peak = config.peak_flops or backend.peak_flops(config.precision)
    first_iter_s = None
    timed_tokens, timed_s = 0, 0.0
    interval = {"iters": 0, "loss": 0.0, "n": 0, "ms": 0.0, "skipped": 0, "nan": 0}
    last_loss, valid_loss, last_saved = None, None, state["iteration"]
    status = "completed"

    with StopSignal() as stop:
        while state["iteration"] < end_iter:
            t0 = time.time()
            it = state["iteration"] + 1
            lr = lr_at(config, it)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = micro_batches(train_data, state["consumed_samples"], g, config, env, device)
            loss, norm, stepped = train_step(model, optimizer, batches, backend=backend,
                                             precision=config.precision, clip_grad=config.clip_grad, scaler=scaler)
            loss_value = float(all_reduce_sum(loss.detach().clone())) / env.world_size  # waits for the device
            elapsed = time.time() - t0
            state.update(iteration=it, consumed_samples=state["consumed_samples"] + g,
                         loss_scale=scaler.scale, good_steps=scaler.good_steps)
            is_nan = not math.isfinite(loss_value)
            state["skipped"] += 0 if stepped else 1
            state["nan"] += int(is_nan)
            if first_iter_s is None:
                first_iter_s = time.time() - start
            else:
                timed_tokens, timed_s = timed_tokens + g * seq, timed_s + elapsed
            tokens_s = g * seq / elapsed
            mfu_value = mfu(tokens_s, flops_token, peak, env.world_size)
            last_loss = loss_value
            metrics.train({"iteration": it, "consumed_samples": state["consumed_samples"], "lm_loss": loss_value,
                           "lr": lr, "grad_norm": norm, "loss_scale": scaler.scale, "elapsed_ms": 1000 * elapsed,
                           "tokens_per_s": tokens_s, "mfu": mfu_value, "skipped": int(not stepped), "nan": int(is_nan)})
            interval["iters"] += 1
            interval["loss"] += 0.0 if is_nan else loss_value
            interval["n"] += 0 if is_nan else 1
            interval["ms"] += 1000 * elapsed
            interval["skipped"] += int(not stepped)
            interval["nan"] += int(is_nan)
            if it % config.log_interval == 0 or it == end_iter:
                ms = interval["ms"] / interval["iters"]
                log(train_line(iteration=it, total=total_iters, consumed=state["consumed_samples"], elapsed_ms=ms,
                               lr=lr, batch=g, loss=interval["loss"] / max(1, interval["n"]), loss_scale=scaler.scale,
                               grad_norm=norm, skipped=interval["skipped"], nan=interval["nan"],
                               tokens_per_s=g * seq / (ms / 1000), mfu_value=mfu(g * seq / (ms / 1000), flops_token, peak, env.world_size)),
                    flush=True)
                interval = {"iters": 0, "loss": 0.0, "n": 0, "ms": 0.0, "skipped": 0, "nan": 0}
            if not config.benchmark and (it % config.eval_interval == 0 or it == end_iter):
                valid_loss = evaluate(model, valid_data, config, env, device, backend,
                                      1 if config.precompile else config.eval_iters)
                if valid_loss is not None:
                    log(valid_line(it, valid_loss), flush=True)
                    metrics.valid(it, state["consumed_samples"], valid_loss)
            if config.precompile:
                continue
            if it % config.save_interval == 0 or it == end_iter:
                ckpt.save(it, model, optimizer, state)
                last_saved = it
            if it < end_iter and stop.should_stop(device):
                if last_saved != it:
                    ckpt.save(it, model, optimizer, state)
                status = "interrupted"
                log(f"stopping at iteration {it} on a signal; checkpoint saved", flush=True)
                break

    if config.precompile and config.compile and backend.name != "neuron":
        save_compile_cache(config, env.rank)
    test_loss = None
    if status == "completed" and not config.precompile and not config.benchmark:
        test_loss = evaluate(model, test_data, config, env, device, backend, config.eval_iters)
        if test_loss is not None:
            log(f" test loss after iteration {state['iteration']} | lm loss value: {test_loss:.6E} | "
                f"lm loss PPL: {math.exp(min(20.0, test_loss)):.6E} |", flush=True)
    metrics.close()
    tokens_per_s = timed_tokens / timed_s if timed_s else (g * seq / first_iter_s if first_iter_s else None)
    summary = {
        "status": status, "iteration": state["iteration"], "train_iters": total_iters,
        "train_loss": last_loss, "valid_loss": valid_loss, "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, flops_token, peak, env.world_size) if tokens_per_s else None,
        "time_to_first_iteration_s": first_iter_s, "wall_s": time.time() - start, "run_dir": str(run_dir),
        "compile_cache_hit": cache_hit, "test_loss": test_loss,
        "test_perplexity": math.exp(min(20.0, test_loss)) if test_loss is not None else None,
    }
    return summary


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="JSON or YAML file of Config fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field (repeatable); the value is parsed as JSON when it can be")
    args = parser.parse_args(argv)
    try:
        overrides = {}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
            overrides[key] = _parse_value(value)
        base = read_config_file(args.config) if args.config else {}
        config = Config.from_dict({**base, **overrides})
        summary = main(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)
    return EXIT_INTERRUPTED if summary["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(cli())
