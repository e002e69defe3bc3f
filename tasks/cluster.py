"""Where training runs: a typed, validated cluster configuration and its sbatch parameters.

Presets live in ``deployments/clusters/<name>.yaml``; flow parameters override single fields.
Every field that ends up in the sbatch script is either checked against a strict pattern or
shell-quoted (``env`` values, ``srun_extra``, ``sbatch_extra``); ``setup`` lines are shell by
nature and are therefore accepted from preset files only, never as overrides.
"""
from __future__ import annotations

import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PRESET_DIR = Path(__file__).resolve().parent.parent / "deployments" / "clusters"

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_HOSTLIST = re.compile(r"^[A-Za-z0-9_.,\[\]-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.,&|()\[\]*:-]+$")
_GRES = re.compile(r"^[A-Za-z0-9_.,:-]+$")
_MEM = re.compile(r"^[0-9]+[KMGT]?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")
_SECRET_KEY = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY", re.I)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2})(?::(\d{2}))?$")


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
    device: Literal["cpu", "cuda", "neuron"] = "cpu"
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
    container_image: str | None = None
    container_mounts: list[str] = Field(default_factory=list)
    signal_delay_s: int = Field(120, ge=10, description="USR2 this long before the time limit")
    max_requeues: int = Field(3, ge=0, description="requeues after time limit / preemption")

    @field_validator("name", "partition", "account", "qos")
    @classmethod
    def _plain_name(cls, v: str | None, info: Any) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(f"{info.field_name}={v!r} may only contain letters, digits and _.+-")
        return v

    @field_validator("nodelist", "exclude")
    @classmethod
    def _hostlist(cls, v: str | None, info: Any) -> str | None:
        if v is not None and not _HOSTLIST.match(v):
            raise ValueError(f"{info.field_name}={v!r} is not a SLURM hostlist such as node[1-4],gpu7")
        return v

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v: str | None) -> str | None:
        if v is not None and not _CONSTRAINT.match(v):
            raise ValueError(f"constraint={v!r} may only contain feature names and & | , ( ) [ ] * :")
        return v

    @field_validator("gres")
    @classmethod
    def _gres(cls, v: str | None) -> str | None:
        if v is not None and not _GRES.match(v):
            raise ValueError(f"gres={v!r} must look like gpu:8 or gpu:a100:8")
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not _MEM.match(v):
            raise ValueError(f"mem={v!r} must be a size such as 0, 64G or 512000M")
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

    @field_validator("srun_extra", "container_mounts")
    @classmethod
    def _lines(cls, v: list[str], info: Any) -> list[str]:
        for item in v:
            _no_control(item, info.field_name)
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for line in v:
            _no_control(line, "setup")
        return v

    @field_validator("container_image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        return None if v is None else _no_control(v, "container_image")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_KEY.match(key):
                raise ValueError(f"env key {key!r} is not a valid environment variable name")
            if _SECRET_KEY.search(key):
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
        if self.gpus_per_node and self.device != "cuda":
            raise ValueError(f"gpus_per_node={self.gpus_per_node} needs device='cuda' (got {self.device!r})")
        if self.nodes > 1 and self.kind == "local":
            raise ValueError(f"nodes={self.nodes} needs SLURM: the local executor runs on one machine")
        return self

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
        args = ["--kill-on-bad-exit=1", *self.srun_extra]
        if self.container_image:
            args.append(f"--container-image={self.container_image}")
            if self.container_mounts:
                args.append(f"--container-mounts={','.join(self.container_mounts)}")
        return args

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
        return _make_sbatch_string(command=command, folder=folder, **self.slurm_parameters(job_name))


def preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml", ".json") and path.exists():
        return path
    candidate = PRESET_DIR / f"{preset}.yaml"
    if not candidate.exists():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ClusterError(f"unknown cluster preset {preset!r}: use one of {names} or a path to a YAML file")
    return candidate


def load_cluster(preset: str = "local", **overrides: Any) -> ClusterConfig:
    """Preset (name in deployments/clusters or a YAML path) plus field overrides, validated.

    ``setup`` cannot be overridden: its lines run unquoted in the batch script, so they only come
    from a preset file that someone reviewed.
    """
    path = preset_path(preset)
    if "setup" in overrides:
        raise ClusterError(f"setup lines are shell commands and come only from preset files; edit {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ClusterError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ClusterError(f"{path}: expected a mapping of ClusterConfig fields")
    data.setdefault("name", path.stem)
    merged = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return ClusterConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ClusterError(f"cluster preset {path} with overrides {sorted(overrides)}: {problems}") from e
