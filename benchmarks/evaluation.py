"""What evaluating every checkpoint costs training: the same run trained with and without an
evaluation set, in the same benchmark run, on a cluster preset, against a Prefect server that serves
`evaluate/checkpoint` with its automation (`deployments/serve.py`). Each run is a command-line run of
the pretrain flow, as a user starts it; the two alternate, and the next starts once the evaluations of
the one before are all written.

Per run: the training job's time from submission to its end (jobs.json) and training's own wall
time (summary.json). For the runs with evaluations: how many checkpoints were evaluated, how many of
them before training ended, and how long after training's end the last one was written.

    python -m benchmarks.evaluation [--cluster slurm-local] [--iters 40] [--save-interval 10] [--repeats 2]

A Prefect server with its own database and `deployments/serve.py` are started for the benchmark and
stopped at its end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from tasks.cluster.record import JOBS_RECORD
from tasks.evaluate.records import result_path
from tasks.tokenize.sample_corpus import sample_corpus

ROOT = Path(__file__).resolve().parent.parent
EVALUATIONS_TIMEOUT_S = 1800


def run(cluster: str = "slurm-local", iters: int = 40, save_interval: int = 10, repeats: int = 2,
        workdir: str | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"benchmark": "evaluation", "cluster": cluster, "model": "tiny", "iters": iters,
                               "save_interval": save_interval, "repeats": repeats}
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench-evaluation-") as tmp:
        work = Path(tmp).resolve()
        held_out = _held_out(work)
        env = {**os.environ, "PYTHONPATH": _prepended(ROOT, "PYTHONPATH"),
               "GPT_INPUT_ROOTS": _prepended(work, "GPT_INPUT_ROOTS"), "GPT_OUTPUT_ROOTS": _prepended(work, "GPT_OUTPUT_ROOTS")}
        with _served(work, env) as served_env:
            runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
            for repeat in range(repeats):
                for name in ("without", "with"):
                    args = ["--cluster", cluster, "--train-iters", str(iters), "--no-compile", "--root", str(work / "root"),
                            "--run-name", f"{name}-{repeat}", "--set", f"save_interval={save_interval}",
                            "--set", "eval_interval=1000000"]
                    if name == "with":
                        args += ["--eval-set", "held", str(held_out)]
                    runs[name].append(_pretrain(args, served_env, work / "root" / f"{name}-{repeat}",
                                                evaluated=name == "with"))
    for name, found in runs.items():
        figures[f"{name}_train_job_s"] = [r["train_job_s"] for r in found]
        figures[f"{name}_train_wall_s"] = [r["train_wall_s"] for r in found]
    figures["evaluations"] = [r["evaluations"] for r in runs["with"]]
    figures["evaluated_before_training_ended"] = [r["evaluated_before_training_ended"] for r in runs["with"]]
    figures["last_evaluation_after_training_s"] = [r["last_evaluation_after_training_s"] for r in runs["with"]]
    for figure in ("train_job_s", "train_wall_s"):
        figures[f"with_over_without_{figure}"] = round(
            statistics.median(figures[f"with_{figure}"]) / statistics.median(figures[f"without_{figure}"]), 3)
    return figures


def _held_out(work: Path) -> Path:
    """The last 50 documents of the sample corpus: a small named set, so an evaluation is short."""
    lines = Path(sample_corpus(str(work / "corpus"))).read_text().splitlines()
    path = work / "held.jsonl"
    path.write_text("\n".join(lines[-50:]) + "\n")
    return path


def _prepended(folder: Path, variable: str) -> str:
    return os.pathsep.join(filter(None, [str(folder), os.environ.get(variable)]))


@contextlib.contextmanager
def _served(work: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A Prefect server with its database in `work`, and deployments/serve.py against it; yields the
    environment that reports to it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = {**env, "PREFECT_HOME": str(work / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)        # the server's own environment; its clients get it below
    started: list[subprocess.Popen] = []

    def start(args: list[str], log: str) -> None:
        with open(work / log, "w") as out:
            started.append(subprocess.Popen(args, env=env, cwd=work, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True))
    try:
        start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)], "server.log")
        _wait(lambda: _answers(f"{url}/health"), 180, "the Prefect server")
        env["PREFECT_API_URL"] = url
        start([sys.executable, str(ROOT / "deployments" / "serve.py"), "--history", str(work / "history")], "serve.log")
        _wait(lambda: _answers(f"{url}/deployments/name/evaluate/checkpoint"), 180, "the served deployments")
        yield env
    finally:
        for proc in reversed(started):
            if proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _wait(ready: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def _pretrain(args: list[str], env: dict[str, str], run_dir: Path, evaluated: bool) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "flows.pretrain", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the pretrain run {run_dir.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    jobs = [j for j in json.loads((run_dir / JOBS_RECORD).read_text()) if j["name"].startswith("train")]
    started, ended = jobs[0]["submitted"], jobs[-1]["states"][-1]["time"]
    found: dict[str, Any] = {"train_job_s": round(ended - started, 2),
                             "train_wall_s": round(json.loads((run_dir / "summary.json").read_text())["wall_s"], 2)}
    if evaluated:
        saved = sorted({r["iteration"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                        if r["kind"] == "save"})
        wanted = [result_path(run_dir, iteration) for iteration in saved]
        _wait(lambda: all(p.exists() for p in wanted), EVALUATIONS_TIMEOUT_S, f"the evaluations of {run_dir.name}")
        written = [p.stat().st_mtime for p in wanted]
        found.update(evaluations=len(wanted), evaluated_before_training_ended=sum(t < ended for t in written),
                     last_evaluation_after_training_s=round(max(written) - ended, 1))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="slurm-local", help="preset in tasks/cluster/presets or a YAML path")
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, without then with evaluations")
    parser.add_argument("--workdir", default=None, help="where the run folders go (shared storage on SLURM)")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.cluster, args.iters, args.save_interval, args.repeats, args.workdir), indent=2))


if __name__ == "__main__":
    main()
