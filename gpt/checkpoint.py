"""Sharded checkpoints with torch.distributed.checkpoint, saved atomically.

Layout: ``<dir>/iter_0000100/`` holds DCP's shard files, ``.metadata`` and a ``COMPLETE`` marker.
A save is written to ``iter_0000100.tmp`` and renamed only after every rank finished writing and
the marker is on disk, so a save killed half-way leaves a ``.tmp`` folder that is never resumed
from (and is removed by the next save).
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)

from gpt.distributed import barrier

MARKER = "COMPLETE"
_NAME = re.compile(r"^iter_(\d{7,})$")


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


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, keep_last: int, rank: int) -> None:
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.rank = rank

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        if not self.dir.is_dir():
            return None
        done = [p for p in self.dir.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
        return max(done, key=lambda p: int(_NAME.match(p.name).group(1)), default=None)

    def save(self, iteration: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any]) -> Path:
        """Write on every rank; returns the final folder once it is complete."""
        final = self.dir / f"iter_{iteration:07d}"
        tmp = self.dir / f"{final.name}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        state = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
            "train": train_state,
            f"rng_rank{self.rank}": rng_state(),  # per rank: DCP keeps one copy of identical keys
        }
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
        barrier()  # every rank's shards are on disk
        if self.rank == 0:
            _write_marker(tmp, iteration)
            os.rename(tmp, final)
            self._prune()
        barrier()
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             train_state: dict[str, Any]) -> dict[str, Any]:
        """Restore model, optimizer and RNG in place; returns the saved training state."""
        state = {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
            "train": dict(train_state),
            f"rng_rank{self.rank}": b"",
        }
        # A checkpoint written by fewer ranks lacks this rank's RNG entry: load what exists.
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True),
                     no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=True))
        if state[f"rng_rank{self.rank}"]:
            set_rng_state(state[f"rng_rank{self.rank}"])
        return state["train"]

    def _prune(self) -> None:
        for p in self.dir.iterdir():
            if p.name.endswith(".tmp"):
                shutil.rmtree(p, ignore_errors=True)  # remains of a save that was killed
        done = sorted((p for p in self.dir.iterdir() if _NAME.match(p.name)), key=lambda p: int(_NAME.match(p.name).group(1)))
        for p in done[:-self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group, although one process is what was meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_marker(folder: Path, iteration: int) -> None:
    marker = folder / MARKER
    with open(marker, "w") as f:
        json.dump({"iteration": iteration}, f)
        f.flush()
        os.fsync(f.fileno())
