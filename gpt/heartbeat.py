"""Where each rank is, for whoever follows the job: a rank marks the phase it enters (data, forward,
backward, sync, eval, save, ...) in memory, and a thread of its own writes that, with the
iteration and a count of the phases entered, to ``<run_dir>/heartbeats/rank-<r>.json`` every few
seconds (a small file per rank per interval, never a write per step). The job's follower
(tasks.cluster.hang) decides from these files whether the job still advances.

SIGUSR1 makes a rank write every thread's Python stack to ``stacks-rank-<r>.txt`` beside its
heartbeat (faulthandler: it works while the main thread waits inside a collective, and needs no
privileges).

Marking a phase is a module-level call (``heartbeat.enter("save")``) so that code deep in a step
(a checkpoint save, a collective) can mark where it is; without a running heartbeat it does nothing.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from gpt.faults import FAULT
from gpt.files import write_json

FOLDER = "heartbeats"
STACK_SIGNAL = signal.SIGUSR1


class Heartbeat:
    """This rank's phase and iteration, written by a thread every ``every_s`` seconds."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, job: str, every_s: float = 5.0) -> None:
        self.folder = Path(run_dir) / FOLDER
        self.rank, self.job, self.every_s = rank, job, every_s
        self.phase, self.iteration, self.entered = "start", 0, 0
        self.since = time.time()
        self.spent: dict[str, float] = {}       # seconds in each phase, summed (busy time for stragglers)
        self.longest: dict[str, float] = {}     # the longest single stay in each phase
        self.step_s: float | None = None        # mean time per iteration in this job, after its first
        self._first: tuple[float, int] | None = None
        self._clock = time.perf_counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stacks = None

    def enter(self, phase: str, iteration: int | None = None) -> None:
        now = time.perf_counter()
        stayed = now - self._clock
        self.spent[self.phase] = self.spent.get(self.phase, 0.0) + stayed
        self.longest[self.phase] = max(self.longest.get(self.phase, 0.0), stayed)
        self._clock, self.phase, self.since = now, phase, time.time()
        self.entered += 1
        if iteration is not None and iteration != self.iteration:
            if self._first is None:
                self._first = (now, iteration)
            else:
                self.step_s = (now - self._first[0]) / (iteration - self._first[1])
            self.iteration = iteration

    def record(self) -> dict[str, Any]:
        return {"job": self.job, "rank": self.rank, "host": socket.gethostname(),
                "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "pid": os.getpid(),
                "phase": self.phase, "iteration": self.iteration, "entered": self.entered, "since": self.since,
                "written": time.time(), "step_s": self.step_s,
                "longest": {k: round(v, 3) for k, v in dict(self.longest).items()}}   # a copy: the rank adds to it

    def write(self) -> None:
        try:
            write_json(self.folder / f"rank-{self.rank}.json", self.record())
        except Exception:  # noqa: BLE001 - a full or flaky shared disk must not stop training (nor this thread)
            pass

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def __enter__(self) -> Heartbeat:
        global _CURRENT
        self.folder.mkdir(parents=True, exist_ok=True)
        self._stacks = open(self.folder / f"stacks-rank-{self.rank}.txt", "w")
        if threading.current_thread() is threading.main_thread():
            faulthandler.register(STACK_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self.write()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()
        _CURRENT = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _CURRENT
        _CURRENT = None
        self.enter("done" if exc[0] is None else "failed")
        self._stop.set()
        self.write()
        if threading.current_thread() is threading.main_thread():
            faulthandler.unregister(STACK_SIGNAL)
        if self._stacks is not None:
            self._stacks.close()


_CURRENT: Heartbeat | None = None


def enter(phase: str, iteration: int | None = None) -> None:
    """Mark the phase this rank enters (nothing without a running heartbeat)."""
    if _CURRENT is not None:
        _CURRENT.enter(phase, iteration)
    FAULT.at(phase, _CURRENT.iteration if _CURRENT is not None else 0)


def spent() -> dict[str, float]:
    return dict(_CURRENT.spent) if _CURRENT is not None else {}




def read(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every rank's last heartbeat in a run folder (any job's; each names its job)."""
    out = []
    for path in sorted((Path(run_dir) / FOLDER).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out
