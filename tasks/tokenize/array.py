"""The tokenize stage as a SLURM job array on the compute nodes (cluster preset ``data_jobs: true``).

The flow's process only plans, follows and joins (what each task took, and the join, are written to
``<prefix>.jobs/summary.json``):

- **plan**: the inputs are cut into shards of about equal bytes, one per array task: whole files,
  and plain JSONL files cut at the line that ends a shard's share (compressed streams and Parquet
  files go whole to one task);
- **encode**: each task encodes its shard on its node's cores into
  ``<prefix>.jobs/shards/<plan>/<n>_<key>_document.bin/.idx`` (under temporary names until
  complete), then writes its record ``<n>.json``;
- **join**: the shards are copied, in order, into one Megatron prefix per key: the bytes one
  process writes for the same inputs (tasks.tokenize.stage), since each line or row is one document
  whichever task encodes it.

A task that fails or is killed runs again alone, up to ARRAY_ATTEMPTS times; a shard whose record
and files agree is never encoded again (nor by a retried flow run). A task that meets bad input
under ``strict`` fails the stage with the file and the line; nothing is joined from partial shards.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

from gpt.data import IndexedDatasetWriter, best_dtype
from gpt.files import write_json
from gpt.tokenizer import GPT2_VOCAB_SIZE
from tasks.cluster.config import ClusterConfig
from tasks.cluster.jobs import JobError, ReturnedError, submit_array
from tasks.common.digest import digest, file_digest
from tasks.common.progress import Progress, human_bytes
from tasks.common.run_context import run_logger
from tasks.tokenize.bpe import TokenizeError
from tasks.tokenize.encode import MAX_MESSAGES_PER_KIND
from tasks.tokenize.inputs import BadLine, Piece
from tasks.tokenize.outputs import TokenizeManifest, manifest, no_document, nonzero_counts, output_prefixes
from tasks.tokenize.shards import Shard, first_lines, plan_shards
from tasks.tokenize.vocabulary import inputs_and_tokenizer

ARRAY_ATTEMPTS = 3        # runs of a shard whose task failed or was killed, the first included


# ---------------------------------------------------------------------------------- the stage

def tokenize_on_cluster(inputs: list[str] | str, output_prefix: str, cluster: ClusterConfig, *,
                        vocab_file: str | None = None, merge_file: str | None = None,
                        json_keys: tuple[str, ...] | list[str] = ("text",), append_eod: bool = True,
                        strict: bool = False, train_vocab_size: int = GPT2_VOCAB_SIZE, train_bytes: int = 256 << 20,
                        tokenizer_model: str | None = None, tasks: int | None = None,
                        add_bos_token: bool = False) -> TokenizeManifest:
    """``tasks.tokenize.stage.tokenize`` as an array of ``tasks`` (default: the preset's
    ``data_array_tasks``, or one per node) tasks of ``cluster.data_job()``: the same outputs and
    manifest. The job records and logs are kept in ``<output_prefix>.jobs/``."""
    json_keys = tuple(json_keys)
    files, tokenizer = inputs_and_tokenizer(inputs, output_prefix, json_keys, vocab_file=vocab_file,
                                            merge_file=merge_file, tokenizer_model=tokenizer_model,
                                            train_vocab_size=train_vocab_size, train_bytes=train_bytes)
    shards_planned = plan_shards(files, tasks or cluster.data_tasks)
    folder = Path(os.path.abspath(output_prefix) + ".jobs")
    plan = digest({"inputs": [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files],
                   "tokenizer": [file_digest(f) for f in tokenizer.files], "args": [list(json_keys), append_eod, strict, *(["add_bos_token"] if add_bos_token else [])],
                   "shards": [[dataclasses.asdict(p) for p in s] for s in shards_planned]}, length=16)
    shard_dir = folder / "shards" / plan
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = [Shard(i, tuple(pieces), str(shard_dir / f"{i:05d}"), tokenizer, json_keys, append_eod, strict, add_bos_token)
              for i, pieces in enumerate(shards_planned)]
    records = run_shards(shards, cluster.data_job(), folder)
    skipped = {kind: sum(r["skipped"][kind] for r in records) for kind in records[0]["skipped"]}
    if not sum(r["documents"] for r in records):
        raise no_document(files, skipped)
    prefixes = output_prefixes(output_prefix, json_keys)
    started = time.perf_counter()
    join(shards, prefixes)
    joined_s = time.perf_counter() - started
    run_logger().info(f"joined {len(shards)} shards into {', '.join(p + '.bin/.idx' for p in prefixes.values())} in "
                      f"{joined_s:.1f} s")
    write_json(folder / "summary.json", {
        "shards": [{"bytes": s.nbytes, "node": r["node"], "cores": r["cores"], "seconds": r["seconds"],
                    "mb_s": round(s.nbytes / max(r["seconds"], 1e-9) / 1e6, 1)} for s, r in zip(shards, records)],
        "join_s": round(joined_s, 3)})
    shutil.rmtree(folder / "shards", ignore_errors=True)      # this plan's, and any an earlier plan left
    _say_skipped(shards, records, skipped)
    return manifest(files, prefixes, tokenizer, append_eod=append_eod, add_bos_token=add_bos_token,
                    documents=sum(r["documents"] for r in records),
                    tokens=sum(r["tokens"] for r in records), skipped=skipped)


def run_shards(shards: list[Shard], job: ClusterConfig, folder: Path) -> list[dict[str, Any]]:
    """Every shard complete (the ones not already so as array tasks, a failed one again alone);
    returns their records in order."""
    total = sum(s.nbytes for s in shards)
    progress = Progress("tokenize on the cluster", "shards", items=len(shards), nbytes=total,
                        artifact_key="tokenize-progress", log_every_s=10.0)
    seen: set[int] = set()

    def count_done() -> None:
        for shard in shards:
            if shard.index not in seen and shard.record_path.exists():
                seen.add(shard.index)
                progress.add(shard.nbytes, items=1)
        progress.show()

    count_done()
    failures: list[str] = []
    for attempt in range(ARRAY_ATTEMPTS):
        todo = [s for s in shards if s.done() is None]
        if not todo:
            break
        seen.difference_update(s.index for s in todo)
        if attempt:
            run_logger().info(f"running {len(todo)} shard(s) again, alone: {', '.join(str(s.index) for s in todo)}")
        else:
            run_logger().info(f"tokenize: {len(shards)} shards of {human_bytes(total / len(shards))} on average, "
                              f"{len(todo)} to encode")
        outcomes = submit_array(todo, job, run_dir=folder, job_name="tokenize", on_poll=count_done)
        for shard, outcome in zip(todo, outcomes):
            if isinstance(outcome, ReturnedError):
                raise shard_error(shard, outcome.error)
        failures = [f"shard {s.index}: {str(o).splitlines()[0]}" for s, o in zip(todo, outcomes)
                    if isinstance(o, Exception)]
    incomplete = [s for s in shards if s.done() is None]
    if incomplete:
        raise JobError(f"tokenize: {len(incomplete)} shard(s) still incomplete after {ARRAY_ATTEMPTS} runs: "
                       + "; ".join(failures or [f"shard {s.index}" for s in incomplete]) + f"; logs in {folder / 'jobs'}")
    progress.show(final=True)
    return [s.done() for s in shards]  # type: ignore[misc]


def shard_error(shard: Shard, error: BaseException) -> BaseException:
    """A task's bad input, placed in its file: a bad line is named by its line in the whole file."""
    if not isinstance(error, BadLine):
        return TokenizeError(f"shard {shard.index}: {error}")
    piece = shard.pieces[error.index]
    line = error.line + (first_lines(piece.path, piece.start) if piece.start else 0)
    return BadLine(Piece(piece.path), line, error.detail)


