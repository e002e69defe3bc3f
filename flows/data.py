"""The data half of the pretrain DAG: tokenizer files and tokenized prefixes from S3, sources synced
and tokenized (the Shakespeare sample when nothing is given), the blend the index stage takes, and
the index itself. Each stage is called with the plan's part it needs (flows.plan.inputs.DataPlan).

Sync and tokenize run in this process, or, when the cluster preset says ``data_jobs: true``, as
jobs on its compute nodes: each sync as one job, tokenize as a job array (tasks.tokenize.array)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flows.plan.build import Plan
from flows.plan.evaluation import EvaluationPlan
from flows.plan.inputs import DataPlan
from flows.plan.layout import Layout
from flows.plan.params import ParameterError, PhaseParams
from flows.plan.sizes import GIB, physical_memory
from flows.stages import Stages
from gpt.config import Config
from gpt.data import MMapIndexedDataset
from gpt.tokenizer import Tokenizer
from tasks import report as reporting
from tasks.cluster.config import ClusterConfig
from tasks.common.run_context import run_logger
from tasks.common.uri import is_s3
from tasks.evaluate.records import EvaluationSpec, JobCluster
from tasks.index import IndexManifest, index_needs, index_task, parse_split
from tasks.sync import Remote, SyncManifest, sync_task
from tasks.tokenize.hf_encoder import tokenizer_file
from tasks.tokenize.inputs import INPUT_SUFFIXES
from tasks.tokenize.outputs import TokenizeManifest, nonzero_counts
from tasks.tokenize.sample_corpus import sample_corpus_task
from tasks.tokenize.stage import tokenize_task
from tasks.tokenize.vocabulary import named_tokenizer
from tasks.train import phases as run_phases
from tasks.train.phases import Phase

# Beyond this many passes over the same text, more data trains better (repeated data loses value
# quickly after about four epochs).
REPEAT_WARNING_EPOCHS = 4
SKIPPED_LINES_WARNING = 0.05       # a larger share of an input's lines skipped is said in the plan

TokenizerFiles = tuple[str | None, str | None, str | None]    # vocab.json, merges.txt, tokenizer.json


@dataclass(frozen=True)
class Dataset:
    """What the index stage and the run take: the blend of (weight, local prefix), the tokenizer
    the prefixes were made with, and the tokenize stage's manifest when this run tokenized."""
    blend: list[tuple[float, str]]
    tokenizer: Tokenizer
    tokenized: TokenizeManifest | None = None
    warnings: tuple[str, ...] = ()        # what the data stages found that the run goes on without


def prepare(data: DataPlan, layout: Layout, stages: Stages, cluster: ClusterConfig) -> Dataset:
    """Everything the index stage needs, each piece by a cached stage."""
    files = fetch_tokenizer(data, layout, stages)
    blend = [(p.weight, fetch_prefix(p.uri, data.remote, layout, stages, cluster, f"sync-prefix-{i}"))
             for i, p in enumerate(data.prefixes)]
    sources = [stages.run("sample-corpus", sample_corpus_task, str(layout.sample()))] if data.sample \
        else list(data.sources)
    if not sources:
        return Dataset(blend, named_tokenizer(*files))  # type: ignore[arg-type]   # the plan asked for one
    tokenized, warnings = sync_and_tokenize(sources, data.json_keys, data, files, layout, stages, cluster)
    return Dataset(blend + [(data.weight, p) for p in tokenized.prefixes.values()], tokenized.tokenizer, tokenized,
                   warnings)


