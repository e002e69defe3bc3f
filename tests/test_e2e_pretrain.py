"""End to end: a real Prefect server, the served deployments, the local SLURM cluster, S3 on loopback.

`prefect deployment run pretrain/gpt3 --watch` trains the tiny GPT on the 2-node SLURM cluster
from a corpus in the S3 server; the run completes with every stage and its artifacts; the same
parameters again skip the data stages; a training job killed mid-run is retried and resumes from
its checkpoint; headless chromium saves a screenshot of the flow run page.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from deployments import evaluations
from flows.plan.boundary import S3_ENDPOINTS
from tasks.tokenize.sample_corpus import sample_corpus
from tests.fixtures_prefect import screenshot, start_server, stop
from tests.fixtures_s3 import SECRET_KEY
from tests.run_folder import job_records, wait_until
from tests.test_evaluate import TASK, write_held_out, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "runs" / "e2e"
DATA_STAGES = ("sync", "tokenize", "index")


def _kill_when_running(run_dir: Path, nth: int) -> None:
    """SIGKILL the job steps of the nth training job once SLURM runs it."""
    def running() -> str | None:
        jobs = job_records(run_dir)
        if len(jobs) >= nth and any(s["state"] == "RUNNING" for s in jobs[nth - 1]["states"]):
            return jobs[nth - 1]["job_id"]
        return None
    job = wait_until(running, 400, f"training job {nth} to run", every=0.5)
    killed = subprocess.run(["scancel", "--signal=KILL", job], capture_output=True, text=True)
    assert killed.returncode == 0, killed.stderr


def _checkpoints(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.glob("iter_*") if (p / "COMPLETE").exists()) if folder.exists() else []


@pytest.fixture(scope="module")
def served(prefect_server, s3_server, slurm_cluster, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`deployments/serve.py` running against the test server, the corpus uploaded to S3."""
    work = tmp_path_factory.mktemp("e2e")  # one host: every SLURM node sees this folder
    corpus = Path(sample_corpus(str(work / "corpus")))
    bucket = s3_server.new_bucket()
    s3_server.put(bucket, "corpus/shakespeare.jsonl", corpus)
    env = dict(prefect_server.env)
    env.update({k: v for k, v in s3_server.env.items() if k.startswith("AWS_")})
    env[S3_ENDPOINTS] = s3_server.endpoint_url          # the operator lets runs use the S3 server
    env["PYTHONPATH"] = str(ROOT)
    env["PREFECT_RUNNER_POLL_FREQUENCY"] = "2"          # a run the UI or an automation schedules starts within 2 s
    log = work / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "deployments" / "serve.py"), "--history",
                                 str(work / "benchmarks")], cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"serve.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            prefect_server.api("/deployments/name/pretrain/gpt3")
            prefect_server.api("/deployments/name/benchmark/nightly")
            return True
        except OSError:
            return False

    wait_until(ready, 120, "the served deployments")
    try:
        yield SimpleNamespace(work=work, bucket=bucket, endpoint=s3_server.endpoint_url, log=log, s3=s3_server,
                              server=prefect_server, partition=slurm_cluster["partition"])
    finally:
        stop(proc, signal.SIGINT, timeout=30)


def params(served: SimpleNamespace, run_name: str, upload: bool = False, evaluation: dict | None = None,
           **training) -> dict:
    return {
        "model": "tiny",
        "data": {"sources": [f"s3://{served.bucket}/corpus/"], "endpoint_url": served.endpoint},
        "tokenizer": {"train_vocab_size": 2048},
        "training": {"train_iters": 20, "eval_interval": 10, "eval_iters": 2, "save_interval": 10,
                     "log_interval": 2, "overrides": {"lr_warmup_iters": 4}, **training},
        "cluster": {"preset": "slurm-local", "overrides": {"partition": served.partition, "time_limit": 20}},
        "output": {"root": str(served.work / "runs"), "run_name": run_name,
                   **({"uri": f"s3://{served.bucket}/runs/{run_name}", "endpoint_url": served.endpoint} if upload else {})},
        **({"evaluation": evaluation} if evaluation else {}),
    }


