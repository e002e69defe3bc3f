"""Index stage: the document, sample and shuffle indices of GPT datasets, as megatron-core builds them.

For each split of each prefix: the split's documents repeated for enough epochs and shuffled with
``numpy.random.RandomState(seed)``; the sample index over them (native C++); the shuffled sample
order. Several weighted prefixes are blended greedily (native C++). Every array is written once as
``.npy`` named by the digest of its description, so a rebuild with the same inputs reads them back;
``gpt.data.GPTDataset.from_index`` memory-maps them through the JSON manifest written here.

``python -m tasks.index --data-path 0.3 A 0.7 B --seq-length 2048 --train-samples N ... --out-dir D``
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from pydantic import BaseModel, ConfigDict

from gpt.data import Blend, DataIndex, IndexedPart, IndexedSplit, MMapIndexedDataset
from gpt.files import replaced, write_atomic, writing
from gpt.token_stats import fingerprint as content_fingerprint
from gpt.token_stats import recorded
from native.index import build_blending_indices, build_sample_idx
from tasks.common.cache import StageCache, cached
from tasks.common.digest import Digest, digest, file_digest

SPLITS = ("train", "valid", "test")
ADD_EXTRA_TOKEN = 1
# A final epoch that would contribute fewer than this share of an epoch's samples is shuffled
# separately so its samples are not diluted into the full epochs (megatron-core's rule).
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
# Each blended component builds this much more than its share, as Megatron does, so that greedy
# blending never runs past a component's end.
BLEND_MARGIN = 1.005


class IndexManifest(BaseModel):
    model_config = ConfigDict(frozen=True)
    path: str
    seq_length: int
    num_samples: dict[str, int]
    digest: str
    max_token_ids: dict[str, int] = {}     # per prefix: the largest token id in its .bin

    def intact(self) -> bool:
        """The index file and every array it names are still there, whole."""
        try:
            files = DataIndex.read(self.path).files()
        except ValueError:
            return False
        return all(whole(Path(self.path).parent / name) for name in files)


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized train/valid/test weights."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"split={split!r}: expected up to three comma-separated numbers such as '969,30,1'") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split={split!r}: expected up to three non-negative numbers with a positive sum, such as '969,30,1'")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_bounds(weights: list[float], num_documents: int) -> list[int]:
    """Document boundaries of the splits: rounded shares, the rounding excess taken off the end."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    excess = bounds[-1] - num_documents
    return [bounds[0]] + [b - excess for b in bounds[1:]]


