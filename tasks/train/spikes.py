"""Loss spikes and runs of non-finite losses, handled by the run: the follower flags them from the
metrics records, the job is stopped without saving, and the run goes back to the newest checkpoint
before them with their samples left out of the train order, so that those samples never come
back while every other sample keeps its place and is seen once.

A spike is a loss above ``spike_factor`` x the median of the ``spike_window`` finite losses before
it (not flagged until that many are seen); ``nan_steps`` non-finite losses in a row are flagged
together. Their samples are named by their id (their position in the train order before any
rollback), with the prefix and documents they were drawn from. ``<run>/skipped.json`` keeps every
rollback and the ids left out; each later job of the run (a resume, a longer leg, another layout)
trains on the order without them. After ``max_rollbacks`` the run fails with the report instead.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
from collections import deque
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer, iteration_of
from gpt.config import Config
from gpt.data import DataIndex, GPTDataset
from gpt.files import write_json
from gpt.metrics import truncate_after
from tasks.cluster.jobs import JobError, StopJob
from tasks.common.records import Count, read_record
from tasks.events import Incident
from tasks.index import build_indices

SKIPPED = "skipped.json"
ROLLED_BACK = "rolled-back"      # <run>/rolled-back/<n>/: the checkpoints newer than a rollback's
SPIKE_ROWS = 64           # samples listed in the training-spike artifact; skipped.json keeps them all


@dataclasses.dataclass(frozen=True)
class Spike:
    """Iterations flagged together, what their losses were, and what they trained on."""
    kind: str                               # "loss spike" or "non-finite losses"
    iterations: list[int]
    losses: list[float]
    median: float | None                    # of the window before them
    samples: list[int] = dataclasses.field(default_factory=list)
    documents: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # per sample: prefix, documents
    resumed_from: int | None = None         # the checkpoint's iteration the run went back to (0: the start)
    data_offset: int = 0                    # the phase's first sample: its samples are ids in the phase's order

    def line(self) -> str:
        its = (f"iteration {self.iterations[0]}" if len(self.iterations) == 1 else
               f"iterations {self.iterations[0]}-{self.iterations[-1]}")
        losses = ", ".join(f"{x:.4g}" for x in self.losses)
        against = f" against a median of {self.median:.4g}" if self.median is not None else ""
        return f"{self.kind} at {its}: loss {losses}{against}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "losses": [x if math.isfinite(x) else str(x) for x in self.losses]}

    def incident(self, what_next: str) -> Incident:
        """The spike as the run reports it: the iterations, the losses, and each sample with the
        documents it came from; ``what_next``: what the run does about it."""
        rows = "\n".join(f"| {d['sample']} | `{d['prefix']}` | {', '.join(map(str, d['documents']))} |"
                         for d in self.documents[:SPIKE_ROWS])
        more = len(self.documents) - SPIKE_ROWS
        return Incident("gpt.training.spike", "training-spike", f"{self.line()}: {what_next}",
                        {k: v for k, v in self.to_dict().items() if k != "documents"}, self.line(),
                        f"**{self.line()}**: {what_next}\n\n| sample | prefix | documents |\n|---|---|---|\n{rows}\n"
                        + (f"\n{more} more samples: see `skipped.json` in the run folder\n" if more > 0 else ""))


class SpikeFound(StopJob):
    """The follower's stop of a job that spiked."""
    state = "SPIKED"

    def __init__(self, spike: Spike) -> None:
        super().__init__(spike.line())
        self.spike = spike


class CannotRollBack(JobError):
    """A spike the run does not roll back: it fails with the report."""
    transient = False

    def __init__(self, message: str, spike: Spike) -> None:
        super().__init__(message)
        self.spike = spike


class TooManyRollbacks(CannotRollBack):
    """A spike past ``max_rollbacks``."""


class SpikeWatch:
    """Flags a spike or a run of non-finite losses in the train records, in order. Records up to
    ``since`` (what the run's newest checkpoint holds: earlier legs, judged under their own
    settings) only fill the window."""

    def __init__(self, config: Config, since: int = 0) -> None:
        self.factor, self.nan_steps, self.since = config.spike_factor, config.nan_steps, since
        self.window: deque[tuple[int, float]] = deque(maxlen=config.spike_window)
        self.non_finite: list[tuple[int, float]] = []

    def add(self, record: dict[str, Any]) -> Spike | None:
        iteration, loss = record["iteration"], float(record["lm_loss"])
        median = statistics.median(x for _, x in self.window) if self.window else None
        if iteration <= self.since:
            if math.isfinite(loss):
                self.window.append((iteration, loss))
            return None
        if not math.isfinite(loss):
            self.non_finite.append((iteration, loss))
            if self.nan_steps and len(self.non_finite) >= self.nan_steps:
                its, losses = (list(x) for x in zip(*self.non_finite))
                return Spike("non-finite losses", its, losses, median)
            return None
        self.non_finite = []
        full = len(self.window) == self.window.maxlen
        if self.factor and full and median is not None and loss > self.factor * median:
            return Spike("loss spike", [iteration], [loss], median)
        self.window.append((iteration, loss))
        return None

    def rewind(self, iteration: int) -> None:
        """Forget what came after ``iteration`` (the run went back to it)."""
        self.since = iteration
        kept = [(i, x) for i, x in self.window if i <= iteration]
        self.window.clear()
        self.window.extend(kept)
        self.non_finite = []


