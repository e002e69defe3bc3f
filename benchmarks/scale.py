"""What grows with the number of ranks and the size of a corpus or a model, measured on the project's code.

Each section runs real code in a temporary folder and reports what it writes, reads or takes:

- ``heartbeats``: one rank's heartbeat file (``gpt.heartbeat.Heartbeat.write``, every phase entered
  once) and one check of the job's follower that reads every rank's file (``tasks.cluster.hang.HangWatch.check``
  of a new watch, median of 5), at each rank count;
- ``metrics``: one ``train`` record of ``metrics.jsonl`` and the TensorBoard bytes of one iteration
  (``gpt.metrics.MetricsWriter``, mean over 1,000 iterations), Megatron's log line, and at each rank
  count one ``ranks`` record (every rank's busy time and node) with the time to parse it and feed it
  to ``tasks.cluster.hang.Stragglers`` (median of 5), and how fast a resume reads back 100 such records at
  the largest rank count (``gpt.metrics.truncate_after``);
- ``index``: the index stage (``tasks.index.build_indices``) on benchmarks.index's synthetic corpus
  (log-normal document lengths, 2,000 tokens per document, a sparse ``.bin``) at each token count:
  the first build, which also reads the whole ``.bin`` once for its largest token id, and a build of
  other indices of the same content; index file bytes, per billion tokens, and a linear
  extrapolation to 1e12 tokens (through the two largest counts measured, or in proportion to a
  single one);
- ``checkpoints``: a real one-process checkpoint (``python -m gpt.train``, one iteration, saved by
  ``gpt.checkpoint.Checkpointer`` with DCP): bytes per parameter, the tensor data per parameter, the
  tied output layer's copy, files per rank; then, by arithmetic on those figures and
  ``gpt.model.param_count``, the checkpoint of each large preset and its share per rank (spread evenly)
  at a few rank counts;
- ``slurm`` (with ``--slurm JOBID``): the follower's own state query (``tasks.cluster.slurm.slurm_state``) for
  that job, median of 20 calls.

``python -m benchmarks.scale [--ranks 8 1000 8000] [--tokens 1e9 1e10] [--slurm JOBID]`` prints JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.index import synthetic_sizes, write_synthetic_dataset
from benchmarks.memory import measure

RANKS = (8, 1000, 8000)
TOKENS = (1_000_000_000, 10_000_000_000)
PRESETS = ("gpt3-175b", "gpt-310.1b")
PRESET_RANKS = (1024, 8000)
EXTRAPOLATE_TO = 1_000_000_000_000
TOKENS_PER_DOCUMENT = 2000
RANKS_PER_NODE = 8
PHASES = ("data", "forward", "backward", "sync", "log", "save", "load")
# The model saved for the checkpoint figures: small enough for seconds on one core.
CHECKPOINT_MODEL = {"model": "tiny", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
                    "seq_length": 16, "vocab_size": 256}


def _node(rank: int) -> str:
    return f"gpu-st-p5-{rank // RANKS_PER_NODE + 1:04d}"


def _median_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, fastest) of ``repeats`` calls, in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times), min(times)


@contextlib.contextmanager
def _environ(name: str) -> Iterator[None]:
    """Restore an environment variable that the block sets."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- heartbeats ----------------------------------------------------------------------------------
def heartbeats(work: Path, ranks: Sequence[int], checks: int = 5) -> list[dict[str, Any]]:
    """Per rank count: one rank's heartbeat file, and one follower check over all of them."""
    from gpt.heartbeat import FOLDER, Heartbeat
    from tasks.cluster import hang
    from tasks.cluster.hang import HangWatch

    per_s = getattr(hang, "HEARTBEATS_PER_S", None)     # the follower's cap on heartbeat files read a second
    rows = []
    for n in ranks:
        run = work / f"heartbeats-{n}"
        (run / FOLDER).mkdir(parents=True)
        start = time.perf_counter()
        with _environ("SLURMD_NODENAME"):
            for rank in range(n):
                os.environ["SLURMD_NODENAME"] = _node(rank)
                beat = Heartbeat(run, rank, "123456.0")
                for phase in PHASES:
                    beat.enter(phase, 100_000 if phase == "data" else None)
                beat.write()
        write_s = time.perf_counter() - start
        sizes = [p.stat().st_size for p in (run / FOLDER).glob("rank-*.json")]
        # a new watch each time: its first check reads every file (later ones may skip the read)
        median, fastest = _median_ms(lambda: HangWatch(run, "123456", n, None).check("RUNNING"), checks)  # noqa: B023 - called within this iteration
        row = {"ranks": n, "files": len(sizes), "file_bytes": round(sum(sizes) / len(sizes), 1),
               "all_files_bytes": sum(sizes), "write_one_ms": round(1e3 * write_s / n, 3),
               "check_ms_median": round(median, 2), "check_ms_min": round(fastest, 2)}
        if per_s is not None:
            row["read_every_s"] = round(n / per_s, 2)
        rows.append(row)
    return rows


