"""The `pretrain` flow: sync -> tokenize -> index -> precompile -> train -> report.

Each stage is a cached task from tasks/: the same inputs again skip it, and a retried flow run
reruns only what did not finish (training resumes from its last checkpoint).

`python -m flows.pretrain` with no arguments runs the embedded default here: the Shakespeare
sample corpus, a BPE trained on it, the tiny GPT on CPU, in a few minutes. Flags change the common
parameters; `--help` lists them.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_API_URL

from flows.params import (SAMPLE_VOCAB_SIZE, ClusterParams, DataParams, ModelName, OutputParams, ParameterError,
                          TokenizerParams, TrainingParams, WeightedPrefix, check, is_remote, local_path)
from gpt.data import MMapIndexedDataset
from tasks import report as reporting
from tasks.export import export_task
from tasks.index import index_task
from tasks.precompile import precompile_task
from tasks.sample_corpus import sample_corpus_task
from tasks.sync import sync_task, upload_task
from tasks.tokenize import tokenize_task
from tasks.train import train_task

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.xz", ".json.xz", ".jsonl.zst", ".json.zst")


class Stages:
    """Runs stage tasks in order, recording wall time and final state (Completed or Cached)."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def skip(self, stage: str, why: str) -> None:
        print(f"stage {stage} skipped: {why}")
        self.records.append({"stage": stage, "state": "Skipped", "seconds": 0.0})

    def run(self, stage: str, task_fn: Any, *args: Any, intact: Any = None, **kwargs: Any) -> Any:
        """Run a stage task; a cached result whose outputs are gone or damaged (``intact(result)``
        is False) runs the stage again."""
        start = time.perf_counter()
        state = task_fn(*args, return_state=True, **kwargs)
        if intact is not None and state.name == "Cached" and not intact(state.result()):
            print(f"stage {stage}: the cached result's outputs are gone or damaged; running it again")
            state = task_fn.with_options(refresh_cache=True)(*args, return_state=True, **kwargs)
        self.records.append({"stage": stage, "state": state.name, "seconds": time.perf_counter() - start})
        return state.result()  # raises the stage's error, failing the flow run


def _tokenized_intact(manifest: Any) -> bool:
    try:
        for prefix in manifest.prefixes.values():
            MMapIndexedDataset(prefix)
    except (OSError, ValueError):
        return False
    return True


def _index_intact(manifest: Any) -> bool:
    try:
        splits = json.loads(Path(manifest.path).read_text())["splits"]
    except (OSError, ValueError, KeyError):
        return False
    folder = Path(manifest.path).parent
    files = [part[k] for split in splits.values() for part in split["datasets"]
             for k in ("document_index", "sample_index", "shuffle_index")]
    files += [name for split in splits.values() if split.get("blend") for name in split["blend"].values()]
    return all((folder / name).is_file() for name in files)


def _check_vocabulary(index: Any, vocab_size: int, vocab_file: str | None) -> None:
    """Token ids beyond the vocabulary would crash the embedding mid-training: say so now."""
    bad = {p: m for p, m in index.max_token_ids.items() if m >= vocab_size}
    if bad:
        raise ParameterError([f"data: {p}.bin holds token id {m}, but the vocabulary "
                              f"{vocab_file or '(the model preset)'} has only {vocab_size} entries: the data was "
                              "tokenized with another vocabulary; give that vocabulary or tokenize again"
                              for p, m in sorted(bad.items())])


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _synced_files(manifest: Any) -> list[str]:
    return sorted(str(Path(manifest.local_dir) / f.path) for f in manifest.files)


