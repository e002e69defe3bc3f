"""Evaluate stage: one checkpoint of a run, scored on its own job, never inside training.

What a run is evaluated on is decided by the pretrain flow and kept in ``<run>/evaluation.json``
(``EvaluationSpec``): named evaluation sets, tokenized with the run's tokenizer, and
lm-evaluation-harness tasks (from its registry, or defined by YAML files with local data). A save
to evaluate is pinned (``pin``) until it is scored. The job computes each set's loss and
perplexity with the gpt package, runs lm-eval's HF backend on an export of the checkpoint in a
temporary folder on its node, and writes ``<run>/eval/iter_N.json``. The job runs where the cluster preset's evaluation settings put it
(``ClusterConfig.eval_job``), or as a local process with the local preset.
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import MARKER as COMPLETE
from gpt.checkpoint import Checkpointer, iteration_of, newest_intact
from gpt.files import replaced_folder, write_json
from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import JOBS_FOLDER, JobError, submit
from tasks.cluster.record import JOBS_RECORD
from tasks.cluster.run_owner import RunBusy, RunOwner
from tasks.common.retry import worth_retrying
from tasks.common.run_context import run_logger
from tasks.train.trackers import Item, Trackers, evaluation_logged, unlogged

SPEC = "evaluation.json"
FOLDER = "eval"
PINNED = "pinned"
# The evaluation's work in progress, which an upload of the run folder leaves out (paths in the run
# folder, fnmatch): saves pinned until they are scored, the evaluation jobs' records and logs, and
# files being written (gpt.files writes ``.NAME.tmp-*`` and renames it when complete). Its results
# (eval/iter_N.json) written by then go with the upload.
IN_PROGRESS = (f"{FOLDER}/{PINNED}/*", f"{FOLDER}/{JOBS_FOLDER}/*", f"{FOLDER}/{JOBS_RECORD}", f"{FOLDER}/.*")
BATCH = 8                      # sequences per forward pass of a set's perplexity
TRACKERS_WAIT_S = 300.0        # how long an evaluation waits for the run folder's owner to log it


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
    cluster: dict[str, Any]               # the evaluation job's resources (ClusterConfig.eval_job)

    def write(self, run_dir: Path) -> None:
        write_json(run_dir / SPEC, self.model_dump())

    @staticmethod
    def remove(run_dir: Path) -> None:
        """The run is evaluated no more (its latest start names no evaluation)."""
        (run_dir / SPEC).unlink(missing_ok=True)

    @classmethod
    def read(cls, run_dir: Path) -> EvaluationSpec | None:
        try:
            return cls.model_validate_json((run_dir / SPEC).read_text())
        except FileNotFoundError:
            return None

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


def results(run_dir: Path) -> list[EvalResult]:
    """Every evaluation of the run written so far, by iteration."""
    found = [EvalResult.model_validate_json(p.read_text()) for p in sorted((run_dir / FOLDER).glob("iter_*.json"))]
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


def to_trackers(run_dir: Path, result: EvalResult) -> None:
    """The run's evaluations to the tracker runs its training made (trackers.json), by one writer,
    the run folder's owner. While the pretrain flow owns the folder, it logs them (the train
    stage's follower reads eval/ on every poll; the flow's last step logs what is left), and this
    waits until it has logged ``result`` or lets the folder go, up to TRACKERS_WAIT_S; once the
    folder is free, this adds every evaluation a tracker run lacks. What neither logs goes with the
    next evaluation or the next leg. A tracker's trouble is a warning: the evaluation stands."""
    try:
        evaluations = results(run_dir)
        if not unlogged(run_dir, [tracker_key(r) for r in evaluations]):
            return
        key, deadline = tracker_key(result), time.monotonic() + TRACKERS_WAIT_S
        said: list[str] = []

        def wait(holder: str) -> None:
            if evaluation_logged(run_dir, key):
                raise _Logged
            if time.monotonic() > deadline:
                raise RunBusy(holder)
            if not said:
                said.append(holder)
                run_logger().info("the run folder is owned by %s: it logs this evaluation to the trackers, or this "
                                  "flow does once it lets the folder go", holder)

        with RunOwner(run_dir, wait=wait):
            tracked = Trackers.of_run(run_dir)
            tracked.evaluations(tracker_items(run_dir, results(run_dir)))
            tracked.close(finished=True)
    except _Logged:
        pass
    except RunBusy as e:
        run_logger().warning("the trackers did not get evaluation %d in %.0f s: the run folder is owned by %s; "
                             "the next evaluation, or the run's next leg, sends it", result.iteration,
                             TRACKERS_WAIT_S, e)
    except Exception as e:  # noqa: BLE001 - trackers never fail an evaluation that is written
        run_logger().warning("the trackers did not get evaluation %d: %s: %s; the next evaluation, or the run's "
                             "next leg, sends it", result.iteration, type(e).__name__, e)


