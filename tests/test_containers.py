"""Every job of a run in the container its cluster preset names: SLURM's own OCI containers (runc)
on the local cluster for real, Pyxis's srun options for the clusters that have it."""
from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.plan.artifact import plan_rows
from flows.plan.build import ParameterError, make_plan
from flows.plan.params import ClusterParams, DataParams, OutputParams, TokenizerParams, TrainingParams
from tasks.cluster.config import PRESET_DIR, load_cluster
from tasks.cluster.container import Container
from tasks.cluster.slurm import slurm_state
from tasks.train.stage import train
from tests.fixtures_gpt import slow_iterations
from tests.run_folder import job_records, wait_until
from tests.test_cluster_slurm import (
    assert_resumed_where_it_stopped,
    requeued_and_resumed,
    running,
    tiny,
    usr2_after_a_checkpoint,
)
from tests.uninterrupted import assert_weights_equal_an_uninterrupted_run

ROOT = Path(__file__).resolve().parents[1]
STARTED = Path("/var/log/slurm/oci-run.log")      # scripts/oci-run: one line per container started
MARKER = ".oci-bundle"                             # in the bundle's root filesystem only


def bundle(path: Path, *mounts: Path) -> Path:
    subprocess.run([str(ROOT / "scripts" / "oci-bundle"), str(path), *[f"--mount={m}" for m in mounts]],
                   check=True, capture_output=True, text=True, timeout=60)
    return path


def container_preset(folder: Path, name: str, container: dict[str, Any], base: str = "slurm-local") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    preset = {**yaml.safe_load((PRESET_DIR / f"{base}.yaml").read_text()), "container": container}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(preset))
    return name


@pytest.fixture(scope="module")
def oci(tmp_path_factory) -> dict[str, Any]:
    """An OCI bundle that mounts this worker's temporary folders, and presets folder with the
    local cluster's preset running every job in it."""
    base = tmp_path_factory.getbasetemp()
    where = tmp_path_factory.mktemp("oci")
    image = bundle(where / "bundle", base)
    presets = where / "presets"
    container_preset(presets, "slurm-oci", {"runtime": "oci", "image": str(image)})
    return {"bundle": image, "presets": presets, "preset": "slurm-oci", "mounted": base}


@pytest.fixture
def oci_presets(oci, monkeypatch) -> dict[str, Any]:
    monkeypatch.setenv("GPT_CLUSTER_PRESET_DIRS", str(oci["presets"]))
    return oci


def started_containers(job_ids: set[str]) -> list[dict[str, Any]]:
    lines = STARTED.read_text().splitlines() if STARTED.exists() else []
    return [e for e in map(json.loads, lines) if e["job"] in job_ids]


def inside(pid: int) -> bool:
    """The process runs in the bundle: its root is the bundle's root filesystem (where the marker
    is) and its mount namespace is not the host's."""
    try:
        return (Path(f"/proc/{pid}/root") / MARKER).exists() and \
            os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


