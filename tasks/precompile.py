"""Precompile: a short graph-extraction run on the nodes and layout of training.

GPU/CPU: a few torch.compile steps whose compiled artifacts gpt saves into ``compile_cache_dir``;
training loads them. Trainium: the same command under ``neuron_parallel_compile`` with a Neuron
cache per node (``NEURON_CC_FLAGS=--cache_dir=<cache>/<node>``). The cache is keyed by model
shape, parallel layout, torch version and device type; an existing cache skips the stage, and
training is pinned to the nodelist the compile ran on.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from gpt.config import ARCHITECTURE, Config, model_name
from gpt.files import write_json
from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import JOBS_FOLDER, JobError, submit
from tasks.cluster.launch import DistributedTask, job_launch
from tasks.common.digest import digest
from tasks.common.retry import worth_retrying
from tasks.common.run_context import run_logger

MARKER = "precompile.json"
# Fields that change the compiled graphs (global batch size only changes how often they run).
GRAPH_FIELDS = ("model", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                "max_position_embeddings", "micro_batch_size", "precision", "fp8_recipe", "fp8_layers", "tensor_parallel",
                "data_parallel_mode", "activation_checkpointing", "activation_checkpointing_scope", "compile_scope")
# Fields that change the graphs too, counted when set (a cache filled before them keeps its key).
GRAPH_FIELDS_WHEN_SET = {"context_parallel": 1, "reset_attention_mask": False, "reset_position_ids": False}


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
    parts.update({f: getattr(config, f) for f, unset in GRAPH_FIELDS_WHEN_SET.items() if getattr(config, f) != unset})
    parts.update(padded_vocab_size=config.padded_vocab_size(), nodes=cluster.nodes,
                 tasks_per_node=cluster.tasks_per_node, torch=torch.__version__, device=cluster.job_device)
    name = model_name(config)
    if name != config.model:           # a shape of its own: the preset's name does not say it
        parts.update({f: getattr(config, f) for f in ARCHITECTURE})
    return f"{name}-{cluster.job_device}-{cluster.nodes}x{cluster.tasks_per_node}-{digest(parts, length=12)}"


def _manifest(cache_dir: Path, hit: bool, marker: dict[str, Any], device: str) -> PrecompileManifest:
    key = cache_dir.name
    return PrecompileManifest(cache_dir=str(cache_dir), key=key, hit=hit, nodelist=marker.get("nodelist"),
                              time_to_first_iteration_s=marker.get("time_to_first_iteration_s"),
                              device=device, digest=digest(key, marker.get("nodelist"), length=None))


def job_config(config: Config) -> Config:
    """The graph-extraction run: a few steps in ``<run_dir>/precompile``, no checkpoints. On
    Trainium torch.compile is already off in the plan: the graphs come from neuron_parallel_compile
    tracing the XLA program."""
    return dataclasses.replace(config, precompile=True, run_dir=str(Path(config.run_dir) / "precompile"))


def without_spares(cluster: ClusterConfig) -> ClusterConfig:
    """The compile job's nodes: a hang there is not restarted in the allocation, so no spare."""
    return cluster.model_copy(update={"spare_nodes": 0})


def sbatch_script(config: Config, cluster: ClusterConfig) -> str:
    """The batch script the compile job would be submitted with (nothing is submitted)."""
    work = Path(job_config(config).run_dir)
    launch, python = job_launch(without_spares(cluster), config.compile_cache_dir, compile_graphs=True)
    return launch.sbatch_script(work / JOBS_FOLDER, job_name=f"precompile-{model_name(config)}", python=python)


def precompile(config: Config, cluster: ClusterConfig) -> PrecompileManifest:
    """Fill ``config.compile_cache_dir`` for this model and layout, or find it already filled."""
    if not config.compile_cache_dir:
        raise ValueError("precompile: config.compile_cache_dir is empty; name the cache folder "
                         f"(e.g. <cache root>/{cache_key(config, cluster)})")
    logger = run_logger()
    cache_dir = Path(config.compile_cache_dir)
    marker_path = cache_dir / MARKER
    if marker_path.exists():
        marker = json.loads(marker_path.read_text())
        logger.info("compile cache hit: %s (compiled on %s)", cache_dir, marker.get("nodelist") or "this host")
        return _manifest(cache_dir, True, marker, cluster.job_device)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return _compile(job_config(config), cluster, cache_dir)


def _compile(job: Config, cluster: ClusterConfig, cache_dir: Path) -> PrecompileManifest:
    """The compile job (``submit`` owns its folder while it runs), then the cache's marker."""
    logger = run_logger()
    logger.info("compile cache miss: compiling %s for %d x %d %s tasks into %s",
                job.model, cluster.nodes, cluster.tasks_per_node, cluster.job_device, cache_dir)
    started = time.time()
    launch, python = job_launch(without_spares(cluster), str(cache_dir), compile_graphs=True)
    summary, job_id, nodes = submit(DistributedTask(job.to_dict()), launch, run_dir=Path(job.run_dir),
                                    job_name=f"precompile-{job.model}", python=python)
    if summary.get("status") != "completed":
        raise JobError(f"precompile job {job_id} returned status {summary.get('status')!r}")
    marker = {"key": cache_dir.name, "job_id": job_id, "nodelist": nodes if cluster.kind == "slurm" else None,
              "time_to_first_iteration_s": summary.get("time_to_first_iteration_s"),
              "torch": torch.__version__, "device": cluster.job_device, "wall_s": round(time.time() - started, 3)}
    write_json(cache_dir / MARKER, marker)
    logger.info("compiled in %.1fs (time to first iteration %.2fs) on %s", marker["wall_s"],
                marker["time_to_first_iteration_s"] or 0, nodes)
    return _manifest(cache_dir, False, marker, cluster.job_device)


# The cache on shared storage decides whether work is needed: a Prefect result cache could
# claim a hit for a cache directory that was deleted since.
precompile_task = task(precompile, name="precompile", retries=1, retry_delay_seconds=5,
                       retry_condition_fn=worth_retrying, cache_policy=NO_CACHE)
