"""Experiment trackers (W&B, MLflow): one tracker run per training run, fed from the head node.

The train stage's follower already reads every metrics record the ranks write, in order, so it is
the follower, not rank 0, that logs them: tracker credentials (``WANDB_API_KEY``, MLflow's
``MLFLOW_TRACKING_*``) stay in the environment of the process that runs the flow, and jobs keep
being submitted without any credential. ``<run>/trackers.json`` keeps each tracker's run id and the
last iteration it got, so every requeue, resume and later leg continues the same tracker run and
logs each iteration once. A tracker that cannot be reached is a warning naming it; training goes on.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from gpt.files import write_json
from tasks.run_context import run_logger

RECORD = "trackers.json"
NAMES = ("wandb", "mlflow")
TRAIN_KEYS = ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "mfu", "elapsed_ms", "consumed_samples")


class _MLflow:
    """MLflow through its client (MLFLOW_TRACKING_URI and credentials from the environment)."""

    name = "mlflow"

    def __init__(self, project: str, run_dir: Path, run_id: str | None, config: dict[str, Any]) -> None:
        # A tracking server that is down should cost seconds, not minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        import mlflow
        from mlflow import MlflowClient

        self.client = MlflowClient()
        self.where = mlflow.get_tracking_uri()
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"run_dir": str(run_dir)})
            run_id = run.info.run_id
            self._params(run_id, config)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def _params(self, run_id: str, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, _text(v, 6000)) for k, v in sorted(config.items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = _now_ms()
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def text(self, name: str, text: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def folder(self, name: str, path: Path) -> None:
        self.client.log_artifacts(self.run_id, str(path), artifact_path=name)

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class _WandB:
    """Weights & Biases (WANDB_API_KEY, WANDB_MODE=offline and the rest from the environment); its
    local files go in the run folder."""

    name = "wandb"

    def __init__(self, project: str, run_dir: Path, run_id: str | None, config: dict[str, Any]) -> None:
        import wandb

        self.where = os.environ.get("WANDB_BASE_URL", "wandb")
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow" if run_id else None,
                              dir=str(run_dir), config=config if run_id is None else None, reinit="create_new")
        self.run_id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def text(self, name: str, text: str) -> None:
        self.run.summary[name] = text

    def folder(self, name: str, path: Path) -> None:
        import wandb

        artifact = wandb.Artifact(name, type="model")
        artifact.add_dir(str(path))
        self.run.log_artifact(artifact)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


_KINDS = {"mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """The run's trackers, opened on the run's tracker runs; each call hides a tracker's failure
    behind one warning, after which that tracker is left out."""

    def __init__(self, names: Iterable[str], project: str, run_dir: Path, config: dict[str, Any]) -> None:
        self.run_dir, self.path = run_dir, run_dir / RECORD
        self.state: dict[str, dict[str, Any]] = _read(self.path)
        self.open: list[Any] = []
        for name in names:
            saved = self.state.get(name, {})
            tracker = self._try(name, lambda n=name, s=saved: _KINDS[n](project, run_dir, s.get("run_id"), config))
            if tracker is not None:
                self.state[name] = {"run_id": tracker.run_id, "last_step": saved.get("last_step", 0),
                                    "last_valid": saved.get("last_valid", 0), "where": tracker.where}
                self.open.append(tracker)
        self._save()

    def record(self, r: dict[str, Any]) -> None:
        """Log one metrics record (train or valid) to every tracker that has not had it."""
        if r.get("kind") not in ("train", "valid") or not self.open:
            return
        if r["kind"] == "train":
            metrics = {f"train/{k}": float(r[k]) for k in TRAIN_KEYS if isinstance(r.get(k), (int, float))}
        else:
            metrics = {"valid/lm_loss": float(r["valid_loss"]), "valid/perplexity": _perplexity(r["valid_loss"])}
        step = int(r["iteration"])
        cursor = "last_step" if r["kind"] == "train" else "last_valid"
        for tracker in list(self.open):
            state = self.state[tracker.name]
            if step <= state.get(cursor, 0):
                continue                     # logged before this requeue or resume
            if self._try(tracker.name, lambda t=tracker: t.log(metrics, step), tracker) is not None:
                state[cursor] = step
        self._save()

    def finish(self, summary: dict[str, float], samples: str | None, export: Path | None) -> None:
        """The run's final figures, its samples and its HuggingFace export, then close its tracker runs."""
        for tracker in list(self.open):
            numbers = {f"final/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
            self._try(tracker.name, lambda t=tracker: t.log(numbers, self.state[t.name]["last_step"]), tracker)
            if samples:
                self._try(tracker.name, lambda t=tracker: t.text("samples.md", samples), tracker)
            if export is not None and export.is_dir():
                self._try(tracker.name, lambda t=tracker: t.folder("hf", export), tracker)
        self.close(finished=True)

    def close(self, finished: bool) -> None:
        for tracker in self.open:
            self._try(tracker.name, lambda t=tracker: t.close(finished))
        self.open = []

    def _try(self, name: str, action: Any, tracker: Any = None) -> Any:
        try:
            result = action()
            return True if result is None else result
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            where = self.state.get(name, {}).get("where") or getattr(tracker, "where", None) or os.environ.get(
                "MLFLOW_TRACKING_URI" if name == "mlflow" else "WANDB_BASE_URL", "its default location")
            run_logger().warning("tracker %s (%s) failed: %s: %s; training goes on without it", name, where,
                                 type(e).__name__, _text(str(e), 300))
            if tracker in self.open:
                self.open.remove(tracker)
            return None

    def _save(self) -> None:
        write_json(self.path, self.state)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _perplexity(loss: float) -> float:
    import math

    return math.exp(min(float(loss), 50.0))


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:limit]


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)
