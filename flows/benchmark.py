"""The `benchmark` flow: run a suite of benchmarks, append the figures to a history, flag regressions.

Each benchmark is a module with `run(**params) -> dict` (benchmarks/tokenize.py, index.py, sync.py,
precompile.py, checkpoint.py, ledger.py and gpt/bench.py). Their numeric results, with the machine's facts and the
parameters, become one JSON line in `<history>/history.jsonl` (a folder or an s3:// prefix). The
flow run shows a table against the previous and the best run on the same hardware, regressions
beyond `regression_threshold` flagged, and a trend plot per metric.

`python -m flows.benchmark --quick` runs a small suite in a few minutes and prints the line it appended.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Annotated, Any, Literal

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from benchmarks.gpu import CASES as GPU_CASES
from tasks import benchmark_history
from tasks.common.figures import png_markdown
from tasks.common.secrets import hide_in_logs

MODULES = {
    "tokenize": "benchmarks.tokenize",
    "index": "benchmarks.index",
    "sync": "benchmarks.sync",
    "precompile": "benchmarks.precompile",
    "checkpoint": "benchmarks.checkpoint",
    "train": "gpt.bench",
    "ledger": "benchmarks.ledger",
}
BenchmarkName = Literal["tokenize", "index", "sync", "precompile", "checkpoint", "train", "ledger"]


class BenchmarkSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: BenchmarkName = Field(description="Which benchmark: " + ", ".join(f"{k} ({v})" for k, v in MODULES.items()))
    label: str | None = Field(None, description="Prefix of its metrics in the history (default: the name)")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the module's run()")

    @property
    def key(self) -> str:
        return self.label or self.name


# The nightly suite: every stage at a size that says something about throughput.
NIGHTLY = [
    BenchmarkSpec(name="tokenize"),
    BenchmarkSpec(name="index"),
    BenchmarkSpec(name="sync", params={"large_count": 2, "large_mb": 512}),
    BenchmarkSpec(name="precompile"),
    BenchmarkSpec(name="checkpoint"),
    BenchmarkSpec(name="train", label="train-tiny", params={"model": "tiny", "steps": 20}),
    BenchmarkSpec(name="train", label="train-gpt3-125m", params={"model": "gpt3-125m", "micro_batch": 4, "steps": 10}),
    BenchmarkSpec(name="ledger"),
]
# One GPU's training figures (benchmarks/gpu.py's cases), which benchmarks/reference.jsonl holds for
# the GPUs they were measured on: a GPU node's run is compared against them.
GPU = [BenchmarkSpec(name="train", label=case.name, params=case.params) for case in GPU_CASES]
# A few minutes on two CPU cores: small inputs, one repeat.
QUICK = [
    BenchmarkSpec(name="tokenize", params={"corpus_mb": 2, "random_words_mb": 2, "repeats": 1, "slow_sample_mb": 0.5}),
    BenchmarkSpec(name="index", params={"tokens": 200_000_000, "documents": 500_000, "sample_idx_tokens": 50_000_000,
                                        "sample_idx_documents": 50_000, "repeats": 1, "megatron": False}),
    BenchmarkSpec(name="sync", params={"small_count": 20, "small_mb": 0.1, "large_count": 1, "large_mb": 8, "workers": 16,
                                       "repeats": 1}),
    BenchmarkSpec(name="train", label="train-tiny", params={"model": "tiny", "steps": 5, "warmup": 2, "vocab_size": 8192}),
]


def _run_one(spec: BenchmarkSpec) -> dict:
    module = importlib.import_module(MODULES[spec.name])
    return module.run(**spec.params)


# Never cached: a benchmark measures this run.
run_benchmark = task(_run_one, name="run-benchmark", task_run_name="{spec.key}", log_prints=True,
                     cache_policy=NO_CACHE)


@flow(name="benchmark", log_prints=True)
def benchmark(
    suite: list[BenchmarkSpec] = NIGHTLY,
    history: str = "runs/benchmarks",
    endpoint_url: str | None = None,
    regression_threshold: Annotated[float, Field(gt=0)] = 0.10,
) -> dict:
    """Run the suite, append one history line, and report changes against earlier runs.

    Args:
        suite: Benchmarks to run, each a module's run() with keyword arguments.
        history: Folder or s3://bucket/prefix holding history.jsonl.
        endpoint_url: S3-compatible endpoint of an s3:// history (credentials from the environment).
        regression_threshold: Flag metrics worse than the previous run by more than this fraction.
    """
    hide_in_logs()          # no log line of the run holds a secret of this process
    keys = [s.key for s in suite]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"suite: labels {duplicates} appear more than once; give each entry its own label")
    store = benchmark_history.History(history, endpoint_url=endpoint_url)
    past = benchmark_history.reference() + store.read()
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for spec in suite:
        start = time.perf_counter()
        state = run_benchmark(spec, return_state=True)
        seconds[spec.key] = round(time.perf_counter() - start, 3)
        if state.is_completed():
            results[spec.key] = state.result()
        else:
            errors[spec.key] = str(state.message or state.name)
    record = {
        "time": benchmark_history.now(), "flow_run_id": str(flow_run.get_id() or ""), "machine": benchmark_history.machine_facts(),
        "params": {"suite": [s.model_dump() for s in suite], "regression_threshold": regression_threshold},
        "results": results, "metrics": benchmark_history.flatten(results), "errors": errors, "wall_s": seconds,
    }
    store.append(record)
    rows = benchmark_history.compare(record, past, regression_threshold)
    regressions = [r["metric"] for r in rows if r["regression"]]
    create_table_artifact(
        benchmark_history.table_rows(rows), key="benchmark-results",
        description=f"{len(rows)} metrics on {record['machine']['cpu']} / {record['machine']['gpu'] or 'no GPU'}; "
                    f"regressions (worse than {regression_threshold:.0%} vs previous): "
                    f"{', '.join(regressions) or 'none'}; failed: {', '.join(errors) or 'none'}; history {store.uri}",
    )
    same = [h for h in past if benchmark_history.same_hardware(h.get("machine", {}), record["machine"])] + [record]
    png = benchmark_history.trend_png(same, sorted(record["metrics"]))
    if png:
        create_markdown_artifact(f"## Benchmark trends ({len(same)} runs on this hardware)\n\n"
                                 f"{png_markdown(png, 'trend per metric')}\n", key="benchmark-trends")
    for metric in regressions:
        print(f"REGRESSION {metric}: " + next(json.dumps(r) for r in rows if r["metric"] == metric))
    if errors:
        raise RuntimeError(f"benchmarks failed: {errors}; the others were recorded in {store.uri}")
    return {"record": record, "regressions": regressions, "history": store.uri}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flows.benchmark", description=__doc__.split("\n\n")[0])
    suites = p.add_mutually_exclusive_group()
    suites.add_argument("--quick", action="store_true", help="a small suite that runs in a few minutes")
    suites.add_argument("--gpu", action="store_true", help="one GPU's training figures (benchmarks/gpu.py's cases)")
    p.add_argument("--only", nargs="+", choices=sorted(MODULES), help="run only these benchmarks of the suite")
    p.add_argument("--history", default="runs/benchmarks", help="folder or s3://bucket/prefix")
    p.add_argument("--endpoint-url")
    p.add_argument("--threshold", type=float, default=0.10, help="regression threshold (fraction)")
    a = p.parse_args(argv)
    from flows.cli import exit_status
    from flows.local_server import ensure_api

    def run() -> int:
        ensure_api()        # without PREFECT_API_URL: a temporary server that ends with this process
        suite = QUICK if a.quick else GPU if a.gpu else NIGHTLY
        if a.only:
            suite = [s for s in suite if s.name in a.only]
        out = benchmark(suite=suite, history=a.history, endpoint_url=a.endpoint_url, regression_threshold=a.threshold)
        print(json.dumps(out["record"], indent=1, sort_keys=True))
        print(f"appended to {out['history']}; regressions: {', '.join(out['regressions']) or 'none'}")
        return 0
    return exit_status("benchmark", run)


if __name__ == "__main__":
    sys.exit(main())
