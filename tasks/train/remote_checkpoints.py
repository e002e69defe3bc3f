"""Checkpoints in two tiers: the run folder's, on the cluster's shared storage, and their copies
under the run's S3 prefix (``output.uri``). The head node makes the copies, never a rank (the
ranks hold no S3 credential): each complete save's files and the run's records as they were at
that save, verified object by object by the uploader (tasks.sync), then a ``COMPLETE`` object,
last, so that a copy without it is not one. ``keep_last_remote`` applies there; a save a rollback
takes back is removed there too; a save pinned for its evaluation is kept until it is evaluated.
A run folder whose newest intact checkpoint is older than the newest complete copy (its
checkpoints wiped or damaged, the run moved to another cluster or root) gets that copy back before
the job, and with it the records the folder lacks.

Under ``output.uri``: ``checkpoints/iter_0000020/`` holds DCP's files, ``records/`` (the run
folder's records at that save: metrics, skipped samples, phases, jobs, evaluations), the
uploader's ``.sync-manifest.json`` and ``COMPLETE``.
"""
from __future__ import annotations

import fnmatch
import functools
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpt.checkpoint import MARKER, iteration_of, newest_intact
from tasks.common.run_context import run_logger
from tasks.evaluate.records import IN_PROGRESS, pins
from tasks.sync import MANIFEST_NAME, PARTIAL_DIR, Remote, SyncError, sync, upload
from tasks.sync.remote import s3_call, split_s3

RECORDS = "records"
# What a copy's records leave out of the run folder (fnmatch, ``*`` also matches ``/``): the
# checkpoints themselves, the saves a rollback took back, the evaluation's work in progress, and
# files being written.
CHECKPOINTS = ("checkpoints/*",)
NOT_RECORDS = (*CHECKPOINTS, "rolled-back/*", *IN_PROGRESS, ".*", "*/.*")
RETRY_S = (2.0, 5.0, 15.0, 30.0, 60.0)      # between tries of a copy while S3 fails, then the last again
FINAL_WAIT_S = 600.0         # how long the end of a train stage waits for copies still to make
STAGED = ".copy-"          # saves staged for their copy, in the run's checkpoints folder
_COPY = re.compile(r"iter_(\d{7,})/" + MARKER)


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
        """A save staged for its copy (``staged``) copied, verified, its ``COMPLETE`` last."""
        upload(str(staged), self.at(iteration), exclude=(MARKER,), **self.remote.options())
        bucket, key = split_s3(f"{self.at(iteration)}/{MARKER}")
        client = self.remote.client()
        marker = (staged / MARKER).read_bytes()
        s3_call(lambda: client.put_object(Bucket=bucket, Key=key, Body=marker), self.at(iteration), self.remote)

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

    def restore(self, run_dir: Path) -> int | None:
        """The newest complete copy brought back into ``run_dir``, verified, when the run folder has no
        intact checkpoint as new (and the records it lacks with it); its iteration, or None."""
        newest, _ = newest_intact(run_dir / "checkpoints")
        have = iteration_of(newest) if newest is not None else 0
        newer = [it for it in self.complete() if it > have]
        if not newer:
            return None
        target = run_dir / "checkpoints" / _name(newer[-1])
        staged = target.parent / f".restore-{target.name}"
        shutil.rmtree(staged, ignore_errors=True)
        sync(self.at(newer[-1]) + "/", str(staged), **self.remote.options())
        for path in sorted((staged / RECORDS).rglob("*")):
            rel = path.relative_to(staged / RECORDS)
            if path.is_file() and not (run_dir / rel).exists():
                (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, run_dir / rel)
        for leftover in (staged / RECORDS, staged / PARTIAL_DIR):
            shutil.rmtree(leftover, ignore_errors=True)
        (staged / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)       # damaged: its copy is the one verified
        os.rename(staged, target)
        return newer[-1]


def staged_save(run_dir: Path, iteration: int) -> Path:
    """The save at ``iteration`` as its copy will hold it, beside it in the run folder: hard links to
    its files (kept whole whatever keep_last or a rollback does meanwhile) and the run's records as
    they are now, at that save. FileNotFoundError when the save is no longer complete there."""
    source = run_dir / "checkpoints" / _name(iteration)
    if not (source / MARKER).is_file():
        raise FileNotFoundError(source / MARKER)
    staged = Path(tempfile.mkdtemp(prefix=f"{STAGED}{source.name}-", dir=source.parent))
    try:
        shutil.copytree(source, staged / "save", copy_function=_link_or_copy)
        _snapshot_records(run_dir, staged / "save" / RECORDS)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged / "save"


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
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            rel = path.relative_to(run_dir).as_posix()
            if any(fnmatch.fnmatchcase(rel, pattern) for pattern in NOT_RECORDS):
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(path, dest / rel)
            except FileNotFoundError:
                continue