def _fetch_tokenizer(tokenizer: TokenizerParams, data: DataParams, root: Path, stages: Stages) -> tuple[str | None, str | None]:
    """Local paths of the tokenizer files, syncing them first when they are in S3."""
    files = [tokenizer.vocab_file, tokenizer.merge_file]
    if not any(f and is_remote(f) for f in files):
        return tuple(local_path(f) if f else None for f in files)  # type: ignore[return-value]
    remote = [f for f in files if f and is_remote(f)]
    manifest = stages.run("sync-tokenizer", sync_task, remote, str(root / "tokenizer" / _digest(remote)),
                          endpoint_url=data.endpoint_url, profile=data.profile,
                          no_sign_request=data.no_sign_request)
    local = {Path(p).name: p for p in _synced_files(manifest)}
    return tuple(local[Path(f).name] if f and is_remote(f) else f for f in files)  # type: ignore[return-value]


def _fetch_prefixes(data: DataParams, root: Path, stages: Stages) -> list[tuple[float, str]]:
    """(weight, local prefix) for each tokenized input, syncing the .bin/.idx pairs from S3."""
    out = []
    for i, p in enumerate(data.prefixes):
        if not is_remote(p.prefix):
            out.append((p.weight, local_path(p.prefix)))
            continue
        dest = root / "prefixes" / _digest(p.prefix)
        stages.run(f"sync-prefix-{i}", sync_task, [p.prefix + ".bin", p.prefix + ".idx"], str(dest),
                   endpoint_url=data.endpoint_url, profile=data.profile, no_sign_request=data.no_sign_request)
        out.append((p.weight, str(dest / Path(p.prefix).name)))
    return out


