"""The plan of one run, decided once: the flow's parameters checked and turned into frozen, typed
parts (what the run reads, where it writes, how it is evaluated, the training job's configuration,
the cluster it runs on, the budget it may spend), before any stage runs.

`make_plan(...)` is the one place the parameters are validated: it raises `ParameterError`
listing every problem, one line per field (`training.micro_batch_size: ...`): values and their
cost (memory, disk), what the operator allows the form to reach (flows.plan.boundary), and whether the
run folder's own run can go on under these parameters (flows.plan.identity, flows.plan.outlook). In a
dry run, what only the cluster can answer (files that are not on this machine, its free space) is a
warning of the plan instead. What only the data stages can know (the tokenizer's vocabulary, the
index) completes the plan once, into the training job (`Plan.training_job`). Every stage receives
its part of the plan; none changes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.plan import identity as run_identity
from flows.plan.approval import with_operator_caps
from flows.plan.boundary import Boundary
from flows.plan.estimate import Estimate, estimate, read_history
from flows.plan.evaluation import EvaluationPlan, check_evaluation
from flows.plan.inputs import DataPlan, check_inputs, container_reads
from flows.plan.job import FLOW_DECIDED, config_fields, job_config
from flows.plan.layout import Layout
from flows.plan.outlook import Outlook, cannot_load, check_phases, outlook
from flows.plan.output import (
    OutputPlan,
    check_upload,
    copy_to_resume,
    output_plan,
    output_root,
    run_name,
    tensorboard_copy,
)
from flows.plan.params import (
    BudgetParams,
    ClusterParams,
    DataParams,
    EvaluationParams,
    OutputParams,
    ParameterError,
    PhaseParams,
    Problems,
    TokenizerParams,
    TrainingParams,
)
from flows.plan.sizes import device_memory, disk_problem, memory_problem
from flows.plan.start import branch_point, check_start, start_from
from gpt.checkpoint import Checkpointer, newest_intact
from gpt.config import Config
from gpt.config.presets import PRESETS
from gpt.tokenizer import Tokenizer
from tasks.cluster.config import ClusterConfig, load_cluster
from tasks.cluster.quarantine import Quarantine
from tasks.cluster.record import JobRecord
from tasks.common.records import DamagedRecord
from tasks.index import IndexManifest
from tasks.precompile import cache_key
from tasks.trackers import tracker_runs
from tasks.train import phases as run_phases
from tasks.train.remote_checkpoints import RemoteTier
from tasks.train.spikes import rollbacks


def precompiles(config: Config) -> bool:
    """A precompile stage fills a graph cache first: torch.compile's, or on Trainium
    neuron_parallel_compile's (torch.compile stays off there)."""
    return config.compile or config.device == "neuron"


@dataclass(frozen=True)
class TrainJob:
    """The training job, complete: the plan's configuration with what only the data stages could
    tell (the tokenizer's vocabulary, the index) and the compile cache they decide; what
    precompile, training and the trackers take."""
    config: Config
    cluster: ClusterConfig
    trackers: tuple[str, ...] = ()
    tracker_project: str = "gpt-pretrain"
    tier: RemoteTier | None = None          # where each checkpoint is copied to, and resumed from

    @property
    def precompiles(self) -> bool:
        return precompiles(self.config)


