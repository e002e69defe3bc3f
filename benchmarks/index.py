"""Index-stage benchmark: ``build_sample_idx`` alone and the whole stage at pretraining scale.

Measured in one run, on the same arrays and files:
- ``build_sample_idx`` on 100M tokens in 50,000 documents at sequence length 2048, ours against
  megatron-core's ``helpers_cpp`` (outputs compared for equality);
- the whole index stage (document, sample and shuffle indices of every split, written as .npy)
  for a 10B-token, 5M-document dataset: an ``.idx`` with synthetic document lengths and a sparse
  ``.bin`` of the matching size, ours against megatron-core's ``GPTDataset`` building the same
  indices (arrays compared for equality). Ours is timed four times: the first build of the pair
  as the tokenize stage leaves it, its largest token id in the writer's record (``ours_first_s``);
  the first build of the same pair given as it is, with no record, which reads the ``.bin`` once for
  that id (``ours_first_given_s``); the indices built again from scratch once the id is known
  (``ours_s``, the figure against megatron-core); and a cached call.

megatron-core is fetched as a wheel (``pip download --no-deps megatron-core``) and run from
its unpacked files in a separate process; when that fails the baseline is reported unavailable.

``python -m benchmarks.index [--tokens N] [--documents N] [--seq-length N]`` prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from gpt import token_stats
from gpt.data import DataIndex, MMapIndexedDataset, write_index
from gpt.tokenizer import GPT2_VOCAB_SIZE
from native.index import build_sample_idx
from tasks.index import build_indices

MEGATRON_CORE = "megatron-core==0.16.1"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpt-pretrain" / "megatron-core"


def megatron_core_path() -> Path | None:
    """Directory holding an unpacked megatron-core wheel (downloaded once), or None."""
    marker = CACHE / "megatron" / "core" / "datasets" / "helpers.py"
    if marker.exists():
        return CACHE
    try:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, MEGATRON_CORE],
                           check=True, capture_output=True, timeout=300)
            wheel = next(Path(tmp).glob("megatron_core-*.whl"))
            CACHE.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as z:
                z.extractall(CACHE)
    except (subprocess.SubprocessError, StopIteration, OSError):
        return None
    return CACHE if marker.exists() else None


def synthetic_sizes(tokens: int, documents: int, seed: int = 0) -> np.ndarray:
    """Document lengths summing to ``tokens``, spread like real text (log-normal)."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=0.0, sigma=1.0, size=documents)
    sizes = (raw / raw.sum() * (tokens - documents)).astype(np.int64) + 1
    sizes[: tokens - int(sizes.sum())] += 1  # the flooring deficit, < documents
    return sizes.astype(np.int32)


def write_synthetic_dataset(prefix: str, sizes: np.ndarray) -> None:
    """An ``.idx`` for ``sizes`` plus a sparse ``.bin`` of the matching length (every token 0), and
    the writer's record of it, as the tokenize stage leaves one (gpt.token_stats)."""
    write_index(prefix + ".idx", sizes, np.arange(len(sizes) + 1), np.uint16)
    tokens = int(sizes.sum(dtype=np.int64))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(tokens * 2)
    token_stats.record(prefix, documents=len(sizes), tokens=tokens, max_token_id=0)


def _best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


_MEGATRON_SAMPLE_IDX = r"""
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1] + "/megatron/core/datasets")
import helpers_cpp
d = np.load(sys.argv[2])
sizes, doc_idx = d["sizes"], d["doc_idx"]
best = float("inf")
for _ in range(int(sys.argv[4])):
    t = time.perf_counter()
    out = helpers_cpp.build_sample_idx_int32(sizes, doc_idx, int(sys.argv[5]), 1, int(sizes.sum(dtype=np.int64)), True, 1)
    best = min(best, time.perf_counter() - t)
np.save(sys.argv[3], out)
print(best)
"""

_MEGATRON_STAGE = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
sys.path.insert(0, sys.argv[1])
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
args = json.loads(sys.argv[2])


class Vocabulary:
    # the index stage reads only these; no tokenization happens
    vocab_size = args["vocab_size"]
    eod = args["eod"]
    pad = -1
    unique_identifiers = {"class": "Vocabulary", "vocab_size": args["vocab_size"]}


config = GPTDatasetConfig(random_seed=args["seed"], sequence_length=args["seq_length"],
                          blend=([args["prefix"]], None), split=args["split"], path_to_cache=args["cache"],
                          reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                          tokenizer=Vocabulary())
