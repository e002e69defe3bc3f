"""Precompile: a short graph-extraction run on the nodes and layout of training.

GPU/CPU: a few torch.compile steps whose compiled artifacts gpt saves into ``compile_cache_dir``;
training loads them. Trainium: the same command under ``neuron_parallel_compile`` with a Neuron
cache per node (``NEURON_CC_FLAGS=--cache_dir=<cache>/<node>``). The cache is keyed by model
shape, parallel layout, torch version and device type; an existing cache skips the stage, and
training is pinned to the nodelist the compile ran on.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from gpt.config import Config
from gpt.files import write_json
from tasks.cluster import ClusterConfig
from tasks.jobs import DistributedTask, JobError, neuron_python, retryable, submit
from tasks.run_context import run_logger
from tasks.run_owner import RunOwner

MARKER = "precompile.json"
# Fields that change the compiled graphs (global batch size only changes how often they run).
GRAPH_FIELDS = ("model", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "max_position_embeddings", "micro_batch_size", "precision", "tensor_parallel",
                "data_parallel_mode", "activation_checkpointing")


class PrecompileManifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    cache_dir: str
    key: str
    hit: bool
    nodelist: str | None
    time_to_first_iteration_s: float | None
    device: str
    digest: str


def cache_key(config: Config, cluster: ClusterConfig) -> str:
    parts: dict[str, Any] = {f: getattr(config, f) for f in GRAPH_FIELDS}
    parts.update(padded_vocab_size=config.padded_vocab_size(), nodes=cluster.nodes,
                 tasks_per_node=cluster.tasks_per_node, torch=torch.__version__, device=cluster.job_device)
    blob = json.dumps(parts, sort_keys=True).encode()
    return f"{config.model}-{cluster.job_device}-{cluster.nodes}x{cluster.tasks_per_node}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _manifest(cache_dir: Path, key: str, hit: bool, marker: dict[str, Any], device: str) -> PrecompileManifest:
    digest = hashlib.sha256(json.dumps([key, marker.get("nodelist")], sort_keys=True).encode()).hexdigest()
    return PrecompileManifest(cache_dir=str(cache_dir), key=key, hit=hit, nodelist=marker.get("nodelist"),
                              time_to_first_iteration_s=marker.get("time_to_first_iteration_s"),
                              device=device, digest=digest)


def compile_config(config: Config, cache_dir: Path, run_dir: Path) -> Config:
    """The graph-extraction run: few steps, no checkpoints; metrics and TensorBoard go to run_dir.
    On Trainium the graphs come from neuron_parallel_compile tracing the XLA program, with
    torch.compile off (inductor generates no code for XLA devices; torch-neuronx has no
    torch.compile)."""
    return dataclasses.replace(config, compile=config.device != "neuron", precompile=True,
                               compile_cache_dir=str(cache_dir), run_dir=str(run_dir))


def launcher(cluster: ClusterConfig, cache_dir: Path) -> str | None:
    """How each task's Python starts: under neuron_parallel_compile on Trainium, plain elsewhere."""
    return neuron_python(str(cache_dir), compile_graphs=True) if cluster.job_device == "neuron" else None


def sbatch_script(config: Config, cluster: ClusterConfig, *, cache_root: str, run_dir: str) -> str:
    """The batch script the compile job would be submitted with (nothing is submitted)."""
    cache_dir = Path(cache_root) / cache_key(config, cluster)
    folder = Path(run_dir) / "precompile" / "jobs"
    return cluster.sbatch_script(folder, job_name=f"precompile-{config.model}", python=launcher(cluster, cache_dir))


def precompile(config: Config, cluster: ClusterConfig, *, cache_root: str, run_dir: str) -> PrecompileManifest:
    """Fill the compile cache for this model and layout, or find it already filled."""
    logger = run_logger()
    key = cache_key(config, cluster)
    cache_dir = Path(cache_root).resolve() / key
    marker_path = cache_dir / MARKER
    if marker_path.exists():
        marker = json.loads(marker_path.read_text())
        logger.info("compile cache hit: %s (compiled on %s)", cache_dir, marker.get("nodelist") or "this host")
        return _manifest(cache_dir, key, True, marker, cluster.job_device)
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(run_dir).resolve() / "precompile"
    with RunOwner(work):
        return _compile(config, cluster, key, cache_dir, work)


def _compile(config: Config, cluster: ClusterConfig, key: str, cache_dir: Path, work: Path) -> PrecompileManifest:
    logger = run_logger()
    marker_path = cache_dir / MARKER
    cfg = compile_config(config, cache_dir, work)
    cfg.validate(world_size=cluster.world_size)
    cfg.save(str(work / "config.json"))
    logger.info("compile cache miss: compiling %s for %d x %d %s tasks into %s",
                config.model, cluster.nodes, cluster.tasks_per_node, cluster.job_device, cache_dir)
    started = time.time()
    summary, job_id, nodes = submit(DistributedTask(cfg.to_dict()), cluster, run_dir=work,
                                    job_name=f"precompile-{config.model}", python=launcher(cluster, cache_dir))
    if summary.get("status") != "completed":
        raise JobError(f"precompile job {job_id} returned status {summary.get('status')!r}")
    marker = {"key": key, "job_id": job_id, "nodelist": nodes if cluster.kind == "slurm" else None,
              "time_to_first_iteration_s": summary.get("time_to_first_iteration_s"),
              "torch": torch.__version__, "device": cluster.job_device, "wall_s": round(time.time() - started, 3)}
    write_json(marker_path, marker)
    logger.info("compiled in %.1fs (time to first iteration %.2fs) on %s", marker["wall_s"],
                marker["time_to_first_iteration_s"] or 0, nodes)
    return _manifest(cache_dir, key, False, marker, cluster.job_device)


# The cache on shared storage decides whether work is needed: a Prefect result cache could
# claim a hit for a cache directory that was deleted since.
precompile_task = task(name="precompile", retries=1, retry_delay_seconds=5, retry_condition_fn=retryable,
                       cache_policy=NO_CACHE)(precompile)