class _Logged(Exception):
    """The run folder's owner logged the evaluation."""


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


def checkpoint_at(run_dir: Path, iteration: int | None) -> Path:
    """The complete checkpoint at ``iteration`` (None: the newest intact one): pinned for its
    evaluation, or still in the run's checkpoints."""
    pinned = sorted((run_dir / FOLDER / PINNED).glob("iter_???????/checkpoints/iter_???????"))
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


def set_loss(model: Any, prefix: str, seq_length: int, max_tokens: int) -> dict[str, float]:
    """Mean next-token loss over a tokenized set, read as one stream of its documents in windows of
    ``seq_length`` + 1 tokens (each window predicts ``seq_length`` tokens), at most ``max_tokens``."""
    import torch

    from gpt.data import MMapIndexedDataset

    device = next(model.parameters()).device
    data = MMapIndexedDataset(prefix)
    stream = np.memmap(data.bin_path, dtype=data.dtype, mode="r")
    windows = min(len(stream) - 1, max_tokens) // seq_length
    if windows == 0:
        raise ValueError(f"evaluation set {prefix}: {len(stream)} tokens, fewer than one window of {seq_length + 1}")
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, windows, BATCH):
            rows = range(start, min(start + BATCH, windows))
            batch = torch.from_numpy(np.stack([stream[r * seq_length: r * seq_length + seq_length + 1]
                                               for r in rows]).astype(np.int64)).to(device)
            loss = model(batch[:, :-1], batch[:, 1:])
            total += float(loss) * len(rows) * seq_length
            count += len(rows) * seq_length
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": float(count)}


def task_scores(export: Path, spec: EvaluationSpec, device: str) -> dict[str, dict[str, float]]:
    """lm-eval's HF backend on the export: each task's metrics (``acc``, ``acc_norm``, ...). A task
    runs in its YAML's folder, so that the local data files it names are found beside it."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(spec.tasks, spec.task_paths)
    model = HFLM(pretrained=str(export), device=device, batch_size=BATCH, dtype="float32")
    scores: dict[str, dict[str, float]] = {}
    for name in spec.tasks:
        where = manager.task_index[name].yaml_path
        with contextlib.chdir(Path(where).parent if where else Path.cwd()):
            out = simple_evaluate(model=model, tasks=[name], task_manager=manager, limit=spec.limit, log_samples=False)
        for reported, metrics in out["results"].items():
            scores[reported] = {key.split(",")[0]: float(value) for key, value in metrics.items()
                            if isinstance(value, (int, float)) and not isinstance(value, bool)
                            and "stderr" not in key and not key.startswith("sample")}
    return scores


def task_manager(tasks: list[str], folders: list[str]) -> Any:
    """lm-eval's index of the task folders, and of its own registry only where a task is not in them
    (indexing the registry reads thousands of files)."""
    from lm_eval.tasks import TaskManager

    if folders:
        own = TaskManager(include_path=list(folders), include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return TaskManager(include_path=list(folders) or None)


def evaluate_checkpoint(checkpoint: Path, spec: EvaluationSpec, result: Path) -> EvalResult:
    """What the evaluation job runs: the sets and the tasks, written to ``result``. The export lies
    in a temporary folder on the job's node, removed whatever happens."""
    import torch

    from gpt.config import Config
    from gpt.export import export, load_checkpoint

    started = time.perf_counter()
    config = Config.load(checkpoint.parent.parent / "config.json")      # the one it was trained with
    device = "cuda" if spec.cluster.get("device") == "cuda" and torch.cuda.is_available() else "cpu"
    model = load_checkpoint(checkpoint, config).to(device)
    sets = {name: set_loss(model, prefix, config.seq_length, spec.set_tokens) for name, prefix in spec.sets.items()}
    del model
    tasks: dict[str, dict[str, float]] = {}
    if spec.tasks:
        with tempfile.TemporaryDirectory(prefix="gpt-eval-") as folder:
            tasks = task_scores(export(checkpoint, Path(folder) / "hf", dtype="fp32", **spec.tokenizer), spec, device)
    done = EvalResult(iteration=iteration_of(checkpoint), checkpoint=str(checkpoint), saved_at=saved_at(checkpoint),
                      sets=sets, tasks=tasks, seconds=round(time.perf_counter() - started, 3), path=str(result))
    write_json(result, done.model_dump())
    return done


