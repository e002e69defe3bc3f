"""Experiment trackers with the real libraries: a real local MLflow tracking server gets one run for
a training run of two legs (the second extends the first), every iteration's metrics once and the
HuggingFace export as artifacts; W&B in offline mode keeps one run id across the legs; a tracker
that cannot be reached is a warning naming it, and the run completes; evaluations reach the same
tracker runs, each once, by one writer at a time."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tasks.tokenize.sample_corpus import sample_corpus
from tests.fixtures_gpt import ROOT
from tests.fixtures_prefect import free_port

pytestmark = pytest.mark.integration  # starts servers of its own

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


class _MLflowServer:
    """`mlflow server` on a loopback port with its own SQLite store; it can be stopped and started again."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        log = open(self.folder / "mlflow.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "mlflow-artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError("the MLflow server did not start: "
                                         + (self.folder / "mlflow.log").read_text()[-2000:]) from None
                time.sleep(1)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:       # its workers may take longer to drain on a busy machine
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One server for the module's tests: each logs to an experiment (tracker project) of its own."""
    server = _MLflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    if server.proc.poll() is None:
        server.stop()


def _wandb_train_steps(wandb_dir: Path) -> list[int]:
    """The iterations of the train metrics in W&B's offline run files."""
    return [row["iteration"] for row in _wandb_history(wandb_dir) if "train/lm_loss" in row]


