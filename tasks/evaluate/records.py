"""What a run folder keeps of its evaluation: what every checkpoint is evaluated on
(``evaluation.json``, written by the pretrain flow), the results (``eval/iter_N.json``), the saves
pinned until they are scored (``eval/pinned/``), and which checkpoint an evaluation scores. Training
pins its saves and reads the results as they come; the evaluate stage writes them."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import MARKER as COMPLETE
from gpt.checkpoint import Checkpointer, iteration_of, newest_intact
from gpt.files import replaced_folder, write_json
from tasks.cluster.config import ClusterConfig, load_cluster
from tasks.cluster.jobs import JOBS_FOLDER
from tasks.cluster.record import JOBS_RECORD
from tasks.common.errors import ParameterError
from tasks.common.records import DamagedRecord, read_record
from tasks.common.run_context import run_logger
from tasks.trackers import Item

SPEC = "evaluation.json"
FOLDER = "eval"
PINNED = "pinned"
# The evaluation's work in progress, which an upload of the run folder leaves out (paths in the run
# folder, fnmatch): saves pinned until they are scored, the evaluation jobs' records and logs, and
# files being written (gpt.files writes ``.NAME.tmp-*`` and renames it when complete). Its results
# (eval/iter_N.json) written by then go with the upload.
IN_PROGRESS = (f"{FOLDER}/{PINNED}/*", f"{FOLDER}/{JOBS_FOLDER}/*", f"{FOLDER}/{JOBS_RECORD}", f"{FOLDER}/.*")


class JobCluster(BaseModel):
    """Where the evaluation jobs run, as the run chose it: the operator's preset by name and the
    fields the form set. What a job runs with (setup lines, environment, container, executor) is
    read again from the operator's presets when the job is built, never from the run folder."""
    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str
    overrides: dict[str, Any] = {}

    def resolved(self) -> ClusterConfig:
        """The evaluation job's resources (ClusterConfig.eval_job) from the presets of this process's
        operator; the overrides pass the form's allow-list again."""
        return load_cluster(self.preset, **self.overrides).eval_job()


