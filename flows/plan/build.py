"""The plan of one run, decided once: the flow's parameters checked and turned into the training job's
configuration, the cluster it runs on and where its files live, before any stage runs.

`make_plan(...)` is the one place the parameters are validated: it raises `ParameterError`
listing every problem, one line per field (`training.micro_batch_size: ...`): values and their
cost (memory, disk), what the operator allows the form to reach (flows.plan.boundary), and whether the
run folder's own run can go on under these parameters (flows.plan.identity, flows.plan.outlook). What only
the data stages can know (the vocabulary's size, the index) is added by `Plan.with_data`, the one
place the job's configuration is completed. Every stage receives its part of the plan; none changes it.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.plan import identity as run_identity
from flows.plan.approval import with_operator_caps
from flows.plan.boundary import Boundary, check_prefix, check_source, refused
from flows.plan.evaluation import check_evaluation
from flows.plan.layout import Layout
from flows.plan.outlook import Outlook, cannot_load, outlook
from flows.plan.params import (
    BudgetParams,
    ClusterParams,
    DataParams,
    EvaluationParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
)
from flows.plan.sizes import device_memory, disk_problem, existing_parent, memory_problem
from gpt.checkpoint import MARKER, Checkpointer, damage, newest_intact
from gpt.config import GPU_LAYOUTS, PRESETS, Config, ConfigError, shape_differences
from gpt.tokenizer import tokenizer_json_files
from tasks.cluster.config import FLOAT8_GPUS, ClusterConfig, load_cluster
from tasks.common.uri import is_s3
from tasks.index import parse_split
from tasks.precompile import cache_key
from tasks.sync import local_path
from tasks.tokenize.hf_encoder import tokenizer_file

# Config fields the flow decides itself: paths on shared storage, how the job is run, and the
# vocabulary's size (the tokenizer's, known once the data stages ran); the model is a parameter.
FLOW_DECIDED = frozenset({"model", "run_dir", "data_index", "compile_cache_dir", "precompile", "mock_data",
                          "vocab_size", "init_from"})
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")    # the whole name: fullmatch
RESERVED_NAMES = frozenset({"data"})       # the root's own folder for what runs share (flows.plan.layout)


@dataclass(frozen=True)
class Plan:
    """What a run does: the training job's configuration, the cluster, the folders, what defines
    the run (flows.plan.identity) and the budget it may spend without approval."""
    config: Config
    cluster: ClusterConfig
    layout: Layout
    run_dir: Path
    identity: dict[str, Any]
    budget: BudgetParams = dataclasses.field(default_factory=BudgetParams)   # each limit at most the operator's cap

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def precompiles(self) -> bool:
        """A precompile stage fills a graph cache first: torch.compile's, or on Trainium
        neuron_parallel_compile's (torch.compile stays off there)."""
        return self.config.compile or self.config.device == "neuron"

    def outlook(self) -> Outlook:
        """What training will do in the run folder, as it stands now."""
        return outlook(self.run_dir, self.config, self.cluster)

    @property
    def device_memory(self) -> str:
        """What one rank's memory check went by, or why there was none."""
        return device_memory(self.cluster)[1]

    def with_data(self, vocab_size: int, data_index: str) -> Plan:
        """The plan with the job's configuration completed by what the data stages made."""
        config = dataclasses.replace(self.config, vocab_size=vocab_size, data_index=data_index)
        cache = str(self.layout.compile_cache(cache_key(config, self.cluster))) if self.precompiles else None
        return dataclasses.replace(self, config=dataclasses.replace(config, compile_cache_dir=cache))