def sync_and_tokenize(sources: list[str], json_keys: tuple[str, ...], data: DataPlan, files: TokenizerFiles,
                      layout: Layout, stages: Stages, cluster: ClusterConfig,
                      label: str = "", field: str = "data.sources") -> tuple[TokenizeManifest, tuple[str, ...]]:
    """The sources synced and tokenized; and what the run goes on without: synced files that are no
    input (by their names relative to the sync's folder), and sources' files the sync did not copy.
    ``label``: what the stages' names end with when the sources are not the run's data (an evaluation
    set's, a later phase's), and ``field`` the parameter that names them."""
    raw = stages.run(f"sync{label}", sync_task, sources, str(layout.raw(sources, data.remote.endpoint_url)),
                     cluster=cluster, remote=data.remote, allowed_roots=list(data.readable),
                     verify_content=data.verify_content)
    inputs = [f for f in synced_files(raw) if f.endswith(INPUT_SUFFIXES)]
    left_out = sorted(f.path for f in raw.files if not f.path.endswith(INPUT_SUFFIXES))
    if not inputs:
        raise ParameterError([f"{field}: no JSONL or Parquet files ({', '.join(INPUT_SUFFIXES)}) among "
                              f"the {len(raw.files)} files synced to {raw.dest}"])
    vocab_file, merge_file, tokenizer_model = files
    t = data.tokenizer
    out_prefix = layout.tokenized(raw.digest, vocab_file, merge_file, list(json_keys), t.train_vocab_size,
                                  *filter(None, [tokenizer_model]), *(["add_bos_token"] if t.add_bos_token else []))
    tokenized = stages.run(f"tokenize{label}", tokenize_task, inputs, str(out_prefix), cluster=cluster,
                           vocab_file=vocab_file, merge_file=merge_file, tokenizer_model=tokenizer_model,
                           json_keys=list(json_keys), train_vocab_size=data.bpe_vocab_size,
                           add_bos_token=t.add_bos_token,
                           origins={str(Path(raw.local_dir) / f.path): f.key for f in raw.files})
    if not label:
        reporting.dataset_table(tokenized)
    warnings = [f"{field}: {len(names)} {what}: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                for names, what in ((left_out, "synced file(s) are not JSONL or Parquet and are not tokenized"),
                                    (raw.not_copied, "file(s) are named as the sync names its own files and are "
                                                     "not copied; rename them if they are data")) if names]
    skipped = {kind: n for kind, n in tokenized.skipped.items() if kind != "blank_line" and n}
    lines = tokenized.documents + sum(skipped.values())
    if lines and sum(skipped.values()) > SKIPPED_LINES_WARNING * lines:
        warnings.append(f"{field}: {sum(skipped.values()):,} of {lines:,} lines ({sum(skipped.values()) / lines:.0%}) "
                        f"were skipped ({nonzero_counts(skipped)}): the run trains on the rest; the tokenize "
                        "stage's log names the first of them, and data.json_keys names the text field")
    return tokenized, tuple(warnings)


def evaluation_sets(evaluation: EvaluationPlan, dataset: Dataset, data: DataPlan, seq_length: int, layout: Layout,
                    stages: Stages, cluster: ClusterConfig) -> dict[str, str]:
    """Each evaluation set's local tokenized prefix: its sources synced and tokenized with the run's
    tokenizer (cached stages, like the training data's; the first of data.json_keys is the text), or
    its prefix, synced from S3 when remote. A set shorter than one window of the run is refused."""
    files = (dataset.tokenizer.vocab_file, dataset.tokenizer.merge_file, dataset.tokenizer.tokenizer_file)
    prefixes = {}
    for s in evaluation.sets:
        if s.prefix:
            prefixes[s.name] = fetch_prefix(s.prefix, data.remote, layout, stages, cluster, "sync-prefix-0")
            continue
        tokenized, _ = sync_and_tokenize(list(s.sources), data.json_keys[:1], data, files, layout, stages, cluster,
                                         label=f"-eval-{s.name}", field=f"evaluation.sets ({s.name!r}) sources")
        (prefixes[s.name],) = tokenized.prefixes.values()
    short = [f"evaluation.sets[{i}] ({s.name!r}): {tokens} tokens, fewer than one window of {seq_length + 1} (the "
             "run's seq_length + 1); give it more text" for i, s in enumerate(evaluation.sets)
             if (tokens := MMapIndexedDataset(prefixes[s.name]).sizes.sum(dtype=np.int64)) < seq_length + 1]
    if short:
        raise ParameterError(short)
    return prefixes


