"""Sharded checkpoints with torch.distributed.checkpoint, saved atomically.

Layout: ``<dir>/iter_0000100/`` holds DCP's shard files, ``.metadata`` and a ``COMPLETE`` marker.
A save is written to ``iter_0000100.tmp-<writer>`` (a name of this job's own, so two writers never
share one) and renamed only after every rank finished writing and the marker is on disk, so a save
killed half-way leaves a ``.tmp-*`` folder that is never resumed from (and is removed by a later
save of a newer iteration).

An asynchronous save (``Config.async_save``) blocks training only while the state is copied to host
memory; a thread writes that copy while training goes on, over a process group of its own. DCP's
coordinator (rank 0) writes the metadata only after every rank reported its shards written, so rank
0 then marks and renames the folder. At most one save is in flight: the next one, the end of
training and a stop signal wait for it first (``finish``).

Resuming verifies the newest checkpoint (marker, DCP metadata, every shard file as long as the
metadata says) and falls back to the newest intact one, saying which and why.

DTensors (FSDP, tensor parallel on eager devices) are saved as one tensor each, in shards, and load
into any layout of DTensors or whole tensors. A parameter split by gpt.parallel.xla (XLA devices) is a plain tensor on each
rank: it is saved under its name and its part (``h.0.mlp.c_fc.weight.tp3of32``), and loads only
into the same tensor-parallel size, which a run checks before loading anything.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gpt.config import ConfigError
from gpt.faults import FAULT
from gpt.files import WriteError
from gpt.model import plain_name, tied

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

# torch.distributed.checkpoint and the parallel layouts are imported where a checkpoint is read or
# written, not with this module: importing them registers DTensor's operators (about a second of
# CPU), which the flow's process, reading only folder names and markers, never needs.

MARKER = "COMPLETE"
_NAME = re.compile(r"^iter_(\d{7,})$")
_TMP = re.compile(r"^iter_(\d{7,})\.tmp(?:-.*)?$")


def damage(path: Path) -> str | None:
    """What is wrong with a saved checkpoint folder, or None when its files are all there: the DCP
    metadata reads, and every shard file it names exists and is as long as the metadata says."""
    return _read_and_check(path)[1]


def shared_metadata(path: Path) -> tuple[Metadata | None, str | None]:
    """A checkpoint's DCP metadata and what is wrong with its files (``damage``), read and checked
    by rank 0 alone and sent to every rank: one read of ``.metadata`` and one ``stat`` per shard file
    for the whole job, where every rank doing it would be thousands of each on the shared file
    system (8,000 ranks, 8,000 shard files). XLA's process group sends no objects: each rank reads."""
    if not _shares_objects():
        return _read_and_check(path)
    found = list(_read_and_check(path)) if dist.get_rank() == 0 else [None, None]
    dist.broadcast_object_list(found, src=0)
    return found[0], found[1]


def _shares_objects() -> bool:
    """Whether rank 0 can send the others what it read (XLA's process group sends no objects)."""
    return dist.is_initialized() and dist.get_backend() != "xla"


def _read_and_check(path: Path) -> tuple[Metadata | None, str | None]:
    """Never raises: on rank 0 an error would leave the other ranks waiting for what it sends."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or torn .metadata
        return None, f"its metadata cannot be read: {type(e).__name__}: {e}"
    try:
        return metadata, _missing_shard(path, metadata)
    except OSError as e:
        return None, f"its files cannot be checked: {type(e).__name__}: {e}"


def _missing_shard(path: Path, metadata: Metadata) -> str | None:
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        name = str(item.relative_path)
        needed[name] = max(needed.get(name, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            return f"shard {name} is missing"
        if have < size:
            return f"shard {name} has {have} bytes, the metadata expects at least {size}"
    return None


def rng_state() -> bytes:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def writer_id() -> str:
    """A name for this job's saves, the same on every rank: the SLURM job and its restart (and
    its step, after the first, where the job restarts its ranks inside its allocation), or the
    local executor's job."""
    env = os.environ
    if "SLURM_JOB_ID" in env:
        step = env.get("SLURM_STEP_ID", "0")
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}" + (f".{step}" if step != "0" else "")
    return env.get("SUBMITIT_LOCAL_JOB_ID") or env.get("MASTER_PORT") or str(os.getpid())