def make_plan(model: str, data: DataParams, tokenizer: TokenizerParams, training: TrainingParams,
              cluster: ClusterParams, output: OutputParams, budget: BudgetParams = BudgetParams(),
              evaluation: EvaluationParams = EvaluationParams(), boundary: Boundary | None = None) -> Plan:
    """Check every parameter (values, paths, endpoints, tokenizer, gpt Config, cluster, what the run
    costs, the run folder's own run, the operator's caps on the budget, the evaluation's sets and
    tasks) and decide the plan. ``boundary``: what the operator allows (default: from the
    environment, flows.plan.boundary).

    Raises ParameterError with one message per problem (the budget's caps and the evaluation are
    checked once the rest passes); nothing is submitted before this passes.
    """
    boundary = boundary or Boundary.from_env()
    errors: list[str] = []
    if model not in PRESETS:
        errors.append(f"model: {model!r} is not a preset; choose one of {', '.join(PRESETS)}")
    for name in sorted(FLOW_DECIDED & set(training.overrides)):
        errors.append(f"training.overrides.{name}: decided by the flow (the model is the model parameter; where runs, "
                      "data and caches live follows output.root and output.run_name; the vocabulary is the "
                      "tokenizer's; a run to start from is training.init_from); remove it")
    if training.train_iters is not None and training.train_samples is not None:
        errors.append("training: set train_iters or train_samples, not both (clear train_iters to train by samples)")
    root = _output_root(output, boundary, errors)
    _check_inputs(data, tokenizer, root, boundary, errors)
    _check_output(output, boundary, errors)

    where = None
    try:
        where = load_cluster(cluster.preset, **cluster.overrides)
    except (ValueError, OSError) as e:
        errors.append(f"cluster: {e}")
    layout = Layout(root)
    config = _job_config(model, training, where, errors) if model in PRESETS else None
    if config is None or where is None:
        raise ParameterError(errors)
    identity = run_identity.run_identity(data, tokenizer, config, config_fields(training))
    run_dir = layout.run(_run_name(output, identity["model"], identity, errors))
    config = dataclasses.replace(config, run_dir=str(run_dir),
                                 init_from=_start_from(training, layout, boundary, config, errors))
    _check_start(config, boundary, root, errors)
    if where.container is not None:
        errors += where.container.problems(_container_reads(data, tokenizer, config), {"output.root": root})
    problem = memory_problem(config, where)
    if problem:
        errors.append(f"training: {problem}")
    resuming = Checkpointer(run_dir / "checkpoints", 1, 0).latest() is not None
    problem = None if any(e.startswith("output.root:") for e in errors) else disk_problem(config, root, resuming)
    if problem:
        errors.append(f"output.root: {problem}")
    if not errors:
        errors += run_folder_problems(run_dir, identity, config)
    if errors:
        raise ParameterError(errors)
    capped = with_operator_caps(budget)         # an operator's cap that does not parse: refused now
    check_evaluation(evaluation, root, config.keep_last, boundary, container=where.container)
    return Plan(config=config, cluster=where, layout=layout, run_dir=run_dir, identity=identity, budget=capped)


def _output_root(output: OutputParams, boundary: Boundary, errors: list[str]) -> Path:
    """The output root, resolved, inside what the operator allows and writable."""
    root = Path(output.root).expanduser().resolve()
    problem = boundary.output_root(root)
    if problem:
        errors.append(f"output.root: {problem}")
        return root
    existing = existing_parent(root)
    try:
        with tempfile.TemporaryFile(dir=existing):    # gone at once: the plan writes nothing
            pass
    except OSError as e:
        errors.append(f"output.root: cannot write in {existing} ({e.strerror or e}); choose a folder this user can "
                      "write, on storage every node sees")
    return root


def _run_name(output: OutputParams, model: str, identity: dict[str, Any], errors: list[str]) -> str:
    """The run folder's name: the one given, or the model and the digest of the run's identity."""
    name = output.run_name
    if name is None:
        return f"{model}-{run_identity.run_key(identity)}"
    if not RUN_NAME.fullmatch(name) or name in RESERVED_NAMES:
        errors.append(f"output.run_name: {name!r} is not a name: use letters, digits and . _ - (up to 128, not "
                      f"starting with . _ -, not {', '.join(sorted(RESERVED_NAMES))}); runs live in output.root")
    return name


def run_folder_problems(run_dir: Path, identity: dict[str, Any], config: Config) -> list[str]:
    """Why the run folder's own run cannot go on under this plan: it was started with other
    defining fields, or its newest intact checkpoint is in a layout this one cannot load. Checked
    by the plan, and again by the flow once it owns the folder (another run may have started it)."""
    newest, _ = newest_intact(run_dir / "checkpoints")
    before = run_identity.recorded(run_dir)
    if before is not None and before != identity and (newest is not None or (run_dir / "metrics.jsonl").exists()):
        changed = run_identity.differences(before, identity)
        return [f"output.run_name: run {run_dir.name} was started with other defining fields "
                f"({'; '.join(changed)}): give another output.run_name for a new run, or start a new run "
                f"from this one with training.init_from={run_dir.name} (weights only, or with "
                "training.init_from_optimizer its optimizer state too)"]
    problem = cannot_load(newest, config) if newest is not None else None
    return [f"training.tensor_parallel: {problem}"] if problem else []


