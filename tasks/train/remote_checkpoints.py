"""Checkpoints in two tiers: the run folder's, on the cluster's shared storage, and their copies
under the run's S3 prefix (``output.uri``). The head node makes the copies, never a rank (the
ranks hold no S3 credential): each complete save's files and the run's records as they were at
that save, verified object by object by the uploader (tasks.sync), then a ``COMPLETE`` object,
last, so that a copy without it is not one (tasks.train.copies makes them as training goes on).
``keep_last_remote`` applies there; a save a rollback takes back is removed there too; a save
pinned for its evaluation keeps its copy until it is evaluated. A run folder whose newest intact
checkpoint is older than the newest complete copy of this run (its checkpoints wiped or damaged,
the run moved to another cluster or root) gets that copy back before the job, and with it the
records the folder lacks.

Under ``output.uri``: ``checkpoints/iter_0000020/`` holds DCP's files, ``records/`` (the run
folder's records at that save: metrics, skipped samples, phases, goodput, evaluations), the
uploader's ``.sync-manifest.json`` and ``COMPLETE`` (its ``saved-at`` metadata: the marker's time).
"""
from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from gpt.checkpoint import MARKER, iteration_of, newest_intact
from gpt.metrics import truncate_after
from tasks.evaluate.records import IN_PROGRESS, SPEC, pins
from tasks.sync import MANIFEST_NAME, PARTIAL_DIR, Remote, SyncError, sync, upload
from tasks.sync.remote import s3_call, split_s3
from tasks.train.spikes import SKIPPED, rollbacks

RECORDS = "records"
CHECKPOINTS = ("checkpoints/*",)
# What a copy's records leave out of the run folder (fnmatch, ``*`` also matches ``/``): the
# checkpoints, the saves a rollback set aside, the evaluation's work in progress and what this
# start decides (its spec), the jobs of this cluster (their records, logs and heartbeats: another
# cluster's job ids mean nothing), the export and TensorBoard's events (the final upload's), and
# files being written.
NOT_RECORDS = (*CHECKPOINTS, "rolled-back/*", *IN_PROGRESS, SPEC, "jobs.json", "jobs/*", "heartbeats/*", "hf/*",
               "tensorboard/*", ".*", "*/.*")
STAGED = ".copy-"          # saves staged for their copy, in the run's checkpoints folder: .copy-HOST-PID-...
SAVED_AT = "saved-at"      # the COMPLETE object's metadata: its marker's mtime (tasks.evaluate.records.saved_at)
_COPY = re.compile(r"iter_(\d{7,})/" + MARKER)
S3_ERRORS = (SyncError, OSError, BotoCoreError, ClientError, ValueError)   # ValueError: an endpoint boto3 refuses


def _name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