def parse_data_path(data_path: list[tuple[float, str]] | list[str] | str) -> list[tuple[float | None, str]]:
    """Megatron's ``--data-path``: ``[w1, p1, w2, p2, ...]``, ``[(w, p), ...]`` or ``[p1, p2, ...]``."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = list(data_path)
    if not items:
        raise ValueError("data_path: no dataset prefix given")
    if all(isinstance(x, (tuple, list)) for x in items):
        return [(float(w), str(p)) for w, p in items]

    def is_number(x: object) -> bool:
        try:
            float(x)  # type: ignore[arg-type]
            return True
        except (TypeError, ValueError):
            return False

    if len(items) % 2 == 0 and all(is_number(x) for x in items[0::2]):
        return [(float(w), str(p)) for w, p in zip(items[0::2], items[1::2])]
    if any(is_number(x) for x in items):
        raise ValueError(f"data_path={items!r}: give either only prefixes or weight/prefix pairs ('0.3 A 0.7 B')")
    return [(None, str(p)) for p in items]


def num_epochs_needed(tokens_per_epoch: int, num_samples: int, seq_length: int) -> int:
    needed = num_samples * seq_length + ADD_EXTRA_TOKEN
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        dtype = np.int32 if len(documents) == 0 or documents[-1] <= np.iinfo(np.int32).max else np.int64
        index = np.tile(documents.astype(dtype), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _fingerprint(data: MMapIndexedDataset) -> list:
    """A pair's identity by content: its writer's record where it was written here (its ``.bin`` not
    opened), else from its files."""
    seen = recorded(data.prefix)
    return seen["fingerprint"] if seen else content_fingerprint(data.prefix)


def whole(path: Path) -> bool:
    """An index array that is there and holds what its header says: a cut file is not whole."""
    try:
        with open(path, "rb") as f:
            read = (np.lib.format.read_array_header_1_0 if np.lib.format.read_magic(f) == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(f)
            return os.fstat(f.fileno()).st_size == f.tell() + math.prod(shape) * dtype.itemsize
    except (OSError, ValueError):
        return False


def _save_npy(path: Path, array: np.ndarray) -> None:
    """An .npy file as np.save writes it, through a file write whose errors say what failed (numpy's
    own raises "N requested and M written" on a full disk)."""
    array = np.ascontiguousarray(array)
    with replaced(path) as tmp, open(tmp, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(array.data)


def _build_part(data: MMapIndexedDataset, fingerprint: list, documents: tuple[int, int], split: str, split_str: str,
                num_samples: int, seq_length: int, seed: int, out_dir: Path,
                left_out: np.ndarray | None = None) -> tuple[IndexedPart, int]:
    """Build (or find) one prefix's indices for one split; returns its manifest entry and sample count.
    ``left_out``: documents of the split the order leaves out (what earlier phases of a run consumed)."""
    docs = np.arange(documents[0], documents[1], dtype=np.int64)
    fields = {
        "class": "GPTDataset", "prefix": os.path.abspath(data.prefix), "files": fingerprint,
        "split": split_str, "split_name": split, "documents": list(documents), "num_samples": num_samples,
        "seq_length": seq_length, "seed": seed, "add_extra_token_to_sequence": ADD_EXTRA_TOKEN,
        "drop_last_partial_sequence": True,
    }
    if left_out is not None and left_out.size:
        docs = np.setdiff1d(docs, left_out, assume_unique=True)
        fields["left_out"] = {"documents": int(documents[1] - documents[0] - docs.size), "digest": Digest().add_bytes(docs.tobytes()).hex(32)}
    description = json.dumps(fields, sort_keys=True)
    key = digest(description, length=32)
    names = {k: f"{key}-GPTDataset-{split}-{k}.npy" for k in ("document_index", "sample_index", "shuffle_index")}
    entry = IndexedPart(prefix=os.path.abspath(data.prefix), description=description, **names)
    desc_path = out_dir / f"{key}-GPTDataset-{split}-description.txt"
    if all(whole(out_dir / n) for n in names.values()) and desc_path.exists():
        return entry, len(np.load(out_dir / names["shuffle_index"], mmap_mode="r"))

    sizes = np.asarray(data.sizes)
    tokens_per_epoch = int(sizes[docs].sum(dtype=np.int64))
    if tokens_per_epoch <= ADD_EXTRA_TOKEN:
        left = f" left after the {fields['left_out']['documents']} earlier phases consumed" if "left_out" in fields else ""
        raise ValueError(f"{data.prefix}: split {split!r} holds {tokens_per_epoch} tokens{left}, too few for one sample")
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        samples_per_epoch = (tokens_per_epoch - ADD_EXTRA_TOKEN) // seq_length
        separate_final_epoch = num_samples - samples_sans_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(docs, num_epochs, rng, separate_final_epoch)
    # Dense access through a shuffled order is faster on an in-memory copy than on the mmap.
    sample_index = build_sample_idx(np.array(sizes), document_index, seq_length, num_epochs, tokens_per_epoch,
                                    True, ADD_EXTRA_TOKEN)
    total = sample_index.shape[0] - 1
    if separate_final_epoch:
        shuffle_index = build_shuffle_index(samples_sans_final, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    with writing(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    _save_npy(out_dir / names["document_index"], document_index)
    _save_npy(out_dir / names["sample_index"], sample_index)
    _save_npy(out_dir / names["shuffle_index"], shuffle_index)
    write_atomic(desc_path, description)
    return entry, len(shuffle_index)


@dataclass(frozen=True)
class SplitNeed:
    """What one prefix's share of one split takes, known from its .idx alone."""
    split: str
    prefix: str
    share: float        # of the documents, by the split weights
    documents: int
    tokens: int
    samples: int        # the samples it must provide
    epochs: int         # passes over its documents to provide them; 0 when it holds too few tokens
    index_bytes: int    # its document, sample and shuffle indices, about

    @property
    def empty(self) -> bool:
        return self.epochs == 0


