"""What a checkpoint costs training: the same run saved synchronously, asynchronously
(``async_save``), and asynchronously with each save copied to S3 by the train stage (``output.uri``:
the two tiers of tasks.train.remote_checkpoints), in the same benchmark run. Per save: the seconds
training waited (blocking) and, for the asynchronous saves, the seconds the write went on beside
training (background); for the copies, the seconds from a save complete to its copy complete and
verified (``copy_lag_s``, by the store's clock, whole seconds).

    python -m benchmarks.checkpoint [--model gpt3-125m] [--cluster local] [--iters 6] [--save-interval 2]
                                    [--endpoint-url URL]

Without --endpoint-url a SeaweedFS server is started on loopback for the copies (benchmarks.sync),
at the lowest CPU priority, as the copies are (tasks.train.copies): on a cluster neither shares the
ranks' cores, here all of them share two.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.sync import s3_endpoint
from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.sync import Remote
from tasks.train.remote_checkpoints import RemoteTier
from tasks.train.stage import train

LEGS = (("sync", False, False), ("async", True, False), ("async_s3", True, True))   # name, async_save, copies


def run(model: str = "gpt3-125m", cluster: str = "local", iters: int = 6, save_interval: int = 2,
        micro_batch: int = 1, seq_length: int = 512, device: str = "cpu", precision: str = "fp32",
        workdir: str | None = None, endpoint_url: str | None = None) -> dict[str, Any]:
    """Jobs through the cluster preset, so the saves go where a run's would (its run folder)."""
    config = Config.from_preset(model, mock_data=True, device=device, precision=precision, train_iters=iters,
                                micro_batch_size=micro_batch, global_batch_size=micro_batch, seq_length=seq_length,
                                lr_warmup_iters=0, log_interval=1, eval_interval=10**6, save_interval=save_interval,
                                keep_last=iters)
    where = load_cluster(cluster)
    figures: dict[str, Any] = {"benchmark": "checkpoint", "model": model, "cluster": cluster,
                               "world_size": where.world_size, "device": device, "precision": precision,
                               "torch": torch.__version__}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-checkpoint-") as tmp, \
            s3_endpoint(endpoint_url, Path(tmp)) as (endpoint, server_group):
        if server_group is not None:        # the store is another machine's on a cluster: here it yields
            os.setpriority(os.PRIO_PGRP, server_group, 19)
        remote = Remote(endpoint)
        bucket = f"bench-checkpoint-{Path(tmp).name.lower().replace('_', '-')}"
        remote.client().create_bucket(Bucket=bucket)
        for name, asynchronous, copied in LEGS:
            run_dir = Path(tmp).resolve() / name
            tier = RemoteTier(f"s3://{bucket}/{name}", remote, keep_last=iters) if copied else None
            summary = train(dataclasses.replace(config, async_save=asynchronous, run_dir=str(run_dir)), where,
                            tier=tier).summary
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            saves = [r for r in records if r["kind"] == "save"]
            figures[f"{name}_step_ms"] = round(statistics.median(r["elapsed_ms"] for r in records
                                                                 if r["kind"] == "train" and r["iteration"] > 1), 1)
            figures["saves"] = len(saves)
            figures[f"{name}_blocking_s"] = round(statistics.median(s["blocking_s"] for s in saves), 3)
            figures[f"{name}_background_s"] = round(statistics.median(s["background_s"] for s in saves), 3)
            figures[f"{name}_wall_s"] = round(summary["wall_s"], 3)
            if tier is not None:
                figures["copies_missing"] = len(summary.get("checkpoint_copies_missing", []))
                figures["copy_lag_s"] = copy_lag(tier, saves)
    figures["async_over_sync_blocking"] = round(figures["async_blocking_s"] / figures["sync_blocking_s"], 3)
    figures["async_over_sync_wall"] = round(figures["async_wall_s"] / figures["sync_wall_s"], 3)
    figures["s3_over_async_blocking"] = round(figures["async_s3_blocking_s"] / figures["async_blocking_s"], 3)
    figures["s3_over_async_wall"] = round(figures["async_s3_wall_s"] / figures["async_wall_s"], 3)
    return figures


def copy_lag(tier: RemoteTier, saves: list[dict[str, Any]]) -> float:
    """The median seconds from a save's record to its copy's COMPLETE object, by the store's clock."""
    bucket, _, prefix = tier.uri.removeprefix("s3://").partition("/")
    client = tier.remote.client()
    lags = []
    for save in saves:
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/checkpoints/iter_{save['iteration']:07d}/COMPLETE")
        lags.append(head["LastModified"].timestamp() - save["time"])
    return round(statistics.median(lags), 1)


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
    parser.add_argument("--endpoint-url", default=None, help="an S3 endpoint for the copies (default: a SeaweedFS "
                                                            "server started here)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.cluster, args.iters, args.save_interval, 1, args.seq_length, args.device,
                         args.precision, args.workdir, args.endpoint_url), indent=2))


if __name__ == "__main__":
    main()
