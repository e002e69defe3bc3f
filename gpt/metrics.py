"""Megatron's log line on stdout, metrics.jsonl and TensorBoard events, written by rank 0; the
training loop's step log, which reads its figures from the device in batches."""
from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpt import heartbeat
from gpt.backend import Backend
from gpt.config import Config
from gpt.files import writing
from gpt.model import param_count
from gpt.parallel.process_group import gather_floats, gather_objects


def flops_per_token(config: Config, num_params: int, span: float | None = None) -> float:
    """Training FLOPs per token: 6 x the parameters that multiply (all but an embedding that is no
    output layer: a lookup) plus attention's 12 x layers x hidden x the keys a token's attention
    spans (query heads count; grouped K/V and SwiGLU's third matrix are in the parameters). The span
    is the sequence (Megatron's count), or with document masking the documents' (``attention_span``)."""
    lookup = config.padded_vocab_size() * config.hidden_size if config.untie_embeddings_and_output_weights else 0
    return 6 * (num_params - lookup) + 12 * config.num_layers * config.hidden_size * (span or config.seq_length)


def attention_span(pieces: list[np.ndarray], seq_length: int) -> float:
    """The keys a token's attention spans, on average, when attention stays inside each document of
    samples packed from these pieces (their lengths, the last one's target token included): the
    sequence's count (``seq_length``) for one document, sum(length^2) / seq_length for several."""
    squares = 0
    for lengths in pieces:
        inputs = np.asarray(lengths, dtype=np.int64).copy()
        inputs[-1] -= 1
        squares += int((inputs * inputs).sum())
    return squares / (seq_length * len(pieces))


