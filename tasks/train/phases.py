"""A run in phases, and its ledger of the samples each phase consumed.

A run trains phase after phase in one folder: the first on the run's own data and settings, each
later one from its ``start`` iteration with its own blend, and optionally a longer ``seq_length``
(with ``rotary_base``) and a learning-rate segment of its own (``constant``, or ``decay``: the decay
of a warmup-stable-decay schedule from the phase's start to its end, Megatron's ``WSD``). The
phases are recorded in ``<run>/phases.json``; a later leg may add phases after those that started,
never rewrite one that did.

Each phase reads its own train order, built by the index stage over each prefix's documents that
the earlier phases left unconsumed (``tasks.index``'s ``leave_out``), and counts its samples from
the run's consumed samples at its start (Config.data_offset). When a phase is trained to its end,
``close`` writes its entry in ``<run>/ledger.json``: the positions of its order it went through (a
range from 0: every one trained, or left out by a rollback), the samples and tokens it trained
per prefix, and the documents it consumed per prefix (``<run>/ledger/phase-<n>.npz``, every
document a trained or skipped sample drew tokens from). The union of those before a phase is what
its order leaves out (``left_out``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from gpt.checkpoint import Checkpointer, iteration_of
from gpt.config import Config
from gpt.data import DataIndex, GPTDataset, MMapIndexedDataset
from gpt.files import write_json
from gpt.metrics import truncate_after
from tasks.common.digest import Digest
from tasks.common.records import Count, read_record
from tasks.index import (
    Continued,
    parse_split,
    read_continued,
    read_left_out,
    samples_going_on,
    split_bounds,
    write_left_out,
)
from tasks.trackers import Item
from tasks.train.spikes import SKIPPED, rollbacks, skipped_samples, skipping

PHASES = "phases.json"
LEDGER = "ledger.json"
LEDGER_DIR = "ledger"
LR_SEGMENTS = ("schedule", "constant", "decay")
CURVE_POINTS = 64          # iterations per phase at which the ledger keeps the tokens trained so far


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase after the first: it trains iterations ``start + 1`` on."""
    start: int
    blend: tuple[tuple[float, str], ...] = ()   # (weight, local prefix); empty: the phase before's blend
    seq_length: int | None = None
    rotary_base: int | None = None
    lr: str = "schedule"                        # one of LR_SEGMENTS


def phase_config(config: Config, phase: Phase, end: int, data_index: str | None = None) -> Config:
    """The run's configuration for a phase that trains to iteration ``end`` on ``data_index`` (None:
    before its index is built, what the index stage is given)."""
    changes: dict[str, Any] = dict(data_offset=phase.start * config.global_batch_size, train_iters=end)
    if data_index is not None:
        changes["data_index"] = data_index
    if phase.seq_length is not None:
        changes.update(seq_length=phase.seq_length, max_position_embeddings=phase.seq_length)
    if phase.rotary_base is not None:
        changes["rotary_base"] = phase.rotary_base
    if phase.lr == "constant":
        changes["lr_decay_style"] = "constant"
    elif phase.lr == "decay":
        changes.update(lr_decay_style="WSD", lr_decay_iters=end, lr_wsd_decay_iters=end - phase.start,
                       lr_decay_samples=None, lr_wsd_decay_samples=None)
    return dataclasses.replace(config, **changes)


def first_phase(config: Config, phases: list[Phase]) -> Config:
    """The run's configuration for its first phase: its own, to the second phase's start."""
    return dataclasses.replace(config, train_iters=phases[0].start) if phases else config