def join(shards: list[Shard], prefixes: dict[str, str]) -> None:
    """The shards' outputs, in order, into one prefix per key (under temporary names until complete)."""
    for key, prefix in prefixes.items():
        with IndexedDatasetWriter(prefix, best_dtype(shards[0].tokenizer.vocab_size)) as writer:
            for shard in shards:
                writer.add_dataset(shard.prefixes[key])


def _say_skipped(shards: list[Shard], records: list[dict[str, Any]], skipped: dict[str, int]) -> None:
    """The first skipped lines of each kind, by their lines in the whole files."""
    before: dict[str, int] = {}          # lines of each file in the pieces before
    said: dict[str, int] = {}
    for shard, record in zip(shards, records):
        for index, line, kind, detail in record["problems"]:
            piece = shard.pieces[index]
            said[kind] = said.get(kind, 0) + 1
            if said[kind] <= MAX_MESSAGES_PER_KIND:
                run_logger().info(f"{Piece(piece.path).where(before.get(piece.path, 0) + line)}: skipped: {detail}")
        for piece, lines in zip(shard.pieces, record["lines"]):
            before[piece.path] = before.get(piece.path, 0) + lines
    if any(skipped.values()):
        run_logger().info(f"Skipped lines: {nonzero_counts(skipped)}")
