"""The copies of one train stage's saves to the run's S3 tier (tasks.train.remote_checkpoints),
made on the head node in a thread of their own so that training never waits on S3: each complete
save is staged at once (hard links: a moment, on the follower's poll) and copied in the thread; a
copy that fails is tried again (RETRY_S) until it succeeds or the stage ends. While S3 is away,
at most ``keep_last_remote`` staged saves wait (the older ones are let go: S3 would not keep
them), so their links never hold more than that much disk. ``note`` says where the copies stand
for the progress artifact; ``finish`` waits for those still to make and names the saves left
without one."""
from __future__ import annotations

import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpt.checkpoint import iteration_of
from tasks.common.priority import lower_priority
from tasks.common.run_context import run_logger
from tasks.evaluate.records import pins
from tasks.train.remote_checkpoints import S3_ERRORS, RemoteTier, remove_stale_stagings, staged_save

RETRY_S = (2.0, 5.0, 15.0, 30.0, 60.0)      # between tries while S3 fails, then the last again
FINAL_WAIT_S = 600.0         # how long the end of a train stage waits for copies still to make
NOT_MISSING = ("rolled back", "superseded")     # saves not copied that S3 would not keep anyway
COPY_NICE = 19


def _yield_to_training() -> None:
    """This thread, and the s5cmd processes and hashing threads it starts, at the lowest CPU
    priority: where the ranks share this machine's cores (the local executor; a head node that also
    trains), the copies take what training leaves."""
    lower_priority(COPY_NICE)


