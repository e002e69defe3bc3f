"""What an evaluation job runs on its node: the checkpoint loaded as it was trained, each named
set's loss and perplexity, and lm-evaluation-harness's HF backend on an export of the checkpoint
in a temporary folder there; its result written beside the run."""
from __future__ import annotations

import contextlib
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpt.checkpoint import iteration_of
from gpt.files import write_json
from tasks.common.secrets import hide_in_logs
from tasks.evaluate.records import EvalResult, EvaluationSpec, saved_at

BATCH = 8                      # sequences per forward pass of a set's perplexity


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


def evaluate_checkpoint(checkpoint: Path, spec: EvaluationSpec, result: Path, device: str = "cpu") -> EvalResult:
    """What the evaluation job runs on a ``device`` of its cluster: the sets and the tasks, written to
    ``result``. The export lies in a temporary folder on the job's node, removed whatever happens."""
    import torch

    from gpt.config import Config
    from gpt.export import export, load_checkpoint

    started = time.perf_counter()
    config = Config.load(checkpoint.parent.parent / "config.json")      # the one it was trained with
    device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
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

    def __init__(self, checkpoint: Path, spec: EvaluationSpec, result: Path, device: str) -> None:
        self.checkpoint, self.spec, self.result, self.device = checkpoint, spec, result, device

    def __call__(self) -> dict[str, Any]:
        hide_in_logs()
        return evaluate_checkpoint(self.checkpoint, self.spec, self.result, self.device).model_dump()
