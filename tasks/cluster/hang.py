"""Whether a job still advances, decided where the run is owned: from its ranks' heartbeats
(gpt.heartbeat, in the run folder), on the machine that follows the job (tasks.cluster.jobs).

A job is hung when no rank has entered a new phase for longer than its limit: ``hang_timeout_s``
when the run sets it, else ``STEP_FACTOR`` step times with a floor of ``FLOOR_S``. Phases that are
long by nature (starting, loading or saving a checkpoint, the job's first step, which compiles) get
``SLOW_FACTOR`` times that, and never less than ``SAVE_FACTOR`` times the longest such phase seen;
starting never less than ``START_FLOOR_S`` either (imports and the rendezvous take what they take
on a busy node, however short the run's own limit).
Evaluation counts as long by nature too (its first pass may compile), and so does the end (``done``:
the process group torn down and the job's step ended, which SLURM may take a while to do). The
rank that is behind the others (fewer phases entered, or no heartbeat at all) is named with
its node when it is one rank, or ranks of one node; the others are then waiting for it.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpt import heartbeat
from tasks.events import Incident

FLOOR_S = 600.0
STEP_FACTOR = 20.0
SLOW_FACTOR = 4.0
SAVE_FACTOR = 3.0
START_FLOOR_S = 60.0
SLOW_PHASES = frozenset({"start", "load", "save", "eval", "done"})
FAILED_GRACE_S = 15.0       # a rank failed this long ago while the others still run: the job is stopped
# The follower reads every rank's heartbeat file at most once per world_size / HEARTBEATS_PER_S
# seconds, and at least every FAILED_GRACE_S: at each poll up to a few hundred ranks, every 15 s
# from 3,000 ranks. A read costs about 30 us a file on a local disk and an open and a read RPC on a
# parallel file system: at 8,000 ranks every 2 s poll would spend seconds in them. Hang limits are
# minutes by default, and a failed rank is noticed within its grace either way.
HEARTBEATS_PER_S = 200.0


@dataclass(frozen=True)
class Hang:
    """Where a job stopped advancing."""
    job_id: str
    iteration: int
    phase: str
    stalled_s: float
    limit_s: float
    rank: int | None            # the rank behind the others, when one is
    node: str | None            # its node, or the one node whose ranks are behind
    ranks: list[dict[str, Any]]  # every rank's last heartbeat
    folder: str = ""            # where its stacks and report were written

    def line(self) -> str:
        who = (f"rank {self.rank} on node {self.node} is behind the others" if self.rank is not None else
               f"the ranks of node {self.node} are behind the others" if self.node else
               "no single rank or node is behind the others")
        return (f"job {self.job_id} hung: no rank advanced for {self.stalled_s:.0f} s (limit {self.limit_s:.0f} s) "
                f"at iteration {self.iteration}, phase {self.phase}; {who}"
                + (f"; stacks and report in {self.folder}" if self.folder else ""))

    def noticed(self) -> str:
        return f"the hang was found ({self.stalled_s:.0f} s to find it)"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def incident(self) -> Incident:
        """The hang as the run reports it: the rank, node, phase and iteration, with every rank's last
        heartbeat."""
        rows = "\n".join(f"| {b['rank']} | {b['node']} | {b['phase']} | {b['iteration']} | {b['entered']} |"
                         for b in sorted(self.ranks, key=lambda b: b["rank"]))
        return Incident("gpt.training.hang", "training-hang", self.line(),
                        {k: v for k, v in self.to_dict().items() if k != "ranks"},
                        f"job {self.job_id} hung at iteration {self.iteration}",
                        f"**{self.line()}**\n\n| rank | node | phase | iteration | phases entered |\n"
                        f"|---|---|---|---|---|\n{rows}\n")


class HangWatch:
    """Follows one job's heartbeats; ``check`` says when it is hung. ``clock`` is the follower's
    own (heartbeat times come from other machines and are only shown, never compared)."""

    def __init__(self, run_dir: Path, job_id: str, world_size: int, hang_timeout_s: float | None,
                 clock: Any = time.monotonic) -> None:
        self.run_dir, self.job_id, self.world_size = Path(run_dir), job_id, world_size
        self.hang_timeout_s, self.clock = hang_timeout_s, clock
        self.progress_at: float | None = None         # when a rank last entered a phase
        self.seen: dict[int, tuple[int, int]] = {}     # rank -> (phases entered, iteration)
        self.step_s: float | None = None               # the slowest rank's time per iteration
        self.longest_slow = 0.0
        self.failed: tuple[float, dict[str, Any]] | None = None   # (seen at, heartbeat) of a rank that failed
        self.read_at: float | None = None               # when the heartbeats were last read
        self.ended: tuple[int, ...] | None = None       # the start this follower ended (restarted in the allocation)

    def beats(self) -> list[dict[str, Any]]:
        """This job's heartbeats, of its newest start only (a requeued SLURM job writes
        ``<id>.<restart>``, a step restarted in its allocation ``<id>.<restart>.<step>``; a rank of an
        earlier start may have left a file), and none of a start the follower ended."""
        ours = self._ours()
        newest = max((_start(b) for b in ours), default=())
        return [b for b in ours if _start(b) == newest and (self.ended is None or newest > self.ended)]

    def _ours(self) -> list[dict[str, Any]]:
        """Every heartbeat of this job, of any start."""
        return [b for b in heartbeat.read(self.run_dir) if str(b.get("job", "")).split(".")[0] == self.job_id]

    def restarted(self) -> None:
        """The ranks were started again inside the job: watched afresh, as a job that starts."""
        self.ended = max([self.ended or (), *(_start(b) for b in self._ours())])
        self.progress_at, self.failed, self.read_at, self.step_s = None, None, None, None
        self.seen = {}

    def check(self, state: str) -> Hang | None:
        now = self.clock()
        if state != "RUNNING":
            self.progress_at, self.failed, self.read_at = None, None, None  # watched afresh when it runs again
            return None
        if self.read_at is not None and now - self.read_at < min(self.world_size / HEARTBEATS_PER_S, FAILED_GRACE_S):
            return None
        self.read_at = now
        beats = self.beats()
        if self.progress_at is None:
            self.progress_at = now
        failing = [b for b in beats if b["phase"] == "failed"]
        if not failing:                     # e.g. a requeued job's new start: the earlier one's failure is over
            self.failed = None
        elif self.failed is None:
            self.failed = (now, failing[0])
        for b in beats:
            mark = (b["entered"], b["iteration"])
            if self.seen.get(b["rank"]) != mark:
                self.seen[b["rank"]] = mark
                self.progress_at = now
            self.longest_slow = max([self.longest_slow, *(v for k, v in b["longest"].items() if k in SLOW_PHASES)])
            if b.get("step_s"):
                self.step_s = max(self.step_s or 0.0, b["step_s"])
        limit, phase = self.limit(beats)
        stalled = now - self.progress_at
        if stalled <= limit:
            return None
        rank, node = self.behind(beats)
        iteration = min((b["iteration"] for b in beats), default=0)
        return Hang(self.job_id, iteration, phase, stalled, limit, rank, node, beats)

    def abandoned(self) -> dict[str, Any] | None:
        """The heartbeat of a rank that failed while the job still runs, once that has lasted
        FAILED_GRACE_S: its peers wait for it in a collective (SLURM's --kill-on-bad-exit ends such a
        step by itself; the local executor waits for every rank)."""
        if self.failed is not None and self.clock() - self.failed[0] > FAILED_GRACE_S:
            return self.failed[1]
        return None

    def limit(self, beats: list[dict[str, Any]]) -> tuple[float, str]:
        """The limit for where the ranks are now, and the phase that decides it."""
        base = self.hang_timeout_s or max(FLOOR_S, STEP_FACTOR * (self.step_s or 0.0))
        slow = [b["phase"] for b in beats if b["phase"] in SLOW_PHASES]
        behind = min(beats, key=lambda b: b["entered"])["phase"] if beats else "start"
        if slow or self.step_s is None:                 # a slow phase, or the job's first step (compiling)
            phase = slow[0] if slow else behind
            floor = START_FLOOR_S if phase == "start" else 0.0
            return max(SLOW_FACTOR * base, SAVE_FACTOR * self.longest_slow, floor), phase
        return base, behind

    def behind(self, beats: list[dict[str, Any]]) -> tuple[int | None, str | None]:
        """The rank (and node) that the others wait for, when the heartbeats single one out."""
        entered = {b["rank"]: b["entered"] for b in beats}
        nodes = {b["rank"]: b["node"] for b in beats}
        missing = [r for r in range(self.world_size) if r not in entered]
        if missing and entered:                       # never started while others did
            behind = missing
        elif len(set(entered.values())) > 1:
            low = min(entered.values())
            behind = [r for r, e in entered.items() if e == low]
        else:
            return None, None
        behind_nodes = {nodes.get(r) for r in behind}
        if len(behind_nodes) != 1 or None in behind_nodes:
            return (behind[0], None) if len(behind) == 1 else (None, None)
        return (behind[0] if len(behind) == 1 else None), behind_nodes.pop()


STRAGGLER_FACTOR = 1.5      # busier than the median of the ranks by this much ...
STRAGGLER_ITERATIONS = 20   # ... over this many iterations in a row ...
STRAGGLER_RECORDS = 3       # ... and at least this many log intervals: a straggler


class Stragglers:
    """Ranks persistently slower than the others, from the ``ranks`` records of metrics.jsonl (each
    rank's busy time per iteration over a log interval: data loading and forward passes, the work
    it does before it waits for the others). With two ranks the median is their mean: one is named
    when it is three times as busy as the other."""

    def __init__(self) -> None:
        self.slow: dict[int, tuple[int, int]] = {}    # rank -> (iterations, records) slow in a row

    def add(self, record: dict[str, Any]) -> list[tuple[str, str]]:
        """Take one ``ranks`` record; returns (node, line) per straggler."""
        busy, median, covered = record["busy_ms"], _median(record["busy_ms"]), record["iterations"]
        lines = []
        for rank, ms in enumerate(busy):
            if ms < STRAGGLER_FACTOR * median:
                self.slow.pop(rank, None)
                continue
            iterations, records = self.slow.get(rank, (0, 0))
            self.slow[rank] = (iterations + covered, records + 1)
            if self.slow[rank][0] >= STRAGGLER_ITERATIONS and self.slow[rank][1] >= STRAGGLER_RECORDS:
                lines.append((record["nodes"][rank], f"straggler: rank {rank} on node {record['nodes'][rank]} is busy {ms:.0f} ms per "
                             f"iteration, {ms / max(median, 1e-6):.1f}x the median of the ranks ({median:.0f} ms), "
                             f"slower than {STRAGGLER_FACTOR}x for {self.slow[rank][0]} iterations (to iteration "
                             f"{record['iteration']})"))
        return lines


def _start(beat: dict[str, Any]) -> tuple[int, ...]:
    """Which start of its job a heartbeat is from: SLURM's restart count, then the step of a job
    restarted inside its allocation (nothing elsewhere)."""
    return tuple(int(part) for part in str(beat.get("job", "")).split(".")[1:] if part.isdigit())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
