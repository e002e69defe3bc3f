"""The train stage's follower: what the head node makes of a training job's records as they come
(metrics.jsonl). Progress and its notes (time left and cost, stragglers, the last save), a log line
per logged iteration, each complete save announced as an event (pinned first when the run
evaluates it), the run's evaluations to its trackers, and the loss spikes it rolls back."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from gpt.checkpoint import iteration_of, newest_intact
from gpt.config import Config, model_name
from gpt.files import NotReplaceable
from gpt.metrics import saved_line, train_line, valid_line
from tasks import events
from tasks.cluster.config import ClusterConfig
from tasks.cluster.hang import HangWatch, Stragglers
from tasks.cluster.jobs import Fault
from tasks.cluster.quarantine import Quarantine
from tasks.cluster.spares import RankLost
from tasks.common.progress import Progress, human_duration
from tasks.common.run_context import run_logger
from tasks.evaluate.records import EvaluationSpec, ResultsTail, pin, pins, tracker_items, unevaluated
from tasks.trackers import Trackers
from tasks.train.copies import CheckpointCopies
from tasks.train.spikes import SpikeFound, SpikeWatch


class MetricsTail:
    """Records appended to a metrics.jsonl since the last call (a line still being written waits).
    The job cuts the file back when it resumes from a checkpoint: records up to the newest one
    already read are skipped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""
        self.seen: dict[str, int] = {}

    def new(self) -> list[dict[str, Any]]:
        try:
            if self.path.stat().st_size < self.offset:
                self.offset, self.partial = 0, b""
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        *complete, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in complete:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record["iteration"] > self.seen.get(record["kind"], 0):
                self.seen[record["kind"]] = record["iteration"]
                out.append(record)
        return out

    def rewind(self, iteration: int) -> None:
        """Read the records again from past ``iteration`` (the run went back to it)."""
        self.seen = {kind: min(seen, iteration) for kind, seen in self.seen.items()}
        self.offset, self.partial = 0, b""


def eta_and_cost(iterations_left: int, step_ms: float, elapsed_s: float, cluster: ClusterConfig) -> str:
    """The time left at the latest step time, and what this stage's nodes have cost so far where the
    cluster preset has a price."""
    text = f"ETA {human_duration(iterations_left * step_ms / 1000)}"
    if cluster.price_per_node_hour is not None:
        spent = elapsed_s / 3600 * (cluster.nodes + cluster.spare_nodes) * cluster.price_per_node_hour
        text += f", {spent:,.2f} {cluster.currency} so far"
    return text


