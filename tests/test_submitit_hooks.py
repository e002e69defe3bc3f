"""The private parts of submitit that tasks.cluster.jobs and tasks.cluster.config rely on, as they are in the exact
version pyproject.toml pins: a new submitit that changes any of them fails here, before a job does."""
import inspect
import re
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import JobPaths
from submitit.slurm import slurm

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


def test_the_pinned_submitit_is_the_one_installed():
    pinned = re.search(r'"submitit==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert submitit.__version__ == pinned
    assert f"submitit=={pinned}" in (ROOT / "requirements.txt").read_text()


def test_the_private_methods_keep_their_signatures():
    # tasks.cluster.config.ClusterConfig.sbatch_script: the batch script without submitting
    params = inspect.signature(slurm._make_sbatch_string).parameters
    assert {"command", "folder", "job_name", "map_count", "additional_parameters", "srun_args"} <= set(params)
    # tasks.cluster.jobs._SlurmExecutor: sbatch without credentials, arrays through the same executor
    executor = slurm.SlurmExecutor
    assert list(inspect.signature(executor._make_submission_command).parameters) == ["self", "submission_file_path"]
    assert list(inspect.signature(executor._internal_process_submissions).parameters) == ["self", "delayed_submissions"]
    assert list(inspect.signature(executor._submit_command).parameters) == ["self", "command"]
    assert isinstance(inspect.getattr_static(executor, "_submitit_command_str"), property)
    assert callable(JobPaths.get_first_id_independent_folder)
    assert "map_count" in inspect.signature(slurm._make_sbatch_string).parameters
