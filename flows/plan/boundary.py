"""What the operator lets the form reach: the local folders a run may read and write, the S3
locations and endpoints its credentials may be sent to; and the checks of the inputs a run names
against it (``check_source``, ``check_prefix``), which the plan and the evaluation's check share.

Set in the environment of the process that runs the flow (the serve process, or the work pool's
job variables), never by a flow parameter; and so is ``GPT_CLUSTER_PRESET_DIRS``, the folders whose
cluster presets runs may name besides the shipped ones (tasks.cluster.config.preset_dirs), which the
plan hands to the cluster's loader:

=====================  =======================================================  ==================
variable               what                                                     unset
=====================  =======================================================  ==================
``GPT_INPUT_ROOTS``    folders (colon-separated) local sources, tokenizer        the current folder
                       files, tokenized prefixes, ``init_from_hf`` and
                       ``init_from`` may be read from (the output root is
                       always readable)
``GPT_OUTPUT_ROOTS``   folders (colon-separated) ``output.root`` may be or lie   the current folder
                       under
``GPT_S3_ALLOWED``     ``s3://bucket`` or ``s3://bucket/prefix`` entries         any bucket
                       (comma-separated) that sources and ``output.uri`` may
                       use
``GPT_S3_ENDPOINTS``   S3-compatible endpoint URLs (comma-separated) that        none: AWS's own
                       ``data.endpoint_url`` and ``output.endpoint_url`` may     endpoints only
                       name
``GPT_AWS_PROFILES``   AWS profiles (comma-separated) that ``data.profile``      any profile
                       and ``output.profile`` may choose
=====================  =======================================================  ==================

Paths are compared after resolving links, so a link cannot lead out of a root.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from flows.plan.params import Problems
from tasks.cluster.config import PRESET_DIR, preset_dirs
from tasks.common.uri import is_s3
from tasks.sync import local_path
from tasks.sync.reach import inside

INPUT_ROOTS = "GPT_INPUT_ROOTS"
OUTPUT_ROOTS = "GPT_OUTPUT_ROOTS"
S3_ALLOWED = "GPT_S3_ALLOWED"
S3_ENDPOINTS = "GPT_S3_ENDPOINTS"
AWS_PROFILES = "GPT_AWS_PROFILES"


def _folders(value: str | None) -> tuple[Path, ...]:
    if not value:
        return (Path.cwd().resolve(),)
    return tuple(Path(p).expanduser().resolve() for p in value.split(":") if p.strip())


def _entries(value: str | None) -> tuple[str, ...]:
    return tuple(e.strip() for e in (value or "").replace("\n", ",").split(",") if e.strip())


def normalise_endpoint(url: str) -> str:
    """scheme://host[:port] in lower case: what an endpoint is compared by."""
    parts = urlsplit(url.strip())
    return f"{parts.scheme.lower()}://{(parts.netloc or '').lower()}"


