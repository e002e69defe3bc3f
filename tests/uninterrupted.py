"""Final weights of a run that recovered from a fault against a run that had none.

The uninterrupted run trains the same Config (the run folder's `config.json`, which the ranks
ran) with the same number of ranks, as plain processes (gloo on loopback, tests.fixtures_gpt).
On CPU with a fixed seed training is deterministic, so every tensor of the final checkpoint's
model and optimizer must be bitwise equal.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gpt.checkpoint import Checkpointer
from gpt.faults import VARIABLE
from tests.fixtures_gpt import GPTLauncher

# Uninterrupted runs already trained in this test session, by configuration and rank count.
_TRAINED: dict[str, dict[str, torch.Tensor]] = {}


def checkpoint_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint's model and optimizer state, by dotted name."""
    newest = Checkpointer(run_dir / "checkpoints", 1, 0).latest()
    assert newest is not None, f"no complete checkpoint in {run_dir}"
    with tempfile.TemporaryDirectory(prefix="checkpoint-") as tmp:
        dcp_to_torch_save(newest, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    tensors: dict[str, torch.Tensor] = {}

    def collect(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            tensors[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                collect(f"{prefix}.{key}", item)

    collect("model", state["model"])
    # The optimizer state is saved flat: "state.<parameter>.<name>", "param_groups.<parameter>.<name>".
    collect("optimizer", {key.removeprefix("state."): value for key, value in state["optimizer"].items()
                          if key.startswith("state.")})
    return tensors


def _uninterrupted(config: dict, world_size: int, timeout_s: float) -> dict[str, torch.Tensor]:
    key = json.dumps({**config, "run_dir": None}, sort_keys=True) + f" x{world_size}"
    if key not in _TRAINED:
        with tempfile.TemporaryDirectory(prefix="uninterrupted-") as tmp:
            run_dir = Path(tmp) / "run"
            launcher = GPTLauncher(Path(tmp))
            results = launcher.wait(launcher.start({**config, "run_dir": str(run_dir)}, world_size, unset=(VARIABLE,)),
                                    timeout_s)
            for rank, (rc, out) in enumerate(results):
                assert rc == 0, f"uninterrupted run, rank {rank} exited {rc}:\n{out[-3000:]}"
            _TRAINED[key] = checkpoint_tensors(run_dir)
    return _TRAINED[key]


def assert_weights_equal_an_uninterrupted_run(run_dir: Path, timeout_s: float = 300) -> None:
    """The final checkpoint in run_dir equals, bitwise, that of the same run trained without a fault."""
    config = json.loads((run_dir / "config.json").read_text())
    cluster = json.loads((run_dir / "cluster.json").read_text())
    got = checkpoint_tensors(run_dir)
    want = _uninterrupted(config, cluster["nodes"] * cluster["tasks_per_node"], timeout_s)
    assert sorted(got) == sorted(want)
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"{len(different)} of {len(want)} tensors differ from the uninterrupted run: {different[:5]}"