class RankWatch(threading.Thread):
    """Reads the heartbeats under ``root`` while training runs: for each rank that wrote one, whether
    its process ran inside the container."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.stop = root, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for beat in self.root.rglob("heartbeats/rank-*.json"):
                try:
                    b = json.loads(beat.read_text())
                except (OSError, ValueError):
                    continue
                if b["rank"] not in self.seen and Path(f"/proc/{b['pid']}").exists():
                    self.seen[b["rank"]] = inside(b["pid"])

    def __enter__(self) -> "RankWatch":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.join(timeout=5)


@pytest.mark.slurm
def test_the_flow_runs_every_job_in_the_oci_container_and_trains_as_without(
        tmp_path, slurm_cluster, oci_presets, prefect_harness, shakespeare_jsonl, bpe_vocab):
    """The pretrain flow with the data stages and the precompile job on the cluster: the sync job,
    each task of the tokenize array, the precompile and the training ranks start in the bundle; the
    ranks run inside it; the run folder on the shared root has every iteration and checkpoint, and
    the final weights are bitwise those of the same training without a container."""
    from flows.pretrain import pretrain

    sources = tmp_path / "corpus"
    sources.mkdir()
    lines = shakespeare_jsonl.read_text().splitlines(keepends=True)
    for i in range(2):
        (sources / f"part-{i}.jsonl").write_text("".join(lines[i::2]))
    vocab, merges = map(str, bpe_vocab)
    with RankWatch(tmp_path / "runs") as ranks:
        state = pretrain(
            model="tiny", data=DataParams(sources=[str(sources)]),
            tokenizer=TokenizerParams(vocab_file=vocab, merge_file=merges),
            training=TrainingParams(train_iters=6, eval_interval=6, eval_iters=1, log_interval=1, save_interval=3,
                                    compile=True, overrides={"lr_warmup_iters": 0, "precompile_iters": 2}),
            cluster=ClusterParams(preset=oci_presets["preset"], overrides={"data_jobs": True, "data_array_tasks": 2}),
            output=OutputParams(root=str(tmp_path / "runs")), return_state=True)
    assert state.is_completed(), state.message
    run_dir = Path(state.result()["run_dir"])
    jobs = {j["job_id"]: j["name"] for path in (tmp_path / "runs").rglob("jobs.json") for j in job_records(path.parent)}
    # Every stage's job, each tokenize task; a job its stage retried after a transient failure (once, a
    # compiler the container could not start) is there once per attempt.
    names = sorted(jobs.values())
    assert sorted(set(names)) == ["precompile-tiny", "sync", "tokenize", "train-tiny"], jobs
    assert names.count("tokenize") >= 2 and names.count("train-tiny") == 1, jobs
    started = started_containers(set(jobs))
    assert {e["job"] for e in started} == set(jobs)
    assert {e["rootfs"] for e in started} == {str(oci_presets["bundle"] / "rootfs")}
    assert sorted(e["rank"] for e in started if jobs[e["job"]] == "train-tiny") == [0, 1]
    assert ranks.seen == {0: True, 1: True}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if m["kind"] == "train"] == list(range(1, 7))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_0000003", "iter_0000006"]
    assert json.loads((run_dir / "cluster.json").read_text())["container"]["runtime"] == "oci"
    assert_weights_equal_an_uninterrupted_run(run_dir)


@pytest.mark.slurm
def test_usr2_requeues_and_scancel_stops_ranks_inside_the_container(tmp_path, slurm_cluster, oci_presets,
                                                                     monkeypatch) -> None:
    """USR2 from SLURM reaches the ranks inside: each saves, the job requeues itself (scontrol from
    inside), resumes and completes every iteration. USR1 has each rank write its stacks, as the hang
    watch asks, and a cancelled job leaves no rank and no container behind."""
    iters = 40
    monkeypatch.setenv("GPT_FAULT", slow_iterations(0.2))
    cluster = load_cluster(oci_presets["preset"])
    runner, outcome, job_id = usr2_after_a_checkpoint(tmp_path, cluster, iters)
    requeued_and_resumed(tmp_path, job_id, runner)
    assert outcome["result"].summary["status"] == "completed"
    assert_resumed_where_it_stopped(tmp_path, f"{job_id}_0_log.out", f"{job_id}_0_log.out", iters)
    assert len([e for e in started_containers({job_id}) if e["rank"] == 0]) == 2       # both legs in the bundle

    cancelled = tmp_path / "cancelled"
    runner = threading.Thread(target=lambda: outcome.update(cancelled=_ended(
        lambda: train(tiny(train_iters=100_000, run_dir=str(cancelled)), cluster))))
    runner.start()
    wait_until(lambda: running(cancelled) and list((cancelled / "heartbeats").glob("rank-*.json")), 90, "the ranks")
    pids = [json.loads(p.read_text())["pid"] for p in (cancelled / "heartbeats").glob("rank-*.json")]
    assert all(inside(pid) for pid in pids)
    job_id = job_records(cancelled)[0]["job_id"]
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)        # what the hang watch asks
    wait_until(lambda: all("File " in _text(cancelled / "heartbeats" / f"stacks-rank-{r}.txt") for r in (0, 1)), 30,
               "every rank's stacks, written from inside")
    subprocess.run(["scancel", job_id], check=True)
    runner.join(timeout=90)
    assert not runner.is_alive()
    wait_until(lambda: (slurm_state(job_id) or ("GONE",))[0] in ("CANCELLED", "GONE"), 30, "scancel")
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), 30, "the ranks to end")
    listed = subprocess.run(["runc", "--root=/run/slurm-oci", "list", "--quiet"], capture_output=True, text=True).stdout
    assert not [c for c in listed.split() if f".{job_id}." in c], listed


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _ended(fn: Any) -> str:
    try:
        fn()
    except Exception as e:          # the cancelled job's failure, as the train stage reports it
        return str(e)
    return "completed"


def test_the_plan_refuses_a_missing_bundle_and_a_root_the_container_does_not_see(tmp_path, oci_presets) -> None:
    base = [DataParams(), TokenizerParams(), TrainingParams(train_iters=2)]
    missing = container_preset(oci_presets["presets"], "slurm-oci-missing",
                               {"runtime": "oci", "image": str(tmp_path / "no-bundle")})
    with pytest.raises(ParameterError) as e:
        make_plan("tiny", *base, ClusterParams(preset=missing), OutputParams(root=str(oci_presets["mounted"] / "r")))
    assert f"cluster.container.image: OCI bundle {tmp_path / 'no-bundle'} has no config.json" in str(e.value)
    outside = Path("/var/tmp") / f"gpt-outside-{os.getpid()}"
    try:
        with pytest.raises(ParameterError) as e:
            make_plan("tiny", *base, ClusterParams(preset=oci_presets["preset"]), OutputParams(root=str(outside)))
    finally:
        subprocess.run(["rm", "-rf", str(outside)], check=False)
    assert f"output.root: {outside} is not visible inside the cluster's container" in str(e.value)
    read_only = container_preset(oci_presets["presets"], "slurm-pyxis-ro", {
        "runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3", "mounts": [f"{tmp_path}:{tmp_path}:ro"]})
    with pytest.raises(ParameterError) as e:
        make_plan("tiny", *base, ClusterParams(preset=read_only), OutputParams(root=str(tmp_path / "runs")))
    assert f"output.root: {tmp_path / 'runs'} is mounted read-only inside the cluster's container" in str(e.value)
    with pytest.raises(ParameterError) as e:
        make_plan("tiny", DataParams(sources=[str(outside.parent)]), *base[1:], ClusterParams(preset=oci_presets["preset"]),
                  OutputParams(root=str(oci_presets["mounted"] / "r")))
    assert f"data.sources[0]: {outside.parent} is not visible inside the cluster's container" in str(e.value)
    plan = make_plan("tiny", *base, ClusterParams(preset=oci_presets["preset"]),
                     OutputParams(root=str(oci_presets["mounted"] / "runs")))
    row = {r["item"]: r["value"] for r in plan_rows(plan, "trains from the start")}["container"]
    assert row.startswith(f"oci {oci_presets['bundle']}; mounts: ") and f", {oci_presets['mounted']};" in row
    assert f"{ROOT} (read-only)" in row and row.endswith(f"tasks start in {ROOT}")
    with pytest.raises(ParameterError) as e:      # a flow parameter never sets the container
        make_plan("tiny", *base, ClusterParams(preset="slurm-local", overrides={"container": {"runtime": "oci",
                  "image": str(oci_presets["bundle"])}}), OutputParams(root=str(tmp_path)))
    assert "container is set only by the operator" in str(e.value)


def test_what_a_container_shows_of_the_host_is_read_from_its_mounts(tmp_path) -> None:
    """A path counts as seen inside only through a mount of the host folder at its own path, the
    innermost that holds it, as the job spells the path (a link is not followed: inside it may
    point nowhere); a write needs that mount writable."""
    fsx, other = tmp_path / "fsx", tmp_path / "scratch"
    (fsx / "runs").mkdir(parents=True)
    other.mkdir()
    (tmp_path / "link").symlink_to(fsx)

    def pyxis(*mounts: str) -> Container:
        return Container(runtime="pyxis", image="nvcr.io#nvidia/pytorch:24.05-py3", mounts=list(mounts))

    assert pyxis(f"{fsx}/").problems({"data": fsx / "data"}, {"root": fsx / "runs"}) == []
    assert pyxis(str(fsx)).srun_args()[1] == f"--container-mounts={fsx}:{fsx}"      # bare SRC as SRC:SRC
    [hidden] = pyxis(f"{fsx}:{fsx}", f"{other}:{fsx}/runs").problems({}, {"output.root": fsx / "runs"})
    assert hidden.startswith(f"output.root: {fsx / 'runs'} is not the host's inside") and f"{other} at " in hidden
    [sibling] = pyxis(str(fsx)).problems({"data": f"{fsx}2/x"}, {})
    assert "is not visible inside" in sibling
    [linked] = pyxis(str(fsx)).problems({"data": tmp_path / "link" / "x"}, {})
    assert linked.startswith(f"data: {tmp_path / 'link' / 'x'} is not visible inside")
    [read_only] = pyxis(f"{fsx}:{fsx}:ro").problems({"data": fsx}, {"root": fsx / "runs"})
    assert read_only.startswith(f"root: {fsx / 'runs'} is mounted read-only")
    [missing] = pyxis(f"{tmp_path / 'nowhere'}:/data").problems({}, {})
    assert missing.startswith("cluster.container.mounts: the source of the mount at /data")
    [no_image] = Container(runtime="pyxis", image=str(tmp_path / "x.sqsh")).problems({}, {})
    assert no_image.startswith(f"cluster.container.image: {tmp_path / 'x.sqsh'} does not exist")
    with pytest.raises(ValueError, match="absolute path"):
        Container(runtime="pyxis", image="./x.sqsh")
    own = bundle(tmp_path / "own-pid", fsx)
    spec = json.loads((own / "config.json").read_text())
    spec["linux"]["namespaces"].append({"type": "pid"})
    (own / "config.json").write_text(json.dumps(spec))
    [pid] = Container(runtime="oci", image=str(own)).problems({}, {"root": fsx / "runs"})
    assert pid.startswith("cluster.container.image: ") and "its own pid namespace" in pid


def test_the_parallelcluster_pyxis_preset_writes_pyxis_options(tmp_path) -> None:
    """The shipped ParallelCluster preset (an enroot squash file on FSx, FSx mounted at its own
    path): srun carries Pyxis's --container-image, --container-mounts and --container-workdir as its
    documentation spells them, and nothing else of containers."""
    cluster = load_cluster("pcluster-p4d-pyxis")
    script = cluster.sbatch_script("/fsx/runs/r1/jobs", job_name="train-gpt3-1.3b")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    options = [o for o in srun.split() if o.startswith("--container")]
    assert options == ["--container-image=/fsx/containers/pytorch-24.05.sqsh", "--container-mounts=/fsx:/fsx",
                       "--container-workdir=/fsx/gpt"]
    assert cluster.data_job().container == cluster.container == cluster.eval_job().container