# -- metrics -------------------------------------------------------------------------------------
def _train_record(rng: random.Random, iteration: int) -> dict[str, Any]:
    """A long run's figures: six-digit iterations, nine-digit sample counts."""
    return {"iteration": iteration, "consumed_samples": 1536 * iteration, "lm_loss": 2.0 + rng.random(),
            "lr": 6e-5 * rng.random(), "grad_norm": rng.random(), "loss_scale": 1.0,
            "elapsed_ms": 10_000 + 100 * rng.random(), "tokens_per_s": 3.1e5 * (1 + rng.random() / 10),
            "mfu": 0.4 + rng.random() / 10, "skipped": 0, "nan": 0}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def metrics(work: Path, ranks: Sequence[int], iterations: int = 1000, reads: int = 5,
            records_for_resume: int = 100) -> dict[str, Any]:
    """Bytes of a train record, TensorBoard bytes per iteration, a ranks record at each rank count,
    and how fast a resume reads the file back (``gpt.metrics.truncate_after``, fastest of 3)."""
    from gpt.metrics import MetricsWriter, train_line, truncate_after
    from tasks.cluster.hang import Stragglers

    rng = random.Random(0)
    empty, run = work / "metrics-empty", work / "metrics"
    MetricsWriter(str(empty), True, 0).close()         # TensorBoard's file header, without any scalar
    writer = MetricsWriter(str(run), True, 0)
    first = 100_001
    for iteration in range(first, first + iterations):
        writer.train(_train_record(rng, iteration))
    train_bytes = (run / "metrics.jsonl").stat().st_size

    rows = []
    for n in ranks:
        before = (run / "metrics.jsonl").stat().st_size
        writer.ranks(first + iterations, 10, [900 + 200 * rng.random() for _ in range(n)],
                     [_node(r) for r in range(n)])
        with open(run / "metrics.jsonl", "rb") as f:
            f.seek(before)
            text = f.read()

        def parse() -> None:
            Stragglers().add(json.loads(text))  # noqa: B023 - called within this iteration

        median, fastest = _median_ms(parse, reads)
        rows.append({"ranks": n, "ranks_record_bytes": len(text), "bytes_per_rank": round(len(text) / n, 1),
                     "parse_ms_median": round(median, 3), "parse_ms_min": round(fastest, 3)})
    for i in range(records_for_resume):   # a long run's records at the largest rank count, then a resume reads them
        writer.ranks(first + iterations + 10 * i, 10, [900 + 200 * rng.random() for _ in range(max(ranks))],
                     [_node(r) for r in range(max(ranks))])
    writer.close()
    size = (run / "metrics.jsonl").stat().st_size
    resume_s = min(_timed(lambda: truncate_after(run / "metrics.jsonl", 10 ** 12)) for _ in range(3))
    tensorboard = _folder_bytes(run / "tensorboard") - _folder_bytes(empty / "tensorboard")
    line = train_line(iteration=first, total=146_484, consumed=1536 * first, elapsed_ms=10_034.5, lr=5.87e-5,
                      batch=1536, loss=2.134, loss_scale=1.0, grad_norm=0.231, skipped=0, nan=0,
                      tokens_per_s=313_567.2, mfu_value=0.4312)
    return {"iterations": iterations, "train_record_bytes": round(train_bytes / iterations, 1),
            "tensorboard_bytes_per_iteration": round(tensorboard / iterations, 1),
            "log_line_bytes": len(line) + 1, "ranks_records": rows,
            "resume": {"metrics_bytes": size, "read_s": round(resume_s, 4), "mb_per_s": round(size / resume_s / 1e6, 1)}}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- index ---------------------------------------------------------------------------------------
def _index_bytes_by_kind(folder: Path) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for p in folder.iterdir():
        kind = next((k for k in ("document_index", "sample_index", "shuffle_index") if k in p.name), "other")
        kinds[kind] = kinds.get(kind, 0) + p.stat().st_size
    return kinds