class LayoutMismatch(ConfigError):
    """The checkpoint holds this run's tensors under other parts (another tensor-parallel size)."""


def part_names(model: nn.Module) -> dict[str, str]:
    """State-dict key -> saved key, for the parameters split by gpt.parallel.xla."""
    from gpt.parallel.xla import sharded_names

    return {plain_name(name): f"{plain_name(name)}.tp{shard.group.index}of{shard.group.size}"
            for name, shard in sharded_names(model).items()}


def optimizer_names(model: nn.Module) -> dict[str, str]:
    """Optimizer-state key -> saved key: the split parameters' parts, and on a pipeline's last stage
    the output layer's copy of the embedding, whose state is the embedding's (``wte.weight``, as a
    whole model names the tied parameter)."""
    names = part_names(model)
    inner = getattr(model, "module", model)  # unwrapped from DDP
    if inner.wte is None and inner.lm_head is not None and tied(inner.config):
        names["lm_head.weight"] = "wte.weight"
    return names


def _renamed(entries: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {names.get(key, key): value for key, value in entries.items()}


# The optimizer state is kept flat ("state.<parameter>.exp_avg", "param_groups.<parameter>.lr"): each
# entry under its parameter's name, whichever rank or pipeline stage holds it, so it loads into any
# layout (nested, the parameter groups would list each rank's own parameters).
def _optimizer_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _renamed_optimizer(entries: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    out = {}
    for key, value in entries.items():
        kind, _, rest = key.partition(".")
        old = next((name for name in names if rest.startswith(name + ".")), None)
        out[f"{kind}.{names[old]}{rest[len(old):]}" if old else key] = value
    return out


@dataclass
class Saved:
    """A save that is complete: how long it held training up, and how long its write went on while
    training continued (0 for a synchronous save)."""
    iteration: int
    blocking_s: float
    background_s: float


@dataclass
class _Writing:
    iteration: int
    tmp: Path
    final: Path
    blocking_s: float = 0.0
    future: Future | None = None
    returned: float = 0.0               # perf_counter when save returned to training
    written: float = 0.0                # perf_counter when the write ended (and rank 0 marked it)
    ended: threading.Event = field(default_factory=threading.Event)
    failure: BaseException | None = None


class Checkpointer:
    """Saves and loads one run's checkpoints. ``to_host`` moves a state dict's device tensors to the
    host at once where that is one transfer instead of one per tensor (XLA: gpt.backend.Backend.to_host).
    ``asynchronous``: ``save`` returns once the state is staged and its write goes on in a thread."""

    def __init__(self, directory: str | os.PathLike, keep_last: int, rank: int,
                 to_host: Callable[[dict[str, Any]], dict[str, Any]] = lambda state: state,
                 layout: dict[str, Any] | None = None, asynchronous: bool = False) -> None:
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.rank = rank
        self.writer = writer_id()
        self.to_host = to_host
        self.layout = layout or {}      # how the saving job was laid out, kept in each marker (saved_layout)
        self.asynchronous = asynchronous
        # The writes' collectives run beside training's: a group of their own keeps them apart.
        self._group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        self._writing: _Writing | None = None      # the save in flight, or ended and not yet collected
        self._saved: list[Saved] = []

    def complete(self) -> list[Path]:
        """Checkpoints with their marker, newest first."""
        if not self.dir.is_dir():
            return []
        done = [p for p in self.dir.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
        return sorted(done, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return next(iter(self.complete()), None)

    def resume(self, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
               log: Any = print) -> tuple[Path | None, dict[str, Any]]:
        """Load the newest intact checkpoint; a damaged newer one is skipped with a message naming
        it and what is wrong. Returns (the checkpoint loaded or None, the training state). Every
        rank tries the checkpoints rank 0 lists, in the same order (a shared file system may show a
        rank an older listing)."""
        shared = _shares_objects()
        candidates = self.complete() if not shared or dist.get_rank() == 0 else []
        if shared:
            listed = [candidates]
            dist.broadcast_object_list(listed, src=0)
            candidates = listed[0]
        for path in candidates:
            metadata, problem = shared_metadata(path)
            if problem is None:
                try:
                    return path, self.load(path, model, optimizer, train_state, metadata)
                except LayoutMismatch:
                    raise
                except Exception as e:  # noqa: BLE001 - any failure to read it means: try an older one
                    problem = f"{type(e).__name__}: {e}"
            log(f"checkpoint {path} is damaged ({problem}); falling back to an older one", flush=True)
        return None, train_state

    def save(self, iteration: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any]) -> None:
        """Write on every rank: at once, or (asynchronous) from a copy staged in host memory while
        training continues; ``completed`` tells when it is complete. A save still in flight is finished
        first. A folder already at the final name (a damaged checkpoint this run fell back from) is
        kept for inspection under ``iter_N.damaged-<writer>``, a name no resume picks up. A save that
        fails (a full or read-only disk) leaves no temporary folder and raises WriteError naming the
        folder (an asynchronous one from ``finish`` or ``completed``)."""
        import torch.distributed.checkpoint as dcp

        from gpt.parallel.process_group import barrier

        self.finish()
        final = self.dir / f"iter_{iteration:07d}"
        writing = _Writing(iteration, self.dir / f"{final.name}.tmp-{self.writer}", final)
        started = time.perf_counter()
        try:
            if self.rank == 0:
                self.dir.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(writing.tmp, ignore_errors=True)
            barrier()
            # per rank RNG: DCP keeps one copy of identical keys
            state = self.to_host(self._state(model, optimizer, {"train": dict(train_state),
                                                                f"rng_rank{self.rank}": rng_state()}))
            with _single_process_quiet():
                if self.asynchronous:
                    writing.future = dcp.async_save(state, checkpoint_id=writing.tmp, process_group=self._group,
                                                    no_dist=not dist.is_initialized())
                else:
                    dcp.save(state, checkpoint_id=writing.tmp, no_dist=not dist.is_initialized())
                    barrier()  # every rank's shards are on disk
                    self._complete(writing)
        except (OSError, _checkpoint_exception()) as e:
            raise self._failed(writing, e) from e
        writing.returned = time.perf_counter()
        writing.blocking_s = writing.returned - started
        if writing.future is None:
            barrier()
            self._saved.append(Saved(iteration, writing.blocking_s, 0.0))
        else:
            self._writing = writing
            writing.future.add_done_callback(lambda _: self._written(writing))

    def finish(self) -> None:
        """Wait until the save in flight (if any) is complete. A write that failed raises WriteError
        here, on every rank (DCP tells every rank of any rank's failure)."""
        if self._writing is not None:
            self._writing.ended.wait()
            self._collect()

    def completed(self) -> list[Saved]:
        """The saves complete since the last call, without waiting."""
        if self._writing is not None and self._writing.ended.is_set():
            self._collect()
        saved, self._saved = self._saved, []
        return saved

    def _collect(self) -> None:
        writing, self._writing = self._writing, None
        if writing.failure is not None:
            raise self._failed(writing, writing.failure) from writing.failure
        self._saved.append(Saved(writing.iteration, writing.blocking_s,
                                 max(0.0, writing.written - writing.returned)))

    def _written(self, writing: _Writing) -> None:
        """In the writing thread, once this rank's write ended: rank 0 marks the folder complete
        (the coordinator's write ending means every rank's did)."""
        try:
            writing.failure = writing.future.exception()
            if writing.failure is None:
                FAULT.at("write", writing.iteration)
                self._complete(writing)
        except BaseException as e:  # noqa: BLE001 - raised again by finish, on the training thread
            writing.failure = e
        writing.written = time.perf_counter()
        writing.ended.set()

    def _complete(self, writing: _Writing) -> None:
        if self.rank != 0:
            return
        _write_marker(writing.tmp, {"iteration": writing.iteration, "layout": self.layout})
        if writing.final.exists():
            os.rename(writing.final, writing.final.with_name(f"{writing.final.name}.damaged-{self.writer}"))
        os.rename(writing.tmp, writing.final)
        self._prune(writing.iteration)

    def _failed(self, writing: _Writing, error: BaseException) -> WriteError:
        if self.rank == 0:
            shutil.rmtree(writing.tmp, ignore_errors=True)
        cause = _os_error(error)
        why = (cause.strerror or str(cause)) if cause is not None else str(error).splitlines()[0]
        return WriteError(cause.errno if cause is not None else None,
                          f"checkpoint iteration {writing.iteration}: cannot write {writing.tmp}: {why}; free space in "
                          f"{self.dir} (or make it writable) and resume: the run continues from its newest "
                          "complete checkpoint")

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any], metadata: Metadata | None = None) -> dict[str, Any]:
        """Restore model, optimizer and RNG in place; returns the saved training state."""
        rng = f"rng_rank{self.rank}"
        state = self._read(path, model, optimizer, {"train": dict(train_state), rng: b""}, metadata)
        if state[rng]:  # a checkpoint written by fewer ranks lacks this rank's RNG entry
            set_rng_state(state[rng])
        return state["train"]

    def initialise(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Start from another run's checkpoint: its weights, and its optimizer state when
        ``optimizer`` is given; the training state (iteration, samples) and RNG stay this run's."""
        self._read(path, model, optimizer, {})

    def _read(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              extra: dict[str, Any], metadata: Metadata | None = None) -> dict[str, Any]:
        """Load the model (and optimizer) in place, and whatever ``extra`` names; returns the state read."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if metadata is None:
            metadata, problem = shared_metadata(path)
            if metadata is None:
                raise FileNotFoundError(f"checkpoint {path}: {problem}")
        state = self.to_host(self._state(model, optimizer, extra))
        _check_layout(path, state["model"], metadata)
        with _single_process_quiet():
            dcp.load(state, storage_reader=_reader(path, metadata), planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=not dist.is_initialized())
        original = {saved: key for key, saved in part_names(model).items()}
        set_model_state_dict(model, _renamed(state["model"], original))
        if optimizer is not None:
            saved_as = {saved: key for key, saved in optimizer_names(model).items()}
            set_optimizer_state_dict(model, optimizer, _renamed_optimizer(state["optimizer"], saved_as),
                                     options=_optimizer_options())
        return state

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               extra: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds (or what is read of it), under the keys it is saved with."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        parts = part_names(model)
        state: dict[str, Any] = {"model": _renamed(get_model_state_dict(model), parts), **extra}
        if optimizer is not None:  # after the model's, as FSDP needs
            state["optimizer"] = _renamed_optimizer(get_optimizer_state_dict(model, optimizer, options=_optimizer_options()),
                                                    optimizer_names(model))
        return state

    def _prune(self, iteration: int) -> None:
        for p in self.dir.iterdir():
            m = _TMP.match(p.name)
            if m and int(m.group(1)) <= iteration:
                shutil.rmtree(p, ignore_errors=True)  # remains of a killed save, superseded by this one
        done = sorted((p for p in self.dir.iterdir() if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))
        for p in done[:-self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)


def newest_intact(directory: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint in ``directory`` whose files are all there, and what is wrong with
    newer ones (read without loading anything)."""
    skipped = []
    for path in Checkpointer(directory, 1, 0).complete():
        problem = damage(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path.name} is damaged ({problem})")
    return None, skipped


def load_whole_model(path: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint, whole, in one process, shaped as ``template`` (a plain
    model's state dict, or some of its tensors; on the meta device, they are made here): tensors saved whole or in DTensor shards are read as they are, tensors saved
    in parts (``.tpXofN``) are read part by part and joined along the dimension they were split."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted: dict[str, torch.Tensor] = {}
    parts: dict[str, list[str]] = {}
    for key, tensor in template.items():
        if f"model.{key}" in saved:
            wanted[key] = torch.empty(tensor.shape, dtype=tensor.dtype) if tensor.is_meta else tensor
            continue
        found = sorted((k.removeprefix("model.") for k in saved if re.fullmatch(rf"model\.{re.escape(key)}\.tp\d+of\d+", k)),
                       key=lambda k: int(re.search(r"tp(\d+)of", k).group(1)))
        count = int(found[0].rsplit("of", 1)[1]) if found else 0
        if not found or len(found) != count:
            raise ValueError(f"checkpoint {path} has no {key} (whole or in all its parts); "
                             "it was written by another model")
        parts[key] = found
        for name in found:
            wanted[name] = torch.empty(saved[f"model.{name}"].size, dtype=tensor.dtype)
    with _single_process_quiet():
        dcp.load({"model": wanted}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True),
                 no_dist=True)
    whole = {key: wanted[key] for key in template if key not in parts}
    for key, names in parts.items():
        pieces = [wanted[name] for name in names]
        dim = next((d for d, (a, b) in enumerate(zip(pieces[0].shape, template[key].shape)) if a != b), 0)
        whole[key] = torch.cat(pieces, dim=dim)
    return whole


def _reader(path: Path, metadata: Metadata) -> Any:
    """DCP's file reader, with the metadata already read (shared_metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Read(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if metadata.storage_meta is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return Read(str(path))


def _checkpoint_exception() -> type[Exception]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _check_layout(path: Path, model_state: dict[str, Any], metadata: Metadata) -> None:
    """Every model tensor this rank loads is in the checkpoint; else it was written with another
    tensor-parallel size (parts named ``.tpXofN``) or another model, and loading would leave
    those tensors as initialised."""
    saved = metadata.state_dict_metadata
    missing = [key for key in model_state if f"model.{key}" not in saved]
    if missing:
        parts = sorted({key.rsplit(".", 1)[1] for key in saved if re.search(r"\.tp\d+of\d+$", key)})
        written = f"it holds the parts {', '.join(parts[:3])}{'...' if len(parts) > 3 else ''}" if parts else \
            ("it holds whole tensors, as a run without tensor parallel or with DTensor's (CPU and CUDA) saves "
             "them, and this run splits them in parts (tensor parallel on an XLA device)")
        raise LayoutMismatch(
            f"checkpoint {path} cannot resume this run: it lacks {len(missing)} of this rank's tensors (e.g. "
            f"{missing[0]}); {written}. Resume with the tensor_parallel and model of the run that wrote it "
            "(its config.json), or start a new run (another run_name)")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group, although one process is what was meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_marker(folder: Path, content: dict[str, Any]) -> None:
    marker = folder / MARKER
    with open(marker, "w") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())


def saved_layout(path: Path) -> dict[str, Any]:
    """How the job that saved a checkpoint was laid out (world_size, nodes, tensor_parallel,
    data_parallel_mode, device, parts), as its marker says; empty for checkpoints saved without it."""
    try:
        return json.loads((path / MARKER).read_text()).get("layout") or {}
    except (OSError, ValueError):
        return {}


def iteration_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def _os_error(error: BaseException) -> OSError | None:
    """The operating system's error behind a failed save, from DCP's per-rank failures too."""
    found = [failure for failure, _ in error.failures.values()] \
        if isinstance(error, _checkpoint_exception()) else [error]
    for e in found:
        while e is not None and not isinstance(e, OSError):
            e = e.__cause__ or e.__context__
        if e is not None:
            return e
    return None
