"""Faults injected for tests, from one variable: ``GPT_FAULT``, read once per process, inert when it
is unset. Production code calls the hooks below at the places a fault can strike; without the
variable each hook returns at once.

``GPT_FAULT`` is ``key=value`` pairs separated by commas:

- ``rank=1,iteration=5,phase=sync,seconds=600``: rank 1 sleeps 600 s when it enters phase ``sync``
  (gpt.heartbeat's phases) at iteration 5; ``every=1`` from then on at every iteration;
  ``node=node1`` only on that SLURM node; ``once=PATH`` only the first time (PATH is created when
  it fires). A hang or a straggler, exactly where a test wants one. ``phase=write``: rank 0's
  asynchronous checkpoint write of that iteration ends that much later (its folder not yet marked
  complete), while training goes on. ``stop=1``: the rank stops
  itself (SIGSTOP) there instead: a process that cannot answer any signal but SIGKILL. ``kill=1``:
  the rank is killed there (SIGKILL), as the kernel's OOM killer or a failing node kills it, after
  holding ``seconds`` (its peers waiting in a collective meanwhile).
- ``sample=X,factor=F``: the loss of the iteration that trains on sample X (its id: its position in
  the train order before any rollback) is multiplied by F on every rank: a loss spike caused by
  the data, which the run rolls back around (tasks/train/spikes.py). With pipeline stages only the
  reported loss is multiplied (their schedule has run the backward pass already).
- ``shard=2``: the tokenize array's task 2 kills itself (SIGKILL) after its first chunk is written,
  on its first run only (a marker beside its outputs remembers it).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gpt.config.overrides import parse_overrides

VARIABLE = "GPT_FAULT"
FIELDS = {"rank": int, "iteration": int, "phase": str, "seconds": float, "every": int, "node": str, "once": str,
          "shard": int, "stop": int, "kill": int, "sample": int, "factor": float}


class Fault:
    def __init__(self, spec: str | None) -> None:
        fields, problems = parse_overrides([item for item in (spec or "").split(",") if item], FIELDS, VARIABLE)
        unknown = sorted(set(fields) - set(FIELDS))
        if problems or unknown:
            raise ValueError(f"{VARIABLE}={spec!r}: " + "; ".join([m for _, m in problems] +
                                                                  [f"{name} is not a fault field" for name in unknown]))
        self.active = bool(fields)
        self.rank = fields.get("rank", -1)
        self.iteration = fields.get("iteration", 0)
        self.phase = fields.get("phase", "")
        self.seconds = fields.get("seconds", 0.0)
        self.every = fields.get("every") == 1
        self.node = fields.get("node")
        self.once = fields.get("once")
        self.shard = fields.get("shard")
        self.stop = fields.get("stop") == 1
        self.kill = fields.get("kill") == 1
        self.sample = fields.get("sample")
        self.factor = fields.get("factor", 1.0)

    def at(self, phase: str, iteration: int) -> None:
        """The rank's sleep, where the spec puts it (the phase it enters, at the iteration)."""
        if not self.active or phase != self.phase:
            return
        if int(os.environ.get("RANK", "0")) != self.rank and self.rank != -1:
            return
        if iteration != self.iteration and not (self.every and iteration >= self.iteration):
            return
        if self.node and os.environ.get("SLURMD_NODENAME") != self.node:
            return
        if self.once:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        if self.stop or self.kill:
            print(f"fault injected: rank {os.environ.get('RANK', '0')} {'stops' if self.stop else 'is killed'} in "
                  f"{phase} at iteration {iteration}", flush=True)
            time.sleep(self.seconds if self.kill else 0.0)
            os.kill(os.getpid(), signal.SIGSTOP if self.stop else signal.SIGKILL)
            return
        print(f"fault injected: rank {os.environ.get('RANK', '0')} sleeps {self.seconds:g} s in {phase} at "
              f"iteration {iteration}", flush=True)
        time.sleep(self.seconds)

    def loss_factor(self, dataset, start: int, count: int) -> float:
        """What the loss of the global batch of ``count`` samples from ``start`` is multiplied by."""
        if self.sample is None or not any(dataset.position(i % len(dataset)) == self.sample
                                          for i in range(start, start + count)):
            return 1.0
        print(f"fault injected: the loss of the batch holding sample {self.sample} is multiplied by {self.factor:g}",
              flush=True)
        return self.factor

    def kill_shard(self, index: int, marker: Path) -> None:
        """The tokenize array task ``index`` killed, once (``marker`` remembers it)."""
        if self.shard != index or marker.exists():
            return
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


FAULT = Fault(os.environ.get(VARIABLE))
