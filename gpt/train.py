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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gpt import heartbeat
from gpt.backend import Backend, get_backend, save_compile_cache, use_compile_cache
from gpt.checkpoint import Checkpointer, writer_id
from gpt.config import Config, ConfigError, read_config_file
from gpt.config.overrides import parse_overrides
from gpt.data import GPTDataset, MockGPTDataset
from gpt.faults import FAULT
from gpt.files import WriteError
from gpt.heartbeat import Heartbeat
from gpt.metrics import HeldStep, MetricsWriter, StepLog, attention_span, saved_line, valid_line
from gpt.model import Packing
from gpt.optim import LossScaler, build_optimizer, lr_at, optimizer_step
from gpt.parallel import context
from gpt.parallel.build import build_model
from gpt.parallel.data import gradient_sync
from gpt.parallel.dims import ParallelDims
from gpt.parallel.gradients import clip_grads, scale_grads
from gpt.parallel.pipeline import Pipeline, build_pipeline
from gpt.parallel.process_group import StopSignal, all_reduce_sum, init_distributed, shutdown
from gpt.parallel.xla import sharded_names

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; run again to resume


# -- one optimizer step ----------------------------------------------------------------------
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[MicroBatch],
               *, backend: Backend, precision: str, clip_grad: float, scaler: LossScaler,
               dims: ParallelDims | None = None, pipeline: Pipeline | None = None,
               loss_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accumulate gradients over the micro-batches, reduce them over the ranks, clip, step.

    Returns device scalars, read by nobody here: the loss averaged over all ranks, the global
    gradient norm, and whether the optimizer stepped. Every decision is taken on the device from
    the reduced gradients, so all ranks take the same one: the clip coefficient, and skipping the
    step (on every rank) when the norm is not finite. On XLA the whole step is one graph. With
    pipeline stages, their schedule runs the micro-batches' forward and backward passes. ``dims``
    averages the gradients where no DDP or FSDP module did, and sums their norm (one process when None).
    ``loss_factor`` multiplies the loss (gpt.faults' injected spike; 1 otherwise).
    """
    dims = dims or ParallelDims(0, 1, 0, None)
    params = [p for p in model.parameters() if p.requires_grad]
    if pipeline is not None:
        heartbeat.enter("forward")
        with backend.autocast(precision):
            total = pipeline.train(micro_batches, scaler.scale if scaler.enabled else None) / len(micro_batches)
            total = total * loss_factor
    else:
        total = torch.zeros((), device=micro_batches[0][0].device)
        for i, (x, y, packing) in enumerate(micro_batches):
            heartbeat.enter("forward")
            with gradient_sync(model, i == len(micro_batches) - 1), backend.autocast(precision):
                loss = model(x, y, packing=packing) * loss_factor / len(micro_batches)
            heartbeat.enter("backward")
            (loss * scaler.scale if scaler.enabled else loss).backward()
            total += loss.detach()
    heartbeat.enter("sync")
    dims.average_gradients(optimizer, backend.lazy)
    if scaler.enabled:
        scale_grads(params, 1.0 / scaler.scale)
    norm = dims.grad_norm(pipeline.norm_parameters(params) if pipeline else params,
                          pipeline.pp_group if pipeline else None)
    finite = torch.isfinite(norm)
    if clip_grad > 0:
        clip_grads(params, clip_grad, norm.to(backend.kind.scalar_dtype))
    optimizer_step(optimizer, (~finite).float(), backend)
    scaler.update(finite)
    optimizer.zero_grad(set_to_none=True)
    world = dist.get_world_size() if dist.is_initialized() else 1
    # Tensor-parallel ranks hold the same loss, context-parallel ones each the mean over the same
    # number of tokens, and only the last pipeline stage holds one: divide by the ranks of the last stage.
    mean_loss = all_reduce_sum(total) / (world // (pipeline.size if pipeline else 1))
    backend.sync()
    return mean_loss, norm, finite


# -- data ------------------------------------------------------------------------------------
# Tokens, targets, and where the tokens sit when that is not one causal sequence (gpt.model.Packing).
MicroBatch = tuple[torch.Tensor, torch.Tensor, Packing | None]


def micro_batches(dataset, start: int, count: int, config: Config, env: ParallelDims,
                  device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches of the global batch of ``count`` samples beginning at ``start``.

    Micro-step m covers samples [start + m*mb*dp, start + (m+1)*mb*dp); data-parallel rank r takes
    its contiguous slice of it, and under context parallel each rank of the slice its share of
    every sequence. The order is the same for any number of ranks.
    """
    dp, dp_rank, mb = env.dp_size, env.dp_rank, config.micro_batch_size
    packed = config.reset_attention_mask or config.reset_position_ids or env.cp_size > 1
    out = []
    for m in range(count // (mb * dp)):
        first = start + m * mb * dp + dp_rank * mb
        samples = [i % len(dataset) for i in range(first, first + mb)]
        tokens = torch.from_numpy(np.stack([dataset[i] for i in samples]).astype(np.int64)).to(device, non_blocking=True)
        batch = (tokens[:, :-1], tokens[:, 1:], sample_packing(dataset, samples, config, device) if packed else None)
        out.append(context.shard(*batch, env.cp_size, env.cp_rank) if env.cp_size > 1 else batch)
    return out


def sample_packing(dataset, samples: list[int], config: Config, device: torch.device) -> Packing:
    """Where the input tokens of these samples sit: their places, and with reset_attention_mask and
    reset_position_ids the documents the index stage packed each sample from."""
    length = config.seq_length
    index = torch.arange(length, device=device)
    if not (config.reset_attention_mask or config.reset_position_ids):
        return Packing(index, index, None)
    pieces = [dataset.pieces(i) for i in samples]
    documents = np.stack([np.repeat(np.arange(len(p)), p)[:length] for p in pieces])
    starts = np.stack([np.repeat(np.cumsum(p) - p, p)[:length] for p in pieces])
    positions = torch.from_numpy(np.arange(length) - starts).to(device) if config.reset_position_ids else index
    return Packing(index, positions, torch.from_numpy(documents).to(device) if config.reset_attention_mask else None)


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
def evaluate(model: nn.Module, dataset, config: Config, env: ParallelDims, device: torch.device,
             backend: Backend, iters: int, pipeline: Pipeline | None = None) -> float | None:
    """Mean loss over the first ``iters`` global batches of the split (the same ones every time)."""
    if len(dataset) == 0:
        return None
    g = config.global_batch_size
    total = torch.zeros((), device=device)
    count = 0
    for k in range(iters):
        heartbeat.enter("eval")             # a mark per batch: a long evaluation still advances
        batches = micro_batches(dataset, k * g, g, config, env, device)
        with backend.autocast(config.precision):
            if pipeline is not None:
                total += pipeline.evaluate(batches)
            else:
                for x, y, where in batches:
                    total += model(x, y, packing=where).float()
        count += len(batches)
    backend.sync()
    # Each tensor-parallel rank holds the same loss, each context-parallel one the mean over as many
    # tokens, and only the last pipeline stage holds one: divide by the ranks of the last stage.
    return float(all_reduce_sum(total / count)) / (env.world_size // env.pp_size)


def job_layout(config: Config, env: ParallelDims, model: nn.Module) -> dict[str, Any]:
    """How this job is laid out, as each checkpoint's marker keeps it (gpt.checkpoint.saved_layout)."""
    return {"world_size": env.world_size, "nodes": int(os.environ.get("SLURM_JOB_NUM_NODES", "1")),
            "tensor_parallel": config.tensor_parallel, "pipeline_parallel": config.pipeline_parallel,
            "context_parallel": config.context_parallel,
            "data_parallel_mode": config.data_parallel_mode,
            "device": config.device, "parts": bool(sharded_names(model))}


def save_checkpoint(run: "Run", state: dict[str, Any]) -> None:
    """Save (or, asynchronous, start saving) at this iteration, after the save in flight ended."""
    heartbeat.enter("save")
    state.update(loss_scale=float(run.scaler.scale), good_steps=int(run.scaler.good_steps))
    run.ckpt.save(state["iteration"], run.model, run.optimizer, state)


def finish_checkpoint(run: "Run", metrics: MetricsWriter) -> None:
    """Wait for the save in flight: the heartbeat's save phase covers the wait, so a write that never
    ends is a hang like any other."""
    heartbeat.enter("save")
    run.ckpt.finish()
    report_saves(run, metrics)


def report_saves(run: "Run", metrics: MetricsWriter) -> None:
    for saved in run.ckpt.completed():
        run.log(saved_line(saved.iteration, saved.blocking_s, saved.background_s), flush=True)
        metrics.saved(saved.iteration, saved.blocking_s, saved.background_s)


# -- main --------------------------------------------------------------------------------------
def main(config: Config) -> dict[str, Any]:
    """Train (or resume) on this rank; returns the run summary on every rank."""
    start = time.time()
    backend = get_backend(config.device)
    env = init_distributed(backend, config.tensor_parallel, config.collective_timeout_s,
                           pp_size=config.pipeline_parallel, data_parallel_mode=config.data_parallel_mode,
                           cp_size=config.context_parallel)
    finished = False
    try:
        config.validate(env.world_size)
        every = min(5.0, config.hang_timeout_s / 4) if config.hang_timeout_s else 5.0
        with Heartbeat(config.run_dir, env.rank, writer_id(), every_s=every):
            summary = _run(config, backend, env, start)
        finished = True
        return summary
    finally:
        shutdown(finished)


@dataclass
class Run:
    """What one rank trains with: its model (a pipeline stage's, with pipeline stages), optimizer,
    loss scaler, data, checkpoints, metrics, and the state a checkpoint carries."""
    config: Config
    backend: Backend
    env: ParallelDims
    device: torch.device
    data: tuple[Any, Any, Any]              # train, valid, test
    pipeline: Pipeline | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    ckpt: Checkpointer
    state: dict[str, Any]
    log: Any                                 # print on rank 0, nothing elsewhere
    cache_hit: bool


def _run(config: Config, backend: Backend, env: ParallelDims, start: float) -> dict[str, Any]:
    run = _prepare(config, backend, env)
    metrics = _start_from(run)
    status, valid_loss, steps = _train(run, metrics, start)
    return _finish(run, metrics, steps, status, valid_loss, start)


def _prepare(config: Config, backend: Backend, env: ParallelDims) -> Run:
    """Seeds, data, the model under its layout, optimizer and checkpoints; nothing read yet."""
    device = backend.device(env.local_rank)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    cache_hit = use_compile_cache(config, backend, env.rank)
    data = load_datasets(config)
    pipeline = build_pipeline(config, env, device) if config.pipeline_parallel > 1 else None
    model = pipeline.model if pipeline else build_model(config, env, device)
    optimizer = build_optimizer(model, config, backend)
    scaler = LossScaler(config.precision == "fp16", device)
    state = {"iteration": 0, "consumed_samples": 0, "skipped": 0, "nan": 0, "loss_scale": 1.0, "good_steps": 0}
    ckpt = Checkpointer(Path(config.run_dir) / "checkpoints", config.keep_last, env.rank, to_host=backend.to_host,
                        layout=job_layout(config, env, model), asynchronous=config.async_save and not backend.lazy)
    return Run(config, backend, env, device, data, pipeline, model, optimizer, scaler, ckpt, state,
               print if env.is_main else (lambda *a, **k: None), cache_hit)


def _start_from(run: Run) -> MetricsWriter:
    """Resume from the newest checkpoint, or start from the weights the config names, or afresh;
    then the run folder's config and the metrics writer (which continues where the state is)."""
    config, log = run.config, run.log
    latest = None
    heartbeat.enter("load")
    if not config.precompile:
        latest, run.state = run.ckpt.resume(run.model, run.optimizer, run.state, log=log)
    if latest is not None:
        run.scaler.load(run.state["loss_scale"], run.state["good_steps"])
    elif config.init_from:
        run.ckpt.initialise(Path(config.init_from), run.model, run.optimizer if config.init_from_optimizer else None)
        log(f"started from {'the weights and optimizer state' if config.init_from_optimizer else 'the weights'} "
            f"of {config.init_from}", flush=True)
    elif config.init_from_hf:
        from gpt.export import load_hf_weights

        load_hf_weights(run.model, config)
        log(f"started from the HuggingFace weights in {config.init_from_hf}", flush=True)
    run_dir = Path(config.run_dir)
    if run.env.is_main and not config.precompile:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.save(run_dir / "config.json")
    metrics = MetricsWriter(str(run_dir), run.env.is_main and not config.precompile, run.state["iteration"],
                            config.tensorboard_dir)
    if latest is not None:
        log(f"resumed from {latest} at iteration {run.state['iteration']}", flush=True)
    return metrics


def _train(run: Run, metrics: MetricsWriter, start: float) -> tuple[str, float | None, StepLog]:
    """The loop: a step per iteration; at the intervals, the log line, evaluation and a checkpoint;
    a stop signal ends it at an iteration boundary, saved. Returns the status ("completed" or
    "interrupted"), the last validation loss and the step log."""
    config, env, state = run.config, run.env, run.state
    end_iter = (min(config.total_iters, state["iteration"] + config.precompile_iters) if config.precompile
                else config.total_iters)
    first_iter = state["iteration"] + 1
    steps = StepLog(config, run.backend, metrics, env.world_size, start, run.log, run.device)
    valid_loss = None
    with StopSignal() as stop:
        while state["iteration"] < end_iter:
            it = state["iteration"] + 1
            lr = lr_at(config, it)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            heartbeat.enter("data", it)
            drawn = state["consumed_samples"] - config.data_offset      # this index's samples before the batch
            g = config.batch_size_at(state["consumed_samples"])          # smaller during a batch-size ramp-up
            batches = micro_batches(run.data[0], drawn, g, config, env, run.device)
            loss, norm, stepped = train_step(run.model, run.optimizer, batches, backend=run.backend,
                                             precision=config.precision, clip_grad=config.clip_grad,
                                             scaler=run.scaler, dims=env, pipeline=run.pipeline,
                                             loss_factor=FAULT.loss_factor(run.data[0], drawn, g))
            state.update(iteration=it, consumed_samples=state["consumed_samples"] + g)
            span = (attention_span([run.data[0].pieces(i % len(run.data[0])) for i in range(drawn, drawn + g)],
                                   config.seq_length) if config.reset_attention_mask else None)
            steps.hold(HeldStep(it, state["consumed_samples"], lr, (loss, norm, stepped, run.scaler.scale), span))
            logging = it % config.log_interval == 0 or it == end_iter
            evaluating = not config.benchmark and (it % config.eval_interval == 0 or it == end_iter)
            saving = not config.precompile and (it % config.save_interval == 0 or it == end_iter)
            if not (logging or evaluating or saving or it == first_iter):
                continue
            for record in steps.read():
                state["skipped"] += record["skipped"]
                state["nan"] += record["nan"]
            if logging:
                steps.log_line()
            if evaluating:
                valid_loss = evaluate(run.model, run.data[1], config, env, run.device, run.backend,
                                      1 if config.precompile else config.eval_iters, run.pipeline)
                if valid_loss is not None:
                    run.log(valid_line(it, valid_loss), flush=True)
                    metrics.valid(it, state["consumed_samples"], valid_loss)
            if saving:
                save_checkpoint(run, state)
            heartbeat.enter("log")
            report_saves(run, metrics)
            if not config.precompile and it < end_iter and stop.should_stop(run.device):
                if not saving:
                    save_checkpoint(run, state)
                finish_checkpoint(run, metrics)
                run.log(f"stopping at iteration {it} on a signal; checkpoint saved", flush=True)
                return "interrupted", valid_loss, steps
            steps.restart_clock()
        # Still under the stop signal: a time limit's USR2 during the last checkpoint's write waits
        # for it (the run is complete) instead of requeuing a job whose final save is cut short.
        finish_checkpoint(run, metrics)
    return "completed", valid_loss, steps


def _finish(run: Run, metrics: MetricsWriter, steps: StepLog, status: str, valid_loss: float | None,
            start: float) -> dict[str, Any]:
    """The compile cache saved (a precompile run), the test loss of a completed run, the summary."""
    config, state = run.config, run.state
    if config.precompile and config.compile and run.backend.name != "neuron":
        save_compile_cache(config, run.env.rank)
    test_loss = None
    if status == "completed" and not config.precompile and not config.benchmark:
        test_loss = evaluate(run.model, run.data[2], config, run.env, run.device, run.backend, config.eval_iters,
                             run.pipeline)
        if test_loss is not None:
            run.log(f" test loss after iteration {state['iteration']} | lm loss value: {test_loss:.6E} | "
                    f"lm loss PPL: {math.exp(min(20.0, test_loss)):.6E} |", flush=True)
    metrics.close()
    tokens_per_s = steps.tokens_per_s()
    return {
        "status": status, "iteration": state["iteration"], "train_iters": config.total_iters,
        "train_loss": steps.last["lm_loss"] if steps.last else None, "valid_loss": valid_loss,
        "tokens_per_s": tokens_per_s, "mfu": steps.mfu(tokens_per_s) if tokens_per_s else None,
        "time_to_first_iteration_s": steps.first_iter_s, "wall_s": time.time() - start,
        "run_dir": str(Path(config.run_dir)), "compile_cache_hit": run.cache_hit, "test_loss": test_loss,
        "test_perplexity": math.exp(min(20.0, test_loss)) if test_loss is not None else None,
    }


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpt.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="JSON or YAML file of Config fields")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field (repeatable); the value is typed by its field")
    args = parser.parse_args(argv)
    try:
        overrides, problems = parse_overrides(args.set)
        if problems:
            raise ConfigError("; ".join(message for _, message in problems))
        base = read_config_file(args.config) if args.config else {}
        config = Config.from_dict({**base, **overrides})
        summary = main(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except WriteError as e:      # a full or read-only disk: its one line says where and what to do
        print(f"error: {e}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary), flush=True)
    return EXIT_INTERRUPTED if summary["status"] == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(cli())