def _wandb_history(wandb_dir: Path) -> list[dict]:
    """The history rows in W&B's offline run files: LevelDB-style log blocks of 32 KiB after a
    7-byte header, each holding a protobuf Record (wandb.proto)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        data, pos, part = path.read_bytes(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                break
            part += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):                  # a whole record, or the last piece of one
                record = pb.Record()
                record.ParseFromString(part)
                part = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in record.history.item})
    return rows


def _leg(tmp_path: Path, corpus: str, iters: int, env: dict[str, str], *trackers: str) -> str:
    args = [sys.executable, "-m", "flows.pretrain", "--source", corpus, "--train-vocab-size", "2048", "--train-iters", str(iters),
            "--no-compile",
            "--root", str(tmp_path / "root"), "--run-name", "tracked", "--set", "eval_interval=4", "--set",
            "eval_iters=1", "--set", "log_interval=2", "--set", "lr_warmup_iters=1",
            *[f"--tracker={t}" for t in trackers]]
    run = subprocess.run(args, env={**{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"},
                                    "PYTHONPATH": str(ROOT), **env},
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(900)
def test_two_legs_log_to_one_mlflow_run_and_one_wandb_run_each_iteration_once(mlflow_server, tmp_path):
    from mlflow import MlflowClient

    corpus = sample_corpus(str(tmp_path / "corpus"))
    env = {"MLFLOW_TRACKING_URI": mlflow_server.url, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    _leg(tmp_path, corpus, 4, env, "mlflow", "wandb")
    _leg(tmp_path, corpus, 8, env, "mlflow", "wandb")           # extends the run: a second leg
    run_dir = tmp_path / "root" / "tracked"
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["mlflow"]["last_step"] == 8 and state["wandb"]["last_step"] == 8

    client = MlflowClient(tracking_uri=mlflow_server.url)
    (experiment,) = [e for e in client.search_experiments() if e.name == "gpt-pretrain"]
    (run,) = client.search_runs([experiment.experiment_id])                 # one run for both legs
    assert run.info.run_id == state["mlflow"]["run_id"] and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/lm_loss")
    assert sorted(m.step for m in losses) == list(range(1, 9))              # every iteration, once
    assert [m.step for m in client.get_metric_history(run.info.run_id, "valid/lm_loss")] == [4, 8]
    assert run.data.params["model"] == "tiny" and "final/test_perplexity" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"hf", "samples.md"} <= artifacts
    assert "model.safetensors" in {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "hf")}

    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) >= 2 and {p.name.rsplit("-", 1)[1] for p in offline} == {state["wandb"]["run_id"]}
    assert _wandb_train_steps(run_dir / "wandb") == list(range(1, 9))    # one W&B run, every iteration once


@pytest.mark.timeout(600)
def test_a_tracker_that_cannot_be_reached_is_a_warning_naming_it(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    corpus = sample_corpus(str(tmp_path / "corpus"))
    out = _leg(tmp_path, corpus, 4, {"MLFLOW_TRACKING_URI": dead}, "mlflow")
    assert f"tracker mlflow ({dead}) failed" in out and "training goes on without it" in out
    assert (tmp_path / "root" / "tracked" / "summary.json").is_file()


@pytest.mark.timeout(600)
def test_no_log_line_or_file_of_a_run_holds_a_secret_of_its_tracker_address(tmp_path):
    """The tracker is down and its address carries secrets in its user, password, path, query and
    fragment; urllib3 retries and says so, with the request's path and query: the run's whole output
    and every file it writes hold none of them."""
    secrets = ("alice-user", "pw0rd-1234", "tok3nPATH123456", "SECRETQUERY1", "fragment99")
    dead = (f"http://{secrets[0]}:{secrets[1]}@127.0.0.1:{free_port()}/t/{secrets[2]}/?token={secrets[3]}"
            f"#{secrets[4]}")
    corpus = sample_corpus(str(tmp_path / "corpus"))
    out = _leg(tmp_path, corpus, 4, {"MLFLOW_TRACKING_URI": dead, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}, "mlflow")
    assert "tracker mlflow (" in out and "training goes on without it" in out
    written = out + "".join(p.read_text(errors="replace") for p in (tmp_path / "root").rglob("*")
                            if p.is_file() and p.suffix in ("", ".json", ".jsonl", ".txt", ".log", ".out", ".err", ".sh"))
    assert [s for s in secrets if s in written] == [], [written[max(0, written.find(s) - 300):written.find(s) + 50] for s in secrets if s in written]


@pytest.mark.timeout(300)
def test_metrics_a_tracker_missed_while_down_are_sent_once_it_is_back(mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from tasks import trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setattr(trackers, "RETRY_S", 0.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def train(i: int) -> dict:
        return {"kind": "train", "iteration": i, "lm_loss": 10.0 - i, "lr": 1e-3, "time": 1.7e9 + i}

    tracked = trackers.Trackers(["mlflow"], "outage", run_dir, {"model": "tiny"})
    tracked.records([train(1), train(2)])
    mlflow_server.stop()
    try:
        tracked.records([train(3)])                          # fails: kept for the next try
        tracked.records([train(4)])
    finally:
        mlflow_server.start()                                # the module's other tests share it
    assert [i.step for i in tracked.pending["mlflow"]] == [3, 4] and "mlflow" in tracked.open
    tracked.records([train(5)])
    tracked.close(finished=True)
    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert state["last_step"] == 5 and state["where"] == mlflow_server.url
    history = MlflowClient(tracking_uri=mlflow_server.url).get_metric_history(state["run_id"], "train/lm_loss")
    assert sorted((m.step, m.value) for m in history) == [(i, 10.0 - i) for i in range(1, 6)]


@pytest.mark.timeout(120)
def test_a_tracker_address_is_shown_and_kept_without_its_secrets(tmp_path, monkeypatch, caplog):
    from tasks import trackers

    port = free_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:pw0rd@127.0.0.1:{port}/mlflow?token=SECRETTOKEN#frag")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with caplog.at_level("WARNING"):
        tracked = trackers.Trackers(["mlflow"], "secrets", run_dir, {"model": "tiny"})
        tracked.records([{"kind": "train", "iteration": 1, "lm_loss": 9.0, "lr": 1e-3, "time": 1.7e9}])
        tracked.close(finished=False)
    assert f"tracker mlflow (http://127.0.0.1:{port}/mlflow) failed" in caplog.text
    kept = caplog.text + "".join(p.read_text() for p in run_dir.rglob("*") if p.is_file())
    assert "SECRETTOKEN" not in kept and "pw0rd" not in kept and "alice" not in kept and "frag" not in kept


def _evaluation(run_dir: Path, iteration: int):
    """An evaluation result as the evaluation job writes it."""
    from gpt.files import write_json
    from tasks.evaluate.records import EvalResult, result_path

    path = result_path(run_dir, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = EvalResult(iteration=iteration, checkpoint=str(run_dir / "checkpoints" / f"iter_{iteration:07d}"),
                      saved_at=1.7e9 + iteration, sets={"held": {"loss": 5.0 - iteration / 10, "perplexity": 100.0 / iteration,
                                                                 "tokens": 1024.0}},
                      tasks={"completion": {"acc": iteration / 10}}, seconds=3.0, path=str(path))
    write_json(path, done.model_dump())
    return done


class _OtherOwner:
    """The run folder owned by another process (as the pretrain flow owns it while training)."""

    def __init__(self, run_dir: Path) -> None:
        code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.pwrite(fd, b'training', 0); print('held', flush=True); "
                "time.sleep(600)")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir / ".owner")], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def leave(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.mark.timeout(300)
def test_evaluations_reach_the_training_runs_tracker_runs_each_once_by_one_writer(mlflow_server, tmp_path,
                                                                                   monkeypatch, caplog):
    """While training owns the run folder its follower logs what eval/ gains, and an evaluation waits
    for that; once training has let go, the evaluation logs itself, leaving the run's status; one
    that could not wait long enough is sent by the next."""
    from mlflow import MlflowClient

    from tasks import trackers
    from tasks.evaluate import records, stage
    from tasks.evaluate.records import ResultsTail, tracker_items
    from tasks.evaluate.stage import to_trackers
    from tasks.trackers import Trackers

    for name, value in {"MLFLOW_TRACKING_URI": mlflow_server.url, "WANDB_MODE": "offline",
                        "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(trackers, "RETRY_S", 0.0)           # a slow request is tried again at the next poll
    run_dir.mkdir()
    training = _OtherOwner(run_dir)
    tracked = Trackers(["mlflow", "wandb"], "evaluated", run_dir, {"model": "tiny"})     # training's follower
    tracked.records([{"kind": "train", "iteration": i, "lm_loss": 9.0 - i, "lr": 1e-3, "time": 1.7e9 + i}
                     for i in range(1, 7)])
    tail = ResultsTail(run_dir)
    assert tail.if_changed() is None                            # no evaluation yet
    _evaluation(run_dir, 2)
    waiting = threading.Thread(target=to_trackers, args=(run_dir, _evaluation(run_dir, 4)))
    waiting.start()                                             # the evaluate flow, while training runs
    started = time.monotonic()
    time.sleep(3)
    assert waiting.is_alive()                                   # it waits for the follower ...
    while waiting.is_alive() and time.monotonic() < started + 120:
        tracked.evaluations(tracker_items(run_dir, tail.if_changed() or []))    # ... whose polls log both
        waiting.join(timeout=2)
    assert not waiting.is_alive() and tail.if_changed() is None
    tracked.close(finished=True)
    training.leave()

    _evaluation(run_dir, 6)
    to_trackers(run_dir, records.results(run_dir)[-1])         # training has ended: logged by the evaluation
    training = _OtherOwner(run_dir)                             # a second leg that owns the folder ...
    monkeypatch.setattr(stage, "TRACKERS_WAIT_S", 1.0)
    with caplog.at_level("WARNING"):
        to_trackers(run_dir, _evaluation(run_dir, 8))           # ... and is not logging: left for the next
    assert "the trackers did not get evaluation 8 in 1 s: the run folder is owned by training" in caplog.text
    training.leave()
    to_trackers(run_dir, _evaluation(run_dir, 10))

    state = json.loads((run_dir / "trackers.json").read_text())
    keys = [f"{i}@{1.7e9 + i:.3f}" for i in (2, 4, 6, 8, 10)]
    assert state["mlflow"]["evaluations"] == keys and state["wandb"]["evaluations"] == keys
    assert state["mlflow"]["project"] == "evaluated"
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run = client.get_run(state["mlflow"]["run_id"])
    assert run.info.status == "FINISHED"                        # as training left it
    perplexity = client.get_metric_history(run.info.run_id, "eval/held/perplexity")
    assert sorted((m.step, m.value) for m in perplexity) == [(i, 100.0 / i) for i in (2, 4, 6, 8, 10)]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/completion/acc")) == [2, 4, 6, 8, 10]
    rows = [row for row in _wandb_history(run_dir / "wandb") if "eval/completion/acc" in row]
    assert [(r["iteration"], r["eval/completion/acc"]) for r in rows] == [(i, i / 10) for i in (2, 4, 6, 8, 10)]
    assert _wandb_train_steps(run_dir / "wandb") == list(range(1, 7))
    offline = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert offline == {state["wandb"]["run_id"]}                # one W&B run, added to
