"""Where a run's files live under ``output.root``: run folders beside ``data/``, which holds what
runs share (synced sources, tokenizers, tokenized data, indices, compile caches), each in a folder
named by a digest of what it was made from, so that other inputs never land on top of it.

Run folder (written by the train stage and the training job)::

    config.json     the gpt Config the ranks ran    cluster.json   the cluster it ran on
    jobs.json       job ids, state history          jobs/          sbatch scripts, per-rank logs
    metrics.jsonl   tensorboard/   checkpoints/     hf/ (the export)   loss.png
    run.json        what defines the run            provenance.json   each start: commit, parameters, versions
    trackers.json   W&B/MLflow run ids, the last iteration each got
    skipped.json    loss-spike rollbacks and the sample ids left out   rolled-back/<n>/  checkpoints and records set aside
    goodput.json    each leg's node-hours by cause (tasks/train/goodput.py)
    phases.json     the phases after the first, as declared             ledger.json, ledger/  what each phase
                    consumed (its order's positions, samples and tokens per prefix, documents)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.digest import digest


@dataclass(frozen=True)
class Layout:
    root: Path                      # output.root, resolved

    def run(self, name: str) -> Path:
        """A run folder."""
        return self.root / name

    @property
    def data(self) -> Path:
        return self.root / "data"

    def sample(self) -> Path:
        return self.data / "sample"

    def raw(self, sources: list[str], endpoint_url: str | None) -> Path:
        return self.data / "raw" / digest(sources, endpoint_url)

    def tokenizer(self, uris: list[str]) -> Path:
        return self.data / "tokenizer" / digest(uris)

    def prefix(self, uri: str) -> Path:
        """A tokenized .bin/.idx pair synced from S3: the local prefix."""
        return self.data / "prefixes" / digest(uri) / Path(uri).name

    def tokenized(self, *made_from: Any) -> Path:
        """The output prefix of the tokenize stage."""
        return self.data / "tokenized" / digest(*made_from) / "corpus"

    def index(self) -> Path:
        return self.data / "index"

    def compile_cache(self, key: str) -> Path:
        """The graph cache of one model shape and parallel layout (tasks.precompile.cache_key)."""
        return self.data / "compile-cache" / key
