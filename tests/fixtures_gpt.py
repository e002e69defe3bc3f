"""Launch gpt.train as real processes (one per rank, gloo on loopback) for the gpt tests."""
from __future__ import annotations

import functools
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.process
import os
import subprocess
from pathlib import Path
from unittest import mock

import pytest

from gpt.parallel.process_group import free_port
from tests import rank_process

ROOT = Path(__file__).resolve().parent.parent

# Small enough for a few seconds per run on two shared cores.
SMALL = {"model": "tiny", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
         "vocab_size": 256, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8,
         "lr_warmup_iters": 2, "lr": 3e-3, "min_lr": 3e-4, "mock_data": True, "precision": "fp32",
         "device": "cpu", "log_interval": 1, "eval_interval": 4, "eval_iters": 1, "save_interval": 4}


def slow_iterations(seconds: float) -> str:
    """GPT_FAULT for a run that lasts without computing: every rank sleeps ``seconds`` in each
    iteration's data phase, so a test has time to act between checkpoints."""
    return f"rank=-1,iteration=1,every=1,phase=data,seconds={seconds}"


class RankProcess:
    """A forked rank, answering as subprocess.Popen does for what the tests ask of a rank."""

    def __init__(self, process: multiprocessing.process.BaseProcess, log: Path) -> None:
        self.process, self.log = process, log

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.process.pid}", timeout or 0)
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        code = self.wait(timeout)
        if not self.log.exists():            # it ended before its first line: the fork server logged why
            return f"rank exited {code} before it opened {self.log}", None
        return self.log.read_text(errors="replace"), None


@functools.cache
def _fork_server() -> multiprocessing.context.ForkServerContext:
    """This test process's fork server, started once with torch imported (one thread per rank, as
    OMP_NUM_THREADS=1 tells torch when it loads)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(rank_process.PRELOAD)
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        multiprocessing.forkserver.ensure_running()
    return context


class GPTLauncher:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def start(self, config: dict, world_size: int = 1, prelude: str = "",
              unset: tuple[str, ...] = ()) -> list[RankProcess]:
        """Start every rank of ``python -c "from gpt.train import cli ..." --config PATH`` on ``config``;
        ``prelude`` runs first in each; the variables ``unset`` names are not in their environment.
        Each rank is forked from a server that imported torch once (tests.rank_process); as with any
        multiprocessing server, a script that calls this starts under ``if __name__ == "__main__"``."""
        cfg_path = Path(config["run_dir"]).with_suffix(".config.json")
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        cfg_path.write_text(json.dumps(config))
        port = free_port()
        code = prelude + "\nimport sys\nfrom gpt.train import cli\nsys.exit(cli(sys.argv[1:]))"
        procs = []
        for rank in range(world_size):
            env = {**{k: v for k, v in os.environ.items() if k not in unset}, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            log = cfg_path.with_suffix(f".rank{rank}.log")
            process = _fork_server().Process(target=rank_process.run, args=(code, ["--config", str(cfg_path)], env, str(log)))
            process.start()
            procs.append(RankProcess(process, log))
        return procs

    @staticmethod
    def wait(procs: list[RankProcess], timeout: float = 240) -> list[tuple[int, str]]:
        out = []
        for p in procs:
            try:
                text, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            out.append((p.returncode, text))
        return out

    def run(self, config: dict, world_size: int = 1, prelude: str = "", expect_rc: int = 0) -> str:
        """Run to the end; returns rank 0's output. Fails the test on an unexpected exit code."""
        results = self.wait(self.start(config, world_size, prelude))
        for rank, (rc, text) in enumerate(results):
            assert rc == expect_rc, f"rank {rank} exited {rc}:\n{text[-4000:]}"
        return results[0][1]


def read_metrics(run_dir: str | Path, kind: str = "train") -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def curve(run_dir: str | Path, kind: str = "train", key: str = "lm_loss") -> list[float]:
    """One figure of every record of a kind: the losses, by default."""
    return [r[key] for r in read_metrics(run_dir, kind)]


def trained_alone(tmp_path_factory, config: dict) -> Path:
    """The run folder of ``config`` trained by one process: what a parallel layout is held against."""
    run_dir = tmp_path_factory.mktemp("one-process") / "run"
    GPTLauncher(run_dir.parent).run({**config, "run_dir": str(run_dir)})
    return run_dir


@pytest.fixture
def gpt_launcher(tmp_path: Path) -> GPTLauncher:
    return GPTLauncher(tmp_path)


@pytest.fixture(scope="session")
def one_rank_run(tmp_path_factory) -> tuple[Path, str]:
    """The small mock-data model trained by one process (checkpoints at iterations 4 and 8), and
    what the process printed: the curve every parallel layout is held against, and a run to export."""
    base = tmp_path_factory.mktemp("one-rank")
    run = base / "run"
    return run, GPTLauncher(base).run({**SMALL, "run_dir": str(run)})


@pytest.fixture(scope="module")
def small_run(one_rank_run, tmp_path_factory) -> Path:
    """A copy of the one-rank run (its module may write into it) with a 256-entry byte-level
    vocabulary in ``<run>/tokenizer/``."""
    import shutil

    from tokenizers import pre_tokenizers

    run = Path(shutil.copytree(one_rank_run[0], tmp_path_factory.mktemp("small") / "run"))
    (run / "tokenizer").mkdir()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    (run / "tokenizer" / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(alphabet)}))
    (run / "tokenizer" / "merges.txt").write_text("#version: 0.2\n")
    return run