@flow(name="pretrain", persist_result=True, log_prints=True)
def pretrain(
    model: ModelName = "tiny",
    data: DataParams = DataParams(),
    tokenizer: TokenizerParams = TokenizerParams(),
    training: TrainingParams = TrainingParams(),
    cluster: ClusterParams = ClusterParams(),
    output: OutputParams = OutputParams(),
) -> dict:
    """Pretrain a GPT: data from S3 or local files to a trained model and its report.

    Args:
        model: Model preset (GPT-3 paper sizes, Megatron's table, or tiny for tests).
        data: JSONL sources and/or tokenized prefixes; empty runs on the bundled Shakespeare sample.
        tokenizer: GPT-2 style vocab.json/merges.txt; empty trains a BPE on the sources.
        training: Schedule, batch sizes, parallel layout and any other gpt Config field.
        cluster: Where training runs: a preset from deployments/clusters plus overrides.
        output: Root folder on shared storage, run name, and an s3:// URI to upload the run to.
    """
    plan = check(model, data, tokenizer, training, cluster, output)
    root, run_dir = plan.root / "data", plan.run_dir
    stages = Stages()
    print(f"run folder {run_dir} ({plan.world_size} processes on {plan.config.device}, {plan.config.precision}, "
          f"cluster preset {cluster.preset!r})")
    reporting.plan_table(plan)

    vocab_file, merge_file = _fetch_tokenizer(tokenizer, data, root, stages)
    blend = _fetch_prefixes(data, root, stages)
    tokenized = None
    sources = list(data.sources)
    if not sources and not blend:
        sources = [stages.run("sample-corpus", sample_corpus_task, str(root / "sample"))]
    if sources:
        raw = stages.run("sync", sync_task, sources, str(root / "raw" / _digest(sources, data.endpoint_url)),
                         endpoint_url=data.endpoint_url, profile=data.profile,
                         no_sign_request=data.no_sign_request)
        inputs = [f for f in _synced_files(raw) if f.endswith(JSONL_SUFFIXES)]
        if not inputs:
            raise ParameterError([f"data.sources: no JSONL files ({', '.join(JSONL_SUFFIXES)}) among "
                                  f"the {len(raw.files)} files synced to {raw.dest}"])
        out_prefix = root / "tokenized" / _digest(raw.digest, vocab_file, merge_file, data.json_keys,
                                                  tokenizer.train_vocab_size) / "corpus"
        train_vocab = tokenizer.train_vocab_size or (SAMPLE_VOCAB_SIZE if not data.sources else 50257)
        tokenized = stages.run("tokenize", tokenize_task, inputs, str(out_prefix), vocab_file=vocab_file,
                               merge_file=merge_file, json_keys=list(data.json_keys),
                               train_vocab_size=train_vocab, intact=_tokenized_intact)
        reporting.dataset_table(tokenized)
        blend += [(data.weight, p) for p in tokenized.prefixes.values()]
        vocab_size = tokenized.vocab_size
    else:
        vocab_size = plan.config.vocab_size if not vocab_file else len(json.loads(Path(vocab_file).read_text()))

    config = dataclasses.replace(plan.config, vocab_size=vocab_size, run_dir=str(run_dir))
    index = stages.run("index", index_task, blend, split=data.split, seq_length=config.seq_length,
                       seed=config.seed, num_samples=config.num_samples(), out_dir=str(root / "index"),
                       intact=_index_intact)
    _check_vocabulary(index, vocab_size, tokenized.vocab_file if tokenized else vocab_file)
    config = dataclasses.replace(config, data_index=index.path)
    config.validate(world_size=plan.world_size)
    compiled = None
    if config.compile or config.device == "neuron":
        compiled = stages.run("precompile", precompile_task, config, plan.cluster,
                              cache_root=str(root / "compile-cache"), run_dir=str(run_dir))
    else:
        stages.skip("precompile", "training.compile is off: nothing to compile")
    result = stages.run("train", train_task, config, plan.cluster, run_dir=str(run_dir), precompiled=compiled)
    tokenizer_files = [tokenized.vocab_file, tokenized.merge_file] if tokenized else [vocab_file, merge_file]
    exported = None
    if all(tokenizer_files):
        exported = stages.run("export", export_task, result.run_dir, *tokenizer_files,
                              intact=lambda m: (Path(m.path) / "model.safetensors").is_file())
    else:
        stages.skip("export", "no vocabulary files: the model preset's vocabulary cannot be exported")
    url = flow_run.get_flow_run_ui_url() if PREFECT_API_URL.value() else None  # None: a temporary server
    figures = reporting.report_task(
        model=model, run_dir=result.run_dir, metrics_path=result.metrics_path, summary=result.summary,
        seq_length=config.seq_length, stages=stages.records, job_ids=result.job_ids,
        uploaded_to=output.uri, flow_run_url=url, exported=exported,
    )
    if output.uri:  # last, so the upload holds the loss plot too
        stages.run("upload", upload_task, str(run_dir), output.uri, endpoint_url=output.endpoint_url,
                   profile=output.profile or data.profile)
    return {
        "run_dir": result.run_dir, "metrics": result.metrics_path,
        "checkpoints": str(Path(result.run_dir) / "checkpoints"),
        "tensorboard": figures["tensorboard"], "loss_plot": figures["loss_plot"],
        "dataset": blend, "index": index.path, "compile_cache": compiled.cache_dir if compiled else None,
        "tokenizer": tokenizer_files, "export": exported.path if exported else None,
        "test_perplexity": figures["test_perplexity"],
        "uploaded_to": output.uri, "flow_run": url, "job_ids": result.job_ids,
        "first_loss": figures["first_loss"], "train_loss": figures["train_loss"],
        "valid_loss": figures["valid_loss"], "tokens_per_s": figures["tokens_per_s"],
        "stages": stages.records,
    }


