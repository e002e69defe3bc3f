"""Running the stages of a flow: each stage a cached task, its wall time and state recorded, a
cached result whose outputs are gone or damaged run again; and the checks that tell."""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from gpt.checkpoint import Checkpointer
from gpt.data import DataIndex, MMapIndexedDataset

if TYPE_CHECKING:
    from prefect import Task

    from tasks.export import ExportManifest
    from tasks.index import IndexManifest
    from tasks.tokenize.outputs import TokenizeManifest
    from tasks.train.stage import TrainResult

R = TypeVar("R")


class Stages:
    """Runs stage tasks in order, recording wall time and final state (Completed or Cached)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def skip(self, stage: str, why: str) -> None:
        print(f"stage {stage} skipped: {why}")
        self.records.append({"stage": stage, "state": "Skipped", "seconds": 0.0})

    def run(self, stage: str, task_fn: "Task[..., R]", *args: Any, intact: Callable[[R], bool] | None = None,
            origins: dict[str, str] | None = None, **kwargs: Any) -> R:
        """Run a stage task; a cached result whose outputs are gone or damaged (``intact(result)``
        is False) runs the stage again. ``origins``: the user's name (a source path or S3 key) of
        each file the stage reads from a copy, which its error names instead of the copy."""
        start = time.perf_counter()
        state = task_fn(*args, return_state=True, **kwargs)
        if intact is not None and state.name == "Cached" and not intact(state.result()):
            print(f"stage {stage}: the cached result's outputs are gone or damaged; running it again")
            state = task_fn.with_options(refresh_cache=True)(*args, return_state=True, **kwargs)
        self.records.append({"stage": stage, "state": state.name, "seconds": time.perf_counter() - start})
        try:
            return state.result()  # raises the stage's error, failing the flow run
        except Exception as e:
            e.failed_stage = stage  # named in the flow run's final state (flows.plan.params.refused_as_failed_run)
            if origins:
                e.args = tuple(named_as_given(a, origins) if isinstance(a, str) else a for a in e.args)
            raise


def named_as_given(text: str, origins: dict[str, str]) -> str:
    """``text`` with each copy's path replaced by the name the user gave its original."""
    for copy in sorted(origins, key=len, reverse=True):
        text = text.replace(copy, origins[copy])
    return text


def tokenized_intact(manifest: TokenizeManifest) -> bool:
    try:
        for prefix in manifest.prefixes.values():
            MMapIndexedDataset(prefix)
    except (OSError, ValueError):
        return False
    return True


def index_intact(manifest: IndexManifest) -> bool:
    try:
        files = DataIndex.read(manifest.path).files()
    except ValueError:
        return False
    return all((Path(manifest.path).parent / name).is_file() for name in files)


def trained_intact(result: TrainResult) -> bool:
    """The run folder of a cached training still holds its metrics and a complete checkpoint (it may
    have been deleted since, and the same parameters train it again)."""
    return Path(result.metrics_path).is_file() and Checkpointer(Path(result.run_dir) / "checkpoints", 1, 0).latest() is not None


def export_intact(manifest: ExportManifest) -> bool:
    from gpt.export import weight_files

    return bool(weight_files(manifest.path))
