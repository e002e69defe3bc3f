"""How a Trainium job is launched: one torchrun per node (srun --ntasks-per-node=1) with one process
per NeuronCore, neuron_parallel_compile around that torchrun once per node for the precompile stage,
a per-node compile cache on the shared file system, training on the nodes that compiled. The batch
scripts of the trn1 preset are generated and their node launcher run as a node would run it; the
launcher itself trains for real on the local SLURM cluster (gloo on CPU: the ranks' environment and
world size are what Neuron would see)."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from submitit.core.utils import JobPaths, pickle_load

from gpt.config import Config
from tasks.cluster.config import load_cluster
from tasks.cluster.jobs import submit
from tasks.cluster.launch import DistributedTask, job_launch, neuron_launch, rendezvous_port
from tasks.precompile import PrecompileManifest, cache_key, sbatch_script
from tasks.train.stage import on_compiled_nodes

CACHE_ROOT = "/fsx/gpt/data/compile-cache"
ENV_PROBE = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
             "'SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NTASKS', 'MASTER_ADDR', 'MASTER_PORT', 'NEURON_CC_FLAGS')}))")


def trn1_config() -> Config:
    config = Config.from_preset("gpt3-1.3b", train_iters=100, device="neuron", run_dir="/fsx/gpt/runs/r1",
                                data_index="/fsx/gpt/data/index.json")
    return dataclasses.replace(config, compile_cache_dir=f"{CACHE_ROOT}/{cache_key(config, load_cluster('trn1-32xl'))}")


def srun_line(script: str) -> str:
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


def run_node(srun: str, tmp_path: Path, *, node: int, nodes: str, env: dict[str, str],
             python_args: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the command srun starts on a node, as that node would, with SLURM's task environment;
    ``scontrol`` answers the node names, and a stand-in neuron_parallel_compile records what it
    would run. ``python_args`` replaces submitit's arguments after the launcher."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    hosts = nodes.split(",")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(hosts) + "\n")
    (bin_dir / "neuron_parallel_compile").write_text(
        '#!/usr/bin/env python3\nimport json, os, sys\n'
        'print(json.dumps({"argv": sys.argv[1:], "NEURON_CC_FLAGS": os.environ["NEURON_CC_FLAGS"]}))\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    command = srun.split(" --ntasks-per-node=1 ", 1)[1]
    if python_args is not None:
        command = command.rsplit(" -u -m submitit", 1)[0] + " " + python_args
    slurm = {"SLURM_JOB_ID": env.pop("SLURM_JOB_ID", "4242"), "SLURM_JOB_NODELIST": nodes,
             "SLURM_JOB_NUM_NODES": str(len(hosts)), "SLURM_NODEID": str(node), "SLURMD_NODENAME": hosts[node],
             "SLURM_PROCID": str(node), "SLURM_NTASKS": str(len(hosts))}
    return subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}", **slurm, **env})


def test_precompile_and_training_scripts_of_the_trn1_preset(tmp_path: Path) -> None:
    config, cluster = trn1_config(), load_cluster("trn1-32xl", partition="compute")
    compile_script = sbatch_script(config, cluster)
    flags = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", compile_script, re.M))
    assert (flags["nodes"], flags["ntasks-per-node"], flags["partition"]) == ("16", "32", "compute")
    assert "exclusive" in flags
    srun = srun_line(compile_script)
    assert "--ntasks=16 --ntasks-per-node=1 " in srun          # one launcher per node
    assert srun.count("neuron_parallel_compile") == 1
    assert "XLA_USE_BF16" not in compile_script and "XLA_DOWNCAST_BF16" not in compile_script

    # Node 3 of 16 runs neuron_parallel_compile once, around torchrun with 32 processes, and
    # compiles into its own folder of the shared cache.
    preset_flags = cluster.env["NEURON_CC_FLAGS"]
    done = run_node(srun, tmp_path, node=3, nodes="trn-1,trn-2,trn-3,trn-4", env={"NEURON_CC_FLAGS": preset_flags})
    assert done.returncode == 0, done.stderr
    ran = json.loads(done.stdout)
    argv = ran["argv"]
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--nnodes=4", "--node_rank=3", "--nproc_per_node=32", "--master_addr=trn-1", "--no-python"} <= set(argv)
    assert argv[-4:] == ["-u", "-m", "submitit.core._submit", str(Path(config.run_dir) / "precompile" / "jobs")]
    assert ran["NEURON_CC_FLAGS"] == f"{preset_flags} --cache_dir={config.compile_cache_dir}/trn-4"

    # Training: on the nodes that compiled, no neuron_parallel_compile, the same per-node cache.
    compiled = PrecompileManifest(cache_dir=config.compile_cache_dir, key=Path(config.compile_cache_dir).name,
                                  hit=False, nodelist="trn-[1-16]", time_to_first_iteration_s=1.0, device="neuron",
                                  digest="d")
    train_cluster, python = job_launch(on_compiled_nodes(cluster, compiled), config.compile_cache_dir,
                                       compile_graphs=False)
    train_script = train_cluster.sbatch_script(Path(config.run_dir) / "jobs", job_name="train", python=python)
    assert "#SBATCH --nodelist='trn-[1-16]'" in train_script
    srun = srun_line(train_script)
    assert "neuron_parallel_compile" not in srun and "--ntasks=16 --ntasks-per-node=1 " in srun
    assert f"{shlex.quote(config.compile_cache_dir)} 32 " in srun


def test_each_torchrun_rank_is_its_own_task_of_the_world(tmp_path: Path) -> None:
    """torchrun for real (one node, two processes): each rank gets the world size and rank torchrun
    gave it, also as SLURM's task variables (which submitit reads to name each rank's result)."""
    cluster = load_cluster("trn1-32xl", nodes=1, tasks_per_node=2)
    launch, python = neuron_launch(cluster, "/fsx/cache/k", compile_graphs=False)
    srun = srun_line(launch.sbatch_script(tmp_path / "jobs", python=python))
    job_id = _job_id_with_a_free_port()
    done = run_node(srun, tmp_path, node=0, nodes="localhost",
                    env={"SLURM_JOB_ID": str(job_id), "NEURON_CC_FLAGS": "--model-type=transformer"},
                    python_args=f"-c {shlex.quote(ENV_PROBE)}")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["RANK"])
    assert [(r["RANK"], r["SLURM_PROCID"], r["LOCAL_RANK"], r["SLURM_LOCALID"]) for r in ranks] == \
        [("0", "0", "0", "0"), ("1", "1", "1", "1")]
    assert {(r["WORLD_SIZE"], r["SLURM_NTASKS"], r["MASTER_ADDR"]) for r in ranks} == {("2", "2", "localhost")}
    assert {r["NEURON_CC_FLAGS"] for r in ranks} == {"--model-type=transformer --cache_dir=/fsx/cache/k/localhost"}


def _job_id_with_a_free_port() -> int:
    """A job id whose launcher port (the one rule, its first start) is free on this machine."""
    for job_id in random.sample(range(15000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", rendezvous_port(job_id, 0)))
            except OSError:
                continue
        return job_id
    raise RuntimeError("no free port between 15000 and 30000")


def test_the_node_launcher_and_the_ranks_take_the_port_of_the_one_rule(monkeypatch) -> None:
    """Trainium's launcher computes the port in bash, every other job's ranks in Python: the same
    port for the same job and restart, another one at each restart."""
    from tasks.cluster import launch

    line = next(part for part in launch._NODE_LAUNCHER.split("; ") if part.startswith("port="))
    for job_id, restarts in [(1, 0), (12345, 0), (12345, 1), (29999, 4)]:
        shell = subprocess.run(["bash", "-c", f"{line}; echo $port"], capture_output=True, text=True, check=True,
                               env={"SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(restarts)})
        assert int(shell.stdout) == rendezvous_port(job_id, restarts)
    assert rendezvous_port(12345, 0) != rendezvous_port(12345, 1)


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_the_launcher_trains_on_two_nodes_with_two_ranks_each(slurm_cluster: dict, tmp_path: Path) -> None:
    """The Trainium launcher on the local SLURM cluster (CPU ranks, gloo): one torchrun per node,
    four ranks that see a world of four, each with its own result."""
    cluster = load_cluster(slurm_cluster["preset"], tasks_per_node=2, cpus_per_task=1)
    config = Config.from_preset("tiny", mock_data=True, precision="fp32", device="cpu", vocab_size=256,
                                num_layers=2, hidden_size=32, seq_length=16, micro_batch_size=2, global_batch_size=8,
                                train_iters=4, log_interval=2, eval_interval=1000, eval_iters=1, save_interval=4,
                                run_dir=str(tmp_path / "run"))
    launch, python = neuron_launch(cluster, None, compile_graphs=False)
    summary, job_id, nodes = submit(DistributedTask(config.to_dict()), launch, run_dir=tmp_path / "run",
                                    job_name="launcher", python=python)
    assert summary["status"] == "completed" and summary["iteration"] == 4
    assert nodes == "node[1-2]"
    folder = tmp_path / "run" / "jobs"
    results = [pickle_load(JobPaths(folder, job_id=job_id, task_id=rank).result_pickle) for rank in range(4)]
    assert [outcome for outcome, _ in results] == ["success"] * 4
    assert all(summary["iteration"] == 4 for _, summary in results)


def test_the_reference_setup_gpt3_6_7b_with_tensor_parallel_32_plans(tmp_path: Path, monkeypatch) -> None:
    """GPT-3 6.7B on 16 x trn1.32xlarge with tensor parallel 32 (one node's 32 NeuronCores per
    group, 16 data-parallel replicas): the plan accepts it and the job's checks pass for 512 ranks."""
    from flows.plan import sizes
    from flows.plan.build import make_plan
    from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
    from gpt.parallel import xla
    from gpt.tokenizer import Tokenizer
    from tasks.index import IndexManifest

    # Its root is shared storage with room for its 72 GiB checkpoints (FSx), unlike this machine's disk.
    monkeypatch.setattr(sizes, "free_bytes", lambda path: 100 * sizes.GIB * 1024)

    plan = make_plan("gpt3-6.7b", DataParams(), TokenizerParams(), TrainingParams(train_iters=100, tensor_parallel=32),
                     ClusterParams(preset="trn1-32xl"), OutputParams(root=str(tmp_path)))
    index = tmp_path / "index.json"
    index.write_text("{}")
    config = plan.training_job(Tokenizer(None, None, None, 50256, 50257),
                               IndexManifest(path=str(index), seq_length=2048, num_samples={}, digest="")).config
    assert (config.device, config.tensor_parallel, config.data_parallel_mode) == ("neuron", 32, "ddp")
    world = plan.cluster.nodes * plan.cluster.tasks_per_node
    assert world == 512
    config.validate(world)
    group = xla.new_group(rank=32 * 5 + 7, world_size=world, size=32, lazy=True)
    assert group.replicas[5] == list(range(160, 192))  # node 5's NeuronCores: a group never leaves its node
    assert group.data_parallel[7] == list(range(7, 512, 32))