def _start_from(training: TrainingParams, layout: Layout, boundary: Boundary, config: Config,
                errors: list[str]) -> str | None:
    """The checkpoint folder a new run starts from: training.init_from names a run (under the
    output root) or a folder of one (its newest intact checkpoint), or a checkpoint folder."""
    given = training.init_from
    if given is None:
        return None
    where = layout.run(given) if RUN_NAME.fullmatch(given) else Path(local_path(given))
    problem = boundary.local_input(str(where), layout.root)
    if problem:
        errors.append(f"training.init_from: {problem}")
        return None
    if (where / "checkpoints").is_dir():
        checkpoint, _ = newest_intact(where / "checkpoints")
        run_dir = where
    elif (where / MARKER).is_file():
        checkpoint, run_dir = where, where.parent.parent
        problem = damage(where)
        if problem:
            errors.append(f"training.init_from: checkpoint {where} is damaged ({problem}); name its run to start "
                          "from the newest intact checkpoint, or an older checkpoint")
            return None
    else:
        checkpoint, run_dir = None, where
    if checkpoint is None:
        errors.append(f"training.init_from: {given!r} ({where}) is neither a run with an intact checkpoint nor a "
                      "checkpoint folder (iter_NNNNNNN with COMPLETE); name a run under output.root or a checkpoint")
        return None
    try:
        theirs = Config.load(run_dir / "config.json")
    except ConfigError as e:
        errors.append(f"training.init_from: {e}")
        return None
    differ = shape_differences(theirs, config)
    if differ:
        errors.append(f"training.init_from: {checkpoint} holds another model ({'; '.join(differ)}); start from a "
                      f"run of {config.model} with these shapes")
    problem = cannot_load(checkpoint, config)
    if problem:
        errors.append(f"training.init_from: {problem}")
    return str(checkpoint)


def _check_start(config: Config, boundary: Boundary, root: Path, errors: list[str]) -> None:
    """A HuggingFace folder to start from is readable and holds a GPT-2 or Llama of this model's shape."""
    if not config.init_from_hf:
        return
    from gpt.export import INDEX, WEIGHTS, ExportError, config_from_hf, weight_files

    field = "training.overrides.init_from_hf"
    folder = Path(local_path(config.init_from_hf))
    problem = boundary.local_input(str(folder), root)
    if problem:
        errors.append(f"{field}: {problem}")
        return
    missing = [n for n in ("config.json",) if not (folder / n).is_file()]
    if not (folder / WEIGHTS).is_file() and not (folder / INDEX).is_file():
        missing.append(WEIGHTS)
    if missing:
        errors.append(f"{field}: {folder} is not a HuggingFace model folder (no {' or '.join(missing)}); give a "
                      "folder written by gpt.export or save_pretrained")
        return
    index = [folder / INDEX] if (folder / INDEX).is_file() else []
    if any([refused(field, boundary.local_input(str(path), root), errors)      # every file it reads
            for path in (folder / "config.json", *index)]):
        return
    try:
        weights = weight_files(folder)
    except (OSError, ValueError, KeyError) as e:
        errors.append(f"{field}: {folder / INDEX} cannot be read ({e}); export the model again")
        return
    if any([refused(field, boundary.local_input(str(path), root), errors) for path in weights]):
        return
    try:
        theirs = config_from_hf(json.loads((folder / "config.json").read_text()))
    except KeyError as e:
        errors.append(f"{field}: {folder}/config.json has no {e} field: it is not a GPT-2 or Llama model's configuration")
        return
    except (ExportError, ValueError, TypeError) as e:
        errors.append(f"{field}: {folder}/config.json: {e}")
        return
    differ = shape_differences(theirs, config)
    if differ:
        errors.append(f"{field}: the model in {folder} has another shape ({'; '.join(differ)})")