def run_args(parameters: dict, timeout: int = 600) -> list[str]:
    """`prefect deployment run` arguments: one --param per group, nested groups as JSON."""
    args = ["deployment", "run", "pretrain/gpt3", "--watch", "--watch-timeout", str(timeout)]
    for key, value in parameters.items():
        args += ["--param", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return args


def watched_run(served: SimpleNamespace, name: str, evaluation: dict | None = None,
                **training) -> tuple[Path, subprocess.Popen]:
    """Start `prefect deployment run ... --watch` in the background: the CLI blocks while it
    watches, and the test kills training jobs beside it."""
    args = [sys.executable, "-m", "prefect", *run_args(params(served, name, evaluation=evaluation, **training))]
    proc = subprocess.Popen(args, env=served.server.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return served.work / "runs" / name, proc


def deployment_run(served: SimpleNamespace, parameters: dict, timeout: int = 600) -> tuple[dict, str]:
    result = served.server.cli(*run_args(parameters, timeout), timeout=timeout + 60)
    output = result.stdout + result.stderr
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert match, f"no flow run id in the CLI output:\n{output}"
    run = served.server.flow_run(match.group(1))
    assert result.returncode == 0 and run["state"]["type"] == "COMPLETED", (
        f"flow run {run['name']} ended {run['state']['name']}: {run['state'].get('message')}\n{output[-3000:]}\n"
        f"serve log:\n{served.log.read_text()[-5000:]}")
    return run, output


def task_states(served: SimpleNamespace, run_id: str) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for tr in served.server.task_runs(run_id):
        states.setdefault(tr["name"].rsplit("-", 1)[0], []).append(tr["state"]["name"])
    return states


def evaluate_runs(served: SimpleNamespace, run_dir: Path) -> list[dict]:
    """The evaluate flow runs of a run folder, oldest first."""
    found = served.server.api("/flow_runs/filter", {"flows": {"name": {"any_": ["evaluate"]}}, "sort": "START_TIME_ASC"})
    return [r for r in found if r["parameters"].get("run") == str(run_dir)]


def test_pretrain_deployment_runs_every_stage_then_skips_data_stages(served):
    # A named set only: lm-eval's tasks on the same evaluation job are checked in tests/test_evaluate.py.
    evaluation = {"sets": [{"name": "held", "sources": [str(write_held_out(served.work / "held.jsonl"))]}]}
    run, _ = deployment_run(served, {**params(served, "e2e-main", upload=True), "evaluation": evaluation})
    states = task_states(served, run["id"])
    for stage in ("index", "train", "export", "upload", "report"):
        assert states.get(stage) == ["Completed"], states
    for stage in ("sync", "tokenize"):        # the training data, and the evaluation set
        assert states.get(stage) == ["Completed", "Completed"], states
    run_dir = served.work / "runs" / "e2e-main"
    assert [j["executor"] for j in job_records(run_dir)] == ["slurm"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("kind", "train") == "train"]
    assert train[-1]["iteration"] == 20 and train[-1]["lm_loss"] < train[0]["lm_loss"]

    artifacts = {a["key"]: a for a in served.server.artifacts(run["id"]) if a["key"]}
    assert {"pretrain-dataset", "pretrain-summary", "pretrain-loss-curve", "pretrain-links"} <= set(artifacts)
    summary = {row["item"]: row["value"] for row in json.loads(artifacts["pretrain-summary"]["data"])}
    assert summary["status"] == "completed" and summary["iterations"].startswith("20")
    assert float(summary["final train loss"]) < train[0]["lm_loss"]
    assert summary["job ids"] != "local"
    dataset = json.loads(artifacts["pretrain-dataset"]["data"])
    assert int(dataset[0]["documents"].replace(",", "")) > 1000
    assert "data:image/png;base64," in artifacts["pretrain-loss-curve"]["data"]
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in artifacts["pretrain-links"]["data"]

    uploaded = served.s3.client().list_objects_v2(Bucket=served.bucket, Prefix="runs/e2e-main/")
    keys = {o["Key"] for o in uploaded.get("Contents", [])}
    assert {"runs/e2e-main/metrics.jsonl", "runs/e2e-main/config.json", "runs/e2e-main/loss.png",
            "runs/e2e-main/hf/model.safetensors", "runs/e2e-main/hf/tokenizer.json",
            "runs/e2e-main/checkpoints/iter_0000020/COMPLETE",     # copied by the flow's process as it came
            "runs/e2e-main/checkpoints/iter_0000020/records/metrics.jsonl"} <= keys, keys

    # The flow used the S3 secret (sync and upload); it must be nowhere else: not in the run folder
    # (job scripts, rank logs), the serve log, Prefect's database, result storage or artifacts, nor
    # in what SLURM keeps of the job's environment.
    secret = SECRET_KEY.encode()
    job_envs = [p for j in job_records(run_dir) for p in Path("/var/spool/slurmctld").glob(f"hash.*/job.{j['job_id']}/*")]
    places = [served.work / "runs", served.log, served.server.home, *job_envs]
    leaks = [str(f) for place in places for f in ([place] if place.is_file() else place.rglob("*"))
             if f.is_file() and secret in f.read_bytes()]
    assert leaks == [], leaks
    assert SECRET_KEY not in json.dumps(served.server.artifacts(run["id"]))

    # Each checkpoint (iterations 10 and 20) evaluated through the automation, one after the other,
    # each on a SLURM job of its own once training had given the nodes back.
    def evaluated() -> list[dict] | None:
        runs = evaluate_runs(served, run_dir)
        if any(r["state"]["type"] in ("FAILED", "CRASHED") for r in runs):
            raise AssertionError(f"{[(r['name'], r['state']) for r in runs]}\n{served.log.read_text()[-5000:]}")
        return runs if len(runs) == 2 and all(r["state"]["type"] == "COMPLETED" for r in runs) else None
    runs = wait_until(evaluated, 500, "two completed evaluations")
    assert sorted(int(r["parameters"]["iteration"]) for r in runs) == [10, 20]
    assert "nothing on this Prefect server evaluates" not in served.log.read_text()
    assert [j["executor"] for j in job_records(run_dir / "eval")] == ["slurm", "slurm"]
    # (each state's time is when its follower saw it, polling every few seconds)
    trained_until = max(s["time"] for j in job_records(run_dir) for s in j["states"])
    assert all(s["time"] >= trained_until - 5 for j in job_records(run_dir / "eval") for s in j["states"]
               if s["state"] == "RUNNING")
    board = max((a for a in served.server.artifacts(run["id"]) if a["key"] == "evaluation"), key=lambda a: a["created"])
    assert "| 10 |" in board["data"] and "| 20 |" in board["data"] and "held ppl" in board["data"]

    again, _ = deployment_run(served, {**params(served, "e2e-main", upload=True), "evaluation": evaluation})
    states = task_states(served, again["id"])
    for stage in (*DATA_STAGES, "train"):
        assert set(states.get(stage, [])) == {"Cached"}, states

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = screenshot(f"{served.server.url}/runs/flow-run/{run['id']}", SCREENSHOTS / "flow-run.png", wait_ms=15000)
    art = screenshot(f"{served.server.url}/artifacts/artifact/{artifacts['pretrain-loss-curve']['id']}",
                     SCREENSHOTS / "loss-curve-artifact.png", wait_ms=15000)
    # A rendered page (dark UI, graph, text) compresses far worse than a blank one.
    assert shot.stat().st_size > 30_000 and art.stat().st_size > 30_000


def test_training_killed_once_is_retried_and_resumes_from_its_checkpoint(served):
    """...and its evaluation, which fails (its task's data file parses as a file name at plan time,
    not as JSON when lm-eval reads it), fails its own flow run, never the training's."""
    broken = write_task(served.work / "broken-task")
    (broken / "completions.jsonl").write_text("{this is not JSON\n")
    evaluation = {"tasks": [TASK], "task_files": [str(broken)], "every": 1000}       # the last checkpoint only
    run_dir, proc = watched_run(served, "e2e-killed", evaluation=evaluation, train_iters=40)
    try:
        wait_until(lambda: _checkpoints(run_dir), 400, "a first checkpoint")
        _kill_when_running(run_dir, 1)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    match = re.search(r"UUID: ([0-9a-f-]{36})", output)
    assert match, output
    run = served.server.flow_run(match.group(1))
    assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{output[-3000:]}\n{served.log.read_text()[-5000:]}"
    train_runs = [tr for tr in served.server.task_runs(run["id"]) if tr["name"].startswith("train")]
    assert len(train_runs) == 1 and train_runs[0]["run_count"] == 2  # failed once, retried once
    assert len({j["job_id"] for j in job_records(run_dir)}) == 2
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line).get("kind", "train") == "train"]
    assert iterations[-1] == 40
    assert iterations.count(1) == 1 and iterations.count(2) == 1  # the retry did not start over

    def ended() -> list[dict] | None:
        runs = evaluate_runs(served, run_dir)
        return runs if runs and all(r["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") for r in runs) else None
    [evaluated] = wait_until(ended, 300, "the run's evaluation to end")
    assert evaluated["state"]["type"] == "FAILED" and int(evaluated["parameters"]["iteration"]) == 40, evaluated["state"]
    assert served.server.flow_run(run["id"])["state"]["type"] == "COMPLETED"


