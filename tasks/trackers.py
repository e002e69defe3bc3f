"""Experiment trackers (W&B, MLflow): one tracker run per training run, fed from the head node.

The train stage's follower already reads every metrics record the ranks write, in order, so it is
the follower, not rank 0, that logs them: tracker credentials (``WANDB_API_KEY``, MLflow's
``MLFLOW_TRACKING_*``) stay in the environment of the process that runs the flow, and jobs keep
being submitted without any credential. ``<run>/trackers.json`` keeps each tracker's run id, its
project, the last iteration it got and the evaluations it got, so every requeue, resume, later leg
and evaluation continues the same tracker run and logs each figure once. A tracker run has one
writer at a time, the run folder's owner: training's follower, or an evaluation once training has
let the folder go (``tasks.evaluate.stage.to_trackers``). A tracker that cannot be reached is a warning naming it; what it missed
is kept and sent again later (with a growing pause), and after MAX_FAILURES failures in a row it is
left out for the rest of the stage. Training never waits on it for long.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Literal, NamedTuple, get_args

from pydantic import BaseModel

from gpt.files import write_json
from tasks.common.records import Count, read_record
from tasks.common.run_context import run_logger
from tasks.common.uri import hide_address_secrets, shown_address

RECORD = "trackers.json"
Tracker = Literal["wandb", "mlflow"]
NAMES = get_args(Tracker)
TRAIN_KEYS = ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu", "elapsed_ms", "consumed_samples")
MAX_FAILURES = 5
RETRY_S = 30.0            # the pause after a failure, times the failures in a row
BATCH = 1000              # metrics per MLflow request (its limit)


class Item(NamedTuple):
    """Figures logged at one step, and the cursor of trackers.json that says they were: the last
    train or valid iteration, or the evaluations' keys (``key``)."""
    values: dict[str, float]
    step: int
    when: float
    cursor: Literal["last_step", "last_valid", "evaluations"]
    key: str | None = None


