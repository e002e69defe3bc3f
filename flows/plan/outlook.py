"""What a run's folder says will happen before anything is submitted: a new run, a resume from its
newest intact checkpoint (under the same layout or another one), or nothing, the run being
trained to its length already; which checkpoints a run's layout cannot load; and the phases it
declares after its first (``check_phases``): each starts at an iteration of the run (``now``: where
it has reached), after the one before and before the run's end; its prefixes are readable where the
operator allows; a longer context needs rotary positions; a phase that has started is declared as
it was (tasks.train.phases keeps them in the run folder).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from flows.plan.boundary import Boundary, check_prefix, check_source
from flows.plan.params import DataParams, PhaseParams, Problems, TrainingParams
from gpt.checkpoint import iteration_of, newest_intact, saved_layout
from gpt.config import Config
from tasks.cluster.config import ClusterConfig
from tasks.common.records import DamagedRecord
from tasks.common.uri import is_s3
from tasks.sync import local_path
from tasks.train import phases as run_phases
from tasks.train.stage import trained_summary

_PART = re.compile(r"\.tp\d+of(\d+)$")


@dataclass(frozen=True)
class Outlook:
    kind: Literal["new", "resume", "trained"]
    message: str
    done: int = 0          # the iteration training starts from


def outlook(run_dir: Path, config: Config, cluster: ClusterConfig, copy: tuple[int, str] | None = None) -> Outlook:
    """What training will do in ``run_dir`` with this configuration on this cluster; ``copy``: the
    iteration and place of the newest checkpoint copied to S3 (flows.plan.output.copy_to_resume)."""
    newest, skipped = newest_intact(run_dir / "checkpoints")
    notes = "".join(f"; {s}, skipped" for s in skipped)
    total = config.total_iters
    if copy is not None and (newest is None or iteration_of(newest) < copy[0]):
        held = "no intact checkpoint" if newest is None else f"iteration {iteration_of(newest):,} at newest"
        return Outlook("resume", f"resumes run {run_dir.name} from iteration {copy[0]:,} of {total:,}, from its "
                                 f"checkpoint copied to {copy[1]} (the run folder holds {held}){notes}", copy[0])
    if newest is None:
        start = f" from {config.init_from}" if config.init_from else (
            f" from {config.init_from_hf}" if config.init_from_hf else "")
        return Outlook("new", f"new run {run_dir.name}{start}, {total:,} iterations{notes}")
    done = iteration_of(newest)
    if trained_summary(run_dir, total, newest) is not None:
        return Outlook("trained", f"run {run_dir.name} is already trained to iteration {done:,} ({total:,} asked): "
                                  f"nothing to train{notes}", done)
    if done >= total:
        return Outlook("resume", f"run {run_dir.name} is trained to iteration {done:,} but left no summary: a short "
                                 f"job evaluates it{notes}", done)
    saved = saved_layout(newest)
    was = (f"saved by {saved['nodes']} x {saved['world_size'] // saved['nodes']} ranks, TP {saved['tensor_parallel']}"
           if saved else "saved by an earlier version, layout not recorded")
    now = f"now {cluster.nodes} x {cluster.tasks_per_node}, TP {config.tensor_parallel}"
    return Outlook("resume", f"resumes run {run_dir.name} from iteration {done:,} of {total:,} ({was}; {now})"
                             f"{_extension(run_dir, config)}{notes}", done)


def _extension(run_dir: Path, config: Config) -> str:
    """What a changed length does to the schedule, when the length changed."""
    try:
        before = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    unit = "train_iters" if config.train_iters is not None else "train_samples"
    decay = "lr_decay_iters" if unit == "train_iters" else "lr_decay_samples"
    old, new = before.get(unit), getattr(config, unit)
    if old is None or old == new:
        return ""
    follows = ("the LR decay follows the new length" if getattr(config, decay) == new
               else f"the LR decay stays fixed at {decay}={getattr(config, decay):,}")
    return f"; {unit} {old:,} -> {new:,}: {follows}"


def parts_of(checkpoint: Path) -> int | None:
    """The tensor-parallel size whose parts a checkpoint holds (Trainium's split layers save each
    rank's part under its own name), or None when it holds whole tensors."""
    saved = saved_layout(checkpoint)
    if "parts" in saved:
        return saved["tensor_parallel"] if saved["parts"] else None
    from torch.distributed.checkpoint import FileSystemReader

    for key in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata:
        m = _PART.search(key)
        if m:
            return int(m.group(1))
    return None


def cannot_load(checkpoint: Path, config: Config) -> str | None:
    """Why a run with ``config`` cannot load ``checkpoint``, or None. Whole tensors (DDP, FSDP,
    DTensor tensor parallel) load under any layout; Trainium's parts only under their own size."""
    parts = parts_of(checkpoint)
    if parts is None or (config.device == "neuron" and config.tensor_parallel == parts):
        return None
    return (f"checkpoint {checkpoint} holds Trainium tensor-parallel parts of TP {parts}, which only a run on "
            f"device neuron with tensor_parallel={parts} loads (this run: {config.device}, TP "
            f"{config.tensor_parallel}); resume with --tp {parts} on a Trainium preset, or export it (python -m "
            "gpt.export joins the parts) and start a new run from the export with init_from_hf")


def check_phases(phases: list[PhaseParams], data: DataParams, training: TrainingParams, config: Config, run_dir: Path,
                 root: Path, boundary: Boundary, problems: Problems,
                 branch_from: Path | None = None) -> tuple[PhaseParams, ...]:
    """The phases with every start an iteration; each problem a line naming its phase. A leg that
    names none goes on with the run's; a new run branched from another's checkpoint has that run's
    phases started by then."""
    newest, _ = newest_intact(run_dir / "checkpoints")
    source = run_dir
    if newest is None and branch_from is not None:
        source, newest = branch_from.parent.parent, branch_from
    reached = iteration_of(newest) if newest is not None else 0
    try:
        recorded = [p for p in run_phases.declared(source) if source == run_dir or p["start"] < reached]
    except DamagedRecord as e:
        problems.append(f"phases: {e}")
        return ()
    phases = phases or [PhaseParams(**p) for p in recorded]
    if phases and (config.train_samples is not None or training.train_samples is not None):
        problems.append("phases: phases start at iterations; set training.train_iters instead of train_samples")
        return ()
    if phases and config.ramp is not None:
        problems.append("phases: a phase counts its samples from whole global batches; train without "
                        "rampup_batch_size, or without phases")
        return ()
    resolved: list[PhaseParams] = []
    for i, phase in enumerate(phases):
        start = phase.start
        if start == "now":      # once recorded, the phase keeps the start it was given
            before = recorded[i] if i < len(recorded) else None
            start = before["start"] if before == {**phase.model_dump(), "start": (before or {}).get("start")} else reached
            if not start:
                problems.append(f"phases[{i}].start: now, but run {run_dir.name} has no checkpoint yet; give an "
                                "iteration")
                continue
        _check_phase(i, phase, start, resolved[-1].start if resolved else 0, config, root, boundary, problems)
        resolved.append(phase.model_copy(update={"start": start}))
    problems += run_phases.rewritten(recorded, [p.model_dump() for p in resolved], reached, run_dir.name)
    if resolved and not problems:
        problems.warnings += run_phases.shortfalls(_legs(data, resolved, config), config.global_batch_size, data.split)
    return tuple(resolved)


def _check_phase(i: int, phase: PhaseParams, start: int, previous: int, config: Config, root: Path,
                 boundary: Boundary, problems: Problems) -> None:
    where = f"phases[{i}]"
    if not previous < start < config.total_iters:
        problems.append(f"{where}.start: {start}: a phase starts after the phase before it (iteration {previous}) "
                        f"and before the run's end (training.train_iters {config.total_iters})")
    if phase.seq_length is not None and config.position_embedding_type != "rope":
        problems.append(f"{where}.seq_length: {config.model} has learned position embeddings for "
                        f"{config.max_position_embeddings} positions; a phase may change the context of a "
                        "model with rotary positions (e.g. tiny-llama, llama3-8b)")
    for j, p in enumerate(phase.prefixes):
        check_prefix(f"{where}.prefixes[{j}].prefix", p.prefix, root, boundary, problems)
    for j, source in enumerate(phase.sources):
        check_source(f"{where}.sources[{j}]", source, root, boundary, problems)


def _legs(data: DataParams, phases: list[PhaseParams], config: Config) -> list[tuple[int, int, list, int]]:
    """Each phase's start, end, blend of local prefixes (the run's own tokenized sources are not
    known before they are tokenized) and sequence length, the first phase the run's."""
    blend = [(p.weight, local_path(p.prefix)) for p in data.prefixes if not is_s3(p.prefix)]
    starts = [0, *(p.start for p in phases)]
    legs, seq = [(0, starts[1], blend, config.seq_length)], config.seq_length
    for phase, end in zip(phases, [*starts[2:], config.total_iters]):
        if not phase.keeps_blend:
            blend = [(p.weight, local_path(p.prefix)) for p in phase.prefixes if not is_s3(p.prefix)]
        seq = phase.seq_length or seq
        legs.append((phase.start, end, blend, seq))
    return legs
