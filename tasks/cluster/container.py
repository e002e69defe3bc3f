"""The container every job of a cluster runs in: an operator's setting of the cluster preset.

Two runtimes, as SLURM sites have them:

- ``pyxis``: NVIDIA's Pyxis plugin runs each task in an enroot container. ``image`` is an enroot
  squash file (an absolute path) or a registry image (``nvcr.io#nvidia/pytorch:24.05-py3``),
  ``mounts`` are ``SRC[:DST[:FLAGS]]`` entries, ``workdir`` is where the tasks start
  (``--container-image``, ``--container-mounts``, ``--container-workdir``).
- ``oci``: SLURM's own ``srun --container=<bundle>`` (oci.conf names the runtime: runc, crun). The
  bundle's ``config.json`` holds its mounts and working directory, so ``mounts`` and ``workdir``
  stay empty here and are read from the bundle. The jobs share the host's processes and network
  (heartbeats name host PIDs; ranks on other nodes connect over it), so the bundle may not have
  namespaces of its own for them.

Either way a run's paths are absolute, so what the jobs read and write must be mounted at its own
path inside: ``problems`` says which is not, before anything is queued.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_UNSAFE = re.compile(r"[\x00-\x1f\x7f,]")      # a control character, or the comma that joins Pyxis's mounts
SHARED_NAMESPACES = ("pid", "network")


class Mount(NamedTuple):
    """One mount of the container, in the order the runtime makes them."""
    source: str
    destination: PurePosixPath
    bind: bool
    writable: bool

    @property
    def same_path(self) -> bool:
        return self.bind and _normal(self.source) == self.destination

    def __str__(self) -> str:
        where = str(self.destination) if self.same_path else f"{self.source} at {self.destination}"
        return where + ("" if self.writable else " (read-only)")


def _normal(path: str | os.PathLike) -> PurePosixPath:
    """The path as a job spells it: absolute and normalized, links not followed (a job opens the
    path it is given, inside the container, where a link may point elsewhere or nowhere)."""
    return PurePosixPath(os.path.normpath(os.path.abspath(path)))


class Container(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: Literal["pyxis", "oci"]
    image: str = Field(min_length=1)
    mounts: list[str] = Field(default_factory=list)
    workdir: str | None = None

    @field_validator("image", "workdir")
    @classmethod
    def _line(cls, v: str | None, info: Any) -> str | None:
        if v is not None and _UNSAFE.search(v):
            raise ValueError(f"container.{info.field_name}={v!r} must be one line without commas")
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            parts = m.split(":")
            if _UNSAFE.search(m) or len(parts) > 3 or not all(parts[:2]) \
                    or not all(p.startswith("/") for p in parts[:2]):
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
        elif self.image.startswith("."):
            raise ValueError(f"container.image={self.image!r}: give a squash file by its absolute path (the jobs "
                             "start in another folder)")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise ValueError(f"container.workdir={self.workdir!r} must be an absolute path")
        return self

    def srun_args(self) -> list[str]:
        if self.runtime == "oci":
            return [f"--container={self.image}"]
        args = [f"--container-image={self.image}"]
        if self.mounts:     # a bare SRC as SRC:SRC, the form every Pyxis release reads
            args.append(f"--container-mounts={','.join(m if ':' in m else f'{m}:{m}' for m in self.mounts)}")
        if self.workdir:
            args.append(f"--container-workdir={self.workdir}")
        return args

    def _bundle(self) -> dict[str, Any]:
        return json.loads((Path(self.image) / "config.json").read_text())

    def all_mounts(self) -> list[Mount]:
        """Every mount, in order: Pyxis's ``SRC[:DST[:FLAGS]]`` (binds; ``ro`` among the flags), or
        the OCI bundle's (binds are ``bind``/``rbind``; ``ro`` among the options)."""
        if self.runtime == "pyxis":
            out = []
            for m in self.mounts:
                source, destination, flags = (m.split(":") + ["", ""])[:3]
                out.append(Mount(source, _normal(destination or source), True, "ro" not in flags.split("+")))
            return out
        return [Mount(m.get("source", ""), _normal(m.get("destination", "/")),
                      m.get("type") == "bind" or bool({"bind", "rbind"} & set(m.get("options", []))),
                      "ro" not in m.get("options", []))
                for m in self._bundle().get("mounts", [])]

    def describe(self) -> str:
        """One line for the plan: the runtime, the image, its mounts and where the tasks start."""
        try:
            mounts = ", ".join(map(str, self.all_mounts())) or "none"
            workdir = self.workdir if self.runtime == "pyxis" else self._bundle().get("process", {}).get("cwd")
        except (OSError, ValueError):
            return f"{self.runtime} {self.image} (its config.json cannot be read)"
        return f"{self.runtime} {self.image}; mounts: {mounts}; tasks start in {workdir or 'the image default'}"

    def problems(self, reads: dict[str, str | Path], writes: dict[str, str | Path]) -> list[str]:
        """Why jobs in this container could not run this plan: a missing bundle, image file or mount
        source, a bundle with its own process or network namespace, a path of ``reads`` (by the
        parameter that names it) that the jobs would not see at its own path, or one of ``writes``
        they could not write."""
        out = []
        if self.runtime == "oci":
            config = Path(self.image) / "config.json"
            if not config.is_file():
                return [f"cluster.container.image: OCI bundle {self.image} has no config.json; build the bundle "
                        "(scripts/oci-bundle) or name one that exists"]
            try:
                bundle = self._bundle()
                mounts = self.all_mounts()
            except (OSError, ValueError, AttributeError) as e:
                return [f"cluster.container.image: {config} cannot be read as an OCI runtime configuration ({e})"]
            rootfs = Path(self.image) / (bundle.get("root") or {}).get("path", "rootfs")
            if not rootfs.is_dir():
                out.append(f"cluster.container.image: the bundle's root file system {rootfs} does not exist")
            own = [n.get("type") for n in (bundle.get("linux") or {}).get("namespaces", [])
                   if n.get("type") in SHARED_NAMESPACES]
            if own:
                out.append(f"cluster.container.image: {config} gives the container its own {' and '.join(own)} "
                           "namespace; the jobs share the host's (heartbeats name host processes, ranks reach each "
                           "other over the host's network): remove it from linux.namespaces")
        else:
            if self.image.startswith("/") and not Path(self.image).exists():
                out.append(f"cluster.container.image: {self.image} does not exist; import the image "
                           "(enroot import -o) or name a registry image")
            mounts = self.all_mounts()
        out += [f"cluster.container.mounts: the source of the mount at {m.destination} ({m.source}) does not exist "
                "on this machine; create it or remove the mount" for m in mounts if m.bind and not Path(m.source).exists()]
        for name, path, write in [*((n, p, False) for n, p in reads.items()), *((n, p, True) for n, p in writes.items())]:
            out += self._seen(name, _normal(path), write, mounts)
        return out

    def _seen(self, name: str, path: PurePosixPath, write: bool, mounts: list[Mount]) -> list[str]:
        # The jobs see a path through the last-made, innermost mount that holds it.
        holding = [(len(m.destination.parts), i, m) for i, m in enumerate(mounts)
                   if path == m.destination or m.destination in path.parents]
        if not holding:
            return [f"{name}: {path} is not visible inside the cluster's container (no mount holds it); mount it "
                    "at its own path, or choose a folder that is"]
        mount = max(holding)[2]
        if not mount.same_path:
            return [f"{name}: {path} is not the host's inside the cluster's container (the jobs see {mount} there); "
                    "mount the host folder at its own path, or choose a folder that is"]
        if write and not mount.writable:
            return [f"{name}: {path} is mounted read-only inside the cluster's container (through "
                    f"{mount.destination}); mount it writable, or choose a folder that is"]
        return []
