"""What a run will cost, estimated before anything runs: whether each rank's estimated peak memory
(gpt.memory) fits its device, and the bytes it writes under the output root at least (a lower
bound, so that what it refuses cannot fit).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from gpt.config import Config
from gpt.memory import GIB, fitting_layout, rank_memory
from gpt.model import param_count
from tasks.cluster.config import ClusterConfig

# Memory of one device (GiB) of the generations sold in one size (a Trainium's per NeuronCore, the
# unit a rank runs on). Others come in several (a100: 40 or 80, h100: 80 or 94, v100: 16 or 32):
# their memory is known from a name that gives it (a100-40gb) or the preset's device_memory_gib,
# never guessed.
ONE_SIZE_GIB = {"t4": 16, "a10g": 24, "l4": 24, "l40s": 48, "h200": 141, "trn1": 16, "trn2": 24}
_VARIANT_GIB = re.compile(r"-(\d+(?:\.\d+)?)gb?$")
CHECKPOINT_BYTES = 12          # per parameter: the fp32 weight and AdamW's two moments
INDEX_BYTES = 12               # per sample at least: its sample-index entry and its shuffle-index entry


def device_memory(cluster: ClusterConfig) -> tuple[int | None, str]:
    """Bytes one rank may use (None where it cannot be told here) and what says so: the preset's
    figure, the accelerator's name, or for CPU ranks of the local executor this machine's memory
    shared by its tasks."""
    if cluster.job_device in ("cuda", "neuron"):
        name = (cluster.accelerator or "").lower()
        variant = _VARIANT_GIB.search(name)
        if cluster.device_memory_gib is not None:
            gib, source = cluster.device_memory_gib, "device_memory_gib of the cluster preset"
        elif variant:
            gib, source = float(variant.group(1)), f"accelerator {cluster.accelerator}"
        elif cluster.generation in ONE_SIZE_GIB:
            gib, source = ONE_SIZE_GIB[cluster.generation], f"every {cluster.accelerator}"
        else:
            return None, (f"not checked: accelerator {cluster.accelerator or '(not named)'} does not say how much "
                          "memory a device has; name the variant (e.g. a100-40gb) or set device_memory_gib in "
                          "the cluster preset")
        return int(gib * GIB), f"{gib:g} GiB per device ({source})"
    if cluster.kind == "local":
        total = physical_memory()
        return total // cluster.tasks_per_node, (f"this machine has {total / GIB:.0f} GiB for "
                                                 f"{cluster.tasks_per_node} rank(s)")
    return None, "not checked: CPU ranks on a cluster's nodes"


def memory_problem(config: Config, cluster: ClusterConfig) -> str | None:
    """Why the ranks cannot hold this model and batch, or None."""
    limit = device_memory(cluster)
    if limit[0] is None:
        return None
    need = rank_memory(config, cluster.world_size)
    if need.total <= limit[0]:
        return None
    layout = fitting_layout(config, cluster.world_size, limit[0])
    fix = (f"this layout would fit: {layout}" if layout else
           "lower micro_batch_size or seq_length, raise tensor_parallel, or choose a cluster with more devices")
    return (f"each rank needs an estimated {need.arithmetic()}, but {limit[1]}; {fix} "
            f"(the fields micro_batch_size, tensor_parallel, pipeline_parallel, context_parallel, "
            f"data_parallel_mode, activation_checkpointing)")


def written_bytes(config: Config) -> tuple[int, int]:
    """(index, one checkpoint) bytes the run writes under the output root at least."""
    samples = sum(config.num_samples().values())
    return INDEX_BYTES * samples, CHECKPOINT_BYTES * param_count(config)


def physical_memory() -> int:
    """This machine's memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def existing_parent(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists (where it would be created)."""
    return next(p for p in (path, *path.parents) if p.exists())


def free_bytes(path: Path) -> int:
    """Free space where ``path`` is (or would be created)."""
    return shutil.disk_usage(existing_parent(path)).free


def disk_problem(config: Config, root: Path, resuming: bool) -> str | None:
    """Why the output root cannot hold what the run writes, or None. A resumed run wrote its data
    index before: one more checkpoint is what it needs."""
    index, checkpoint = written_bytes(config)
    index = 0 if resuming else index
    free = free_bytes(root)
    if index + checkpoint <= free:
        return None
    return (f"{root} has {free / GIB:,.2f} GiB free, but the run writes at least {(index + checkpoint) / GIB:,.2f} "
            f"GiB there (the data index {index / GIB:,.2f} GiB for {sum(config.num_samples().values()):,} samples, "
            f"a checkpoint {checkpoint / GIB:,.2f} GiB); free space there, or train fewer samples")