class _Inputs:
    """The prefixes of an index, their blend weights and their split boundaries."""

    def __init__(self, data_path: list[tuple[float, str]] | list[str], split: str,
                 num_samples: dict[str, int], seq_length: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length}: must be >= 1")
        unknown = set(num_samples) - set(SPLITS)
        if unknown:
            raise ValueError(f"num_samples: unknown split(s) {sorted(unknown)}; use {list(SPLITS)}")
        if any(int(v) < 0 for v in num_samples.values()):
            raise ValueError(f"num_samples={num_samples}: counts must be >= 0")
        self.split_weights = parse_split(split)
        self.entries = parse_data_path(data_path)
        self.datasets = [MMapIndexedDataset(p) for _, p in self.entries]
        if self.entries[0][0] is None:
            weights = [float(d.num_tokens) for d in self.datasets]
        else:
            weights = [w for w, _ in self.entries]
        if any(w <= 0 for w in weights):
            raise ValueError(f"data_path: weights {weights} must all be positive; drop a prefix instead of weighting it 0")
        self.weights = [w / sum(weights) for w in weights]
        self.blended = len(self.datasets) > 1
        self.bounds = [split_bounds(self.split_weights, len(d)) for d in self.datasets]

    def part_samples(self, target: int, weight: float) -> int:
        """Samples a prefix builds for a split's ``target``: its share, with the blending margin."""
        return math.ceil(math.ceil(target * weight) * BLEND_MARGIN) if self.blended else target


def index_needs(data_path: list[tuple[float, str]] | list[str], *, split: str, seq_length: int,
                num_samples: dict[str, int]) -> list[SplitNeed]:
    """What building the indices would take, per split and prefix, before building anything: the
    documents and tokens of each split, the passes over them its samples need, the bytes."""
    inputs = _Inputs(data_path, split, num_samples, seq_length)
    out = []
    for s, name in enumerate(SPLITS):
        target = int(num_samples.get(name, 0))
        for d, b, w in zip(inputs.datasets, inputs.bounds, inputs.weights):
            samples = inputs.part_samples(target, w) if target else 0
            tokens = int(np.asarray(d.sizes)[b[s]:b[s + 1]].sum(dtype=np.int64))
            epochs = num_epochs_needed(tokens, samples, seq_length) if tokens > ADD_EXTRA_TOKEN and samples else 0
            built = epochs * max(0, tokens - ADD_EXTRA_TOKEN) // seq_length + 1
            out.append(SplitNeed(name, d.prefix, inputs.split_weights[s], b[s + 1] - b[s], tokens, samples, epochs,
                                 4 * epochs * (b[s + 1] - b[s]) + 12 * built))
    return out


@dataclass(frozen=True)
class Continued:
    """Where a prefix's train order goes on: the order (an IndexedPart's fields) and its first
    position not drawn yet."""
    order: dict[str, Any]
    first: int


def read_left_out(path: str) -> dict[str, np.ndarray]:
    """The documents a ``leave_out`` file names, per prefix (absolute): an ``.npz`` of the prefixes
    (``prefixes``) and, for the i-th, its sorted document ids (``documents_<i>``)."""
    return _read(path, lambda f, i: np.asarray(f[f"documents_{i}"], dtype=np.int64))