class _MLflow:
    """MLflow through its client; MLFLOW_TRACKING_URI and credentials from the environment."""

    name = "mlflow"

    def __init__(self, project: str, run_dir: Path, run_id: str | None, config: dict[str, Any],
                 created: Any, add_only: bool) -> None:
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            raise ValueError("MLFLOW_TRACKING_URI is not set where the flow runs")
        # A tracking server that is down should cost seconds, not minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient

        self.client = MlflowClient()
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name,
                                            tags={"run_dir": str(run_dir)}).info.run_id
            created(run_id)                   # kept before anything else can fail
            self._params(run_id, config)
        elif not add_only:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id, self.add_only = run_id, add_only

    def _params(self, run_id: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, _text(v, 6000)) for k, v in sorted(config.items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])

    def log(self, items: list[Item]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, int(1000 * i.when), i.step) for i in items for k, v in i.values.items()]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + BATCH])

    def final(self, numbers: dict[str, float], step: int) -> None:
        self.log([Item(numbers, step, time.time(), "last_step")])

    def text(self, name: str, text: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def folder(self, name: str, path: Path) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path=name)

    def close(self, finished: bool) -> None:
        if not self.add_only:             # evaluations added to a run leave its status as it is
            self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class _WandB:
    """Weights & Biases (WANDB_API_KEY, WANDB_MODE=offline and the rest from the environment); its
    local files go in the run folder. It records no console or system stats of the head node.
    Every figure is plotted over ``iteration``, not W&B's own step: that step only grows (a row
    logged below it is dropped), and an evaluation arrives after training has logged later
    iterations."""

    name = "wandb"

    def __init__(self, project: str, run_dir: Path, run_id: str | None, config: dict[str, Any],
                 created: Any, add_only: bool) -> None:
        import wandb

        self.run_dir = run_dir
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow" if run_id else None,
                              dir=str(run_dir), config=config if run_id is None else None, reinit="create_new",
                              settings=wandb.Settings(console="off", x_disable_stats=True))
        self.run_id = self.run.id
        created(self.run_id)
        self.run.define_metric("iteration")
        for group in ("train", "valid", "eval"):
            self.run.define_metric(f"{group}/*", step_metric="iteration")

    def log(self, items: list[Item]) -> None:
        for i in items:
            self.run.log({**i.values, "iteration": i.step})

    def final(self, numbers: dict[str, float], step: int) -> None:
        self.run.summary.update(numbers)      # a resumed online run has moved past `step`

    def text(self, name: str, text: str) -> None:
        self.run.summary[name] = text

    def folder(self, name: str, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"{self.run_dir.name}-{name}", type="model")
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS = {"mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """The run's trackers, opened on the run's tracker runs. A tracker's failure is a warning; what
    it missed waits for the next try. ``add_only``: opened to add evaluations to tracker runs that
    training made and may have ended, leaving their status as training left it."""

    def __init__(self, names: Iterable[str], project: str, run_dir: Path, config: dict[str, Any],
                 add_only: bool = False) -> None:
        self.names = list(names)
        self.run_dir, self.path = run_dir, run_dir / RECORD
        self.state: dict[str, dict[str, Any]] = tracker_runs(run_dir) if self.names else {}
        self.open: dict[str, Any] = {}
        self.pending: dict[str, list[Item]] = {}
        self.failures: dict[str, int] = {}
        self.retry_at: dict[str, float] = {}
        self.add_only = add_only
        for name in self.names:
            saved = self.state.setdefault(name, {})
            saved.setdefault("last_step", 0)
            saved.setdefault("last_valid", 0)
            saved.setdefault("evaluations", [])
            if not add_only:
                saved["project"], saved["where"] = project, _where(name)

            def created(run_id: str, s: dict[str, Any] = saved) -> None:
                s["run_id"] = run_id
                self._save()

            tracker = self._try(name, lambda n=name, s=saved, c=created: _KINDS[n](
                project, run_dir, s.get("run_id"), config, c, add_only))
            if tracker is not None:
                self.open[name] = tracker
                self.pending[name] = []
                saved["logging"] = not add_only         # the run folder's owner logs to it now
        if self.names:
            self._save()

    @classmethod
    def of_run(cls, run_dir: Path) -> Trackers:
        """The tracker runs a run's training made (its trackers.json), opened to add to them where
        this process logs to the same place; none is made."""
        state, names = tracker_runs(run_dir), []
        for name, saved in state.items():
            if name not in NAMES or not saved.get("run_id") or not saved.get("project"):
                continue
            if _where(name) != saved.get("where"):
                run_logger().warning("tracker %s: this process logs to %s, the run's training logged to %s: its "
                                     "evaluations are left for a process that logs where training did", name,
                                     _where(name), saved.get("where"))
                continue
            names.append(name)
        project = next((state[n]["project"] for n in names), "")
        return cls(names, project, run_dir, {}, add_only=True)

    def records(self, records: list[dict[str, Any]]) -> None:
        """Log new metrics records (train and valid) to every tracker that has not had them, in one
        batch per tracker."""
        self._log([item for r in records if (item := _item(r)) is not None])

    def evaluations(self, items: list[Item]) -> None:
        """Log the evaluations (``tasks.evaluate.records.tracker_items``) a tracker has not had."""
        self._log(items)

    def _log(self, items: list[Item]) -> None:
        if not self.open:
            return
        for name in list(self.open):
            state = self.state[name]
            queued = {(i.step, i.cursor, i.key) for i in self.pending[name]}
            self.pending[name] += [i for i in items if (i.key not in state["evaluations"] if i.key is not None
                                                        else i.step > state[i.cursor])
                                   and (i.step, i.cursor, i.key) not in queued]
            self._send(name)
        self._save()

    def _send(self, name: str, now: bool = False) -> None:
        pending = self.pending[name]
        if not pending or (not now and time.monotonic() < self.retry_at.get(name, 0.0)):
            return
        tracker = self.open[name]
        if self._try(name, lambda: tracker.log(pending)):
            state = self.state[name]
            for i in pending:
                if i.key is not None:
                    state["evaluations"].append(i.key)
                else:
                    state[i.cursor] = max(state[i.cursor], i.step)
            self.pending[name] = []
            self.failures[name] = 0

    def finish(self, records: list[dict[str, Any]], evaluations: list[Item], summary: dict[str, float],
               samples: str | None, export: Path | None) -> None:
        """Whatever of the run's metrics records and evaluations a tracker has not had, the run's
        final figures, its samples and its HuggingFace export; then close its tracker runs."""
        self.records(records)
        self.evaluations(evaluations)
        numbers = {f"final/{k}": float(v) for k, v in summary.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name in list(self.open):
            tracker = self.open[name]
            self._send(name, now=True)
            steps = (lambda t=tracker, n=name: t.final(numbers, self.state[n]["last_step"]),
                     (lambda t=tracker: t.text("samples.md", samples)) if samples else None,
                     (lambda t=tracker: t.folder("hf", export)) if export is not None and export.is_dir() else None)
            for step in steps:
                if step is not None and name in self.open:
                    self._try(name, step)
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        """Send what waits (once more), then close the tracker runs; what still fails to go is sent
        by the next leg or by ``finish``, which read the metrics records again."""
        for name in list(self.open):
            self._send(name, now=True)
            if name in self.open:
                self._close(name, finished)
        if self.names:
            self._save()

    def _close(self, name: str, finished: bool) -> None:
        tracker = self.open.pop(name)
        saved = self.state[name]
        if self.add_only:
            finished = saved.get("finished", True)        # as training left it
        else:
            saved["logging"], saved["finished"] = False, finished
        try:
            tracker.close(finished)
        except Exception as e:  # noqa: BLE001 - closing is best effort
            run_logger().warning("tracker %s (%s): closing its run failed: %s", name, self.state[name]["where"],
                                 _text(_hide_secrets(str(e)), 300))

    def _try(self, name: str, action: Any) -> Any:
        """``action()``'s result (True for None), or None after a warning when it raised."""
        try:
            result = action()
            return True if result is None else result
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            failures = self.failures[name] = self.failures.get(name, 0) + 1
            self.retry_at[name] = time.monotonic() + RETRY_S * failures
            gone = name in self.open and failures >= MAX_FAILURES
            work = "the evaluation" if self.add_only else "training"
            run_logger().warning("tracker %s (%s) failed: %s: %s; %s", name, self.state[name].get("where", _where(name)),
                                 type(e).__name__, _text(_hide_secrets(str(e)), 300),
                                 f"left out after {failures} failures in a row, {work} goes on without it" if gone
                                 else f"{work} goes on without it" if name not in self.open
                                 else f"{work} goes on; what it missed is sent again in {RETRY_S * failures:.0f} s")
            if gone:
                self._close(name, finished=False)
            return None

    def _save(self) -> None:
        write_json(self.path, self.state)


def evaluation_logged(run_dir: Path, key: str) -> bool:
    """Whether the trackers the run folder's owner logs to now have had the evaluation ``key``, as
    trackers.json says (False when the owner logs to none)."""
    logging = [s for s in tracker_runs(run_dir).values() if s.get("logging")]
    return bool(logging) and all(key in s.get("evaluations", []) for s in logging)


def unlogged(run_dir: Path, keys: Iterable[str]) -> bool:
    """Whether a tracker run the run's training made lacks one of the evaluations ``keys``."""
    return any(s.get("run_id") and set(keys) - set(s.get("evaluations", [])) for s in tracker_runs(run_dir).values())


def _item(r: dict[str, Any]) -> Item | None:
    """The figures of one metrics record, or None for records trackers do not get."""
    if r.get("kind") == "train":
        values = {f"train/{k}": float(r[k]) for k in TRAIN_KEYS
                  if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)}
        return Item(values, int(r["iteration"]), float(r.get("time") or time.time()), "last_step")
    if r.get("kind") == "valid":
        loss = float(r["valid_loss"])
        return Item({"valid/lm_loss": loss, "valid/perplexity": math.exp(min(loss, 50.0))}, int(r["iteration"]),
                    float(r.get("time") or time.time()), "last_valid")
    return None


