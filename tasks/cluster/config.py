"""Where training runs: a typed, validated cluster configuration and its sbatch parameters.

Two kinds of author, two levels of trust:

- The operator writes presets: YAML files in ``tasks/cluster/presets/`` or in the folders listed
  in ``GPT_CLUSTER_PRESET_DIRS`` (the environment of the process that runs the flow, never a
  flow parameter). A preset may hold anything: ``setup`` shell lines, container images and
  mounts, any extra sbatch/srun option, any environment variable.
- Whoever can start a run chooses a preset by name and overrides single fields through flow
  parameters. Those overrides pass an allowlist (``FORM_FIELDS``, ``check_overrides``): resources
  and placement (partition, account, qos, nodes, gpus, time, constraint...), extra sbatch/srun
  options from a fixed list with a checked value shape, and environment variables from a fixed
  list of tuning knobs. Nothing that sets the job's environment at large, prologs, paths, shells or
  images, and nothing the plan's checks rest on: the executor, the device, the accelerator and its
  memory, the price.

Every field that ends up in the sbatch script is either checked against a strict pattern or
shell-quoted (``env`` values, ``srun_extra``, ``sbatch_extra``).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpt.config.overrides import split_assignment
from tasks.cluster.container import Container
from tasks.cluster.spares import step_loop
from tasks.common.secrets import SECRET_NAME

PRESET_DIR = Path(__file__).resolve().parent / "presets"        # the reviewed presets shipped with this package
PRESET_DIRS_VARIABLE = "GPT_CLUSTER_PRESET_DIRS"

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_HOSTLIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,&|()\[\]*:-]+$")
_GRES = re.compile(r"^[A-Za-z0-9_.,:-]+$")
_MEM = re.compile(r"^[0-9]+[KMGT]?$")
# The string fields whose shape is checked: the pattern each must match, and what it should look like.
_SHAPES = {
    **dict.fromkeys(("name", "partition", "account", "qos", "accelerator", "data_partition", "eval_partition"),
                    (_NAME, "may only contain letters, digits and _.+-")),
    **dict.fromkeys(("nodelist", "exclude"), (_HOSTLIST, "is not a SLURM hostlist such as node[1-4],gpu7")),
    "constraint": (_CONSTRAINT, "may only contain feature names and & | , ( ) [ ] * :"),
    "gres": (_GRES, "must look like gpu:8 or gpu:a100:8"),
    **dict.fromkeys(("mem", "data_mem"), (_MEM, "must be a size such as 0, 64G or 512000M")),
}
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2})(?::(\d{2}))?$")


# GPU generations without fast bf16 (accelerator names, lower case).
PRE_AMPERE_GPUS = frozenset({"v100", "t4", "p100", "p4", "k80", "m60", "rtx8000", "rtx6000", "titanv"})
# GPU generations with the float8 matmuls of precision fp8: Hopper and later.
FLOAT8_GPUS = frozenset({"h100", "h200", "h800", "h20", "gh200", "b100", "b200", "gb200", "b300", "gb300"})


class ClusterError(ValueError):
    """A cluster configuration or submission problem; the message says what to change."""


def _no_control(value: str, field: str) -> str:
    if _CONTROL.search(value):
        raise ValueError(f"{field} must be a single line without control characters: {value!r}")
    return value


class ClusterConfig(BaseModel):
    """Resources and launch settings of one training job (one SLURM task per device)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    executor: Literal["auto", "slurm", "local"] = "auto"
    # What the job runs on. "auto" (local executor only: the job runs on this machine) is CUDA when
    # this machine has a GPU, else CPU. `accelerator` names the device generation where it matters
    # (e.g. v100, a100, h100, trn1): GPUs before Ampere have no fast bf16, so they train in fp16.
    device: Literal["auto", "cpu", "cuda", "neuron"] = "cpu"
    accelerator: str | None = None
    # Memory of one device in GiB, as the operator knows it; without it the plan reads it from an
    # accelerator name that fixes it (a100-40gb, h100-80gb, or a generation sold in one size).
    device_memory_gib: float | None = Field(None, gt=0, le=100_000, allow_inf_nan=False)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int = Field(1, ge=1, le=100_000)
    tasks_per_node: int = Field(1, ge=1, le=1024)
    gpus_per_node: int = Field(0, ge=0, le=64)
    cpus_per_task: int | None = Field(None, ge=1, le=4096)
    mem: str | None = None
    time_limit: int = Field(60, ge=1, description="minutes")
    exclusive: bool = False
    nodelist: str | None = None
    exclude: str | None = None
    constraint: str | None = None
    gres: str | None = None
    sbatch_extra: dict[str, str | int | bool] = Field(default_factory=dict)
    srun_extra: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list)
    # The container every job runs in (tasks/cluster/container.py): Pyxis's or SLURM's own OCI.
    container: Container | None = None
    signal_delay_s: int = Field(120, ge=10, description="USR2 this long before the time limit")
    max_requeues: int = Field(3, ge=0, description="requeues after time limit / preemption")
    # Nodes allocated beyond `nodes`: a hung rank's node is left out and the ranks start again on
    # a spare inside the same job, without the queue (tasks/cluster/spares.py).
    spare_nodes: int = Field(0, ge=0, le=10_000)
    # The operator's list of nodes kept out of every job on this cluster, with why (tasks/cluster/
    # quarantine.py), and the commands the burn-in flow runs on such a node besides a short training
    # job (a vendor's health check: `dcgmi diag -r 2`); a node that passes is let back in.
    quarantine: str | None = None
    burn_in_checks: list[str] = Field(default_factory=list)
    # What one node costs an hour, for the plan's cost estimate and a run's budget (flows/plan/estimate.py).
    price_per_node_hour: float | None = Field(None, ge=0, le=1e6, allow_inf_nan=False)
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$")
    # The data stages (sync, tokenize) as jobs on the compute nodes instead of in the flow's own
    # process: sync as one job, tokenize as an array of `data_array_tasks` tasks (default: one per
    # node), each task one node's share of `data_partition`, `data_cpus_per_task` and `data_mem`
    # (default: the training job's partition, cpus_per_task and mem).
    data_jobs: bool = False
    data_partition: str | None = None
    data_cpus_per_task: int | None = Field(None, ge=1, le=4096)
    data_mem: str | None = None
    data_array_tasks: int | None = Field(None, ge=1, le=10_000)
    # Evaluation jobs (tasks/evaluate/): one task on one node of `eval_partition` (default: the
    # training job's partition), with one GPU where training has them.
    eval_partition: str | None = None

    @field_validator(*_SHAPES)
    @classmethod
    def _shaped(cls, v: str | None, info: Any) -> str | None:
        pattern, shape = _SHAPES[info.field_name]
        if v is not None and not pattern.match(v):
            raise ValueError(f"{info.field_name}={v!r} {shape}")
        return v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time(cls, v: Any) -> Any:
        """Accept minutes or SLURM's [D-]HH:MM[:SS]."""
        if isinstance(v, str) and not v.isdigit():
            m = _TIME.match(v)
            if not m:
                raise ValueError(f"time_limit={v!r} must be minutes or [D-]HH:MM[:SS]")
            days, hours, minutes, seconds = (int(x or 0) for x in m.groups())
            return days * 1440 + hours * 60 + minutes + (1 if seconds else 0)
        return v

    @field_validator("sbatch_extra")
    @classmethod
    def _sbatch_extra(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            if not _FLAG.match(key):
                raise ValueError(f"sbatch_extra key {key!r} must be a long sbatch option name like 'mail-type'")
            _no_control(str(value), f"sbatch_extra[{key!r}]")
        return v

    @field_validator("srun_extra")
    @classmethod
    def _lines(cls, v: list[str], info: Any) -> list[str]:
        for item in v:
            _no_control(item, info.field_name)
        return v

    @field_validator("setup", "burn_in_checks")
    @classmethod
    def _setup(cls, v: list[str], info: Any) -> list[str]:
        for line in v:
            _no_control(line, info.field_name)
        return v

    @field_validator("quarantine")
    @classmethod
    def _quarantine(cls, v: str | None) -> str | None:
        if v is not None and not Path(_no_control(v, "quarantine")).is_absolute():
            raise ValueError(f"quarantine={v!r} must be an absolute path (a file every flow run on this cluster reads)")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_KEY.match(key):
                raise ValueError(f"env key {key!r} is not a valid environment variable name")
            if SECRET_NAME.search(key):
                raise ValueError(
                    f"env key {key!r} looks like a secret; secrets must not be written into the sbatch "
                    "script: export it in the submitting environment (sbatch passes it on) instead"
                )
            _no_control(value, f"env[{key!r}]")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "ClusterConfig":
        if self.gpus_per_node and self.tasks_per_node not in (1, self.gpus_per_node):
            raise ValueError(
                f"tasks_per_node={self.tasks_per_node} with gpus_per_node={self.gpus_per_node}: "
                "use one task per GPU (tasks_per_node = gpus_per_node)"
            )
        if self.gpus_per_node and self.device not in ("cuda", "auto"):
            raise ValueError(f"gpus_per_node={self.gpus_per_node} needs device='cuda' (got {self.device!r})")
        if self.device == "auto" and self.kind != "local":
            raise ValueError("device='auto' is for the local executor only: a SLURM job runs on other machines, so "
                             "say in the preset what they have (device: cuda, neuron or cpu)")
        if self.container is not None and self.kind == "local":
            raise ValueError("container: jobs start in a container through SLURM's srun; the local executor runs "
                             "them in this machine's environment (use executor: slurm)")
        if self.nodes > 1 and self.kind == "local":
            raise ValueError(f"nodes={self.nodes} needs SLURM: the local executor runs on one machine")
        if self.spare_nodes and self.kind == "local":
            raise ValueError(f"spare_nodes={self.spare_nodes} needs SLURM: the local executor has this machine only, "
                             "with no node to leave out (set spare_nodes: 0)")
        if self.spare_nodes and self.device == "neuron":
            raise ValueError(f"spare_nodes={self.spare_nodes}: restarts inside the allocation are not built for "
                             "Trainium's launcher (one torchrun per node); set spare_nodes: 0")
        return self

    @property
    def job_device(self) -> Literal["cpu", "cuda", "neuron"]:
        """The device the job's ranks run on, decided from this configuration (and, for the local
        executor's "auto", from this machine, which is where that job runs)."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def generation(self) -> str:
        """The accelerator's generation without its variant: ``a100`` of ``a100-40gb``."""
        return (self.accelerator or "").lower().split("-")[0]

    def default_precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """fp32 on CPU, bf16 on accelerators, fp16 on GPUs older than Ampere."""
        device = self.job_device
        if device == "cpu":
            return "fp32"
        if device == "cuda" and self.generation in PRE_AMPERE_GPUS:
            return "fp16"
        return "bf16"

    def data_job(self) -> "ClusterConfig":
        """The resources of one data job (sync, or one task of the tokenize array): one task on one
        CPU node of the data partition, in the training job's environment; none of the training
        job's GPUs, node list or node features."""
        return self.model_copy(update={
            "nodes": 1, "tasks_per_node": 1, "gpus_per_node": 0, "gres": None, "device": "cpu", "exclusive": False,
            "spare_nodes": 0,
            "nodelist": None, "constraint": None, "partition": self.data_partition or self.partition,
            **self._without_gpu_options(),
            "cpus_per_task": self.data_cpus_per_task or self.cpus_per_task, "mem": self.data_mem or self.mem})

    def eval_job(self) -> "ClusterConfig":
        """The resources of an evaluation job: one task on one node of the evaluation partition, on
        the training job's device (CPU for Trainium's, which lm-eval cannot drive) with one GPU."""
        device = "cpu" if self.job_device == "neuron" else self.job_device
        return self.model_copy(update={
            "nodes": 1, "tasks_per_node": 1, "gpus_per_node": min(self.gpus_per_node, 1), "device": device,
            "spare_nodes": 0,
            "gres": None, "exclusive": False, "nodelist": None, "partition": self.eval_partition or self.partition,
            **self._without_gpu_options()})

    def _without_gpu_options(self) -> dict[str, Any]:
        """sbatch_extra and srun_extra without the options that ask for GPUs (a job of its own
        decides its GPUs)."""
        return {"sbatch_extra": {k: v for k, v in self.sbatch_extra.items() if "gpu" not in k and k != "gres"},
                "srun_extra": [o for o in self.srun_extra if "gpu" not in o]}

    @property
    def data_tasks(self) -> int:
        return self.data_array_tasks or self.nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def kind(self) -> Literal["slurm", "local"]:
        """The executor actually used: 'auto' means SLURM when `srun` is on PATH."""
        if self.executor == "auto":
            return "slurm" if shutil.which("srun") else "local"
        return self.executor

    def setup_lines(self) -> list[str]:
        """Lines run by the batch script before srun: setup commands, then quoted env exports."""
        exports = [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return [*self.setup, *exports]

    def srun_args(self) -> list[str]:
        # One dead rank ends the step: the survivors would otherwise wait in a collective forever.
        return ["--kill-on-bad-exit=1", *self.srun_extra, *(self.container.srun_args() if self.container else [])]

    def slurm_parameters(self, job_name: str) -> dict[str, Any]:
        """Keyword arguments for submitit's SlurmExecutor.update_parameters."""
        params: dict[str, Any] = {
            "job_name": job_name,
            "nodes": self.nodes,
            "ntasks_per_node": self.tasks_per_node,
            "time": self.time_limit,
            "signal_delay_s": self.signal_delay_s,
            "setup": self.setup_lines(),
            "srun_args": self.srun_args(),
        }
        optional = {
            "partition": self.partition, "account": self.account, "qos": self.qos,
            "gpus_per_node": self.gpus_per_node or None, "cpus_per_task": self.cpus_per_task,
            "mem": self.mem, "nodelist": self.nodelist, "exclude": self.exclude,
            "constraint": self.constraint, "gres": self.gres, "exclusive": True if self.exclusive else None,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.sbatch_extra:
            params["additional_parameters"] = dict(self.sbatch_extra)
        return params

    def sbatch_script(self, folder: str | Path, *, job_name: str = "gpt", python: str | None = None) -> str:
        """The batch script submitit writes for this configuration (nothing is submitted)."""
        from submitit.slurm.slurm import _make_sbatch_string

        python = python or shlex.quote(sys.executable)
        command = f"{python} -u -m submitit.core._submit {shlex.quote(str(folder))}"
        script = _make_sbatch_string(command=command, folder=folder, **self.slurm_parameters(job_name))
        return step_loop(script, self.nodes, self.tasks_per_node, self.spare_nodes, Path(folder)) \
            if self.spare_nodes else script


# ---------------------------------------------------------------- what flow parameters may change

_COUNT = re.compile(r"^[0-9]{1,6}$")
_TYPED_COUNT = re.compile(r"^(?:[A-Za-z0-9_.-]+:)?[0-9]{1,4}$")    # 8 or a100:8
_WORDS = re.compile(r"^[A-Za-z0-9_,:.+-]{1,200}$")                 # no slash, no shell, no space
_BOOL = re.compile(r"^(?:true|false|True|False|1|0)$")
_COMMENT = re.compile(r"^[A-Za-z0-9_ .,:=+@-]{0,200}$")
_EMAIL = re.compile(r"^[A-Za-z0-9_.+-]+@[A-Za-z0-9.-]+$")
_IFACES = re.compile(r"^\^?[A-Za-z0-9_.,=-]{1,100}$")

# Extra sbatch options a flow parameter may set, with the shape of their value.
SBATCH_OPTIONS: dict[str, re.Pattern[str]] = {
    "time": re.compile(r"^(?:[0-9]+|(?:[0-9]+-)?[0-9]+:[0-9]{2}(?::[0-9]{2})?)$"), "time-min": _COUNT,
    "partition": _NAME, "account": _NAME, "qos": _NAME, "reservation": _NAME, "wckey": _NAME,
    "constraint": _CONSTRAINT, "nodes": re.compile(r"^[0-9]{1,6}(?:-[0-9]{1,6})?$"), "ntasks": _COUNT,
    "ntasks-per-node": _COUNT, "cpus-per-task": _COUNT, "cpus-per-gpu": _COUNT, "gpus": _TYPED_COUNT,
    "gpus-per-node": _TYPED_COUNT, "gpus-per-task": _TYPED_COUNT, "gres": _GRES, "mem": _MEM,
    "mem-per-cpu": _MEM, "mem-per-gpu": _MEM, "tmp": _MEM, "exclusive": re.compile(r"^(?:true|True|user|mcs)$"),
    "nodelist": _HOSTLIST, "exclude": _HOSTLIST, "switches": re.compile(r"^[0-9]{1,4}(?:@[0-9:-]{1,12})?$"),
    "licenses": _WORDS, "hint": _WORDS, "distribution": re.compile(r"^[A-Za-z0-9_:,*]{1,60}$"),
    "nice": re.compile(r"^-?[0-9]{1,6}$"), "priority": _COUNT, "requeue": _BOOL, "no-requeue": _BOOL,
    "mail-type": re.compile(r"^[A-Z0-9_,]{1,100}$"), "mail-user": _EMAIL, "comment": _COMMENT,
    "begin": re.compile(r"^[A-Za-z0-9:+-]{1,30}$"), "dependency": re.compile(r"^[A-Za-z0-9_:,?+]{1,200}$"),
}
# Extra srun options a flow parameter may set (``--name`` or ``--name=value``).
SRUN_OPTIONS: dict[str, re.Pattern[str] | None] = {
    "cpu-bind": _WORDS, "mem-bind": _WORDS, "gpu-bind": _WORDS, "distribution": SBATCH_OPTIONS["distribution"],
    "hint": _WORDS, "mpi": _NAME, "network": _WORDS, "overlap": None, "exact": None, "label": None,
    "unbuffered": None, "kill-on-bad-exit": re.compile(r"^[01]$"), "cpus-per-task": _COUNT,
}
# Environment variables a flow parameter may set: tuning knobs whose values are plain words. Names
# that load code or read files (LD_PRELOAD, BASH_ENV, PYTHONPATH, NCCL_NET_PLUGIN...) are not here.
ENV_VARIABLES: dict[str, re.Pattern[str]] = {
    **{name: _COUNT for name in (
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_CROSS_NIC", "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NSOCKS_PERTHREAD", "NCCL_SOCKET_NTHREADS",
        "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
        "FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "MALLOC_ARENA_MAX", "NEURON_FUSE_SOFTMAX",
        "NEURON_RT_STOCHASTIC_ROUNDING_EN", "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
        "TORCH_SHOW_CPP_STACKTRACES")},
    **{name: _WORDS for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_ALGO", "NCCL_PROTO",
                                 "NCCL_NET_GDR_LEVEL", "FI_PROVIDER", "TORCH_DISTRIBUTED_DEBUG",
                                 "TORCH_CPP_LOG_LEVEL")},
    **{name: _IFACES for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")},
}
# The fields a flow parameter (cluster.overrides, --cluster-set) may set: the resources a job asks
# for and where it is placed. Every other field is the operator's, in preset files: what runs on the
# nodes and how (executor, setup lines, the container), what the devices are (device, accelerator,
# device_memory_gib: the memory check and the estimate rest on them), and what a node-hour costs.
FORM_FIELDS = frozenset({
    "partition", "account", "qos", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem", "time_limit",
    "exclusive", "nodelist", "exclude", "constraint", "gres", "sbatch_extra", "srun_extra", "env",
    "signal_delay_s", "max_requeues", "spare_nodes", "data_jobs", "data_partition", "data_cpus_per_task", "data_mem",
    "data_array_tasks", "eval_partition"})


def _option_value(kind: str, name: str, value: Any, pattern: re.Pattern[str] | None) -> None:
    text = str(value)
    if pattern is None:
        if value not in (True, "true", "True", None, ""):
            raise ClusterError(f"{kind} option {name!r} takes no value (got {text!r})")
    elif not pattern.fullmatch(text):
        raise ClusterError(f"{kind} option {name!r}={text!r} does not have the shape this option takes")


def check_overrides(overrides: dict[str, Any]) -> None:
    """Refuse what a flow parameter may not set, naming the field or option; see the module doc."""
    for field in overrides:
        if field in ClusterConfig.model_fields and field not in FORM_FIELDS:
            raise ClusterError(f"{field} is set only by the operator, in preset files (what runs on the nodes and "
                               "how, what the devices are, what a node-hour costs); choose a preset that has it")
    for name, value in (overrides.get("sbatch_extra") or {}).items():
        if name not in SBATCH_OPTIONS:
            raise ClusterError(f"sbatch_extra option {name!r} cannot be set from parameters (options that set the "
                               f"environment, prologs, paths or shells are for preset files); allowed: "
                               f"{', '.join(sorted(SBATCH_OPTIONS))}")
        _option_value("sbatch_extra", name, value, SBATCH_OPTIONS[name])
    for item in overrides.get("srun_extra") or []:
        name, value = split_assignment(str(item).removeprefix("--"))
        if not str(item).startswith("--") or name not in SRUN_OPTIONS:
            raise ClusterError(f"srun_extra option {item!r} cannot be set from parameters; allowed: "
                               f"{', '.join('--' + o for o in sorted(SRUN_OPTIONS))}")
        _option_value("srun_extra", name, value, SRUN_OPTIONS[name])
    for name, value in (overrides.get("env") or {}).items():
        if name not in ENV_VARIABLES:
            raise ClusterError(f"env variable {name!r} cannot be set from parameters (only tuning variables such as "
                               f"NCCL_DEBUG or OMP_NUM_THREADS may; others go in a preset file)")
        _option_value("env", name, value, ENV_VARIABLES[name])


# ---------------------------------------------------------------- presets


def preset_dirs(environ: Mapping[str, str] = os.environ) -> tuple[Path, ...]:
    """The reviewed presets folder, then the folders the operator lists in GPT_CLUSTER_PRESET_DIRS."""
    extra = [Path(d).expanduser().resolve() for d in environ.get(PRESET_DIRS_VARIABLE, "").split(os.pathsep) if d]
    return (PRESET_DIR, *extra)


def preset_path(preset: str, dirs: Sequence[Path]) -> Path:
    """The preset file for a name, or for a path inside one of the preset folders ``dirs``."""
    if "/" in preset or preset.endswith((".yaml", ".yml")):
        path = Path(preset).expanduser().resolve()
        if not any(path.is_relative_to(d) for d in dirs):
            raise ClusterError(f"cluster preset {preset!r} is not in a presets folder ({', '.join(map(str, dirs))}): "
                               f"presets hold shell lines, so they load only from folders the operator lists in "
                               f"{PRESET_DIRS_VARIABLE}; give a preset name")
        if not path.is_file():
            raise ClusterError(f"cluster preset {preset!r}: file not found")
        return path
    for d in dirs:
        candidate = d / f"{preset}.yaml"
        if candidate.is_file():
            return candidate
    names = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    raise ClusterError(f"unknown cluster preset {preset!r}: use one of {names}")


def load_cluster(preset: str = "local", *, dirs: Sequence[Path] | None = None, **overrides: Any) -> ClusterConfig:
    """A preset (by name, from the presets folders ``dirs`` the caller hands in; by default those of
    this process's environment, ``preset_dirs``) plus field overrides from flow parameters,
    validated. Overrides pass ``check_overrides``; ``env`` and ``sbatch_extra`` overrides add to
    the preset's entries."""
    path = preset_path(preset, preset_dirs() if dirs is None else dirs)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    try:
        check_overrides(overrides)
    except ClusterError as e:
        raise ClusterError(f"cluster preset {path} with overrides {sorted(overrides)}: {e}") from None
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ClusterError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ClusterError(f"{path}: expected a mapping of ClusterConfig fields")
    data.setdefault("name", path.stem)
    merged = {**data, **overrides}
    for field in ("env", "sbatch_extra"):
        if isinstance(data.get(field), dict) and isinstance(overrides.get(field), dict):
            merged[field] = {**data[field], **overrides[field]}
    try:
        return ClusterConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ClusterError(f"cluster preset {path} with overrides {sorted(overrides)}: {problems}") from e