def read_continued(path: str) -> dict[str, Continued]:
    """The orders a ``leave_out`` file says go on, per prefix (``order_<i>``: the order as JSON,
    ``first_<i>``: its first position not drawn yet)."""
    found = _read(path, lambda f, i: Continued(json.loads(str(f[f"order_{i}"])), int(f[f"first_{i}"]))
                  if f"order_{i}" in f.files else None)
    return {p: c for p, c in found.items() if c is not None}


def _read(path: str, item: Any) -> dict[str, Any]:
    try:
        with np.load(path, allow_pickle=False) as f:
            return {str(p): item(f, i) for i, p in enumerate(f["prefixes"])}
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: cannot read the documents to leave out ({e}); it is written by the run's ledger "
                         "(tasks.train.phases): run the phase again from the flow") from e


def write_left_out(path: Path, documents: dict[str, np.ndarray], continued: dict[str, Continued] | None = None) -> None:
    """Write what ``read_left_out`` and ``read_continued`` read, complete or not at all."""
    arrays = {f"documents_{i}": np.unique(np.asarray(d, dtype=np.int64)) for i, d in enumerate(documents.values())}
    for i, prefix in enumerate(documents):
        if continued and prefix in continued:
            arrays[f"order_{i}"] = np.array(json.dumps(continued[prefix].order, sort_keys=True))
            arrays[f"first_{i}"] = np.array(continued[prefix].first, dtype=np.int64)
    with replaced(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, prefixes=np.array(list(documents), dtype=str), **arrays)


def _going_on(continued: Continued | None, fingerprint: list, split: str, seq_length: int, seed: int,
              out_dir: Path) -> tuple[IndexedPart, int] | None:
    """A prefix's part that goes on with the order an earlier phase drew from, and the samples that
    order has left, where it is of these tokens, split, sequence length and seed; else None."""
    if continued is None:
        return None
    before = json.loads(continued.order["description"])
    same = [before[k] for k in ("files", "split", "seq_length", "seed")] == [fingerprint, split, seq_length, seed]
    if not same or not all(whole(out_dir / continued.order[k]) for k in ("document_index", "sample_index", "shuffle_index")):
        return None
    left = len(np.load(out_dir / continued.order["shuffle_index"], mmap_mode="r")) - continued.first
    return IndexedPart(**continued.order, first=continued.first), left


def samples_going_on(prefix: str, leave_out: str, split: str, seq_length: int, seed: int, out_dir: Path) -> int:
    """The samples of a prefix's earlier order (the one ``leave_out`` records a phase drew from) that
    a phase with these settings goes on with: 0 where the index stage would order its documents anew."""
    continued = read_continued(leave_out).get(os.path.abspath(prefix))
    going = _going_on(continued, _fingerprint(MMapIndexedDataset(prefix)), split, seq_length, seed, out_dir)
    return going[1] if going else 0