class CheckpointCopies:
    def __init__(self, tier: RemoteTier, run_dir: Path) -> None:
        self.tier, self.run_dir, self.log = tier, run_dir, run_logger()
        self.todo: queue.Queue[tuple[str, int] | None] = queue.Queue()       # (copy|drop|prune|catch-up, iteration)
        self.lock = threading.Lock()            # over the fields below, written by both threads
        self.staged: dict[int, Path] = {}       # saves staged and waiting for their copy
        self.seen: dict[int, float] = {}        # iteration -> when its save was seen complete
        self.copied: dict[int, float] = {}      # iteration -> seconds from the save seen to its copy complete
        self.gone: dict[int, str] = {}          # saves not copied, and why
        self.held: list[int] = []               # the iterations of the copies S3 holds, as last listed
        self.failing = ""                       # S3's last error while a copy waits
        self.ending = threading.Event()
        self.deadline = float("inf")
        self.missing: list[str] | None = None   # once finished: a line per save left without a copy
        remove_stale_stagings(run_dir)
        self.thread = threading.Thread(target=self._work, name="checkpoint-copies", daemon=True)
        self.thread.start()

    def saved(self, iteration: int) -> None:
        """A complete save: staged for its copy now, copied in the thread."""
        try:
            staged = staged_save(self.run_dir, iteration)
        except OSError as e:        # removed by keep_last or a rollback before this poll; a full disk
            self._let_go(iteration, f"it could not be staged for its copy ({e})")
            return
        with self.lock:
            self.seen[iteration] = time.monotonic()
            self.gone.pop(iteration, None)          # saved again after a rollback
            self.copied.pop(iteration, None)
            self.staged[iteration] = staged
            waiting = sorted(self.staged)
        self.todo.put(("copy", iteration))
        pinned = {iteration_of(p) for p in pins(self.run_dir)}     # S3 keeps these too
        for older in [it for it in waiting if it not in pinned][:-self.tier.keep_last]:
            self._let_go(older, f"superseded: newer saves came while S3 was away, and keep_last_remote "
                                f"{self.tier.keep_last} keeps only those")

    def catch_up(self, iteration: int) -> None:
        """The run folder's newest save, copied unless S3 holds it (an earlier stage ended first)."""
        self.todo.put(("catch-up", iteration))

    def rolled_back(self, iteration: int) -> None:
        """The run went back to ``iteration``: later saves are not copied, and their copies removed."""
        why = f"rolled back to iteration {iteration} before it was copied"
        with self.lock:
            for it in [it for it in self.staged if it > iteration]:
                self._let_go(it, why, locked=True)
            self.copied = {it: s for it, s in self.copied.items() if it <= iteration}
            self.held = [it for it in self.held if it <= iteration]
        self.todo.put(("drop", iteration))

    def note(self) -> str:
        """The S3 tier for the progress artifact: what it holds, what is being copied."""
        with self.lock:
            waiting, held, failing = sorted(self.staged), list(self.held), self.failing
        line = f"S3 holds saves {', '.join(map(str, held))}" if held else "S3 holds no save yet"
        if waiting:
            line += f"; {', '.join(map(str, waiting))} copying" + (f" ({failing}; retrying)" if failing else "")
        return line

    def finish(self, wait_s: float | None = None) -> list[str]:
        """Waits up to ``wait_s`` (FINAL_WAIT_S) for the copies still to make, then removes the copies
        past keep_last_remote that pins kept; one line per save left without a copy (once; a second
        call returns them)."""
        if self.missing is not None:
            return self.missing
        self.deadline = time.monotonic() + (FINAL_WAIT_S if wait_s is None else wait_s)
        self.todo.put(("prune", 0))
        self.todo.put(None)
        self.thread.join(max(0.0, self.deadline - time.monotonic()) + 5)
        self.ending.set()           # a copy under way ends with its try; the rest are not started
        with self.lock:
            for iteration in list(self.staged):
                self._let_go(iteration, self.failing or "its copy did not end in time", locked=True)
            self.missing = [f"checkpoint iteration {it} has no complete copy under {self.tier.at(it)}: {why}"
                            for it, why in sorted(self.gone.items()) if not why.startswith(NOT_MISSING)]
        for line in self.missing:
            self.log.warning("warning: %s", line)
        return self.missing

    def _let_go(self, iteration: int, why: str, locked: bool = False) -> None:
        """The save at ``iteration`` will not be copied: its staging removed, the reason kept."""
        if not locked:
            with self.lock:
                return self._let_go(iteration, why, locked=True)
        staged = self.staged.pop(iteration, None)
        if staged is not None:
            shutil.rmtree(staged.parent, ignore_errors=True)
        self.gone[iteration] = why
        if not why.startswith("rolled back"):      # a rollback says so itself
            self.log.warning("warning: checkpoint iteration %d is not copied to S3: %s", iteration, why)

    def _work(self) -> None:
        _yield_to_training()
        while (item := self.todo.get()) is not None:
            if self.ending.is_set():
                continue
            try:
                self._do(*item)
            except Exception:       # noqa: BLE001 -- the thread goes on with the next; the log has why
                self.log.exception("the S3 copies of run %s: %s of iteration %d failed", self.run_dir.name, *item)

    def _do(self, action: str, iteration: int) -> None:
        if action == "drop":
            self._tried(lambda: self._drop(iteration), f"removing the copies after iteration {iteration}")
            return
        if action == "catch-up" and self._tried(self._prune, "listing the copies") and iteration not in self.held:
            self.saved(iteration)
        if action == "copy":
            with self.lock:
                staged = self.staged.get(iteration)
            if staged is None or not self._tried(lambda: self._copy(staged, iteration), f"copying iteration {iteration}"):
                return
            with self.lock:
                if self.staged.pop(iteration, None) is None:
                    return                          # let go meanwhile
                self.copied[iteration] = time.monotonic() - self.seen[iteration]
            shutil.rmtree(staged.parent, ignore_errors=True)
            self.log.info("checkpoint iteration %d copied to %s (verified, %.1f s after its save)", iteration,
                          self.tier.at(iteration), self.copied[iteration])
        self._tried(self._prune, "removing copies past keep_last_remote")

    def _prune(self) -> None:
        held = self.tier.prune(self.run_dir)
        with self.lock:
            self.held = held

    def _copy(self, staged: Path, iteration: int) -> None:
        """The copy made; nothing, should the save be let go meanwhile (its staging is gone)."""
        try:
            self.tier.copy(staged, iteration)
        except S3_ERRORS:
            with self.lock:
                if iteration in self.staged:
                    raise

    def _drop(self, iteration: int) -> None:
        """The copies past ``iteration`` removed (but for a save made again since the rollback)."""
        for it in self.tier.complete():
            with self.lock:
                again = it in self.copied or it in self.staged
            if it > iteration and not again:
                self.tier.remove(it)

    def _tried(self, work: Callable[[], Any], what: str) -> bool:
        """``work`` done, tried again while S3 fails and the stage has not ended; whether it was done."""
        for attempt in range(10**6):
            try:
                work()
                with self.lock:
                    self.failing = ""
                return True
            except S3_ERRORS as e:
                with self.lock:
                    self.failing = str(e)
                wait = RETRY_S[min(attempt, len(RETRY_S) - 1)]
                self.log.warning("warning: S3 tier: %s failed (%s); trying again in %.0f s, training goes on",
                                 what, e, wait)
                if time.monotonic() + wait > self.deadline or self.ending.wait(wait):
                    return False
        return False
