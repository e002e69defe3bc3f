"""The container every job of a cluster runs in: an operator's setting of the cluster preset.

Two runtimes, as SLURM sites have them:

- ``pyxis``: NVIDIA's Pyxis plugin runs each task in an enroot container. ``image`` is an enroot
  squash file or a registry image (``nvcr.io#nvidia/pytorch:24.05-py3``), ``mounts`` are
  ``SRC:DST[:FLAGS]`` entries, ``workdir`` is where the tasks start (``--container-image``,
  ``--container-mounts``, ``--container-workdir``).
- ``oci``: SLURM's own ``srun --container=<bundle>`` (oci.conf names the runtime: runc, crun). The
  bundle's ``config.json`` holds its mounts and working directory, so ``mounts`` and ``workdir``
  stay empty here and are read from the bundle.

Either way a run's paths are absolute, so the output root and the local data must be mounted at
the same path inside: ``problems`` says which are not, before anything is queued.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_CONTROL_OR_COMMA = set("\x00\n\r\t,")


class Container(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: Literal["pyxis", "oci"]
    image: str = Field(min_length=1)
    mounts: list[str] = Field(default_factory=list)
    workdir: str | None = None

    @field_validator("image", "workdir")
    @classmethod
    def _line(cls, v: str | None, info) -> str | None:
        if v is not None and any(c in _CONTROL_OR_COMMA or ord(c) < 32 for c in v):
            raise ValueError(f"container.{info.field_name}={v!r} must be one line without commas")
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            parts = m.split(":")
            if any(c in _CONTROL_OR_COMMA or ord(c) < 32 for c in m) or not 1 <= len(parts) <= 3 \
                    or not all(parts[:2]) or not parts[0].startswith("/"):
                raise ValueError(f"container.mounts entry {m!r} must be /source[:/destination[:flags]]")
        return v

    @model_validator(mode="after")
    def _runtime_fields(self) -> "Container":
        if self.runtime == "oci":
            if self.mounts or self.workdir:
                raise ValueError("container.mounts and container.workdir are for pyxis; an OCI bundle's mounts and "
                                 "working directory are in its config.json")
            if not self.image.startswith("/"):
                raise ValueError(f"container.image={self.image!r}: an OCI bundle is an absolute folder path")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise ValueError(f"container.workdir={self.workdir!r} must be an absolute path")
        return self

    def srun_args(self) -> list[str]:
        if self.runtime == "oci":
            return [f"--container={self.image}"]
        args = [f"--container-image={self.image}"]
        if self.mounts:
            args.append(f"--container-mounts={','.join(self.mounts)}")
        if self.workdir:
            args.append(f"--container-workdir={self.workdir}")
        return args

    def same_path_mounts(self) -> list[PurePosixPath]:
        """The host folders seen at their own path inside: a pyxis mount ``SRC`` or ``SRC:SRC``, an
        OCI bundle's bind mount whose source is its destination."""
        if self.runtime == "pyxis":
            pairs = [(m.split(":")[0], (m.split(":") + [m.split(":")[0]])[1]) for m in self.mounts]
        else:
            spec = json.loads((Path(self.image) / "config.json").read_text())
            pairs = [(m.get("source", ""), m.get("destination", "")) for m in spec.get("mounts", [])
                     if m.get("type") == "bind" or "bind" in m.get("options", []) or "rbind" in m.get("options", [])]
        return [PurePosixPath(src) for src, dst in pairs if src and src == dst]

    def describe(self) -> str:
        """One line for the plan: the runtime, the image and what the jobs see of the host."""
        try:
            seen = ", ".join(str(p) for p in self.same_path_mounts()) or "nothing"
        except (OSError, ValueError):
            seen = "(bundle unreadable)"
        return f"{self.runtime} {self.image}; host folders inside: {seen}"

    def problems(self, paths: dict[str, str | Path]) -> list[str]:
        """Why jobs in this container could not run this plan: a missing bundle or image file, a
        missing mount source, or a path of ``paths`` (a parameter's name: its folder) that no mount
        shows inside at the same path."""
        if self.runtime == "oci":
            config = Path(self.image) / "config.json"
            if not config.is_file():
                return [f"cluster.container.image: OCI bundle {self.image} has no config.json; build the bundle "
                        "(scripts/oci-bundle) or name one that exists"]
            try:
                mounts = self.same_path_mounts()
            except (OSError, ValueError) as e:
                return [f"cluster.container.image: {config} cannot be read as an OCI runtime configuration ({e})"]
        else:
            if self.image.startswith(("/", "./")) and not Path(self.image).exists():
                return [f"cluster.container.image: {self.image} does not exist; import the image "
                        "(enroot import) or name a registry image"]
            missing = [m for m in self.mounts if not Path(m.split(":")[0]).exists()]
            if missing:
                return [f"cluster.container.mounts: the source of {missing[0]!r} does not exist on this machine; "
                        "create it or remove the mount"]
            mounts = self.same_path_mounts()
        out = []
        for name, path in paths.items():
            p = PurePosixPath(Path(path).resolve())
            if not any(p == m or m in p.parents for m in mounts):
                out.append(f"{name}: {p} is not visible inside the cluster's container (its same-path mounts: "
                           f"{', '.join(map(str, mounts)) or 'none'}); mount it there, or choose a folder that is")
        return out
