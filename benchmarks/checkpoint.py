"""What a checkpoint costs training: the same run saved synchronously, then asynchronously
(``async_save``), in the same benchmark run. Per save: the seconds training waited (blocking) and,
for the asynchronous saves, the seconds the write went on beside training (background).

    python -m benchmarks.checkpoint [--model gpt3-125m] [--cluster local] [--iters 6] [--save-interval 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.train.stage import train


def run(model: str = "gpt3-125m", cluster: str = "local", iters: int = 6, save_interval: int = 2,
        micro_batch: int = 1, seq_length: int = 512, device: str = "cpu", precision: str = "fp32",
        workdir: str | None = None) -> dict[str, Any]:
    """Jobs through the cluster preset, so the saves go where a run's would (its run folder)."""
    config = Config.from_preset(model, mock_data=True, device=device, precision=precision, train_iters=iters,
                                micro_batch_size=micro_batch, global_batch_size=micro_batch, seq_length=seq_length,
                                lr_warmup_iters=0, log_interval=1, eval_interval=10**6, save_interval=save_interval,
                                keep_last=iters)
    where = load_cluster(cluster)
    figures: dict[str, Any] = {"benchmark": "checkpoint", "model": model, "cluster": cluster,
                               "world_size": where.world_size, "device": device, "precision": precision,
                               "torch": torch.__version__}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-checkpoint-") as tmp:
        for name, asynchronous in (("sync", False), ("async", True)):
            run_dir = Path(tmp).resolve() / name
            summary = train(dataclasses.replace(config, async_save=asynchronous, run_dir=str(run_dir)), where).summary
            saves = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                     if r["kind"] == "save"]
            figures["saves"] = len(saves)
            figures[f"{name}_blocking_s"] = round(statistics.median(s["blocking_s"] for s in saves), 3)
            figures[f"{name}_background_s"] = round(statistics.median(s["background_s"] for s in saves), 3)
            figures[f"{name}_wall_s"] = round(summary["wall_s"], 3)
    figures["async_over_sync_blocking"] = round(figures["async_blocking_s"] / figures["sync_blocking_s"], 3)
    figures["async_over_sync_wall"] = round(figures["async_wall_s"] / figures["sync_wall_s"], 3)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-125m")
    parser.add_argument("--cluster", default="local", help="preset in tasks/cluster/presets or a YAML path")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--save-interval", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--workdir", default=None, help="where temporary run folders go (shared storage on SLURM)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.cluster, args.iters, args.save_interval, 1, args.seq_length, args.device,
                         args.precision, args.workdir), indent=2))


if __name__ == "__main__":
    main()
