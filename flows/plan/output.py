"""Where a run writes, checked once: the output root inside what the operator allows and writable,
the run folder's name, the S3 location the run is uploaded to and how it is reached, and the
experiment trackers it is logged to."""
from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flows.plan import identity as run_identity
from flows.plan.boundary import Boundary, refused
from flows.plan.params import OutputParams, Problems
from flows.plan.sizes import existing_parent
from tasks.common.uri import is_s3
from tasks.sync import Remote
from tasks.train.remote_checkpoints import S3_ERRORS, RemoteTier

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")    # the whole name: fullmatch
RESERVED_NAMES = frozenset({"data"})       # the root's own folder for what runs share (flows.plan.layout)


@dataclass(frozen=True)
class OutputPlan:
    root: Path                          # output.root, resolved
    run_dir: Path
    uri: str | None                     # s3:// prefix the run folder is uploaded to
    remote: Remote                      # how ``uri`` is reached: its endpoint, the output's profile or the data's
    trackers: tuple[str, ...]
    tracker_project: str
    keep_last_remote: int = 1           # checkpoints kept under ``uri``

    @property
    def tier(self) -> RemoteTier | None:
        """The run's checkpoints under ``uri``, where the run has one."""
        return RemoteTier(self.uri, self.remote, self.keep_last_remote) if self.uri else None


def output_root(output: OutputParams, boundary: Boundary, problems: Problems) -> Path:
    """The output root, resolved, inside what the operator allows and writable."""
    root = Path(output.root).expanduser().resolve()
    problem = boundary.output_root(root)
    if problem:
        problems.append(f"output.root: {problem}")
        return root
    existing = existing_parent(root)
    try:
        with tempfile.TemporaryFile(dir=existing):    # gone at once: the plan writes nothing
            pass
    except OSError as e:
        problems.not_here(f"output.root: cannot write in {existing} ({e.strerror or e}); choose a folder this user "
                          "can write, on storage every node sees")
    return root


def tensorboard_copy(output: OutputParams, boundary: Boundary, problems: Problems) -> str | None:
    """The folder TensorBoard's events are written to besides the run folder, resolved, inside the
    output roots the operator allows (the ranks write there)."""
    if output.tensorboard_dir is None:
        return None
    folder = Path(output.tensorboard_dir).expanduser().resolve()
    refused("output.tensorboard_dir", boundary.output_root(folder), problems)
    return str(folder)


def check_upload(output: OutputParams, boundary: Boundary, problems: Problems) -> None:
    if output.uri is not None and not is_s3(output.uri):
        problems.append(f"output.uri: {output.uri!r} is not an s3:// URI; write s3://BUCKET/PREFIX or leave it empty")
    elif output.uri is not None:
        refused("output.uri", boundary.s3_uri(output.uri), problems)
    refused("output.endpoint_url", boundary.endpoint(output.endpoint_url), problems)
    refused("output.profile", boundary.profile(output.profile), problems)


def run_name(output: OutputParams, named: str, problems: Problems) -> str:
    """The run folder's name: the one given, or ``named`` (the model and the digest of the run's identity)."""
    name = output.run_name
    if name is None:
        return named
    if not RUN_NAME.fullmatch(name) or name in RESERVED_NAMES:
        problems.append(f"output.run_name: {name!r} is not a name: use letters, digits and . _ - (up to 128, not "
                        f"starting with . _ -, not {', '.join(sorted(RESERVED_NAMES))}); runs live in output.root")
    return name


def output_plan(output: OutputParams, root: Path, run_dir: Path, data_profile: str | None, keep_last: int) -> OutputPlan:
    return OutputPlan(root=root, run_dir=run_dir, uri=output.uri,
                      remote=Remote(output.endpoint_url, False, output.profile or data_profile),
                      trackers=tuple(output.trackers), tracker_project=output.tracker_project,
                      keep_last_remote=output.keep_last_remote or keep_last)


def copy_to_resume(tier: RemoteTier | None, run_dir: Path, identity: dict, problems: Problems) -> int | None:
    """The iteration of the newest complete checkpoint copied under ``output.uri``, where the run
    folder has no intact checkpoint as new (the train stage brings it back before the job) and the
    copy is this run's; None otherwise. S3 out of reach now is a warning: the run goes on from the
    run folder."""
    if tier is None or problems.dry_run:        # a dry run reaches no store
        return None
    try:
        iteration = tier.to_resume(run_dir)
        recorded = tier.record(iteration, run_identity.RECORD) if iteration is not None else None
    except S3_ERRORS as e:
        problems.warnings.append(f"output.uri: the checkpoints copied to {tier.uri} cannot be listed now ({e}): "
                                 "the run goes on from the run folder's")
        return None
    before = json.loads(recorded).get("identity") if recorded else None
    if iteration is not None and before is not None and before != identity:
        problems.append(f"output.uri: {tier.at(iteration)} is a checkpoint of another run "
                        f"({'; '.join(run_identity.differences(before, identity))}): give this run an output.uri "
                        "of its own")
        return None
    return iteration