@dataclass(frozen=True)
class RemoteTier:
    """The run's checkpoints under ``uri`` (the run folder's S3 prefix), reached as ``remote``."""
    uri: str
    remote: Remote
    keep_last: int

    def at(self, iteration: int) -> str:
        return f"{self.uri.rstrip('/')}/checkpoints/{_name(iteration)}"

    def complete(self) -> list[int]:
        """The iterations whose copy is complete, oldest first."""
        bucket, key = split_s3(self.uri.rstrip("/") + "/checkpoints/")
        client = self.remote.client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        found = []
        for page in s3_call(lambda: list(pages), self.uri, self.remote):
            for o in page.get("Contents", []):
                m = _COPY.fullmatch(o["Key"][len(key):])
                if m:
                    found.append(int(m.group(1)))
        return sorted(found)

    def record(self, iteration: int, name: str) -> bytes | None:
        """The record ``name`` (a path in the run folder) as the copy at ``iteration`` holds it."""
        bucket, key = split_s3(f"{self.at(iteration)}/{RECORDS}/{name}")
        client = self.remote.client()
        try:
            return s3_call(lambda: client.get_object(Bucket=bucket, Key=key)["Body"].read(), self.uri, self.remote)
        except SyncError as e:
            if "disappeared" in str(e):     # no such key: the copy holds no such record
                return None
            raise

    def copy(self, staged: Path, iteration: int) -> None:
        """A save staged for its copy (``staged_save``) copied, verified, its ``COMPLETE`` last (the
        one of an earlier copy at this iteration, before a rollback, removed first)."""
        bucket, key = split_s3(f"{self.at(iteration)}/{MARKER}")
        client = self.remote.client()
        s3_call(lambda: client.delete_object(Bucket=bucket, Key=key), self.at(iteration), self.remote)
        upload(str(staged), self.at(iteration), exclude=(MARKER,), **self.remote.options())
        marker = staged / MARKER
        body, saved_at = marker.read_bytes(), repr(marker.stat().st_mtime)
        s3_call(lambda: client.put_object(Bucket=bucket, Key=key, Body=body, Metadata={SAVED_AT: saved_at}),
                self.at(iteration), self.remote)

    def remove(self, iteration: int) -> None:
        """The copy at ``iteration`` removed, its ``COMPLETE`` first (a copy half removed is no copy)."""
        bucket, key = split_s3(self.at(iteration) + "/")
        client = self.remote.client()
        s3_call(lambda: client.delete_object(Bucket=bucket, Key=key + MARKER), self.at(iteration), self.remote)
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        keys = [o["Key"] for page in s3_call(lambda: list(pages), self.uri, self.remote)
                for o in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True}
            s3_call(functools.partial(client.delete_objects, Bucket=bucket, Delete=batch), self.at(iteration),
                    self.remote)

    def prune(self, run_dir: Path) -> list[int]:
        """Copies beyond the newest ``keep_last`` removed, but for saves pinned for their evaluation;
        the iterations of the copies kept."""
        pinned = {iteration_of(p) for p in pins(run_dir)}
        complete = self.complete()
        removed = [it for it in complete[:-self.keep_last] if it not in pinned]
        for it in removed:
            self.remove(it)
        return [it for it in complete if it not in removed]

    def to_resume(self, run_dir: Path) -> int | None:
        """The iteration of the newest complete copy newer than the run folder's newest intact
        checkpoint, but for a copy of a save the run folder's rollbacks took back (a copy the
        rollback could not remove); None when there is none."""
        newest, _ = newest_intact(run_dir / "checkpoints")
        have = iteration_of(newest) if newest is not None else 0
        done = rollbacks(run_dir)
        for it in reversed(self.complete()):
            if it <= have:
                return None
            if not done or it <= done[-1]["resumed_from"] or self._knows_rollbacks(it, len(done)):
                return it
        return None

    def _knows_rollbacks(self, iteration: int, count: int) -> bool:
        """Whether the copy at ``iteration`` was made after the run's ``count``-th rollback."""
        held = self.record(iteration, SKIPPED)
        return held is not None and len(json.loads(held).get("rollbacks", [])) >= count

    def restore(self, run_dir: Path) -> int | None:
        """The copy ``to_resume`` names brought back into ``run_dir``, verified, with the records the
        folder lacks; its iteration, or None."""
        iteration = self.to_resume(run_dir)
        if iteration is None:
            return None
        target = run_dir / "checkpoints" / _name(iteration)
        staged = target.parent / f".restore-{target.name}"
        sync(self.at(iteration) + "/", str(staged), **self.remote.options())    # resumes a partial one
        for path in sorted((staged / RECORDS).rglob("*")):
            rel = path.relative_to(staged / RECORDS)
            if path.is_file() and not (run_dir / rel).exists():
                (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, run_dir / rel)
        for leftover in (staged / RECORDS, staged / PARTIAL_DIR):
            shutil.rmtree(leftover, ignore_errors=True)
        (staged / MANIFEST_NAME).unlink(missing_ok=True)
        self._keep_saved_at(iteration, staged / MARKER)
        truncate_after(run_dir / "metrics.jsonl", iteration)    # records past it: the iterations to train again
        shutil.rmtree(target, ignore_errors=True)       # damaged: its copy is the one verified
        os.rename(staged, target)
        return iteration

    def _keep_saved_at(self, iteration: int, marker: Path) -> None:
        """The restored marker with the time the save was complete, as evaluations know it."""
        bucket, key = split_s3(f"{self.at(iteration)}/{MARKER}")
        client = self.remote.client()
        head = s3_call(lambda: client.head_object(Bucket=bucket, Key=key), self.at(iteration), self.remote)
        saved_at = head.get("Metadata", {}).get(SAVED_AT)
        if saved_at:
            os.utime(marker, (float(saved_at), float(saved_at)))


def staged_save(run_dir: Path, iteration: int) -> Path:
    """The save at ``iteration`` as its copy will hold it, beside it in the run folder: hard links to
    its files (kept whole whatever keep_last or a rollback does meanwhile) and the run's records as
    they are now, at that save. OSError when the save is no longer complete there or cannot be
    staged (nothing is left behind)."""
    source = run_dir / "checkpoints" / _name(iteration)
    if not (source / MARKER).is_file():
        raise FileNotFoundError(source / MARKER)
    staged = Path(tempfile.mkdtemp(prefix=f"{STAGED}{socket.gethostname()}-{os.getpid()}-{source.name}-",
                                   dir=source.parent))
    try:
        shutil.copytree(source, staged / "save", copy_function=_link_or_copy)
        _snapshot_records(run_dir, staged / "save" / RECORDS)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged / "save"


def remove_stale_stagings(run_dir: Path) -> None:
    """Saves staged by a process of this host that is gone (its copies ended with it)."""
    host = socket.gethostname()
    for folder in (run_dir / "checkpoints").glob(f"{STAGED}{host}-*"):
        pid = folder.name.removeprefix(f"{STAGED}{host}-").split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_or_copy(source: str, dest: str) -> None:
    """A hard link (the copy stays whole when keep_last removes the save meanwhile), or a copy
    where the file system has none."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def _snapshot_records(run_dir: Path, dest: Path) -> None:
    """The run folder's records as they are now, but what NOT_RECORDS names; a file that goes away
    meanwhile is left out (a record is written whole under another name, then renamed)."""
    for folder, dirs, files in os.walk(run_dir):
        rel_folder = Path(folder).relative_to(run_dir).as_posix()
        dirs[:] = sorted(d for d in dirs if not _left_out(f"{d}/x" if rel_folder == "." else f"{rel_folder}/{d}/x"))
        for name in sorted(files):
            rel = name if rel_folder == "." else f"{rel_folder}/{name}"
            if _left_out(rel):
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(Path(folder) / name, dest / rel)
            except FileNotFoundError:
                continue


def _left_out(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, pattern) for pattern in NOT_RECORDS)
