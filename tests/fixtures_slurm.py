"""`slurm_cluster`: the real local SLURM cluster (scripts/local-slurm), started once per session.

The cluster is left running at the end of the session (other sessions on the same machine may be
using it); `scripts/local-slurm stop` stops it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "local-slurm"


@pytest.fixture(scope="session")
def slurm_cluster() -> dict:
    """Yields {"partition", "nodes", "preset"} of the running local cluster."""
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root: run the tests as root or start it with sudo "
                    f"{SCRIPT} start")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is unavailable to install slurm-wlm and munge")
    result = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        pytest.fail(f"{SCRIPT} start failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    partition = os.environ.get("LOCAL_SLURM_PARTITION", "debug")
    count = int(os.environ.get("LOCAL_SLURM_NODES", "2"))
    return {"partition": partition, "nodes": [f"node{i}" for i in range(1, count + 1)], "preset": "slurm-local"}


@pytest.fixture(scope="module")
def three_node_cluster(slurm_cluster: dict) -> Iterator[dict]:
    """The local cluster with a third node, for the tests of a module whose jobs need two nodes and a
    spare; the session's cluster again after them (the SLURM tests run one at a time)."""
    def start(count: int) -> None:
        result = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "LOCAL_SLURM_NODES": str(count)})
        assert result.returncode == 0, f"{SCRIPT} start with {count} nodes failed:\n{result.stdout}\n{result.stderr}"
    start(3)
    try:
        yield {**slurm_cluster, "nodes": ["node1", "node2", "node3"]}
    finally:
        start(len(slurm_cluster["nodes"]))


def preset_file(folder: Path, name: str, base: str = "slurm-local", **fields: Any) -> str:
    """A preset the operator writes in ``folder``: the shipped preset ``base`` with ``fields`` set."""
    import yaml

    from tasks.cluster.config import PRESET_DIR

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({**yaml.safe_load((PRESET_DIR / f"{base}.yaml").read_text()),
                                                         **fields}))
    return name


@pytest.fixture
def operator_preset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """``operator_preset(base, **fields)``: a preset of the operator's (GPT_CLUSTER_PRESET_DIRS), the
    shipped ``base`` with the operator-only ``fields`` (accelerator, device_memory_gib, ...) set; its name."""
    folder = tmp_path / "operator-presets"
    monkeypatch.setenv("GPT_CLUSTER_PRESET_DIRS", str(folder))
    made: list[str] = []

    def make(base: str, **fields: Any) -> str:
        made.append(f"{base}-{len(made)}")
        return preset_file(folder, made[-1], base, **fields)
    return make

