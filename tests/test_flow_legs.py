"""A run through the flow, leg after leg: 2 nodes x 1 task on the local SLURM cluster, then 1 node x
2 tasks, then the local executor with one process, each leg extending the run in the same folder
with the uninterrupted run's losses; and the same run started twice at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
from flows.pretrain import pretrain
from tests.fixtures_gpt import GPTLauncher, read_metrics
from tests.run_folder import job_records

ROOT = Path(__file__).resolve().parent.parent
ITERS = 30


def _leg(small_corpus: Path, root: Path, iters: int, cluster: ClusterParams) -> dict:
    state = pretrain(
        data=DataParams(sources=[str(small_corpus)], split="80,10,10"),
        tokenizer=TokenizerParams(train_vocab_size=1024),
        # The decay is fixed at the run's full length: each leg extends the one before.
        training=TrainingParams(train_iters=iters, eval_interval=10, eval_iters=1, log_interval=5, save_interval=10,
                                compile=False, overrides={"lr_decay_iters": ITERS}),
        cluster=cluster, output=OutputParams(root=str(root)), return_state=True)
    assert state.is_completed(), state.message
    return state.result()


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_legs_on_other_layouts_resume_one_run_with_the_uninterrupted_losses(slurm_cluster, small_corpus, tmp_path, prefect_harness):
    legs = [(10, ClusterParams(preset="slurm-local")),
            (20, ClusterParams(preset="slurm-local", overrides={"nodes": 1, "tasks_per_node": 2})),
            (ITERS, ClusterParams(preset="local"))]
    runs = [_leg(small_corpus, tmp_path, iters, cluster) for iters, cluster in legs]
    run_dir = Path(runs[0]["run_dir"])
    assert {r["run_dir"] for r in runs} == {str(run_dir)}
    assert [len(r["job_ids"]) for r in runs] == [1, 2, 3]          # one job per leg, in one run folder
    assert [j["executor"] for j in job_records(run_dir)] == ["slurm", "slurm", "local"]

    config = json.loads((run_dir / "config.json").read_text())
    reference = tmp_path / "uninterrupted"
    GPTLauncher(tmp_path).run({**config, "run_dir": str(reference)})
    want = {r["iteration"]: r["lm_loss"] for r in read_metrics(reference)}
    got = {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir)}
    assert sorted(got) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert got[it] == pytest.approx(want[it], rel=1e-4), f"iteration {it}: {got[it]} vs {want[it]}"


def _cli(root: Path, small_corpus: Path, home: Path, storage: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_LOCAL_STORAGE_PATH=str(storage), PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "flows.pretrain", "--source", str(small_corpus), "--split", "80,10,10",
                             "--train-vocab-size", "1024",
                             "--root", str(root),
                             "--train-iters", str(ITERS), "--no-compile", "--set", "log_interval=5"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(600)
def test_the_same_run_started_twice_at_once_trains_once_and_both_end_with_its_result(small_corpus, tmp_path):
    storage = tmp_path / "results"                 # one result store: the second run finds the first's results
    first = _cli(tmp_path / "runs", small_corpus, tmp_path / "home-1", storage)
    second = _cli(tmp_path / "runs", small_corpus, tmp_path / "home-2", storage)
    outputs = []
    for proc in (first, second):
        out, _ = proc.communicate(timeout=500)
        outputs.append(out)
        assert proc.returncode == 0, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
    assert any("following that run until it ends" in out for out in outputs), outputs[1][-3000:]
    finished = [line for out in outputs for line in out.splitlines() if line.startswith("pretrain finished")]
    assert len(finished) == 2 and finished[0].split(": loss ")[1] == finished[1].split(": loss ")[1]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.name != "data"]
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, ITERS + 1))   # every iteration once
    assert len(job_records(run_dir)) == 1