def shortfalls(legs: list[tuple[int, int, list[tuple[float, str]], int]], global_batch_size: int,
               split: str) -> list[str]:
    """Before anything trains: each prefix a phase will use up, projected from the tokens of its
    train documents. ``legs``: per phase, its start, end, blend of (weight, local prefix; those not
    here are left out) and sequence length. A phase at the sequence length a prefix was last drawn
    at goes on with its order; at another, the rest of every document drawn from before is left
    out too (a mean document per sample drawn)."""
    left: dict[str, float] = {}
    drawn: dict[str, tuple[int, float, float]] = {}       # prefix: its order's sequence length, samples, mean document
    said = []
    for n, (start, end, blend, seq_length) in enumerate(legs, start=1):
        total = sum(w for w, _ in blend)
        for weight, prefix in blend:
            if not Path(prefix + ".idx").is_file():
                continue
            if prefix not in left:
                data = MMapIndexedDataset(prefix)
                first, last = split_bounds(parse_split(split), len(data))[:2]
                left[prefix] = float(np.asarray(data.sizes)[first:last].sum(dtype=np.int64))
                drawn[prefix] = (seq_length, 0.0, left[prefix] / max(1, last - first))
            length, samples, mean = drawn[prefix]
            if length != seq_length:          # a new order over the documents left
                left[prefix] = max(0.0, left[prefix] - samples * mean)
            per_iteration = weight / total * global_batch_size * seq_length
            drawn[prefix] = (seq_length, samples + per_iteration / seq_length * (end - start), mean)
            if left[prefix] <= seq_length:
                said.append(f"phase {n}: {prefix} is used up before the phase starts (projected: the phases before "
                            "it consume its train documents); give the phase other data")
            elif left[prefix] < per_iteration * (end - start):
                said.append(f"phase {n}: {prefix} runs out at about iteration {start + int(left[prefix] // per_iteration)} "
                            "(projected from its train documents): they are repeated from there")
            left[prefix] = max(0.0, left[prefix] - per_iteration * (end - start))
    return said


# -- the phases a run declared -----------------------------------------------------------------
class _Declared(BaseModel):
    """A phase as the flow records it (its form's fields, the start resolved)."""
    model_config = ConfigDict(extra="allow")
    start: Count
    lr: Literal[LR_SEGMENTS]  # type: ignore[valid-type]
    seq_length: Count | None = None


class _Phases(BaseModel):
    phases: list[_Declared]


class _Entry(BaseModel):
    """A phase's entry in the ledger, as ``close`` writes it."""
    phase: Count
    first_iteration: Count
    last_iteration: Count
    first_sample: Count
    samples: Count
    seq_length: Count
    index: str | None
    order: list[Count]
    skipped: list[Count]
    prefixes: dict[str, dict[str, Any]]
    documents: str | None = None


class _Ledger(BaseModel):
    phases: list[_Entry]


def declared(run_dir: Path) -> list[dict[str, Any]]:
    """The phases after the first that the run's legs declared so far, as they were given."""
    return read_record(run_dir / PHASES, _Phases, "restore it from a copy: a phase that has started cannot change, "
                       "and this file says which did", {"phases": []})["phases"]


def rewritten(recorded: list[dict[str, Any]], phases: list[dict[str, Any]], reached: int, run: str) -> list[str]:
    """Why ``phases`` (as given, each with its resolved ``start``) would rewrite one of the phases
    ``recorded`` for run ``run`` that has started by iteration ``reached``: one line per phase."""
    problems = []
    for n, before in enumerate(recorded, start=2):
        if before["start"] >= reached:
            continue
        now = phases[n - 2] if n - 2 < len(phases) else None
        if now != before:
            problems.append(f"phases[{n - 2}]: phase {n} of run {run} started at iteration {before['start']} (it is at "
                            f"{reached}) as {json.dumps(before, sort_keys=True)}; "
                            + ("it is not declared now" if now is None else f"now it is {json.dumps(now, sort_keys=True)}")
                            + ": a phase that has started cannot change; declare it as it was and add new phases after it")
    return problems


def record(run_dir: Path, phases: list[dict[str, Any]]) -> None:
    write_json(run_dir / PHASES, {"phases": phases})


# -- the ledger --------------------------------------------------------------------------------
def ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The ledger's entries, one per phase trained to its end, in phase order."""
    return read_record(run_dir / LEDGER, _Ledger, "restore it from a copy: later phases leave out the documents it "
                       "says the earlier ones consumed", {"phases": []})["phases"]