def mfu(tokens_per_s: float, flops_token: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation as a fraction, or None without a known peak."""
    if not peak_per_device:
        return None
    return flops_token * tokens_per_s / (peak_per_device * devices)


def train_line(*, iteration: int, total: int, consumed: int, elapsed_ms: float, lr: float, batch: int,
               loss: float, loss_scale: float, grad_norm: float, skipped: int, nan: int,
               tokens_per_s: float, mfu_value: float | None) -> str:
    mfu_text = f"{100 * mfu_value:.2f}%" if mfu_value is not None else "n/a"
    return (f" iteration {iteration:8d}/{total:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {lr:.6E} | "
            f"global batch size: {batch:5d} | lm loss: {loss:.6E} | loss scale: {loss_scale:.1f} | "
            f"grad norm: {grad_norm:.3f} | number of skipped iterations: {skipped:3d} | "
            f"number of nan iterations: {nan:3d} | tokens/s: {tokens_per_s:.1f} | MFU: {mfu_text} |")


def valid_line(iteration: int, loss: float) -> str:
    ppl = math.exp(min(20.0, loss))
    return f" validation loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"


def saved_line(iteration: int, blocking_s: float, background_s: float) -> str:
    line = f" saved checkpoint at iteration {iteration} | training waited {blocking_s:.2f} s"
    if background_s:
        line += f", written in {background_s:.2f} s more while it went on"
    return line + " |"


class MetricsWriter:
    """Appends one JSON object per iteration to metrics.jsonl and mirrors scalars to TensorBoard.

    Disabled (writes nothing) on ranks other than 0 and in precompile runs. A record is appended
    whole or not at all: a write that fails (a full disk) is cut off again and raises WriteError,
    naming the file and what to do, as does a run folder that cannot be written.
    """

    def __init__(self, run_dir: str, enabled: bool, resume_iteration: int = 0,
                 tensorboard_copy: str | None = None) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._path = Path(run_dir) / "metrics.jsonl"
        if enabled:
            with writing(self._path, [run_dir]):
                self._path.parent.mkdir(parents=True, exist_ok=True)
                truncate_after(self._path, resume_iteration)
                self._file = open(self._path, "ab", buffering=0)
                self._tb = _Events([str(Path(run_dir) / "tensorboard"), *([tensorboard_copy] if tensorboard_copy else [])])

    def train(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({"kind": "train", "iteration": record["iteration"], **record, "time": time.time()})
        step = record["iteration"]
        for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "elapsed_ms"):
            self._tb.add_scalar(f"train/{key}", record[key], step)
        if record.get("mfu") is not None:
            self._tb.add_scalar("train/mfu", record["mfu"], step)

    def valid(self, iteration: int, consumed: int, loss: float) -> None:
        if not self.enabled:
            return
        self._write({"kind": "valid", "iteration": iteration, "consumed_samples": consumed,
                     "valid_loss": loss, "time": time.time()})
        self._tb.add_scalar("valid/lm_loss", loss, iteration)

    def saved(self, iteration: int, blocking_s: float, background_s: float) -> None:
        """A checkpoint complete: how long training waited for it, and how long its write went on
        in the background."""
        if not self.enabled:
            return
        self._write({"kind": "save", "iteration": iteration, "blocking_s": round(blocking_s, 4),
                     "background_s": round(background_s, 4), "time": time.time()})
        self._tb.add_scalar("checkpoint/blocking_s", blocking_s, iteration)
        self._tb.add_scalar("checkpoint/background_s", background_s, iteration)

    def ranks(self, iteration: int, iterations: int, busy_ms: list[float], nodes: list[str]) -> None:
        """Each rank's busy time per iteration (data loading and forward passes) over the last
        ``iterations`` iterations, and its node: what tells a straggler."""
        if not self.enabled:
            return
        self._write({"kind": "ranks", "iteration": iteration, "iterations": iterations,
                     "busy_ms": [round(b, 3) for b in busy_ms], "nodes": nodes, "time": time.time()})

    def _write(self, obj: dict[str, Any]) -> None:
        data = memoryview((json.dumps(obj) + "\n").encode())
        end = os.fstat(self._file.fileno()).st_size
        with writing(self._path):
            try:
                while data:
                    data = data[self._file.write(data):]
            except OSError:
                os.ftruncate(self._file.fileno(), end)
                raise

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


class _Events:
    """TensorBoard's event files in each of ``folders``: the run folder's, and a copy where the run
    says (Megatron's --tensorboard-dir)."""

    def __init__(self, folders: list[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writers = [SummaryWriter(folder) for folder in folders]

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


_ITERATION = re.compile(rb'\{"kind": "[a-z]+", "iteration": (\d+)[,}]')


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl; a torn last line (a run still writing) is ignored."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_after(path: Path, iteration: int, cut_to: Path | None = None) -> None:
    """Drop records past the checkpoint a run resumes from (those iterations run again), and a line
    cut short when the previous run was killed; ``cut_to`` keeps the whole records dropped. The file is cut in place, never replaced, so that
    nothing that still holds it open writes into an unlinked copy. Only each record's head is read
    (``_write`` puts its iteration there): a month-long run at thousands of ranks writes gigabytes
    of ``ranks`` records, which parsing whole would take minutes at every resume."""
    if not path.exists():
        return
    keep = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n") or _iteration(line) > iteration:
                break
            keep += len(line)
        if cut_to is not None:
            f.seek(keep)
            cut = [line for line in f if line.endswith(b"\n")]
            with open(cut_to, "ab") as out:
                out.writelines(cut)
    os.truncate(path, keep)


def _iteration(line: bytes) -> float:
    """A record's iteration, from its head where it is written there, else from the whole record;
    infinite for a line that is not a record (which ends what is kept)."""
    head = _ITERATION.match(line)
    if head is not None:
        return int(head.group(1))
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return math.inf


# -- the training loop's records, read from the device in batches --------------------------------
@dataclass
class HeldStep:
    """One iteration's figures, left on the device until the next read."""
    iteration: int
    consumed_samples: int
    lr: float
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # loss, grad norm, stepped, loss scale
    span: float | None = None                    # keys a token attends to, with document masking (attention_span)


class StepLog:
    """The iterations' figures stay on the device until a read point (the log interval, an
    evaluation, a checkpoint, the first and the last iteration), where they are read together: one
    wait for the device there instead of one per iteration. Every iteration still gets its
    metrics record; its time is the mean over the iterations read together."""

    def __init__(self, config: Config, backend: Backend, metrics: MetricsWriter, world_size: int, start: float,
                 log: Any, device: torch.device) -> None:
        self.config, self.backend, self.metrics, self.world_size, self.start, self.log = (
            config, backend, metrics, world_size, start, log)
        self.device = device
        # Each rank's busy time goes to the records at each read, where the ranks can compare (not on
        # XLA devices, whose step is one graph: a host-side time would say nothing).
        self.nodes = gather_objects(os.environ.get("SLURMD_NODENAME") or socket.gethostname()) \
            if world_size > 1 and not backend.lazy else None
        self.busy = self._busy_s()
        self.held: list[HeldStep] = []
        self.clock = time.time()
        self.first_iter_s: float | None = None
        self.first_tokens = 0
        self.timed_tokens, self.timed_s = 0, 0.0
        self.interval: list[dict[str, Any]] = []
        self.last: dict[str, Any] | None = None
        self.flops_token = flops_per_token(config, param_count(config))
        self.peak = config.peak_flops or backend.peak_flops(config.precision)

    def hold(self, step: HeldStep) -> None:
        self.held.append(step)

    def read(self) -> list[dict[str, Any]]:
        """Read the held iterations, write their records; returns them."""
        values = self.backend.read([v for step in self.held for v in step.values])
        now = time.time()
        count = len(self.held)
        elapsed = (now - self.clock) / count
        held_tokens = [self.config.batch_of(step.iteration) * self.config.seq_length for step in self.held]
        first = self.first_iter_s is None
        if first:
            self.first_iter_s, self.first_tokens = now - self.start, sum(held_tokens)
        else:
            self.timed_tokens, self.timed_s = self.timed_tokens + sum(held_tokens), self.timed_s + now - self.clock
        records = []
        for i, (step, tokens) in enumerate(zip(self.held, held_tokens)):
            loss, norm, stepped, scale = values[4 * i:4 * i + 4]
            records.append({"iteration": step.iteration, "consumed_samples": step.consumed_samples, "lm_loss": loss,
                            "lr": step.lr, "grad_norm": norm, "loss_scale": scale, "elapsed_ms": 1000 * elapsed,
                            "tokens_per_s": tokens / elapsed, "mfu": self.mfu(tokens / elapsed, step.span),
                            "skipped": int(not stepped), "nan": int(not math.isfinite(loss)),
                            **({"attention_span": step.span} if step.span is not None else {})})
        for record in records:
            self.metrics.train(record)
        if self.nodes is not None:
            busy, self.busy = self._busy_s() - self.busy, self._busy_s()
            busy_ms = gather_floats(1000 * busy / count, self.device)
            if not first:   # the job's first iteration warms up: it tells nothing about the rank
                self.metrics.ranks(records[-1]["iteration"], count, busy_ms, self.nodes)
        self.held = []
        self.interval += records
        self.last = records[-1]
        return records

    @staticmethod
    def _busy_s() -> float:
        """Seconds this rank spent loading data and in forward passes: its own work, before it waits
        for the others in a collective (gpt.heartbeat keeps the time per phase)."""
        spent = heartbeat.spent()
        return spent.get("data", 0.0) + spent.get("forward", 0.0)

    def log_line(self) -> None:
        """Megatron's line for the iterations since the last one: mean loss of the finite ones."""
        finite = [r["lm_loss"] for r in self.interval if not r["nan"]]
        ms = sum(r["elapsed_ms"] for r in self.interval) / len(self.interval)
        tokens_per_s = (sum(r["tokens_per_s"] * r["elapsed_ms"] for r in self.interval)   # tokens / time
                        / sum(r["elapsed_ms"] for r in self.interval))
        last = self.interval[-1]
        self.log(train_line(iteration=last["iteration"], total=self.config.total_iters,
                            consumed=last["consumed_samples"], elapsed_ms=ms, lr=last["lr"],
                            batch=self.config.batch_of(last["iteration"]), loss=sum(finite) / max(1, len(finite)),
                            loss_scale=last["loss_scale"], grad_norm=last["grad_norm"],
                            skipped=sum(r["skipped"] for r in self.interval), nan=sum(r["nan"] for r in self.interval),
                            tokens_per_s=tokens_per_s, mfu_value=self.mfu(tokens_per_s, self._span())), flush=True)
        self.interval = []

    def _span(self) -> float | None:
        """The interval's mean attention span, with document masking."""
        spans = [r["attention_span"] for r in self.interval if "attention_span" in r]
        return sum(spans) / len(spans) if spans else None

    def restart_clock(self) -> None:
        """Evaluations and checkpoints are not training time."""
        self.clock = time.time()

    def mfu(self, tokens_per_s: float, span: float | None = None) -> float | None:
        flops = self.flops_token if span is None else flops_per_token(self.config, param_count(self.config), span)
        return mfu(tokens_per_s, flops, self.peak, self.world_size)

    def tokens_per_s(self) -> float | None:
        """Over the timed iterations (all but the first), else the first alone."""
        if self.timed_s:
            return self.timed_tokens / self.timed_s
        return self.first_tokens / self.first_iter_s if self.first_iter_s else None