def index(work: Path, tokens: Sequence[int], seq_length: int = 2048, split: str = "969,30,1",
          seed: int = 1234) -> dict[str, Any]:
    """The index stage at each token count, per billion tokens, and extrapolated linearly to 1e12."""
    from tasks.index import build_indices

    shares = [float(x) for x in split.split(",")]
    rows, points = [], []
    for count in sorted({int(t) for t in tokens}):
        folder = work / f"index-{count}"
        folder.mkdir()
        documents = max(1, count // TOKENS_PER_DOCUMENT)
        prefix = str(folder / "synthetic")
        write_synthetic_dataset(prefix, synthetic_sizes(count, documents))
        # one epoch of each split, as benchmarks.index asks
        num_samples = {name: int(count * share / sum(shares) / seq_length * 0.99)
                       for name, share in zip(("train", "valid", "test"), shares)}
        start = time.perf_counter()
        manifest = build_indices([prefix], split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                                 out_dir=str(folder / "index"))
        first_s = time.perf_counter() - start
        kinds = _index_bytes_by_kind(folder / "index")
        # Another seed: new indices of the same content, whose largest token id is known by now.
        start = time.perf_counter()
        build_indices([prefix], split=split, seq_length=seq_length, seed=seed + 1, num_samples=num_samples,
                      out_dir=str(folder / "index"))
        build_s = time.perf_counter() - start
        total = sum(kinds.values())
        billions = count / 1e9
        rows.append({"tokens": count, "documents": documents, "samples": sum(manifest.num_samples.values()),
                     "first_build_s": round(first_s, 4), "build_s": round(build_s, 4),
                     "index_bytes": total, "index_bytes_by_kind": kinds,
                     "first_build_s_per_billion_tokens": round(first_s / billions, 4),
                     "build_s_per_billion_tokens": round(build_s / billions, 4),
                     "index_bytes_per_billion_tokens": round(total / billions)})
        points.append((count, build_s, total, first_s))
        for p in folder.glob("synthetic.*"):
            p.unlink()
    return {"seq_length": seq_length, "split": split, "tokens_per_document": TOKENS_PER_DOCUMENT,
            "measured": rows, "extrapolated": _extrapolate(points, EXTRAPOLATE_TO)}


def _extrapolate(points: list[tuple[int, float, int, float]], to: int) -> dict[str, Any]:
    """Build time, index bytes and first build time at ``to`` tokens from (tokens, seconds, bytes,
    seconds) points: the straight line through the two largest counts, or through the origin and a
    single one."""
    low, high = points[-2:] if len(points) > 1 else [(0, 0.0, 0, 0.0), points[-1]]

    def line(i: int) -> float:
        return high[i] + (high[i] - low[i]) / (high[0] - low[0]) * (to - high[0])

    return {"method": "linear extrapolation", "through_tokens": [p[0] for p in (low, high) if p[0]],
            "tokens": to, "build_s": round(line(1), 1), "first_build_s": round(line(3), 1), "index_bytes": round(line(2))}


# -- checkpoints ---------------------------------------------------------------------------------
def _train_once(work: Path, fields: dict[str, Any]) -> Path:
    """Train one iteration on one CPU process and save (as benchmarks.memory runs gpt.train);
    returns the checkpoint folder."""
    measure({**fields, "micro_batch_size": 2, "global_batch_size": 2, "train_iters": 1, "lr_warmup_iters": 0,
             "mock_data": True, "precision": "fp32", "device": "cpu", "log_interval": 1, "eval_interval": 1000,
             "eval_iters": 1, "save_interval": 1}, 1, work)
    saved = sorted((work / "run" / "checkpoints").glob("iter_*"))
    if not saved:
        raise RuntimeError("gpt.train saved no checkpoint")
    return saved[-1]


def _read_checkpoint(folder: Path) -> dict[str, Any]:
    """Files, stored bytes by entry, and tensor data bytes (elements x element size) by tensor entry that
    is not a scalar, from DCP's metadata."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata()
    stored: dict[str, int] = {}
    for idx, item in metadata.storage_data.items():
        stored[idx.fqn] = stored.get(idx.fqn, 0) + item.length
    data = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata) and len(entry.size):   # scalars (AdamW's step) aside
            element = torch.empty((), dtype=entry.properties.dtype).element_size()
            data[fqn] = element * int(np.prod(entry.size, dtype=np.int64))
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    return {"files": files, "stored": stored, "data": data}


def checkpoints(work: Path, presets: Sequence[str] = PRESETS,
                preset_ranks: Sequence[int] = PRESET_RANKS) -> dict[str, Any]:
    """A real checkpoint's bytes per parameter and files per rank, and the large presets' by arithmetic."""
    from gpt.config import Config
    from gpt.model import param_count

    config = Config.from_dict(CHECKPOINT_MODEL)
    params = param_count(config)
    folder = _train_once(work, CHECKPOINT_MODEL)
    saved = _read_checkpoint(folder)
    total = sum(saved["files"].values())
    shards = [name for name in saved["files"] if name.endswith(".distcp")]
    world = 1
    # the output layer is tied to the embedding: a copy saved under its own name is counted apart
    copy_bytes = saved["data"].get("model.lm_head.weight", 0) if "model.wte.weight" in saved["data"] else 0
    data_bytes = sum(saved["data"].values()) - copy_bytes
    entries = len(saved["stored"])
    overhead = sum(saved["stored"].values()) - sum(saved["data"].values())
    vocab_hidden = config.padded_vocab_size() * config.hidden_size
    measured = {
        "model": CHECKPOINT_MODEL, "parameters": params, "world_size": world, "checkpoint": folder.name,
        "files": saved["files"], "bytes": total, "bytes_per_parameter": round(total / params, 3),
        "tensor_data_bytes_per_parameter": round(data_bytes / params, 4),
        "tied_copy_bytes": copy_bytes, "tied_copy_bytes_per_vocab_hidden": round(copy_bytes / vocab_hidden, 3),
        "entries": entries, "other_bytes_per_entry": round(overhead / entries, 1),
        "shard_files_per_rank": len(shards) / world, "shared_files": len(saved["files"]) - len(shards),
    }
    arithmetic = []
    for name in presets:
        preset = Config.from_dict({"model": name})
        count = param_count(preset)
        copy = measured["tied_copy_bytes_per_vocab_hidden"] * preset.padded_vocab_size() * preset.hidden_size
        size = data_bytes / params * count + copy
        arithmetic.append({
            "model": name, "parameters": count, "checkpoint_bytes": round(size), "tied_copy_bytes": round(copy),
            "per_rank": [{"ranks": r, "bytes_per_rank": round(size / r),
                          "files": round(measured["shard_files_per_rank"] * r) + measured["shared_files"]}
                         for r in preset_ranks]})
    return {"measured": measured,
            "arithmetic": {"method": "tensor data bytes per parameter x parameters + the tied copy; "
                                     "per rank: spread evenly over the ranks", "presets": arithmetic}}


# -- slurm ---------------------------------------------------------------------------------------
def slurm(job_id: str, calls: int = 20) -> dict[str, Any]:
    """The follower's SLURM state query for one job, timed."""
    from tasks.cluster.slurm import slurm_state

    try:
        state = slurm_state(job_id)
        median, fastest = _median_ms(lambda: slurm_state(job_id), calls)
    except (OSError, subprocess.SubprocessError) as e:
        return {"job": job_id, "unavailable": f"{type(e).__name__}: {e}"}
    return {"job": job_id, "state": list(state) if state else None, "calls": calls,
            "median_ms": round(median, 2), "min_ms": round(fastest, 2)}


# -- the whole benchmark -------------------------------------------------------------------------
def run(ranks: Sequence[int] = RANKS, tokens: Sequence[int] = TOKENS, slurm_job: str | None = None,
        slurm_calls: int = 20, presets: Sequence[str] = PRESETS,
        preset_ranks: Sequence[int] = PRESET_RANKS) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        result = {
            "benchmark": "scale",
            "load_average_1m": round(os.getloadavg()[0], 2),
            "heartbeats": heartbeats(work, ranks),
            "metrics": metrics(work, ranks),
            "index": index(work, tokens),
            "checkpoints": checkpoints(work, presets, preset_ranks),
        }
    if slurm_job is not None:
        result["slurm"] = slurm(slurm_job, slurm_calls)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=list(RANKS),
                        help="rank counts for the heartbeat and ranks-record figures")
    parser.add_argument("--tokens", type=lambda s: int(float(s)), nargs="+", default=list(TOKENS),
                        help="corpus sizes for the index figures (1e11 takes minutes and a 200 GB sparse file)")
    parser.add_argument("--slurm", metavar="JOBID", help="also time the follower's SLURM query for this job")
    parser.add_argument("--slurm-calls", type=int, default=20)
    args = parser.parse_args(argv)
    print(json.dumps(run(ranks=args.ranks, tokens=args.tokens, slurm_job=args.slurm, slurm_calls=args.slurm_calls),
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