t = time.perf_counter()
datasets = BlendedMegatronDatasetBuilder(GPTDataset, args["num_samples"], lambda: True, config).build()
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def bench_sample_idx(work: Path, tokens: int, documents: int, seq_length: int, megatron: Path | None,
                     repeats: int) -> dict:
    sizes = synthetic_sizes(tokens, documents, seed=1)
    doc_idx = np.random.RandomState(1).permutation(documents).astype(np.int32)
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    ours_s, ours = _best_of(lambda: build_sample_idx(sizes, doc_idx, seq_length, 1, tokens_per_epoch), repeats)
    result = {"tokens": tokens, "documents": documents, "seq_length": seq_length, "samples": int(len(ours) - 1),
              "ours_ms": round(ours_s * 1e3, 3)}
    if megatron is None:
        result["megatron_helpers_cpp"] = "unavailable"
        return result
    np.savez(work / "arrays.npz", sizes=sizes, doc_idx=doc_idx)
    out = subprocess.run([sys.executable, "-c", _MEGATRON_SAMPLE_IDX, str(megatron), str(work / "arrays.npz"),
                          str(work / "megatron_sample_idx.npy"), str(repeats), str(seq_length)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        result["megatron_helpers_cpp"] = f"failed: {out.stderr.strip().splitlines()[-1:]}"
        return result
    theirs = np.load(work / "megatron_sample_idx.npy")
    result.update(megatron_ms=round(float(out.stdout) * 1e3, 3), speedup_vs_megatron=round(float(out.stdout) / ours_s, 2),
                  equal_to_megatron=bool(np.array_equal(theirs, ours)))
    return result


def bench_stage(work: Path, tokens: int, documents: int, seq_length: int, split: str, seed: int,
                megatron: Path | None) -> dict:
    prefix = str(work / "synthetic")
    write_synthetic_dataset(prefix, synthetic_sizes(tokens, documents))
    data = MMapIndexedDataset(prefix)
    shares = [float(x) for x in split.split(",")]
    # one epoch of each split's tokens, as a pretraining run over the corpus would ask
    num_samples = {name: int(tokens * share / sum(shares) / seq_length * 0.99)
                   for name, share in zip(("train", "valid", "test"), shares)}
    start = time.perf_counter()
    build_indices([prefix], split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                  out_dir=str(work / "ours"))
    first_s = time.perf_counter() - start
    # The same pair given as it is (no writer's record): its first build also reads the whole .bin
    # once for its largest token id (the vocabulary check, which megatron-core does not make).
    os.rename(prefix + token_stats.SUFFIX, prefix + ".kept")
    start = time.perf_counter()
    build_indices([prefix], split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                  out_dir=str(work / "given"))
    first_given_s = time.perf_counter() - start
    os.rename(prefix + ".kept", prefix + token_stats.SUFFIX)
    # Built again from scratch, the indices alone compare with megatron-core's.
    for built in (work / "ours").iterdir():
        built.unlink()
    start = time.perf_counter()
    manifest = build_indices([prefix], split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                             out_dir=str(work / "ours"))
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    build_indices([prefix], split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                  out_dir=str(work / "ours"))
    cached_s = time.perf_counter() - start
    result = {"tokens": data.num_tokens, "documents": data.num_documents, "seq_length": seq_length, "split": split,
              "num_samples": manifest.num_samples, "ours_first_s": round(first_s, 3),
              "ours_first_given_s": round(first_given_s, 3), "ours_s": round(ours_s, 3),
              "ours_cached_s": round(cached_s, 3),
              "goal_s": 10.0}
    if megatron is None:
        result["megatron_gpt_dataset"] = "unavailable"
        return result
    args = {"prefix": prefix, "seed": seed, "seq_length": seq_length, "split": split, "cache": str(work / "megatron"),
            "vocab_size": GPT2_VOCAB_SIZE, "eod": GPT2_VOCAB_SIZE - 1,    # GPT-2's <|endoftext|> takes the last id
            "num_samples": [num_samples["train"], num_samples["valid"], num_samples["test"]]}
    out = subprocess.run([sys.executable, "-c", _MEGATRON_STAGE, str(megatron), json.dumps(args)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        result["megatron_gpt_dataset"] = f"failed: {out.stderr.strip().splitlines()[-3:]}"
        return result
    theirs_s = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
    result.update(megatron_s=round(theirs_s, 3), speedup_vs_megatron=round(theirs_s / ours_s, 2),
                  equal_to_megatron=_same_arrays(Path(manifest.path), work / "megatron"))
    return result


def _same_arrays(manifest_path: Path, megatron_cache: Path) -> bool:
    """Every split's document, sample and shuffle index equals megatron-core's."""
    for split, entry in DataIndex.read(manifest_path).splits.items():
        for part in entry.datasets:
            for kind in ("document_index", "sample_index", "shuffle_index"):
                theirs = list(megatron_cache.glob(f"*-GPTDataset-{split}-{kind}.npy"))
                if len(theirs) != 1:
                    return False
                ours = np.load(manifest_path.parent / getattr(part, kind))
                if not np.array_equal(ours, np.load(theirs[0])):
                    return False
    return True


def run(tokens: int = 10_000_000_000, documents: int = 5_000_000, seq_length: int = 2048,
        sample_idx_tokens: int = 100_000_000, sample_idx_documents: int = 50_000, split: str = "969,30,1",
        seed: int = 1234, repeats: int = 5, megatron: bool = True) -> dict:
    megatron_dir = megatron_core_path() if megatron else None
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        work = Path(tmp)
        return {
            "benchmark": "index",
            "load_average_1m": round(os.getloadavg()[0], 2),
            "baseline": MEGATRON_CORE if megatron_dir else None,
            "build_sample_idx": bench_sample_idx(work, sample_idx_tokens, sample_idx_documents, seq_length,
                                                 megatron_dir, repeats),
            "index_stage": bench_stage(work, tokens, documents, seq_length, split, seed, megatron_dir),
        }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.index", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=10_000_000_000)
    p.add_argument("--documents", type=int, default=5_000_000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--no-megatron", action="store_true", help="skip the megatron-core baseline")
    a = p.parse_args()
    print(json.dumps(run(tokens=a.tokens, documents=a.documents, seq_length=a.seq_length, megatron=not a.no_megatron),
                     indent=1))


if __name__ == "__main__":
    main()