class CheckpointCopies:
    """The copies of one train stage's saves, made one at a time in a thread of their own so that
    training never waits on S3; a copy that fails is tried again (RETRY_S) until it succeeds or
    the stage ends. ``note`` says where each stands for the progress artifact; ``finish`` waits
    for those still to make and names those it could not."""

    def __init__(self, tier: RemoteTier, run_dir: Path) -> None:
        self.tier, self.run_dir, self.log = tier, run_dir, run_logger()
        self.todo: queue.Queue[tuple[str, int, Path | None] | None] = queue.Queue()  # (copy|drop|prune, iteration, staged)
        for left in (run_dir / "checkpoints").glob(f"{STAGED}*"):
            shutil.rmtree(left, ignore_errors=True)         # staged by a stage that ended before its copies
        self.asked: list[int] = []          # saves to copy, in the order they came
        self.copied: dict[int, float] = {}  # iteration -> seconds from the save seen to its copy complete
        self.held: list[int] = []           # the iterations of the copies S3 holds, as last listed
        self.seen: dict[int, float] = {}    # iteration -> when its save was seen complete
        self.gone: dict[int, str] = {}      # saves not copied, and why
        self.failing = ""                   # S3's last error while a copy waits
        self.ending = threading.Event()
        self.deadline = float("inf")
        self.missing: list[str] | None = None   # once finished: a line per save left without a copy
        self.thread = threading.Thread(target=self._work, name="checkpoint-copies", daemon=True)
        self.thread.start()

    def saved(self, iteration: int) -> None:
        """A complete save, staged for its copy at once (hard links: a moment), copied in the thread."""
        self.asked.append(iteration)
        self.seen[iteration] = time.monotonic()
        self.gone.pop(iteration, None)          # saved again after a rollback
        try:
            self.todo.put(("copy", iteration, staged_save(self.run_dir, iteration)))
        except FileNotFoundError:
            self.gone[iteration] = "the save left the run folder before it could be staged for its copy"
            self.log.warning("warning: checkpoint iteration %d: %s (keep_last, or a rollback)", iteration,
                             self.gone[iteration])

    def rolled_back(self, iteration: int) -> None:
        """The run went back to ``iteration``: the copies of later saves are removed."""
        self.todo.put(("drop", iteration, None))

    def note(self) -> str:
        """The S3 tier for the progress artifact: what is copied, what waits."""
        waiting = [it for it in self.asked if it not in self.copied and it not in self.gone]
        held = f"S3 holds saves {', '.join(map(str, self.held))}" if self.held else "S3 holds no save yet"
        if not waiting:
            return held
        return f"{held}; {', '.join(map(str, waiting))} copying" + (f" ({self.failing}; retrying)" if self.failing else "")

    def finish(self, wait_s: float | None = None) -> list[str]:
        """Waits up to ``wait_s`` (FINAL_WAIT_S) for the copies still to make, then removes the copies past
        keep_last_remote that pins kept; one line per save left without a copy (once; a second call
        returns them)."""
        if self.missing is not None:
            return self.missing
        wait_s = FINAL_WAIT_S if wait_s is None else wait_s
        self.deadline = time.monotonic() + wait_s
        self.todo.put(("prune", 0, None))
        self.todo.put(None)
        self.thread.join(wait_s + 30)
        self.ending.set()
        self.missing = missing = [f"checkpoint iteration {it} has no complete copy under {self.tier.at(it)}: "
                   f"{self.gone.get(it) or self.failing or 'its copy did not end in time'}"
                   for it in sorted(set(self.asked)) if it not in self.copied and "rolled back" not in self.gone.get(it, "")]
        for line in missing:
            self.log.warning("warning: %s", line)
        return missing

    def _work(self) -> None:
        while (item := self.todo.get()) is not None:
            self._do(*item)

    def _do(self, action: str, iteration: int, staged: Path | None) -> None:
        if action == "drop":
            self._tried(lambda: self._drop(iteration), f"removing the copies after iteration {iteration}")
            return
        if staged is not None:
            try:
                if not self._tried(lambda: self.tier.copy(staged, iteration), f"copying iteration {iteration}"):
                    return
            finally:
                shutil.rmtree(staged.parent, ignore_errors=True)
            self.copied[iteration] = time.monotonic() - self.seen[iteration]
            self.log.info("checkpoint iteration %d copied to %s (verified, %.1f s after its save)", iteration,
                          self.tier.at(iteration), self.copied[iteration])
        self._tried(self._prune, "removing copies past keep_last_remote")

    def _prune(self) -> None:
        self.held = self.tier.prune(self.run_dir)

    def _drop(self, iteration: int) -> None:
        for it in self.tier.complete():
            if it > iteration:
                self.tier.remove(it)
        self.held = [it for it in self.held if it <= iteration]
        for it in self.asked:
            if it > iteration and it not in self.copied:
                self.gone[it] = f"rolled back to iteration {iteration} before it was copied"
        self.copied = {it: s for it, s in self.copied.items() if it <= iteration}

    def _tried(self, work: Any, what: str) -> bool:
        """``work`` done, tried again while S3 fails and the stage has not ended; whether it was done."""
        for attempt in range(10**6):
            try:
                work()
                self.failing = ""
                return True
            except (SyncError, OSError, BotoCoreError, ClientError) as e:
                self.failing = str(e)
                wait = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                self.log.warning("warning: S3 tier: %s failed (%s); trying again in %.0f s, training goes on",
                                 what, e, wait)
                if time.monotonic() + wait > self.deadline or self.ending.wait(wait):
                    return False
        return False
