"""Where the node-hours of one short training leg go, for the nightly history: the train stage's own
ledger (tasks/train/goodput.py) of the tiny model trained on mock data, so that a change that makes
a start, a save or the stage's following slower shows as a drop in goodput, flagged as any other
regression.

    python -m benchmarks.ledger [--iters 60] [--save-interval 20] [--cluster local]

Runs the train stage as a flow does (its jobs followed, its saves waited for), on the preset's
executor: two ranks on this machine's cores with ``local``. Prints JSON: the leg's goodput
(productive node-seconds over held), the node-seconds held and those of each cause.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.train.goodput import GOODPUT
from tasks.train.stage import train


def run(iters: int = 60, save_interval: int = 20, cluster: str = "local", tasks_per_node: int = 2,
        workdir: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-ledger-") as tmp:
        config = Config.from_preset("tiny", mock_data=True, precision="fp32", device="cpu", vocab_size=512,
                                    num_layers=2, hidden_size=64, seq_length=64, train_iters=iters,
                                    save_interval=save_interval, log_interval=10, eval_interval=10_000, eval_iters=1,
                                    lr_warmup_iters=2, run_dir=str(Path(tmp) / "run"))
        train(config, load_cluster(cluster, nodes=1, tasks_per_node=tasks_per_node))
        (leg,) = json.loads((Path(config.run_dir) / GOODPUT).read_text())["legs"]
    return {"benchmark": "ledger", "cluster": cluster, "iters": iters, "save_interval": save_interval,
            "goodput": leg["goodput"], "held_node_s": round(leg["held_node_seconds"], 3),
            "node_s": {cause: round(seconds, 3) for cause, seconds in leg["node_seconds"].items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger", description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--save-interval", type=int, default=20)
    parser.add_argument("--cluster", default="local")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.iters, args.save_interval, args.cluster), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