def evaluation_spec(plan: Plan, dataset: Dataset, stages: Stages) -> EvaluationSpec:
    """What each checkpoint of the run is evaluated on and where: the sets tokenized with the run's
    tokenizer, and the evaluation job's resources from the cluster preset."""
    e = plan.evaluation
    sets = evaluation_sets(e, dataset, plan.data, plan.config.seq_length, plan.layout, stages, plan.cluster)
    files = {"vocab_file": dataset.tokenizer.vocab_file, "merge_file": dataset.tokenizer.merge_file,
             "tokenizer_file": dataset.tokenizer.tokenizer_file}
    return EvaluationSpec(sets=sets, set_tokens=e.set_tokens, tasks=list(e.tasks), task_paths=list(e.task_paths),
                          limit=e.limit, every=e.every, tokenizer=files,
                          cluster=JobCluster(preset=plan.cluster_preset, overrides=plan.cluster_set))


def synced_files(manifest: SyncManifest) -> list[str]:
    return sorted(str(Path(manifest.local_dir) / f.path) for f in manifest.files)


def fetch_tokenizer(data: DataPlan, layout: Layout, stages: Stages) -> TokenizerFiles:
    """Local paths of the tokenizer files (vocab, merges, tokenizer.json), syncing them first when
    they are in S3: a tokenizer_model folder (``s3://.../llama3/``) whole, as HuggingFace saves one."""
    t = data.tokenizer
    remote = t.remote_files
    if not remote:
        return t.files
    manifest = stages.run("sync-tokenizer", sync_task, remote, str(layout.tokenizer(remote)), remote=data.remote)
    synced = {Path(p).name: p for p in synced_files(manifest)}
    vocab, merges = (synced[Path(f).name] if f and is_s3(f) else f for f in (t.vocab_file, t.merge_file))
    model = t.tokenizer_model
    if model and is_s3(model):       # a file, or a folder as HuggingFace saves one (synced whole)
        model = os.path.abspath(tokenizer_file(synced.get(Path(model).name, manifest.local_dir)))
    return vocab, merges, model


def fetch_prefix(uri: str, remote: Remote, layout: Layout, stages: Stages, cluster: ClusterConfig, stage: str) -> str:
    """The local prefix of a tokenized .bin/.idx pair, synced from S3 when it is there."""
    if not is_s3(uri):
        return uri
    local = layout.prefix(uri)
    stages.run(stage, sync_task, [uri + ".bin", uri + ".idx"], str(local.parent), cluster=cluster, remote=remote)
    return str(local)


def index(dataset: Dataset, data: DataPlan, config: Config, layout: Layout,
          stages: Stages) -> tuple[IndexManifest, list[str]]:
    """The index stage over the blend, once the blend is known to hold a sample of every split given
    a share; and what the run goes on without (check_repetition)."""
    warnings = check_repetition(dataset, data.split, config)
    built = stages.run("index", index_task, dataset.blend, split=data.split, seq_length=config.seq_length,
                       seed=config.seed, num_samples=config.num_samples(), out_dir=str(layout.index()))
    return built, warnings


def phase_blend(phase: PhaseParams, before: list[tuple[float, str]], dataset: Dataset, plan: Plan, stages: Stages,
                number: int) -> list[tuple[float, str]]:
    """A phase's blend of local prefixes: its prefixes (synced from S3 where they are there) and its
    sources synced and tokenized with the run's tokenizer (the run's own sources, named as the run
    names them, are the run's tokenized data); or the blend of the phase before when it names none."""
    if phase.keeps_blend:
        return before
    blend = [(p.weight, fetch_prefix(p.prefix, plan.data.remote, plan.layout, stages, plan.cluster,
                                     f"sync-phase-{number}-prefix-{i}")) for i, p in enumerate(phase.prefixes)]
    if dataset.tokenized is not None and sorted(phase.sources) == sorted(plan.data.sources):
        blend += [(phase.weight, p) for p in dataset.tokenized.prefixes.values()]
    elif phase.sources:
        files = (dataset.tokenizer.vocab_file, dataset.tokenizer.merge_file, dataset.tokenizer.tokenizer_file)
        tokenized, warnings = sync_and_tokenize(list(phase.sources), plan.data.json_keys, plan.data, files, plan.layout,
                                                stages, plan.cluster, label=f"-phase-{number}",
                                                field=f"phases[{number - 2}].sources")
        for warning in warnings:
            run_logger().warning("warning: %s", warning)
        blend += [(phase.weight, p) for p in tokenized.prefixes.values()]
    return blend