def _where(name: str) -> str:
    """Where a tracker logs, without any secret its address holds."""
    if name == "mlflow":
        return shown_address(os.environ.get("MLFLOW_TRACKING_URI", "")) or "MLFLOW_TRACKING_URI unset"
    mode = os.environ.get("WANDB_MODE", "online")
    return "offline, in the run folder" if mode in ("offline", "dryrun") else shown_address(os.environ.get(
        "WANDB_BASE_URL", "https://api.wandb.ai"))


def _hide_secrets(text: str) -> str:
    """An error's text without the secrets of the trackers' addresses."""
    for variable in ("MLFLOW_TRACKING_URI", "WANDB_BASE_URL"):
        text = hide_address_secrets(text, os.environ.get(variable, ""))
    return text


class _TrackerRun(BaseModel):
    """A tracker's entry in trackers.json: its run, and what it has had."""
    run_id: str | None = None
    project: str = ""
    where: str = ""
    last_step: Count = 0
    last_valid: Count = 0
    evaluations: list[str] = []
    logging: bool = False
    finished: bool | None = None


def tracker_runs(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Each tracker's entry in the run's trackers.json, checked when read."""
    return read_record(run_dir / RECORD, dict[str, _TrackerRun], "restore it from a copy, or move it aside: the "
                       "trackers then log to new runs of theirs", {})


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:limit]