@dataclass(frozen=True)
class Plan:
    """What a run does, checked: what it reads (``data``), where it writes (``output``), what its
    checkpoints are evaluated on, the training job's configuration (its vocabulary as far as the
    plan can tell, ``vocabulary`` says how), the cluster, what defines the run
    (flows.plan.identity) and the budget it may spend without approval."""
    config: Config
    cluster: ClusterConfig
    layout: Layout
    identity: dict[str, Any]
    data: DataPlan
    output: OutputPlan
    evaluation: EvaluationPlan | None = None
    budget: BudgetParams = dataclasses.field(default_factory=BudgetParams)   # each limit at most the operator's cap
    vocabulary: str = ""
    warnings: tuple[str, ...] = ()      # what a dry run could not check on this machine
    cluster_preset: str = "local"       # the operator's preset the run named
    cluster_set: dict[str, Any] = dataclasses.field(default_factory=dict)    # the cluster fields the run set
    phases: tuple[PhaseParams, ...] = ()    # after the first, each start an iteration (flows.plan.outlook)
    branch_from: Path | None = None         # the checkpoint of another run this new run goes on from
    resume_copy: int | None = None          # the iteration of the copy in S3 the run resumes from

    @property
    def run_dir(self) -> Path:
        return self.output.run_dir

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def precompiles(self) -> bool:
        return precompiles(self.config)

    def outlook(self) -> Outlook:
        """What training will do in the run folder, as it stands now."""
        copy = (self.resume_copy, self.output.tier.at(self.resume_copy)) if self.output.tier and self.resume_copy else None
        return outlook(self.run_dir, self.config, self.cluster, copy)

    def estimate(self, outlook: Outlook) -> Estimate:
        """Time, node-hours and cost of training from where ``outlook`` starts to the run's end."""
        return estimate(self.config, self.cluster, outlook.done, read_history(self.layout.root))

    @property
    def device_memory(self) -> str:
        """What one rank's memory check went by, or why there was none."""
        return device_memory(self.cluster)[1]

    def training_job(self, tokenizer: Tokenizer, index: IndexManifest) -> TrainJob:
        """The job's configuration completed, once, by what the data stages made. Token ids beyond
        the vocabulary would crash the embedding mid-training, and a vocabulary larger than the plan
        could tell may not fit the devices: either is refused here."""
        size = tokenizer.vocab_size
        problems = [f"data: {p}.bin holds token id {m}, but the vocabulary {tokenizer.files[0]} has only {size} "
                    "entries: the data was tokenized with another vocabulary; give that vocabulary or tokenize again"
                    for p, m in sorted(index.max_token_ids.items()) if m >= size]
        config = dataclasses.replace(self.config, vocab_size=size, data_index=index.path)
        problem = memory_problem(config, self.cluster) if size > self.config.vocab_size else None
        if problem:
            problems.append(f"training: with the tokenizer's {size:,} entries (the plan assumed "
                            f"{self.config.vocab_size:,}), {problem}")
        if problems:
            raise ParameterError(problems)
        cache = str(self.layout.compile_cache(cache_key(config, self.cluster))) if precompiles(config) else None
        return TrainJob(dataclasses.replace(config, compile_cache_dir=cache), self.cluster, self.output.trackers,
                        self.output.tracker_project, self.output.tier)


def make_plan(model: str, data: DataParams, tokenizer: TokenizerParams, training: TrainingParams,
              cluster: ClusterParams, output: OutputParams, budget: BudgetParams = BudgetParams(),
              evaluation: EvaluationParams = EvaluationParams(), phases: list[PhaseParams] | None = None,
              boundary: Boundary | None = None, dry_run: bool = False) -> Plan:
    """Check every parameter (values, paths, endpoints, tokenizer, gpt Config, cluster, what the run
    costs, the run folder's own run, the operator's caps on the budget, the evaluation's sets and
    tasks) and decide the plan. ``boundary``: what the operator allows (default: from the
    environment, flows.plan.boundary). ``dry_run``: what only the cluster can answer is a warning.

    Raises ParameterError with one message per problem (the budget's caps and the evaluation are
    checked once the rest passes); nothing is submitted before this passes.
    """
    boundary = boundary or Boundary.from_env()
    problems = Problems(dry_run)
    _check_choices(model, training, problems)
    root = output_root(output, boundary, problems)
    reads = check_inputs(data, tokenizer, root, boundary, problems)
    check_upload(output, boundary, problems)

    where = cluster_of(cluster, boundary, problems)
    layout = Layout(root)
    config = job_config(model, training, where, problems) if model in PRESETS else None
    if config is None or where is None:
        raise ParameterError(problems)
    vocab_size, vocabulary = reads.vocabulary()
    if vocab_size is None:
        vocabulary = f"{config.vocab_size:,} assumed (GPT-2's): {vocabulary}"     # the preset's
    config = dataclasses.replace(config, vocab_size=vocab_size or config.vocab_size)      # the memory check's
    identity = run_identity.run_identity(data, tokenizer, config, config_fields(training), training.branch_from)
    run_dir = layout.run(run_name(output, f"{identity['model']}-{run_identity.run_key(identity)}", problems))
    config = dataclasses.replace(config, run_dir=str(run_dir), tensorboard_dir=tensorboard_copy(output, boundary, problems),
                                 init_from=start_from(training, layout, boundary, config, problems))
    check_start(config, boundary, root, problems)
    branch = branch_point(training, layout, boundary, identity, config, problems)
    planned = check_phases(list(phases or ()), data, training, config, run_dir, root, boundary, problems, branch)
    if where.container is not None:
        problems += where.container.problems(container_reads(reads, config.init_from, config.init_from_hf),
                                             {"output.root": root, **({"output.tensorboard_dir": config.tensorboard_dir}
                                                                      if config.tensorboard_dir else {})})
    check_memory(config, planned, where, problems)
    resuming = Checkpointer(run_dir / "checkpoints", 1, 0).latest() is not None
    problem = None if any(e.startswith("output.root:") for e in problems) else disk_problem(config, root, resuming)
    if problem:
        problems.not_here(f"output.root: {problem}")
    if not problems:
        problems += run_folder_problems(run_dir, identity, config)
    output_planned = output_plan(output, root, run_dir, data.profile, config.keep_last)
    resume_copy = None if problems else copy_to_resume(output_planned.tier, run_dir, identity, problems)
    if problems:
        raise ParameterError(problems)
    capped = with_operator_caps(budget)         # an operator's cap that does not parse: refused now
    evaluated, not_here = check_evaluation(evaluation, root, config.keep_last, boundary, container=where.container,
                                           dry_run=dry_run)
    return Plan(config=config, cluster=where, layout=layout, identity=identity, data=reads,
                output=output_planned, evaluation=evaluated, budget=capped, resume_copy=resume_copy,
                vocabulary=vocabulary, warnings=tuple(problems.warnings + not_here), cluster_preset=cluster.preset, cluster_set=dict(cluster.overrides),
                phases=planned, branch_from=branch)


