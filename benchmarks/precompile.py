"""Time to first iteration with torch.compile: cold (empty cache, the precompile run) vs warm
(training that loads the cache), with eager mode as a reference, all in the same run.

    python -m benchmarks.precompile [--model tiny] [--cluster local] [--iters 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.precompile import cache_key, precompile
from tasks.train.stage import train


def run(model: str = "tiny", cluster: str = "local", iters: int = 4, device: str = "cpu",
        precision: str = "fp32", vocab_size: int = 512, workdir: str | None = None) -> dict[str, Any]:
    """Fresh processes for every measurement (jobs through submitit), so no in-memory compile
    state carries over from one to the next."""
    eager = Config.from_preset(model, mock_data=True, device=device, precision=precision, vocab_size=vocab_size,
                               train_iters=iters, lr_warmup_iters=0, log_interval=1, eval_interval=10**6,
                               save_interval=10**6, precompile_iters=2)
    where = load_cluster(cluster)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-precompile-") as tmp:
        root = Path(tmp).resolve()
        compiled = dataclasses.replace(eager, compile=True, run_dir=str(root / "run"),
                                       compile_cache_dir=str(root / "cache" / cache_key(eager, where)))
        eager_s = train(dataclasses.replace(eager, run_dir=str(root / "eager")), where).summary
        cold = precompile(compiled, where)
        warm = train(compiled, where, precompiled=cold).summary
    cold_s = cold.time_to_first_iteration_s
    warm_s = warm["time_to_first_iteration_s"]
    return {
        "benchmark": "precompile", "model": model, "cluster": cluster, "world_size": where.world_size,
        "device": device, "precision": precision, "torch": torch.__version__,
        "eager_ttfi_s": round(eager_s["time_to_first_iteration_s"], 3),
        "cold_ttfi_s": round(cold_s, 3), "warm_ttfi_s": round(warm_s, 3),
        "warm_over_cold": round(warm_s / cold_s, 3), "warm_cache_hit": warm["compile_cache_hit"],
        "goal_warm_over_cold_gpu": 0.25,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--cluster", default="local", help="preset in tasks/cluster/presets or a YAML path")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="where temporary run folders go (shared storage on SLURM)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.model, args.cluster, args.iters, args.device, args.precision, args.vocab_size,
                         args.workdir), indent=2))


if __name__ == "__main__":
    main()