@dataclass(frozen=True)
class Boundary:
    """The operator's limits on what a run's parameters may name."""
    input_roots: tuple[Path, ...]
    output_roots: tuple[Path, ...]
    s3: tuple[str, ...] | None          # allowed s3://bucket[/prefix] entries; None: any
    endpoints: tuple[str, ...]          # allowed endpoint URLs, normalised
    profiles: tuple[str, ...] | None = None   # allowed AWS profiles; None: any
    presets: tuple[Path, ...] = (PRESET_DIR,)  # the folders cluster presets load from

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Boundary:
        s3 = _entries(env.get(S3_ALLOWED))
        return cls(input_roots=_folders(env.get(INPUT_ROOTS)), output_roots=_folders(env.get(OUTPUT_ROOTS)),
                   s3=tuple(e.rstrip("/") for e in s3) or None,
                   endpoints=tuple(normalise_endpoint(e) for e in _entries(env.get(S3_ENDPOINTS))),
                   profiles=_entries(env.get(AWS_PROFILES)) or None, presets=preset_dirs(env))

    def output_root(self, path: Path) -> str | None:
        """What is wrong with ``path`` (resolved) as the output root, or None."""
        if any(inside(path, root) for root in self.output_roots):
            return None
        return (f"{path} is outside the output roots the operator allows ({_listed(self.output_roots)}; "
                f"{OUTPUT_ROOTS} where the flow runs); choose a folder under one of them")

    def local_input(self, path: str, output_root: Path) -> str | None:
        """What is wrong with reading the local ``path`` (links resolved), or None."""
        real = Path(path).resolve()
        if any(inside(real, root) for root in (*self.input_roots, output_root)):
            return None
        shown = f"{path} (a link to {real})" if str(real) != os.path.abspath(path) else path
        return (f"{shown} is outside the folders the operator allows reading from ({_listed(self.input_roots)}, "
                f"and the output root; {INPUT_ROOTS} where the flow runs); copy it there or ask the operator")

    def s3_uri(self, uri: str) -> str | None:
        """What is wrong with using the S3 location ``uri``, or None."""
        if self.s3 is None:
            return None
        bare = uri.rstrip("/")
        if any(bare == e or bare.startswith(e + "/") for e in self.s3):
            return None
        return (f"{uri} is outside the S3 locations the operator allows ({', '.join(self.s3)}; {S3_ALLOWED} "
                "where the flow runs)")

    def profile(self, name: str | None) -> str | None:
        """What is wrong with using the credentials of AWS profile ``name``, or None."""
        if name is None or self.profiles is None or name in self.profiles:
            return None
        return (f"{name!r} is not an AWS profile the operator allows ({', '.join(self.profiles)}; {AWS_PROFILES} "
                "where the flow runs)")

    def endpoint(self, url: str | None) -> str | None:
        """What is wrong with sending requests (and credentials) to ``url``, or None (AWS's own
        endpoints, chosen by the SDK, are always allowed)."""
        if url is None or normalise_endpoint(url) in self.endpoints:
            return None
        allowed = ", ".join(self.endpoints) or "none: only AWS's own endpoints"
        return (f"{url!r} is not an endpoint the operator allows ({allowed}; {S3_ENDPOINTS} where the flow "
                "runs); leave it empty for AWS, or ask the operator to list it")


def _listed(folders: tuple[Path, ...]) -> str:
    return ", ".join(str(f) for f in folders)


def refused(field: str, problem: str | None, errors: list[str]) -> bool:
    """Record what the boundary refuses; True when it refused."""
    if problem:
        errors.append(f"{field}: {problem}")
    return problem is not None


def check_source(field: str, src: str, root: Path, boundary: Boundary, errors: Problems) -> None:
    """A JSONL/Parquet source (a path, glob or s3:// URI) exists, lies where the operator allows and
    is not the output root's own."""
    if is_s3(src):
        refused(field, boundary.s3_uri(src), errors)
        return
    matches = glob.glob(local_path(src))
    if not matches:
        errors.not_here(f"{field}: {src} matches no file or folder; give an existing path, a glob or an s3:// URI")
    for match in matches:
        real = Path(match).resolve()
        if inside(real, root) or inside(root, real):
            errors.append(f"{field}: {match} {'lies in' if inside(real, root) else 'holds'} the output root "
                          f"{root}: a run never reads its own output back as a source; give the raw data's folder")
            return
        if refused(field, boundary.local_input(match, root), errors):
            return


def check_prefix(field: str, prefix: str, root: Path, boundary: Boundary, errors: Problems) -> None:
    """A tokenized .bin/.idx pair exists and lies where the operator allows."""
    if is_s3(prefix):
        refused(field, boundary.s3_uri(prefix), errors)
        return
    for ext in (".bin", ".idx"):
        path = local_path(prefix) + ext
        if not os.path.isfile(path):
            errors.not_here(f"{field}: {path} not found; give the prefix without .bin/.idx")
        elif refused(field, boundary.local_input(path, root), errors):
            return