def cluster_of(cluster: ClusterParams, boundary: Boundary, problems: Problems) -> ClusterConfig | None:
    """The operator's preset with the run's fields set, and the nodes the operator's quarantine keeps
    out excluded (each said, with why, as a warning of the plan)."""
    try:
        where = load_cluster(cluster.preset, dirs=boundary.presets, **cluster.overrides)
        where, kept_out = quarantine.kept_out(where) if (quarantine := Quarantine.of(where)) else (where, [])
    except (ValueError, OSError) as e:
        problems.append(f"cluster: {e}")
        return None
    problems.warnings += [f"cluster: {line}" for line in kept_out]
    return where


def check_memory(config: Config, phases: tuple[PhaseParams, ...], cluster: ClusterConfig, problems: Problems) -> None:
    """A rank's memory fits its device, at the run's sequence length and at each phase's longer one."""
    problem = memory_problem(config, cluster)
    if problem:
        problems.append(f"training: {problem}")
    for i, phase in enumerate(phases):
        longer = run_phases.phase_config(config, run_phases.Phase(phase.start, seq_length=phase.seq_length),
                                         config.total_iters)
        if not phase.seq_length or problems:
            continue
        found = [message for _, message in dataclasses.replace(longer, mock_data=True).problems(cluster.world_size)]
        problem = found[0] if found else memory_problem(longer, cluster)
        if problem:
            problems.append(f"phases[{i}].seq_length: {problem}")


def _check_choices(model: str, training: TrainingParams, problems: Problems) -> None:
    """The model is a preset, the training fields are the form's to set, and the run's length is given once."""
    if model not in PRESETS:
        problems.append(f"model: {model!r} is not a preset; choose one of {', '.join(PRESETS)}")
    for name in sorted(FLOW_DECIDED & set(training.overrides)):
        problems.append(f"training.overrides.{name}: decided by the flow (the model is the model parameter; where "
                        "runs, data and caches live follows output.root and output.run_name; the vocabulary is the "
                        "tokenizer's; a run to start from is training.init_from); remove it")
    if training.branch_from is not None and training.init_from is not None:
        problems.append("training.branch_from: a branch goes on from a checkpoint with its iterations; init_from "
                        "starts a new run from weights: give one of them")
    if training.train_iters is not None and training.train_samples is not None:
        problems.append("training: set train_iters or train_samples, not both (clear train_iters to train by samples)")


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
    damaged = []
    for read in (rollbacks, JobRecord, tracker_runs, run_phases.ledger):       # what the run reads back of itself
        try:
            read(run_dir)
        except DamagedRecord as e:
            damaged.append(f"output.run_name: {e}")
    problem = cannot_load(newest, config) if newest is not None else None
    return damaged + ([f"training.tensor_parallel: {problem}"] if problem else [])

