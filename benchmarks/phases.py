"""What a run's phases cost on the orchestration side, at pretraining scale: closing a phase in
the ledger (the documents every sample of its order drew from, per prefix), and building the next
phase's order, at the same sequence length (each prefix's order goes on where phase 1 left it)
and at twice it (a new order over the documents phase 1 left), each against the index stage
building that phase's order with nothing left out (the baseline, measured in the same run on the
same files).

At another sequence length the documents phase 1 drew from are left out whole, and they hold more
tokens than it trained (``document_tokens_per_trained_token``): a sample takes part of the
documents at its two ends, whose rest no later phase trains. At the same length nothing is lost.

Two prefixes of synthetic document lengths (sparse ``.bin`` files: no token is read), phase 1 at
0.5/0.5 and phase 2 at 0.9/0.1, each ``--samples`` samples of ``--seq-length``.

``python -m benchmarks.phases [--tokens N] [--documents N] [--samples N] [--seq-length N]`` prints JSON.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from benchmarks.index import synthetic_sizes, write_synthetic_dataset
from gpt.config import Config
from gpt.data import MMapIndexedDataset
from tasks.index import build_indices, read_left_out
from tasks.train import phases

GLOBAL_BATCH = 512


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(tokens: int, documents: int, samples: int, seq_length: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="phases-bench-") as tmp:
        root = Path(tmp)
        prefixes = [str(root / name) for name in ("web", "code")]
        for seed, prefix in enumerate(prefixes):
            write_synthetic_dataset(prefix, synthetic_sizes(tokens, documents, seed))
        options = dict(split="100,0,0", seq_length=seq_length, seed=1234, out_dir=str(root / "index"),
                       num_samples={"train": samples})
        first_s, first = _timed(lambda: build_indices([(0.5, p) for p in prefixes], **options))
        iterations = samples // GLOBAL_BATCH
        config = Config.from_preset("gpt3-125m", data_index=first.path, train_iters=2 * iterations,
                                    global_batch_size=GLOBAL_BATCH, micro_batch_size=1, seq_length=seq_length,
                                    device="cpu", precision="fp32", run_dir=str(root / "run"))
        config = phases.first_phase(config, [phases.Phase(start=iterations)])
        (root / "run").mkdir()
        tracemalloc.start()
        close_s, entry = _timed(lambda: phases.close(root / "run", 1, config, 0))
        close_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        left_s, left = _timed(lambda: phases.left_out(root / "run", 2))
        second = [(0.9, prefixes[0]), (0.1, prefixes[1])]
        baseline_s, _ = _timed(lambda: build_indices(second, **options))
        going_on_s, _ = _timed(lambda: build_indices(second, **options, leave_out=left))
        longer = {**options, "seq_length": 2 * seq_length}
        longer_baseline_s, _ = _timed(lambda: build_indices(second, **longer))
        documents_s, _ = _timed(lambda: build_indices(second, **longer, leave_out=left))
        return {
            "tokens_per_prefix": tokens, "documents_per_prefix": documents, "samples_per_phase": samples,
            "seq_length": seq_length, "phase_1_index_s": round(first_s, 3),
            "close_phase_s": round(close_s, 3), "left_out_file_s": round(left_s, 3),
            "documents_consumed": {Path(p).name: row["documents"] for p, row in entry["prefixes"].items()},
            # Tokens of the documents a phase consumed per token it trained: a sample draws part of
            # the documents at its ends, whose rest no later phase trains.
            "document_tokens_per_trained_token": {
                Path(p).name: round(float(MMapIndexedDataset(p).sizes[docs].sum(dtype=np.int64))
                                    / entry["prefixes"][p]["tokens"], 3)
                for p, docs in read_left_out(str(root / "run" / entry["documents"])).items()},
            "phase_2_index_baseline_s": round(baseline_s, 3), "phase_2_index_going_on_s": round(going_on_s, 3),
            "going_on_vs_baseline": round(going_on_s / baseline_s, 3),
            "longer_phase_2_index_baseline_s": round(longer_baseline_s, 3),
            "longer_phase_2_index_documents_left_s": round(documents_s, 3),
            "documents_left_vs_baseline": round(documents_s / longer_baseline_s, 3),
            "close_vs_index_build": round(close_s / baseline_s, 3),
            "close_peak_mib": round(close_peak / 2**20, 1),     # what closing allocates (numpy's arrays included)
        }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.phases", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2 * 10**9, help="tokens per prefix")
    p.add_argument("--documents", type=int, default=10**6, help="documents per prefix")
    p.add_argument("--samples", type=int, default=GLOBAL_BATCH * 1000, help="samples per phase")
    p.add_argument("--seq-length", type=int, default=2048)
    a = p.parse_args()
    print(json.dumps(measure(a.tokens, a.documents, a.samples, a.seq_length)))


if __name__ == "__main__":
    main()