class EvaluationSpec(BaseModel):
    """What every checkpoint of a run is evaluated on, and where: written once by the pretrain flow."""
    model_config = ConfigDict(frozen=True)

    sets: dict[str, str]                  # name -> tokenized prefix (the run's tokenizer)
    set_tokens: int                       # at most this many tokens of each set
    tasks: list[str]                      # lm-eval task names
    task_paths: list[str]                 # folders of lm-eval task YAMLs (TaskManager's include_path)
    limit: int | None                     # lm-eval: at most this many examples per task
    every: int                            # evaluate every Nth checkpoint saved, and the last
    tokenizer: dict[str, str | None]      # the run's tokenizer files, as gpt.export takes them
    cluster: JobCluster                   # where its jobs run

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / SPEC, self.model_dump())

    @staticmethod
    def remove(run_dir: Path) -> None:
        """The run is evaluated no more (its latest start names no evaluation)."""
        (run_dir / SPEC).unlink(missing_ok=True)

    @classmethod
    def read(cls, run_dir: Path) -> EvaluationSpec | None:
        """The spec the run's pretrain flow wrote; None where it wrote none. One that does not read as
        this version writes it is refused, naming the file and its first wrong field."""
        try:
            raw = read_record(run_dir / SPEC, cls, "start the run's pretrain flow again to write it")
        except DamagedRecord as e:
            raise ParameterError([f"run: {e}"]) from None
        return None if raw is None else cls.model_validate(raw)

    def evaluates(self, iteration: int, save_interval: int, total_iters: int) -> bool:
        """Whether the checkpoint saved at ``iteration`` is evaluated: every ``every``-th of the
        regular saves, and the last."""
        return iteration >= total_iters or (iteration % save_interval == 0
                                            and (iteration // save_interval) % self.every == 0)


class EvalResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    iteration: int
    checkpoint: str
    saved_at: float                         # the checkpoint's marker time (saved_at)
    sets: dict[str, dict[str, float]]       # name -> loss, perplexity, tokens
    tasks: dict[str, dict[str, float]]      # lm-eval task -> metric -> value
    seconds: float
    path: str


def result_path(run_dir: Path, iteration: int) -> Path:
    return run_dir / FOLDER / f"iter_{iteration:07d}.json"


def _result(path: Path) -> EvalResult:
    return EvalResult.model_validate(read_record(path, EvalResult, "remove it to evaluate that checkpoint again"))


def results(run_dir: Path) -> list[EvalResult]:
    """Every evaluation of the run written so far, by iteration."""
    found = [_result(p) for p in sorted((run_dir / FOLDER).glob("iter_*.json"))]
    return sorted(found, key=lambda r: r.iteration)


class ResultsTail:
    """The run's evaluations, read again only when its eval/ folder holds another or a rewritten one."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.seen = run_dir, []

    def if_changed(self) -> list[EvalResult] | None:
        """Every evaluation of the run when one was written since the last call; None when none
        was, or when one cannot be read (said, and read again at the next call)."""
        try:
            listing = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size)
                             for p in (self.run_dir / FOLDER).glob("iter_*.json"))
            if listing == self.seen:
                return None
            found = results(self.run_dir)
        except (OSError, ValueError) as e:
            run_logger().warning("the run's evaluations in %s could not be read: %s", self.run_dir / FOLDER, e)
            return None
        self.seen = listing
        return found


def tracker_items(run_dir: Path, evaluations: list[EvalResult]) -> list[Item]:
    """The evaluations as the trackers log them: their figures at their checkpoints' iterations."""
    return [Item(summary(r), r.iteration, _written_at(run_dir, r), "evaluations", tracker_key(r)) for r in evaluations]


def tracker_key(result: EvalResult) -> str:
    """Tells an evaluation from another at the same iteration (a checkpoint saved again)."""
    return f"{result.iteration}@{result.saved_at:.3f}"


def _written_at(run_dir: Path, result: EvalResult) -> float:
    try:
        return result_path(run_dir, result.iteration).stat().st_mtime
    except FileNotFoundError:
        return time.time()


def saved_at(checkpoint: Path) -> float:
    """When the checkpoint was complete (its marker's time): tells a checkpoint saved again at the
    same iteration (after a rollback) from the one evaluated before."""
    return (checkpoint / COMPLETE).stat().st_mtime


def pin(run_dir: Path, iteration: int) -> Path | None:
    """Keep the checkpoint at ``iteration`` for its evaluation, whatever training's ``keep_last``
    or a rollback does to it meanwhile: ``<run>/eval/pinned/iter_N/`` is a run folder of that one
    checkpoint and the configuration it was trained with, hard links to their files (no copy).
    None when the checkpoint is gone already; NotReplaceable (its folder left as it is) when a
    folder there holds what no pin wrote."""
    source = run_dir / "checkpoints" / f"iter_{iteration:07d}"
    pinned = run_dir / FOLDER / PINNED / source.name
    try:
        # one pinned before a rollback is replaced by this one
        with replaced_folder(pinned, _not_a_pin, "the evaluation's pin") as tmp:
            (tmp / "checkpoints").mkdir()
            os.link(run_dir / "config.json", tmp / "config.json")
            shutil.copytree(source, tmp / "checkpoints" / source.name, copy_function=os.link)
            if not (tmp / "checkpoints" / source.name / COMPLETE).is_file():
                raise FileNotFoundError(source / COMPLETE)
    except (FileNotFoundError, shutil.Error):
        return None
    return pinned / "checkpoints" / source.name


def _not_a_pin(folder: Path) -> list[str]:
    return [entry.name for entry in folder.iterdir() if entry.name not in ("config.json", "checkpoints")]


def pins(run_dir: Path) -> list[Path]:
    """The checkpoints kept for their evaluation (see ``pin``), oldest first."""
    return sorted((run_dir / FOLDER / PINNED).glob("iter_???????/checkpoints/iter_???????"))


def unevaluated(run_dir: Path) -> str:
    """What to do with pins no automation will evaluate."""
    return (f"evaluate them with `python -m flows.evaluate {run_dir} --iteration N`, or remove "
            f"{run_dir / FOLDER / PINNED}/iter_N to let one go (`python -m deployments.setup` creates the automation "
            "that evaluates each save)")


def checkpoint_at(run_dir: Path, iteration: int | None) -> Path:
    """The complete checkpoint at ``iteration`` (None: the newest intact one): pinned for its
    evaluation, or still in the run's checkpoints."""
    pinned = pins(run_dir)
    if iteration is None:
        newest, _ = newest_intact(run_dir / "checkpoints")
        candidates = [p for p in pinned if (p / COMPLETE).is_file()] + ([newest] if newest else [])
        if not candidates:
            raise FileNotFoundError(f"{run_dir / 'checkpoints'} holds no complete checkpoint yet: evaluate once "
                                    "training saved one")
        return max(candidates, key=iteration_of)
    for path in (run_dir / FOLDER / PINNED / f"iter_{iteration:07d}" / "checkpoints" / f"iter_{iteration:07d}",
                 run_dir / "checkpoints" / f"iter_{iteration:07d}"):
        if (path / COMPLETE).is_file():
            return path
    kept = sorted({p.name for p in [*Checkpointer(run_dir / "checkpoints", 1, 0).complete(), *pinned]})
    raise FileNotFoundError(f"no complete checkpoint at iteration {iteration} (kept: {', '.join(kept) or 'none'}): "
                            "give one of those iterations, or none for the newest")


def evaluated(run_dir: Path, iteration: int | None) -> EvalResult | None:
    """The evaluation written for the checkpoint at ``iteration`` (None: the newest), when it is of
    that very checkpoint, or of one no longer kept (a checkpoint saved again at that iteration, after
    a rollback, is evaluated anew). Its pin, if any, is let go."""
    try:
        checkpoint: Path | None = checkpoint_at(run_dir, iteration)
    except FileNotFoundError:
        checkpoint = None
    if checkpoint is None and iteration is None:
        return None
    done = result_path(run_dir, iteration_of(checkpoint) if checkpoint is not None else iteration)
    if not done.is_file():
        return None
    earlier = _result(done)
    if checkpoint is not None and earlier.saved_at != saved_at(checkpoint):
        return None
    if checkpoint is not None:
        unpin(run_dir, checkpoint)
    return earlier


def unpin(run_dir: Path, checkpoint: Path) -> None:
    pinned = run_dir / FOLDER / PINNED
    if checkpoint.is_relative_to(pinned):
        shutil.rmtree(checkpoint.parent.parent, ignore_errors=True)


def summary(result: EvalResult) -> dict[str, float]:
    """The figures of one evaluation, flat: ``eval/<set>/perplexity``, ``eval/<task>/acc``."""
    flat = {f"eval/{name}/{k}": v for name, figures in result.sets.items() for k, v in figures.items() if k != "tokens"}
    flat.update({f"eval/{name}/{k}": v for name, metrics in result.tasks.items() for k, v in metrics.items()})
    return flat
