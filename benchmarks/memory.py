"""Memory per rank: the plan's estimate (gpt.memory) against what each rank of a real run holds.

Every layout trains a few iterations with ``python -m gpt.train`` on gloo ranks of this machine
(CPU, fp32, mock data). Each rank reports its resident set's high-water mark (``VmHWM``) above what
it held before training started (Python, torch and gpt imported); the layout's figure is its
largest rank. The estimate is that of the heaviest stage, as the plan checks it. The ranks run with
glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so that a large buffer freed (FSDP's
all-gathers, one per block and step) goes back to the system, as a GPU's caching allocator reuses it:
with the default dynamic threshold the heap keeps them, and FSDP2's peak on CPU reads 1.5x higher.

``python -m benchmarks.memory [--model gpt3-125m] [--seq-length 256] [--set FIELD=VALUE ...]`` prints
JSON: per layout the estimate, the measured peak, and their ratio. ``--set`` gives any Config field, such
as a Llama block of GPT-3 125M's size (``--model tiny-llama --set num_layers=12 --set hidden_size=768 ...``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpt.config import Config
from gpt.config.overrides import parse_overrides
from gpt.memory import GIB, rank_memory
from gpt.parallel.process_group import free_port
from gpt.tokenizer import GPT2_VOCAB_SIZE

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [  # (world size, fields)
    (1, {}),
    (1, {"activation_checkpointing": True}),
    (2, {"data_parallel_mode": "fsdp"}),
    (2, {"data_parallel_mode": "ddp"}),
    (2, {"pipeline_parallel": 2}),
    (2, {"pipeline_parallel": 2, "activation_checkpointing": True}),
    (2, {"context_parallel": 2}),
    (2, {"context_parallel": 2, "activation_checkpointing": True}),
]
# Runs in each rank: the high-water mark above the resident set once everything is imported.
RANK = """
import atexit, json, os, sys
import gpt.train
def _hwm():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
def _rss():
    line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024
_before = _rss()
atexit.register(lambda: print("MEMORY " + json.dumps({"rank": int(os.environ["RANK"]), "bytes": _hwm() - _before})))
sys.exit(gpt.train.cli(sys.argv[1:]))
"""


def measure(fields: dict, world_size: int, work: Path) -> int:
    """The largest rank's peak resident memory above its start, in bytes."""
    config_file = work / "config.json"
    config_file.write_text(json.dumps({**fields, "run_dir": str(work / "run")}))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, "--config", str(config_file)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(r),
                                   "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(world_size)]
    peaks = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a rank exited {p.returncode}:\n{out[-3000:]}")
        peaks += [json.loads(line[len("MEMORY "):])["bytes"] for line in out.splitlines() if line.startswith("MEMORY ")]
    return max(peaks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-125m")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any gpt Config field")
    args = parser.parse_args(argv)
    overrides, problems = parse_overrides(args.set)
    if problems:
        parser.error("; ".join(message for _, message in problems))
    base = {"model": args.model, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch,
            "global_batch_size": 4 * args.micro_batch, "train_iters": args.iters, "lr_warmup_iters": 0,
            "mock_data": True, "benchmark": True, "device": "cpu", "precision": "fp32", "vocab_size": GPT2_VOCAB_SIZE,
            "log_interval": args.iters, "save_interval": 10 ** 6, **overrides}
    rows = []
    for world, change in LAYOUTS:
        fields = {**base, **change}
        estimate = rank_memory(Config.from_dict(fields), world)
        with tempfile.TemporaryDirectory(prefix="memory-") as tmp:
            measured = measure(fields, world, Path(tmp))
        rows.append({"world_size": world, "layout": change, "estimate_gib": round(estimate.total / GIB, 3),
                     "measured_gib": round(measured / GIB, 3), "estimate_over_measured": round(estimate.total / measured, 3),
                     "stage": estimate.stage})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "overrides": overrides, "seq_length": args.seq_length, "micro_batch": args.micro_batch,
                      "peak": "resident set above the rank's start (VmHWM)", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