class EvaluationJob:
    """The callable the evaluation job runs (submitit pickles it)."""

    def __init__(self, checkpoint: Path, spec: EvaluationSpec, result: Path) -> None:
        self.checkpoint, self.spec, self.result = checkpoint, spec, result

    def __call__(self) -> dict[str, Any]:
        return evaluate_checkpoint(self.checkpoint, self.spec, self.result).model_dump()


def evaluate(run_dir: str, iteration: int | None, spec: EvaluationSpec) -> EvalResult:
    """Evaluate the checkpoint at ``iteration`` (None: the newest) on its own job, then let its pin
    go; an evaluation already written for that very checkpoint is the answer."""
    run = Path(run_dir)
    earlier = evaluated(run, iteration)
    if earlier is not None:
        run_logger().info("checkpoint iteration %d is evaluated already: %s", earlier.iteration, earlier.path)
        return earlier
    checkpoint = checkpoint_at(run, iteration)
    done = result_path(run, iteration_of(checkpoint))
    cluster = ClusterConfig(**spec.cluster)
    # On this machine an evaluation would share training's cores: it waits for the run's training
    # (the run folder's owner) to end. On SLURM it queues for nodes of its own.
    with RunOwner(run, wait=_waiting_for_training()) if cluster.kind == "local" else contextlib.nullcontext():
        run_logger().info("evaluating %s on %s (%s job)", checkpoint, cluster.name, cluster.kind)
        result, job_id, _ = submit(EvaluationJob(checkpoint, spec, done), cluster, run_dir=run / FOLDER,
                                   job_name=f"evaluate-{checkpoint.name}")
    if not isinstance(result, dict):
        raise JobError(f"evaluation job {job_id} returned {result!r}")
    _unpin(run, checkpoint)
    return EvalResult(**result)


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
    earlier = EvalResult.model_validate_json(done.read_text())
    if checkpoint is not None and earlier.saved_at != saved_at(checkpoint):
        return None
    if checkpoint is not None:
        _unpin(run_dir, checkpoint)
    return earlier


def _unpin(run_dir: Path, checkpoint: Path) -> None:
    pinned = run_dir / FOLDER / PINNED
    if checkpoint.is_relative_to(pinned):
        shutil.rmtree(checkpoint.parent.parent, ignore_errors=True)


def _waiting_for_training() -> Callable[[str], None]:
    said: list[str] = []

    def wait(holder: str) -> None:
        if not said:
            said.append(holder)
            run_logger().info("the run's training (%s) still runs on this machine: the evaluation waits for it to "
                              "end, so as not to share its cores", holder)
    return wait


evaluate_task = task(evaluate, name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=worth_retrying,
                     cache_policy=NO_CACHE)


def summary(result: EvalResult) -> dict[str, float]:
    """The figures of one evaluation, flat: ``eval/<set>/perplexity``, ``eval/<task>/acc``."""
    flat = {f"eval/{name}/{k}": v for name, figures in result.sets.items() for k, v in figures.items() if k != "tokens"}
    flat.update({f"eval/{name}/{k}": v for name, metrics in result.tasks.items() for k, v in metrics.items()})
    return flat

