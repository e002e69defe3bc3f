"""The graph caches a training job starts from: torch.compile's (inductor and triton, plus the
artifacts the precompile run saved) or, on Trainium, the Neuron compiler's per-node cache. Both
live in ``Config.compile_cache_dir`` on shared storage."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from gpt.backend import Backend
from gpt.config import Config
from gpt.files import write_atomic


def use_compile_cache(config: Config, backend: Backend, rank: int) -> bool:
    """Point the compilers at ``compile_cache_dir`` and preload saved artifacts. Returns True on a hit."""
    if not config.compile_cache_dir:
        return False
    root = Path(config.compile_cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    if backend.name == "neuron":
        # One cache per node (the Neuron cache's file locks are unreliable on NFS); a launcher that
        # already passed --cache_dir in NEURON_CC_FLAGS chose the same <root>/<node> layout.
        node_cache = root / (os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0])
        flags = os.environ.get("NEURON_CC_FLAGS", "")
        if "--cache_dir" not in flags:
            os.environ["NEURON_CC_FLAGS"] = f"{flags} --cache_dir={node_cache}".strip()
        return any(node_cache.glob("**/*.neff"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
    artifacts = root / f"artifacts-rank{rank}.bin"
    if artifacts.exists():
        torch.compiler.load_cache_artifacts(artifacts.read_bytes())
        return True
    return False


def save_compile_cache(config: Config, rank: int) -> None:
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    write_atomic(Path(config.compile_cache_dir) / f"artifacts-rank{rank}.bin", saved[0])