def _job_config(model: str, training: TrainingParams, where: ClusterConfig | None,
                errors: list[str]) -> Config | None:
    """The training job's gpt Config from the preset and the parameters, with every problem it
    would have on the cluster's ranks added to ``errors``."""
    fields = config_fields(training)
    world_size = 1
    if where is not None:
        world_size = where.world_size
        fields["device"], fields["precision"] = job_device_and_precision(training, where, errors)
        fields["tensor_parallel"], fields["pipeline_parallel"] = tp, pp = model_parallel(model, fields, where)
        ranks = (training.data_parallel or 1) * tp * pp
        if training.data_parallel is not None and ranks != world_size:
            errors.append(f"training.data_parallel: {training.data_parallel} x tensor_parallel {tp} x "
                          f"pipeline_parallel {pp} = {ranks} processes, but the cluster runs {world_size} "
                          "(nodes x tasks_per_node); change one of them")
        if fields["device"] == "neuron":  # graphs come from neuron_parallel_compile; torch-neuronx has no torch.compile
            fields["compile"] = False
    try:
        config = Config.from_preset(model, **{k: v for k, v in fields.items() if k not in FLOW_DECIDED})
    except ConfigError as e:
        errors.append(f"{_config_field(e.field, training)}: {e}")
        return None
    except TypeError as e:
        errors.append(f"training.overrides: {e}; see gpt/config.py for the field names")
        return None
    # The data index is built later; stand mock data in for it while checking the rest.
    problems = dataclasses.replace(config, mock_data=True).problems(world_size=world_size)
    for field, problem in problems:
        errors.append(f"{_config_field(field, training)}: {problem}")
    return None if problems else config


def model_parallel(model: str, fields: dict[str, Any], cluster: ClusterConfig) -> tuple[int, int]:
    """(tensor_parallel, pipeline_parallel): the run's (its parameters or overrides, ``fields``), or
    with neither set the preset's published layout on a GPU cluster whose ranks it divides
    (gpt.config.GPU_LAYOUTS), else no model parallel."""
    tp, pp = fields.get("tensor_parallel"), fields.get("pipeline_parallel")
    if tp is not None or pp is not None:
        return 1 if tp is None else tp, 1 if pp is None else pp
    tp, pp = GPU_LAYOUTS.get(model, (1, 1))
    if cluster.job_device == "cuda" and cluster.world_size % (tp * pp) == 0:
        return tp, pp
    return 1, 1


def config_fields(training: TrainingParams) -> dict[str, Any]:
    """The gpt Config fields these parameters set; the preset fills the rest (device and precision
    come from the cluster: see `job_device_and_precision`)."""
    t = training
    fields: dict[str, Any] = {
        "data_parallel_mode": t.data_parallel_mode,
        "compile": t.compile, "activation_checkpointing": t.activation_checkpointing,
        "benchmark": t.benchmark, "seed": t.seed,
    }
    for name in ("train_iters", "train_samples", "micro_batch_size", "global_batch_size", "seq_length",
                 "tensor_parallel", "pipeline_parallel",
                 "lr", "min_lr", "log_interval", "eval_interval", "eval_iters", "save_interval", "init_from"):
        if getattr(t, name) is not None:
            fields[name] = getattr(t, name)
    if t.init_from_optimizer:
        fields["init_from_optimizer"] = True
    fields.update(t.overrides)
    return fields


def job_device_and_precision(training: TrainingParams, cluster: ClusterConfig, errors: list[str]) -> tuple[str, str]:
    """What the training job runs on, decided from the cluster it is submitted to (never from the
    machine that runs the flow), and its precision: the parameter's, or fp32 on CPU, bf16 on
    accelerators, fp16 on GPUs before Ampere."""
    device = cluster.job_device
    if training.device not in ("auto", device):
        errors.append(f"training.device: {training.device!r}, but cluster preset {cluster.name!r} runs on {device!r}; "
                      f"leave training.device auto, or choose a preset (or cluster.overrides.device) for {training.device}")
    precision = cluster.default_precision() if training.precision == "auto" else training.precision
    if precision == "fp8" and (device != "cuda" or cluster.generation not in FLOAT8_GPUS):
        errors.append(f"training.precision: fp8 needs NVIDIA GPUs of the Hopper generation or later, but cluster "
                      f"preset {cluster.name!r} runs on {cluster.accelerator or device}; use bf16, or a preset whose "
                      f"accelerator is one of {', '.join(sorted(FLOAT8_GPUS))}")
    return device, precision