def _key_values(items: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} {item!r}: expected key=value")
        out[key] = yaml.safe_load(value)
    return out


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Flow parameters from command-line flags (unset flags keep the flow's defaults)."""
    p = argparse.ArgumentParser(prog="python -m flows.pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="preset name, e.g. tiny, gpt3-125m, gpt3-1.3b")
    p.add_argument("--source", action="append", default=[], help="JSONL input: s3:// URI, path or glob (repeatable)")
    p.add_argument("--prefix", nargs=2, action="append", default=[], metavar=("WEIGHT", "PREFIX"),
                   help="already tokenized .bin/.idx prefix with its blend weight (repeatable)")
    p.add_argument("--json-key", action="append", help="JSON field with the text (repeatable; default text)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for sources and tokenizer files")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--train-iters", type=int)
    p.add_argument("--train-samples", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--tp", type=int, dest="tensor_parallel")
    p.add_argument("--dp", type=int, dest="data_parallel")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "neuron"])
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile with a precompile stage first (default on)")
    p.add_argument("--benchmark", action="store_true", default=None)
    p.add_argument("--seed", type=int)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any gpt Config field, e.g. --set lr_warmup_iters=50 (repeatable)")
    p.add_argument("--cluster", help="cluster preset name or YAML path (default local)")
    p.add_argument("--cluster-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="cluster field, e.g. --cluster-set partition=gpu --cluster-set nodes=2")
    p.add_argument("--root", help="folder for data, indices, caches and runs (default ./runs)")
    p.add_argument("--run-name")
    p.add_argument("--output-uri", help="s3://bucket/prefix to upload the run folder to")
    p.add_argument("--output-endpoint-url")
    a = p.parse_args(argv)

    def pick(**kw: Any) -> dict:
        return {k: v for k, v in kw.items() if v is not None and v != []}

    params: dict[str, Any] = pick(model=a.model)
    params["data"] = DataParams(**pick(
        sources=a.source, json_keys=a.json_key, endpoint_url=a.endpoint_url,
        prefixes=[WeightedPrefix(weight=float(w), prefix=pr) for w, pr in a.prefix]))
    params["tokenizer"] = TokenizerParams(vocab_file=a.vocab_file, merge_file=a.merge_file)
    params["training"] = TrainingParams(**pick(
        train_iters=a.train_iters, train_samples=a.train_samples, micro_batch_size=a.micro_batch_size,
        global_batch_size=a.global_batch_size, seq_length=a.seq_length, tensor_parallel=a.tensor_parallel,
        data_parallel=a.data_parallel, device=a.device, precision=a.precision, compile=a.compile,
        benchmark=a.benchmark, seed=a.seed, overrides=_key_values(a.set, "--set")))
    params["cluster"] = ClusterParams(**pick(preset=a.cluster, overrides=_key_values(a.cluster_set, "--cluster-set")))
    params["output"] = OutputParams(**pick(root=a.root, run_name=a.run_name, uri=a.output_uri,
                                           endpoint_url=a.output_endpoint_url))
    return params


def main(argv: list[str] | None = None) -> int:
    # Without PREFECT_API_URL, Prefect starts a temporary server for this run; keep it quiet.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    params = parse_args(argv)
    started = time.perf_counter()
    try:
        out = pretrain(**params)
    except ParameterError as e:
        print(e, file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    print("\n" + "=" * 72)
    print(f"pretrain finished in {wall:.0f} s: loss {out['first_loss']:.3f} -> {out['train_loss']:.3f}"
          if out["first_loss"] is not None and out["train_loss"] is not None else f"pretrain finished in {wall:.0f} s")
    for label, key in [("run folder", "run_dir"), ("metrics", "metrics"), ("checkpoints", "checkpoints"),
                       ("loss plot", "loss_plot"), ("tensorboard", "tensorboard"), ("index", "index"),
                       ("compile cache", "compile_cache"), ("HF export", "export"), ("uploaded to", "uploaded_to"),
                       ("flow run", "flow_run")]:
        if out.get(key):
            print(f"{label:>14}: {out[key]}")
    print(f"{'tokenizer':>14}: {', '.join(str(t) for t in out['tokenizer'] if t) or '-'}")
    print(f"{'dataset':>14}: {', '.join(f'{w:g} x {p}' for w, p in out['dataset'])}")
    print(f"{'stages':>14}: " + ", ".join(f"{s['stage']} {s['seconds']:.1f}s ({s['state'].lower()})" for s in out["stages"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