def test_served_nightly_benchmark_carries_its_schedule(served):
    deployment = served.server.api("/deployments/name/benchmark/nightly")
    crons = [s["schedule"].get("cron") for s in deployment["schedules"] if s["active"]]
    assert crons == ["0 2 * * *"]
    assert deployment["parameters"]["history"] == str(served.work / "benchmarks")
    pretrain = served.server.api("/deployments/name/pretrain/gpt3")
    schema = pretrain["parameter_openapi_schema"]
    assert list(schema["properties"]) == ["model", "data", "tokenizer", "training", "cluster", "output", "budget",
                                          "evaluation", "phases", "dry_run"]
    assert served.server.api("/deployments/name/evaluate/checkpoint")["entrypoint"].endswith("evaluate")
    burn_in = served.server.api("/deployments/name/burn-in/quarantine")
    assert list(burn_in["parameter_openapi_schema"]["properties"]) == ["cluster", "iterations"]


def test_bad_parameters_are_rejected_before_a_run_is_created(served):
    for param, field in (("model=gpt3-7b", "model"), ('training={"micro_batch_size": 0}', "micro_batch_size"),
                         ('data={"sorces": ["s3://x/"]}', "sorces")):
        result = served.server.cli("deployment", "run", "pretrain/gpt3", "--param", param)
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "Validation failed" in output and field in output, output
    runs = served.server.api("/flow_runs/filter", {"flows": {"name": {"any_": ["pretrain"]}},
                                                   "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}}})
    assert runs == []


def test_prefect_yaml_deploys_to_a_process_pool_and_setup_makes_the_evaluation_automation(tmp_path):
    # Its own server: these deployments have the same names as the served ones.
    server, proc = start_server(tmp_path / "prefect-home")
    try:
        env = {**server.env, "GPT_PRETRAIN_DIR": str(ROOT)}
        pool = server.cli("work-pool", "create", "gpt", "--type", "process")
        assert pool.returncode == 0, pool.stdout + pool.stderr
        result = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all",
                                 "--prefect-file", "deployments/prefect.yaml"], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        deployments = server.api("/deployments/filter", {"work_pools": {"name": {"any_": ["gpt"]}}})
        by_name = {d["name"]: d for d in deployments}
        assert set(by_name) == {"gpt3", "checkpoint", "nightly", "quarantine"}
        assert [s["schedule"]["cron"] for s in by_name["nightly"]["schedules"]] == ["0 2 * * *"]
        step = by_name["gpt3"]["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]
        assert step["directory"] == str(ROOT)
        made = subprocess.run([sys.executable, "-m", "deployments.setup"], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stdout + made.stderr
        (automation,) = [a for a in server.api("/automations/filter", {}) if a["name"] == evaluations.NAME]
        (action,) = automation["actions"]
        assert action["deployment_id"] == by_name["checkpoint"]["id"]
        assert automation["trigger"]["expect"] == [evaluations.EVENT]
    finally:
        stop(proc)


def test_retry_from_the_ui_reruns_only_what_did_not_finish(served):
    """Training fails on both attempts (killed twice): the flow run fails. Retrying it as the UI's
    Retry button does reuses the data stages and resumes training from its checkpoint."""
    run_dir, proc = watched_run(served, "e2e-ui-retry", train_iters=80)
    try:
        wait_until(lambda: _checkpoints(run_dir), 400, "a first checkpoint")
        _kill_when_running(run_dir, 1)
        _kill_when_running(run_dir, 2)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", output).group(1)
    assert served.server.flow_run(run_id)["state"]["type"] == "FAILED", output[-3000:]
    before = {tr["id"] for tr in served.server.task_runs(run_id)}

    served.server.api(f"/flow_runs/{run_id}/set_state", {
        "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": False})
    run = wait_until(lambda: (r := served.server.flow_run(run_id))["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED")
                and r, 600, "the retried flow run", every=2)
    assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{served.log.read_text()[-5000:]}"
    assert run["run_count"] == 2
    retried = [tr for tr in served.server.task_runs(run_id) if tr["id"] not in before]
    states = {tr["name"].rsplit("-", 1)[0]: tr["state"]["name"] for tr in retried}
    assert [states[s] for s in DATA_STAGES] == ["Cached"] * 3 and states["train"] == "Completed", states
    assert len(job_records(run_dir)) == 3
    iterations = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line).get("kind", "train") == "train"]
    assert iterations[-1] == 80 and iterations.count(1) == 1