def phase_index(phase: Phase, number: int, plan: Plan, config: Config, stages: Stages) -> IndexManifest:
    """The order of phase ``number`` (``config``: its configuration): the index stage over its blend,
    each prefix's order going on where the earlier phases left it, or over the documents they left.
    A prefix they consumed to the last document is refused by name; one whose text left runs out
    before the phase ends (and is repeated from there) is a warning with the iteration."""
    leave_out = run_phases.left_out(plan.run_dir, number)
    total = sum(w for w, _ in phase.blend)
    problems = []
    for weight, prefix in phase.blend:
        per_iteration = weight / total * config.global_batch_size * config.seq_length
        needed = per_iteration * (config.total_iters - phase.start)
        going_on, documents = run_phases.tokens_left(prefix, plan.data.split, config.seq_length, config.seed,
                                                     leave_out, plan.layout.index())
        if going_on >= needed:
            continue
        if documents <= 1:
            problems.append(f"phases[{number - 2}].prefixes: {prefix} is exhausted before phase {number} can start: the "
                            "earlier phases drew from all its train documents; give the phase other data, or more "
                            "documents in this prefix")
        elif documents < needed:
            run_logger().warning("warning: phase %d: %s runs out at about iteration %d: the %s tokens of the documents "
                                 "the earlier phases left are repeated from there", number, prefix,
                                 phase.start + int(documents // per_iteration), f"{documents:,}")
    if problems:
        raise ParameterError(problems)
    return stages.run(f"index-phase-{number}", index_task, list(phase.blend), split=plan.data.split,
                      seq_length=config.seq_length, seed=config.seed, num_samples=config.num_samples(),
                      out_dir=str(plan.layout.index()), leave_out=leave_out)


def check_repetition(dataset: Dataset, split: str, config: Config) -> list[str]:
    """Before the index is built: refuse splits that are given a share but hold no text, and an
    index this machine's memory cannot build (the plan checked the disk); returns a warning when the training text is repeated more
    than REPEAT_WARNING_EPOCHS times (evaluating the same small split again costs nothing but time)."""
    needs = index_needs(dataset.blend, split=split, seq_length=config.seq_length, num_samples=config.num_samples())
    errors, warnings = [], list(dataset.warnings)
    if parse_split(split)[1] == 0 and not config.benchmark:
        warnings.append(f"data.split {split!r} gives the valid split no share: the run trains without evaluation "
                        "(no validation loss); give it a share, such as 969,30,1")
    for n in needs:
        if n.empty and n.share > 0 and n.samples:
            errors.append(f"data.split: the {n.split} split of {n.prefix} holds {n.documents} documents, {n.tokens} "
                          f"tokens: too few for one sample of {config.seq_length + 1} tokens (split {split!r} of "
                          f"{sum(m.documents for m in needs if m.prefix == n.prefix)} documents); give it a larger "
                          "share, or more data")
        elif n.split == "train" and n.epochs > REPEAT_WARNING_EPOCHS:
            warnings.append(f"the {n.split} split of {n.prefix} is repeated {n.epochs:,} times ({n.tokens:,} tokens "
                            f"for {n.samples:,} samples of {config.seq_length:,}): more data, or fewer samples, "
                            "would train better")
    total = sum(n.index_bytes for n in needs)
    if total > physical_memory():       # each split's document index is built in memory
        errors.append(f"training: the data index would take {total / GIB:,.1f} GiB (the data repeated up to "
                      f"{max(n.epochs for n in needs):,} times for these samples and seq_length "
                      f"{config.seq_length:,}), more than this machine's memory ({physical_memory() / GIB:,.1f} "
                      "GiB) to build it; train fewer samples, or give more data")
    if errors:
        raise ParameterError(errors)
    return warnings