def build_indices(data_path: list[tuple[float, str]] | list[str], *, split: str = "969,30,1", seq_length: int,
                  seed: int, num_samples: dict[str, int], out_dir: str, skipped: list[int] = (),
                  leave_out: str | None = None) -> IndexManifest:
    """Build every split's indices under ``out_dir`` and write the manifest ``GPTDataset`` reads.

    ``num_samples`` maps train/valid/test to sample counts (missing = 0: the split is left empty).
    Prefixes without weights are blended in proportion to their token counts. ``skipped``: positions
    of the train order left out (a run's rollbacks around loss spikes, ``<run>/skipped.json``); the
    order is built that much longer, so the run still has its samples and every position before
    the first skipped one is unchanged. ``leave_out``: what a run's earlier phases consumed
    (``write_left_out``): the train split goes on with each prefix's order where they left it, when
    that order holds the samples (same tokens, split, sequence length and seed), else orders the
    documents they left.
    """
    skipped = sorted({int(p) for p in skipped})
    consumed, continued = (read_left_out(leave_out), read_continued(leave_out)) if leave_out else ({}, {})
    inputs = _Inputs(data_path, split, num_samples, seq_length)
    entries, datasets, weights, bounds = inputs.entries, inputs.datasets, inputs.weights, inputs.bounds
    fingerprints = [_fingerprint(d) for d in datasets]
    out = Path(out_dir).resolve()
    with writing(out):
        out.mkdir(parents=True, exist_ok=True)

    splits: dict[str, IndexedSplit] = {}
    counts: dict[str, int] = {}
    for s, name in enumerate(SPLITS):
        target = int(num_samples.get(name, 0))
        parts: list[IndexedPart] = []
        if target == 0 or any(b[s + 1] <= b[s] for b in bounds):
            splits[name] = IndexedSplit(datasets=[], blend=None, num_samples=0)
            counts[name] = 0
            continue
        sizes = []
        for d, fingerprint, b, w in zip(datasets, fingerprints, bounds, weights):
            part_samples = inputs.part_samples(target, w)
            prefix = os.path.abspath(d.prefix)
            going = _going_on(continued.get(prefix), fingerprint, split, seq_length, seed, out) if name == "train" else None
            entry, n = (going if going and going[1] >= part_samples else None) or \
                _build_part(d, fingerprint, (b[s], b[s + 1]), name, split, part_samples, seq_length, seed, out,
                            consumed.get(prefix) if name == "train" else None)
            parts.append(entry)
            sizes.append(n)
        left_out = skipped if name == "train" else []
        blend = _build_blend(parts, weights, sizes, target + len(left_out), name, out) if inputs.blended else None
        built = target + len(left_out) if inputs.blended else sizes[0]
        _check_skipped(left_out, built, target)
        splits[name] = IndexedSplit(datasets=parts, blend=blend, num_samples=built, skipped=left_out)
        counts[name] = built - len(left_out)

    built_with = _built_with(entries, split=split, seq_length=seq_length, seed=seed, num_samples=num_samples,
                             **({"leave_out": leave_out} if leave_out else {}))
    text = DataIndex(seq_length=seq_length, add_extra_token=ADD_EXTRA_TOKEN, seed=seed, split=split,
                     splits=splits, built_with=built_with).to_json()
    name = digest(text, length=32)
    path = out / f"{name}-index.json"
    write_atomic(path, text)
    return IndexManifest(path=str(path), seq_length=seq_length, num_samples=counts, digest=name,
                         max_token_ids={p: _max_token_id(d, f, out) for (_, p), d, f in zip(entries, datasets, fingerprints)})


def _check_skipped(skipped: list[int], built: int, target: int) -> None:
    """The train order still holds ``target`` samples once ``skipped`` are left out of the ``built``."""
    if skipped and (skipped[-1] >= built or built - len(skipped) < target):
        raise ValueError(f"skipped samples {skipped[:5]}...: the train order holds {built} samples; leaving "
                         f"{len(skipped)} out leaves fewer than the {target} the run needs, and the split has "
                         "no spare samples to take their place (its last pass over the documents is used up). "
                         "Remove entries from <run>/skipped.json, or train fewer iterations")


def _built_with(entries: list[tuple[float | None, str]], **arguments: Any) -> dict[str, Any]:
    """build_indices' arguments as the manifest records them (prefixes absolute): what builds it again."""
    prefixes = [os.path.abspath(p) for _, p in entries]
    data_path = prefixes if entries[0][0] is None else [[w, p] for (w, _), p in zip(entries, prefixes)]
    return json.loads(json.dumps({"data_path": data_path, **arguments}))