def _check_inputs(data: DataParams, tokenizer: TokenizerParams, root: Path, boundary: Boundary,
                  errors: list[str]) -> None:
    """Sources, prefixes and tokenizer files exist and lie where the operator allows; local sources
    are not the output root's own files."""
    for i, src in enumerate(data.sources):
        check_source(f"data.sources[{i}]", src, root, boundary, errors)
    for i, p in enumerate(data.prefixes):
        check_prefix(f"data.prefixes[{i}].prefix", p.prefix, root, boundary, errors)
    refused("data.endpoint_url", boundary.endpoint(data.endpoint_url), errors)
    refused("data.profile", boundary.profile(data.profile), errors)
    if (tokenizer.vocab_file is None) != (tokenizer.merge_file is None):
        errors.append("tokenizer: give both vocab_file and merge_file, or neither to train a BPE tokenizer")
    if tokenizer.add_bos_token and not tokenizer.tokenizer_model:
        errors.append("tokenizer.add_bos_token: GPT-2's files add no beginning-of-text token; it needs a "
                      "tokenizer_model (a tokenizer.json whose post-processor adds one, as Llama 3's does)")
    if tokenizer.tokenizer_model and tokenizer.vocab_file:
        errors.append("tokenizer.tokenizer_model: a tokenizer.json replaces vocab_file and merge_file; give one or "
                      "the other")
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(tokenizer, name)
        if not value:
            continue
        if is_s3(value):
            refused(f"tokenizer.{name}", boundary.s3_uri(value), errors)
        elif not os.path.isfile(local_path(value)) and not (
                name == "tokenizer_model" and os.path.isfile(os.path.join(local_path(value), "tokenizer.json"))):
            errors.append(f"tokenizer.{name}: {value} not found" + (
                " (a tokenizer.json, or the folder that holds one)" if name == "tokenizer_model" else ""))
        elif not refused(f"tokenizer.{name}", boundary.local_input(local_path(value), root), errors) \
                and name == "tokenizer_model":      # the files read, links resolved: not only the folder named
            for read in tokenizer_json_files(tokenizer_file(local_path(value))):
                refused(f"tokenizer.{name}", boundary.local_input(read, root), errors)
    if data.prefixes and tokenizer.vocab_file is None and tokenizer.tokenizer_model is None:
        errors.append("tokenizer.vocab_file: data.prefixes were tokenized with some vocabulary; give its "
                      "vocab_file and merge_file, or its tokenizer_model (also used for the sources, so all "
                      "data agree)")
    try:
        parse_split(data.split)
    except ValueError as e:
        errors.append(f"data.split: {e}")


def _container_reads(data: DataParams, tokenizer: TokenizerParams, config: Config) -> dict[str, str]:
    """What the jobs read from the shared file system besides the output root (which they write, and
    which holds the rest: runs, synced data, caches), by the parameter that names it."""
    paths = {f"data.sources[{i}]": _fixed_part(local_path(src)) for i, src in enumerate(data.sources) if not is_s3(src)}
    paths.update({f"data.prefixes[{i}].prefix": local_path(p.prefix) for i, p in enumerate(data.prefixes)
                  if not is_s3(p.prefix)})
    paths.update({f"tokenizer.{name}": local_path(value) for name in ("vocab_file", "merge_file", "tokenizer_model")
                  if (value := getattr(tokenizer, name)) and not is_s3(value)})
    paths.update({field: value for field, value in (("training.init_from", config.init_from),
                                                     ("training.overrides.init_from_hf", config.init_from_hf))
                  if value and not is_s3(value)})
    return paths


def _fixed_part(path: str) -> str:
    """A glob's folder without wildcards (the path itself when it has none)."""
    while glob.has_magic(path):
        path = os.path.dirname(path)
    return path


def _check_output(output: OutputParams, boundary: Boundary, errors: list[str]) -> None:
    if output.uri is not None and not is_s3(output.uri):
        errors.append(f"output.uri: {output.uri!r} is not an s3:// URI; write s3://BUCKET/PREFIX or leave it empty")
    elif output.uri is not None:
        refused("output.uri", boundary.s3_uri(output.uri), errors)
    refused("output.endpoint_url", boundary.endpoint(output.endpoint_url), errors)
    refused("output.profile", boundary.profile(output.profile), errors)


def _config_field(name: str, training: TrainingParams) -> str:
    """The parameter that sets the Config field ``name`` ("" for the configuration as a whole)."""
    if name in training.overrides:
        return f"training.overrides.{name}"
    if name in TrainingParams.model_fields:
        return f"training.{name}"
    return "training"