class _Rollback(BaseModel):
    """A rollback as ``Spike.to_dict`` writes it in skipped.json."""
    model_config = ConfigDict(extra="forbid")
    kind: Literal["loss spike", "non-finite losses"]
    iterations: list[Count]
    losses: list[float | Literal["nan", "inf", "-inf"]]
    median: float | None
    samples: list[Count]
    documents: list[dict[str, Any]]
    resumed_from: Count | None = None
    data_offset: Count = 0


class _Skipped(BaseModel):
    rollbacks: list[_Rollback]


def rollbacks(run_dir: Path) -> list[dict[str, Any]]:
    """The run's rollbacks so far (``<run>/skipped.json``), oldest first."""
    return read_record(run_dir / SKIPPED, _Skipped, "restore it from a copy: the run leaves these samples out of its "
                       "order, and without it they come back", {"rollbacks": []})["rollbacks"]


def skipped_samples(run_dir: Path, data_offset: int = 0) -> list[int]:
    """The sample ids the run's rollbacks left out of the train order of the phase whose first
    sample is ``data_offset`` (a run in one phase has one order)."""
    return sorted({s for r in rollbacks(run_dir) if r.get("data_offset", 0) == data_offset for s in r["samples"]})


def skipping(config: Config, skipped: list[int]) -> Config:
    """``config`` on the train order without ``skipped``: its index rebuilt with them left out (the
    indices it is made of are found again, not rebuilt) where it does not leave them out already."""
    if not skipped or config.mock_data or not config.data_index:
        return config
    index = DataIndex.read(config.data_index)
    if index.splits["train"].skipped == skipped:
        return config
    if not index.built_with:
        raise ValueError(f"{config.data_index}: this index does not record how it was built; build it again with "
                         "`python -m tasks.index` (or run the flow) before the run can leave samples out")
    built = build_indices(**index.built_with, out_dir=str(Path(config.data_index).parent), skipped=skipped)
    return dataclasses.replace(config, data_index=built.path)


def roll_back(spike: Spike, config: Config, run_dir: Path) -> tuple[Spike, Config]:
    """Go back to the newest checkpoint before the spike, with its samples left out of the order.
    The order without them is built first (what can fail); then newer checkpoints are moved to
    ``<run>/rolled-back/<n>/``, the metrics records after the checkpoint cut off (and kept there), and the rollback
    recorded in ``<run>/skipped.json``. Returns the spike with its samples and documents named, and
    the config to resume with. Raises CannotRollBack with the report past ``max_rollbacks``, or
    when no checkpoint before the spike is kept."""
    done = rollbacks(run_dir)
    train = GPTDataset.from_index(config.data_index, "train")
    positions = [i % len(train) for it in spike.iterations
                 for i in range(config.samples_after(it - 1) - config.data_offset,
                                config.samples_after(it) - config.data_offset)]
    named = [{"sample": train.position(i), "prefix": prefix, "documents": docs}
             for i in positions for prefix, docs in [train.documents(i)]]
    spike = dataclasses.replace(spike, samples=[n["sample"] for n in named], documents=named,
                                data_offset=config.data_offset)
    if len(done) >= config.max_rollbacks:
        raise TooManyRollbacks(f"{spike.line()}, after {len(done)} rollback(s) (max_rollbacks {config.max_rollbacks}): "
                               f"not rolled back again. {_named(spike, run_dir, done)}", spike)
    before, first = min(spike.iterations) - 1, config.data_offset // config.global_batch_size  # in its phase
    complete = [iteration_of(p) for p in Checkpointer(run_dir / "checkpoints", 1, 0).complete()]
    kept = next((it for it in complete if first <= it <= before), 0 if first == 0 else None)
    if kept is None or (kept == 0 and complete):
        raise CannotRollBack(f"{spike.line()}: no checkpoint before it " + (f"and from its phase's start (iteration "
                             f"{first}) on " if first else "") + f"is kept (the oldest is iteration {complete[-1] if complete else '-'}; "
                             f"keep_last {config.keep_last}), so it is not rolled back. "
                             f"{_named(spike, run_dir, done)}", spike)
    resumed = skipping(config, sorted({*skipped_samples(run_dir, config.data_offset), *spike.samples}))
    n = len(done) + 1
    while (run_dir / ROLLED_BACK / str(n)).exists():     # a rollback cut short before it was recorded
        n += 1
    (run_dir / ROLLED_BACK / str(n)).mkdir(parents=True, exist_ok=True)
    for path in sorted((run_dir / "checkpoints").glob("iter_*")):
        if _iteration_or_none(path) is None or _iteration_or_none(path) > kept:
            shutil.move(str(path), run_dir / ROLLED_BACK / str(n) / path.name)
    truncate_after(run_dir / "metrics.jsonl", kept, cut_to=run_dir / ROLLED_BACK / str(n) / "metrics.jsonl")
    spike = dataclasses.replace(spike, resumed_from=kept)
    write_json(run_dir / SKIPPED, {"rollbacks": [*done, spike.to_dict()]})
    return spike, resumed


def _iteration_or_none(path: Path) -> int | None:
    try:
        return iteration_of(path)
    except (AttributeError, ValueError):
        return None


def _named(spike: Spike, run_dir: Path, done: list[dict[str, Any]], shown: int = 8) -> str:
    """Where the report names what the spike trained on."""
    ids = ", ".join(map(str, spike.samples[:shown]))
    more = f" and {len(spike.samples) - shown} more" if len(spike.samples) > shown else ""
    earlier = f"; {run_dir / SKIPPED} the earlier rollbacks" if done else ""
    return f"The samples it trained on are {ids}{more} (the training-spike artifact names their documents{earlier})"