def _max_token_id(data: MMapIndexedDataset, fingerprint: list, out_dir: Path) -> int:
    """The largest token id in a prefix's .bin: its writer's record where it was written here (the
    tokenize stage saw every token), else read once per content (by its fingerprint) and kept beside
    the indices: a corpus of 1T tokens is 2 TB to read."""
    if (seen := recorded(data.prefix)) is not None:
        return int(seen["max_token_id"])
    stat = os.stat(data.bin_path)   # with the sampled fingerprint: a .bin rewritten in place is read again
    key = json.dumps([fingerprint, stat.st_ino, stat.st_mtime_ns])
    path = out_dir / f"{digest(key, length=32)}-max-token-id.json"
    if path.exists():
        return int(json.loads(path.read_text())["max_token_id"])
    largest = data.max_token_id()
    write_atomic(path, json.dumps({"prefix": os.path.abspath(data.prefix), "max_token_id": largest}))
    return largest


def _build_blend(parts: list[IndexedPart], weights: list[float], sizes: list[int], target: int, split: str,
                 out: Path) -> Blend:
    description = json.dumps({"class": "BlendedDataset", "weights": weights, "size": target,
                              "datasets": [p.description for p in parts]}, sort_keys=True)
    key = digest(description, length=32)
    names = Blend(dataset_index=f"{key}-BlendedDataset-{split}-dataset_index.npy",
                  dataset_sample_index=f"{key}-BlendedDataset-{split}-dataset_sample_index.npy")
    if whole(out / names.dataset_index) and whole(out / names.dataset_sample_index):
        return names
    dataset_index = np.zeros(target, dtype=np.int16)
    dataset_sample_index = np.zeros(target, dtype=np.int64)
    build_blending_indices(dataset_index, dataset_sample_index, np.asarray(weights, dtype=np.float64),
                           len(weights), target, False)
    for d, size in enumerate(sizes):
        used = dataset_sample_index[dataset_index == d]
        if used.size and int(used.max()) >= size:
            raise ValueError(f"{parts[d].prefix}: split {split!r} needs {int(used.max()) + 1} samples but holds {size}")
    _save_npy(out / names.dataset_index, dataset_index)
    _save_npy(out / names.dataset_sample_index, dataset_sample_index)
    return names


def _index_cache_key(parameters: dict) -> str:
    """Arguments plus the identity (size, mtime) of every .bin/.idx they name."""
    entries = parse_data_path(parameters["data_path"])
    stamps = []
    for _, prefix in entries:
        for ext in (".idx", ".bin"):
            st = os.stat(prefix + ext)
            stamps.append([os.path.abspath(prefix + ext), st.st_size, st.st_mtime_ns])
    if parameters.get("leave_out"):
        stamps.append(file_digest(parameters["leave_out"]))
    return "index-v2-" + digest(parameters, stamps, length=32)      # v2: manifests record how they were built


index_task = task(build_indices, name="index", cache_policy=StageCache(key_of=_index_cache_key), persist_result=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tasks.index", description=__doc__.split("\n")[0])
    p.add_argument("--data-path", nargs="+", required=True, help="prefixes, or weight/prefix pairs: 0.3 A 0.7 B")
    p.add_argument("--split", default="969,30,1")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--train-samples", type=int, required=True)
    p.add_argument("--valid-samples", type=int, default=0)
    p.add_argument("--test-samples", type=int, default=0)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--skip", type=int, nargs="*", default=[], help="positions of the train order to leave out")
    p.add_argument("--leave-out", help="an .npz of documents the train split leaves out (a run's ledger writes it)")
    p.add_argument("--no-cache", action="store_true", help="build even when the index of these inputs is there and "
                                                           "intact (the stage's cache, shared with the pretrain flow)")
    a = p.parse_args(argv)
    start = time.perf_counter()
    options = dict(data_path=a.data_path, split=a.split, seq_length=a.seq_length, seed=a.seed,
                   num_samples={"train": a.train_samples, "valid": a.valid_samples, "test": a.test_samples},
                   out_dir=a.out_dir, skipped=a.skip, leave_out=a.leave_out)
    m, was_cached = (build_indices(**options), False) if a.no_cache else cached(index_task, **options)
    print(json.dumps({**m.model_dump(), "cached": was_cached, "seconds": round(time.perf_counter() - start, 3)}))


if __name__ == "__main__":
    main()