class TrainingWatch:
    """Follows one run's training jobs: ``on_poll`` reads what the job wrote since the last poll
    (raising SpikeFound on a loss spike to roll back); ``rewind`` goes back with a rollback. Each
    complete save is handed to ``copies`` (the S3 tier) where the run has one."""

    def __init__(self, config: Config, cluster: ClusterConfig, run_dir: Path, tracked: Trackers,
                 copies: CheckpointCopies | None = None) -> None:
        self.config, self.cluster, self.run_dir, self.tracked = config, cluster, run_dir, tracked
        self.copies = copies
        self.log = run_logger()
        self.progress = Progress(f"{model_name(config)} on {cluster.name}", "iterations", items=config.total_iters,
                                 artifact_key="training-progress", log_every_s=None)
        self.records = MetricsTail(run_dir / "metrics.jsonl")
        self.stragglers = Stragglers()
        self.notes = {"eta": "", "stragglers": "", "save": "", "copies": ""}
        self.first_record: float | None = None      # when this stage saw the job train (the cost clock starts)
        self.hang_watch: HangWatch | None = None
        self.quarantine, self.quarantined = Quarantine.of(cluster), set()     # nodes this run put there
        self.restart: tuple[float, Fault] | None = None   # the fault whose job restarts in its allocation
        self.trained = 0                            # the newest iteration the records show
        newest = newest_intact(run_dir / "checkpoints")[0]
        self.announced = iteration_of(newest) if newest else 0   # the newest save a checkpoint event was sent for
        self.spikes = SpikeWatch(config, since=self.announced)
        self.evaluation = EvaluationSpec.read(run_dir)
        self.automated = self.evaluation is not None and events.saves_are_evaluated()
        self.evaluated = ResultsTail(run_dir)
        if config.mock_data and (config.spike_factor or config.nan_steps):
            self.log.info("loss spikes are not rolled back in this run: mock_data has no sample order to leave "
                          "samples out of")

    def on_poll(self) -> None:
        new = self.records.new()
        self.tracked.records(new)
        if self.tracked.open and (evaluations := self.evaluated.if_changed()) is not None:   # written meanwhile
            self.tracked.evaluations(tracker_items(self.run_dir, evaluations))
        for r in new:
            {"valid": self._valid, "ranks": self._ranks, "save": self._save}.get(r["kind"], self._train)(r)

    def hangs(self, job_id: str) -> HangWatch:
        """The watch over the ranks' heartbeats of the job ``job_id``."""
        self.hang_watch = HangWatch(self.run_dir, job_id, self.cluster.world_size, self.config.hang_timeout_s)
        return self.hang_watch

    def placed(self, fault: Fault) -> Fault:
        """A lost rank at the iteration it was lost in, the one after the newest the records show (a
        killed rank's heartbeat, written every few seconds, may be behind), as a hang is at the
        iteration it stopped in."""
        return dataclasses.replace(fault, iteration=self.trained + 1) if isinstance(fault, RankLost) else fault

    def restarting(self, fault: Fault) -> Fault:
        """The job restarts its ranks inside its allocation after ``fault``: its first iteration past
        where it was says where, and how long it took."""
        self.restart = (time.monotonic(), fault)
        return fault

    def rewind(self, iteration: int, config: Config) -> None:
        """The run went back to ``iteration`` (a rollback), to go on with ``config``: its records and
        saves from there are new."""
        self.config, self.trained = config, iteration
        self.records.rewind(iteration)
        self.spikes.rewind(iteration)
        self.announced = iteration
        if self.copies is not None:
            self.copies.rolled_back(iteration)

    def finish(self) -> None:
        if self.copies is not None:
            self.copies.finish()
            self.notes["copies"] = self.copies.note()
            self.progress.note = "; ".join(n for n in self.notes.values() if n)
        self.progress.set(self.config.total_iters)
        self.progress.show(final=True)

    def _valid(self, r: dict[str, Any]) -> None:
        self.log.info("%s", valid_line(r["iteration"], r["valid_loss"]))

    def _ranks(self, r: dict[str, Any]) -> None:
        named = self.stragglers.add(r)
        self.notes["stragglers"] = "; ".join(line for _, line in named)
        if self.notes["stragglers"]:
            self.log.warning("%s", self.notes["stragglers"])
        for node, line in named:
            if self.quarantine is not None and node not in self.quarantined:
                self.quarantined.add(node)
                self.quarantine.verdict(node, "straggler", line, run=self.run_dir.name, evidence=str(self.records.path))

    def _save(self, r: dict[str, Any]) -> None:
        line = saved_line(r["iteration"], r["blocking_s"], r["background_s"])
        self.log.info("%s", line)
        self.notes["save"] = line.strip(" |")
        if r["iteration"] > self.announced:        # not a save of an earlier leg, read again
            self.announced = r["iteration"]
            if self.copies is not None:
                self.copies.saved(r["iteration"])
            events.checkpoint_saved(self.run_dir, r["iteration"], self._to_evaluate(r["iteration"]))

    def _train(self, r: dict[str, Any]) -> None:
        c, total = self.config, self.config.total_iters
        self.trained = r["iteration"]
        if self.restart is not None:
            self._restarted(r["iteration"])
        if self.first_record is None:
            self.first_record = time.monotonic()
        self.notes["eta"] = eta_and_cost(total - r["iteration"], r["elapsed_ms"], time.monotonic() - self.first_record,
                                         self.cluster)
        self.notes["copies"] = self.copies.note() if self.copies is not None else ""
        self.progress.note = "; ".join(n for n in self.notes.values() if n)
        self.progress.set(r["iteration"])
        self.progress.show()
        if r["iteration"] % c.log_interval == 0 or r["iteration"] == total:
            self.log.info("%s", train_line(
                iteration=r["iteration"], total=total, consumed=r["consumed_samples"], elapsed_ms=r["elapsed_ms"],
                lr=r["lr"], batch=c.batch_of(r["iteration"]), loss=r["lm_loss"], loss_scale=r["loss_scale"],
                grad_norm=r["grad_norm"], skipped=r["skipped"], nan=r["nan"], tokens_per_s=r["tokens_per_s"],
                mfu_value=r["mfu"]))
        spike = None if c.mock_data else self.spikes.add(r)
        if spike is not None:
            raise SpikeFound(spike)

    def _restarted(self, iteration: int) -> None:
        """Said once the restarted ranks train past where the hung ones were."""
        (at, fault), self.restart = self.restart, None
        nodes = sorted({b["node"] for b in self.hang_watch.beats()}) if self.hang_watch is not None else []
        back_s = time.monotonic() - at
        noticed = fault.noticed()
        line = (f"restarted in the allocation{f' without node {fault.node}' if fault.node else ''}, on "
                f"{','.join(nodes) or 'its nodes'}: training again at iteration {iteration}, {back_s:.0f} s after "
                f"{noticed}")
        events.report(events.Incident("gpt.training.restarted", "training-restart", line,
                                      {"job_id": fault.job_id, "node": fault.node, "nodes": nodes,
                                       "iteration": iteration, "back_s": round(back_s, 1), "after": noticed},
                                      f"restarted in the allocation at iteration {iteration}", f"**{line}**\n"),
                      self.run_dir.name)

    def _to_evaluate(self, iteration: int) -> bool:
        """Whether the run evaluates this save: then it is pinned for its evaluation first."""
        c = self.config
        if self.evaluation is None or not self.evaluation.evaluates(iteration, c.save_interval, c.total_iters):
            return False
        try:
            pinned = pin(self.run_dir, iteration)
        except NotReplaceable as e:     # training goes on; this save is not evaluated
            self.log.warning("checkpoint %d is not evaluated: %s", iteration, e)
            return False
        if pinned is None:
            self.log.warning("checkpoint %d was gone before it could be kept for its evaluation (keep_last %d): "
                             "it is not evaluated", iteration, c.keep_last)
            return False
        kept = pins(self.run_dir)
        if len(kept) > c.keep_last:
            self.log.warning("%s keeps %d saves for their evaluation (%s), more than keep_last=%d: %s",
                             self.run_dir / "eval" / "pinned", len(kept), ", ".join(p.name for p in kept), c.keep_last,
                             "their evaluations run behind training; each is let go once evaluated" if self.automated
                             else "nothing on this Prefect server evaluates them; " + unevaluated(self.run_dir))
        return True