def consumed(dataset: GPTDataset, positions: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per prefix of the order: the documents positions ``[0, positions)`` drew tokens from, and for
    each of those positions that is the prefix's, which one it is."""
    out = {}
    for d, part in enumerate(dataset.parts):
        if dataset.dataset_index is None:
            mine = np.arange(positions, dtype=np.int64)
            samples = mine
        else:
            mine = np.flatnonzero(np.asarray(dataset.dataset_index[:positions]) == d)
            samples = np.asarray(dataset.dataset_sample_index[:positions])[mine]
        rows = np.asarray(part.shuffle_index)[part.first + samples]
        first = np.asarray(part.sample_index)[rows, 0].astype(np.int64)
        last = np.asarray(part.sample_index)[rows + 1, 0].astype(np.int64)
        covered = np.zeros(len(part.document_index) + 1, dtype=np.int64)
        np.add.at(covered, first, 1)
        np.add.at(covered, last + 1, -1)
        touched = np.cumsum(covered[:-1]) > 0
        out[part.data.prefix] = (np.unique(np.asarray(part.document_index)[touched]), mine)
    return out


def close(run_dir: Path, number: int, config: Config, start: int) -> dict[str, Any]:
    """Phase ``number``'s ledger entry, for its configuration trained to its end (iteration
    ``config.total_iters``, from ``start``); written once, read back after, and written again for
    the run's last phase when a later leg extended it."""
    done = ledger(run_dir)
    if len(done) >= number and done[number - 1]["last_iteration"] == config.total_iters:
        return done[number - 1]
    done = done[:number - 1]
    if len(done) != number - 1:
        raise ValueError(f"{run_dir / LEDGER}: holds {len(done)} phases; phase {number} cannot be closed before "
                         f"phase {len(done) + 1}")
    config = skipping(config, skipped_samples(run_dir, config.data_offset))     # the order it trained on
    g = config.global_batch_size
    samples = (config.total_iters - start) * g
    entry: dict[str, Any] = {"phase": number, "first_iteration": start + 1, "last_iteration": config.total_iters,
                             "first_sample": config.data_offset, "samples": samples, "seq_length": config.seq_length,
                             "index": config.data_index, "order": [0, 0], "skipped": [], "prefixes": {}}
    if config.mock_data or not config.data_index or samples == 0:
        return _append(run_dir, done, entry)
    train, split = GPTDataset.from_index(config.data_index, "train"), DataIndex.read(config.data_index).splits["train"]
    positions = train.position(samples - 1) + 1
    skipped = [p for p in split.skipped if p < positions]
    kept = np.ones(positions, dtype=bool)
    kept[skipped] = False
    iteration_of_position = np.full(positions, -1, dtype=np.int64)
    iteration_of_position[kept] = start + 1 + np.arange(samples) // g
    marks = np.unique(np.linspace(start + 1, config.total_iters, min(CURVE_POINTS, config.total_iters - start))
                      .round().astype(np.int64))
    documents, continued = {}, {}
    orders = {p.prefix: p for p in split.datasets}
    for prefix, (docs, mine) in consumed(train, positions).items():
        trained = iteration_of_position[mine]
        trained = trained[trained >= 0]
        tokens = np.searchsorted(trained, marks, side="right") * config.seq_length
        entry["prefixes"][prefix] = {"documents": int(docs.size), "samples": int(trained.size),
                                     "tokens": int(trained.size) * config.seq_length,
                                     "curve": [[int(m), int(t)] for m, t in zip(marks, tokens)]}
        documents[prefix] = docs
        order = {k: v for k, v in dataclasses.asdict(orders[prefix]).items() if k != "first"}
        continued[prefix] = Continued(order, orders[prefix].first + int(mine.size))     # drawn or skipped
        entry["prefixes"][prefix]["positions"] = [orders[prefix].first, continued[prefix].first]
    entry.update(order=[0, int(positions)], skipped=skipped)
    path = run_dir / LEDGER_DIR / f"phase-{number}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_left_out(path, documents, continued)
    entry["documents"] = str(path.relative_to(run_dir))
    return _append(run_dir, done, entry)


def _append(run_dir: Path, done: list[dict[str, Any]], entry: dict[str, Any]) -> dict[str, Any]:
    write_json(run_dir / LEDGER, {"phases": [*done, entry]})
    return entry


def tokens_left(prefix: str, split: str, seq_length: int, seed: int, leave_out: str | None,
                index_dir: Path) -> tuple[int, int]:
    """What a prefix's train split still holds for a phase at ``seq_length`` after the phases
    ``leave_out`` records: the tokens of the order an earlier phase goes on with (0 where the index
    stage orders the documents anew: tasks.index.samples_going_on), and the tokens of the documents
    none drew from."""
    data = MMapIndexedDataset(prefix)
    first, last = split_bounds(parse_split(split), len(data))[:2]
    drawn = read_left_out(leave_out).get(os.path.abspath(prefix), np.empty(0, np.int64)) if leave_out else np.empty(0, np.int64)
    documents = int(np.asarray(data.sizes)[np.setdiff1d(np.arange(first, last), drawn)].sum(dtype=np.int64))
    going_on = samples_going_on(prefix, leave_out, split, seq_length, seed, index_dir) if leave_out else 0
    return going_on * seq_length, documents


def tokens_by_source(entries: list[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Tokens trained per source (a prefix, by its name) against iteration, over the ledger's phases."""
    curves: dict[str, list[tuple[int, int]]] = {}
    totals: dict[str, int] = {}
    for entry in entries:
        before = dict(totals)
        for prefix, row in entry["prefixes"].items():
            name = Path(prefix).name
            points = curves.setdefault(name, [(entry["first_iteration"] - 1, before.get(name, 0))])
            points += [(it, before.get(name, 0) + tokens) for it, tokens in row["curve"]]
            totals[name] = before.get(name, 0) + row["tokens"]
    return curves


def tracker_items(run_dir: Path) -> list[Item]:
    """``data/<source>/tokens`` at the ledger's iterations, for the experiment trackers (each logged once)."""
    return [Item({f"data/{name}/tokens": float(tokens)}, it, time.time(), "evaluations", f"data/{name}/tokens@{it}")
            for name, points in tokens_by_source(ledger(run_dir)).items() for it, tokens in points if it > 0]


def branch(run_dir: Path, checkpoint: Path) -> None:
    """A new run folder seeded from another run's checkpoint, to go on from there as that run would:
    what the run knew up to it (its configuration, metrics, rollbacks, phases started and the ledger
    of phases ended), then the checkpoint itself, its files linked where the file system allows
    (checkpoints are never written in place). Nothing when the folder holds a checkpoint already."""
    if Checkpointer(run_dir / "checkpoints", 1, 0).latest() is not None:
        return
    source, reached = checkpoint.parent.parent, iteration_of(checkpoint)
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / "config.json", run_dir / "config.json")
    if (source / "metrics.jsonl").exists():
        shutil.copyfile(source / "metrics.jsonl", run_dir / "metrics.jsonl")
        truncate_after(run_dir / "metrics.jsonl", reached)
    rolled = [r for r in rollbacks(source) if max(r["iterations"]) <= reached]
    write_json(run_dir / SKIPPED, {"rollbacks": rolled})
    record(run_dir, [p for p in declared(source) if p["start"] < reached])
    ended = [e for e in ledger(source) if e["last_iteration"] <= reached]
    for entry in ended:
        if entry.get("documents"):
            (run_dir / entry["documents"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / entry["documents"], run_dir / entry["documents"])
    write_json(run_dir / LEDGER, {"phases": ended})
    target = run_dir / "checkpoints" / checkpoint.name
    staged = target.with_name(f".{checkpoint.name}.branch-{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(checkpoint, staged, copy_function=_link_or_copy)
    os.replace(staged, target)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def left_out(run_dir: Path, number: int) -> str | None:
    """What phases before ``number`` consumed, for the index stage (None when none did): per prefix,
    the documents any drew from, and the order the last to draw from it goes on with from where it
    stopped. Named by its content, so that the index stage's cache knows it."""
    union: dict[str, list[np.ndarray]] = {}
    continued: dict[str, Continued] = {}
    for entry in ledger(run_dir)[:number - 1]:
        if entry.get("documents"):
            for prefix, docs in read_left_out(str(run_dir / entry["documents"])).items():
                union.setdefault(prefix, []).append(docs)
            continued.update(read_continued(str(run_dir / entry["documents"])))
    if not union:
        return None
    merged = {p: np.unique(np.concatenate(d)) for p, d in sorted(union.items())}
    name = Digest(sorted(merged), {p: dataclasses.asdict(c) for p, c in continued.items()}) \
        .add_bytes(b"".join(d.tobytes() for d in merged.values())).hex(16)
    path = run_dir / LEDGER_DIR / f"before-phase-{number}-{name}.npz"
    if not path.exists():
        write_left_out(path, merged, continued)
    return str(path)
