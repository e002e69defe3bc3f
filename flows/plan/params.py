"""Parameters of the pretrain flow: typed models the Prefect UI renders as a form. What they mean
for the run is decided once, by `flows.plan.build.make_plan`."""
from __future__ import annotations

import functools
from typing import Any, Callable, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpt.config.checks import CHOICES
from gpt.config.presets import PRESETS
from gpt.tokenizer import GPT2_VOCAB_SIZE
from tasks.common.errors import ParameterError
from tasks.common.secrets import hide_in_logs
from tasks.trackers import Tracker

ModelName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]  # the UI shows a choice list


SAMPLE_VOCAB_SIZE = 4096  # keeps the tiny model's output layer cheap on a CPU


class Problems(list):
    """What a plan refuses, one line per field. In a dry run, what only the cluster can answer (a
    file that is not on this machine, the output root's free space) is a warning instead
    (``not_here``): a dry run sizes a job before anyone has the cluster's files."""

    def __init__(self, dry_run: bool = False) -> None:
        super().__init__()
        self.dry_run = dry_run
        self.warnings: list[str] = []

    def not_here(self, problem: str) -> None:
        (self.warnings if self.dry_run else self).append(problem)


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: Any) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and annotation is not bool and bool not in get_args(annotation):
            raise ValueError("expected a number, not true/false")
        return value


def refused_as_failed_run(flow_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A flow whose ParameterError, or the error of a failed stage (flows.stages), ends the run Failed
    with a message that says it (what the UI and alerts show): the error's lines, or the stage and
    its error; a caller of the flow still gets the error."""
    @functools.wraps(flow_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from prefect.states import Failed

        hide_in_logs()          # no log line of the run holds a secret of this process
        try:
            return flow_fn(*args, **kwargs)
        except ParameterError as e:
            return Failed(message=str(e), data=e)
        except Exception as e:
            if getattr(e, "failed_stage", None) is None:
                raise
            return Failed(message=failure_message(e), data=e)

    return run


def failure_message(error: Exception) -> str:
    """What a run that ``error`` ended says of it: the failed stage (flows.stages), if one, and the error."""
    stage = getattr(error, "failed_stage", None)
    return f"{f'stage {stage} failed: ' if stage else ''}{type(error).__name__}: {error}"


def parameter_errors(error: ValidationError, group: str) -> list[str]:
    """One line per field of a parameter group that pydantic refused, in ParameterError's format."""
    def where(loc: tuple) -> str:
        return group + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)

    return [f"{where(e['loc'])}: {e['msg']} (got {e['input']!r})" for e in error.errors()]


class WeightedPrefix(_Params):
    prefix: str = Field(description="Tokenized dataset (.bin/.idx pair) without the extension: a path "
                                    "or s3://bucket/key prefix, e.g. s3://corpora/pile/pile_text_document")
    weight: float = Field(1.0, gt=0, description="Relative blend weight")


class DataParams(_Params):
    sources: list[str] = Field(
        default_factory=list,
        description="JSONL (.jsonl, .json, .gz, .xz, .zst) or Parquet inputs: s3:// URIs or prefixes, local files, "
                    "folders or globs. Empty, with no prefixes: the bundled Shakespeare sample corpus.")
    prefixes: list[WeightedPrefix] = Field(
        default_factory=list, description="Already tokenized datasets to train on, with blend weights")
    weight: float = Field(1.0, gt=0, description="Blend weight of the data tokenized from `sources` "
                                                  "when `prefixes` are given too")
    json_keys: list[str] = Field(default_factory=lambda: ["text"], min_length=1,
                                 description="JSON fields, or Parquet columns, holding the text")
    split: str = Field("969,30,1", description="train,valid,test proportions of documents")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint, e.g. http://127.0.0.1:9000 "
                                                       "(credentials come from the environment, never here)")
    profile: str | None = Field(None, description="AWS profile name for the S3 sources")
    no_sign_request: bool = Field(False, description="Read public buckets anonymously")
    verify_content: bool = Field(False, description="Hash every local source and copy again and verify every "
                                                    "S3 copy, instead of trusting unchanged size, times and "
                                                    "ETags (slow: for a rerun after doubts about the storage)")


class TokenizerParams(_Params):
    vocab_file: str | None = Field(None, description="GPT-2 style vocab.json (path or s3:// URI). "
                                                     "Empty: a byte-level BPE is trained on the sources")
    merge_file: str | None = Field(None, description="GPT-2 style merges.txt (path or s3:// URI)")
    tokenizer_model: str | None = Field(
        None, description="A HuggingFace tokenizer.json (path or s3:// URI; a tokenizer_config.json beside it "
                          "names the end-of-text token), in place of vocab_file and merge_file")
    add_bos_token: bool = Field(
        False, description="Begin each document with the beginning-of-text token the tokenizer.json's "
                           "post-processor adds (Llama 3's <|begin_of_text|>), as the model sees text at inference")
    train_vocab_size: int | None = Field(
        None, ge=257, description=f"Entries of the BPE trained when no vocab_file is given (empty: {GPT2_VOCAB_SIZE}, "
                                  f"or {SAMPLE_VOCAB_SIZE} for the bundled sample corpus)")


class TrainingParams(_Params):
    """Empty fields take the model preset's value (e.g. tiny: 300 iterations, batch 8/16)."""
    train_iters: int | None = Field(None, ge=1, le=10**9, description="Iterations to train; a larger value "
                                    "than the run reached extends it")
    train_samples: int | None = Field(None, ge=1, le=10**13, description="Samples to train, instead of train_iters")
    micro_batch_size: int | None = Field(None, ge=1, le=65536, description="Sequences per device per micro-step")
    global_batch_size: int | None = Field(None, ge=1, le=2**24, description="Sequences per optimizer step, all devices")
    seq_length: int | None = Field(None, ge=8, le=2**20, description="Sequence length")
    tensor_parallel: int | None = Field(None, ge=1, le=1024, description="Tensor-parallel size (tp); empty with "
                                        "pipeline_parallel: the preset's published layout on a GPU cluster, else 1")
    pipeline_parallel: int | None = Field(None, ge=1, le=1024, description="Pipeline stages (pp); empty: 1 (or the "
                                          "preset's published layout); the schedule and virtual stages go in "
                                          "overrides: pipeline_schedule, virtual_pipeline_stages")
    context_parallel: int | None = Field(None, ge=1, le=1024, description="Ranks splitting every sequence (cp), "
                                         "attention around a ring of them; empty: 1")
    data_parallel: int | None = Field(None, ge=1, le=2**20, description="Data-parallel size (dp); empty: the "
                                                                       "cluster's tasks divided by tp x pp x cp. Must match.")
    data_parallel_mode: Literal[tuple(sorted(CHOICES["data_parallel_mode"]))] = "ddp"  # type: ignore[valid-type]
    device: Literal[CHOICES["device"]] = Field(  # type: ignore[valid-type]
        "auto", description="auto: what the cluster preset runs on (its device)")
    precision: Literal[("auto", *CHOICES["precision"])] = Field(  # type: ignore[valid-type]
        "auto", description="auto: fp32 on CPU, bf16 on accelerators (fp16 on GPUs before Ampere), decided "
                            "from the cluster preset, not from the machine that runs the flow; fp8: bf16 with "
                            "float8 linears, on Hopper GPUs or later")
    lr: float | None = Field(None, gt=0, description="Peak learning rate")
    min_lr: float | None = Field(None, ge=0)
    compile: bool = Field(True, description="torch.compile the model; the precompile stage fills its cache first, so training starts without compiling")
    activation_checkpointing: bool = False
    benchmark: bool = Field(False, description="Benchmark mode: train only, no evaluation")
    seed: int = Field(1234, ge=0, lt=2**32)
    log_interval: int | None = Field(None, ge=1, le=10**9)
    eval_interval: int | None = Field(None, ge=1, le=10**9)
    eval_iters: int | None = Field(None, ge=1, le=10**6)
    save_interval: int | None = Field(None, ge=1, le=10**9)
    init_from: str | None = Field(None, description="A new run starts from this run (a name under output.root, or "
                                                    "its folder) or checkpoint folder: its weights")
    init_from_optimizer: bool = Field(False, description="With init_from: its optimizer state too")
    branch_from: str | None = Field(None, description="A checkpoint of a run of this recipe (RUN/iter_NNNNNNN under "
                                    "output.root, or its folder) that this new run goes on from with its "
                                    "iterations, samples, phases and ledger: e.g. a decay phase from a stable "
                                    "checkpoint, on other data")
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description='Any other gpt Config field, e.g. {"lr_warmup_iters": 50}')


class PhaseParams(_Params):
    """A phase of the run after its first: from its start, its own blend, and optionally a longer
    context and a learning-rate segment of its own. A phase that has started cannot change; a later
    leg may add phases after it."""
    start: int | Literal["now"] = Field(description="The iteration it starts after, or now: where the run has "
                                                    "reached (its newest checkpoint)")
    prefixes: list[WeightedPrefix] = Field(default_factory=list, description="Its blend: tokenized datasets "
                                           "with weights (a prefix of an earlier phase goes on with the documents "
                                           "it left). Empty, with no sources: the blend of the phase before")
    sources: list[str] = Field(default_factory=list, description="And JSONL or Parquet inputs, tokenized with the "
                                                                 "run's tokenizer; the run's data.sources, named as there, are its data")
    weight: float = Field(1.0, gt=0, description="Blend weight of the data tokenized from `sources`")
    seq_length: int | None = Field(None, ge=1, le=2**20, description="A new sequence length from this phase "
                                                                    "on (rotary position embeddings)")
    rotary_base: int | None = Field(None, ge=1, description="Rotary base (theta) from this phase on")
    lr: Literal["schedule", "constant", "decay"] = Field(
        "schedule", description="The learning rate: the run's schedule; constant at training's lr (after "
                                "warmup); or decay: the decay of a warmup-stable-decay schedule (Megatron's WSD, "
                                "shaped by lr_wsd_decay_style) from its start to its end")

    @property
    def keeps_blend(self) -> bool:
        """A phase that names no data trains on the blend of the phase before."""
        return not self.prefixes and not self.sources


class EvalSet(_Params):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="The set's name in results, e.g. wikitext")
    sources: list[str] = Field(default_factory=list, description="JSONL or Parquet files, folders, globs or s3:// "
                                                                 "URIs, tokenized with the run's tokenizer")
    prefix: str | None = Field(None, description="Or a set tokenized already with the run's tokenizer (.bin/.idx "
                                                 "prefix)")


class EvaluationParams(_Params):
    """Every checkpoint the run saves (every Nth, and the last) is evaluated by the evaluate flow on a
    job of its own: set perplexities and lm-evaluation-harness tasks. Empty: no evaluation."""
    sets: list[EvalSet] = Field(default_factory=list, description="Named evaluation sets: loss and perplexity")
    tasks: list[str] = Field(default_factory=list, description="lm-evaluation-harness tasks, by name: its "
                                                                "registry's, or those defined in task_files")
    task_files: list[str] = Field(default_factory=list, description="Folders of lm-eval task YAMLs whose data are "
                                                                     "local files (a cluster without internet)")
    every: int = Field(1, ge=1, le=10**6, description="Evaluate every Nth checkpoint saved; the last always")
    limit: int | None = Field(None, ge=1, le=10**9, description="lm-eval: at most this many examples per task")
    set_tokens: int = Field(2**20, ge=1, le=10**12, description="At most this many tokens of each set")

    @property
    def wanted(self) -> bool:
        return bool(self.sets or self.tasks)


class ClusterParams(_Params):
    preset: str = Field("local", description="Cluster preset name: a file of tasks/cluster/presets/ or of the "
                                             "operator's GPT_CLUSTER_PRESET_DIRS")
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description='Fields to change, e.g. {"partition": "gpu", "nodes": 2}')


class BudgetParams(_Params):
    """Above either limit the run waits for approval in the Prefect UI before anything is submitted."""
    node_hours: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False,
                                     description="Node-hours the plan may estimate without asking")
    cost: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False,
                               description="Cost (the cluster preset's currency) the plan may estimate without asking")
    wait_hours: float = Field(24, gt=0, le=24 * 30, allow_inf_nan=False,
                              description="How long a run over budget waits for an answer before it fails")

    @property
    def set(self) -> bool:
        return self.node_hours is not None or self.cost is not None


class OutputParams(_Params):
    root: str = Field("runs", description="Folder on storage every node sees: run folders go here, "
                                          "data, indices and compile caches in its data/ folder")
    run_name: str | None = Field(None, description="Run folder name (empty: model and a hash of the "
                                                    "parameters, so the same parameters resume the same run)")
    uri: str | None = Field(None, description="s3://bucket/prefix of the run: each checkpoint is copied there as it "
                                              "completes (by this process, never by the ranks), the run folder "
                                              "after training; a run folder without its checkpoints resumes "
                                              "from there")
    keep_last_remote: int | None = Field(None, ge=1, description="Checkpoints kept under `uri` (empty: "
                                                                 "training's keep_last); a save pinned for its "
                                                                 "evaluation is kept until it is evaluated")
    tensorboard_dir: str | None = Field(None, description="Folder every node sees where TensorBoard's events are "
                                                          "written too, as they are written (Megatron's "
                                                          "--tensorboard-dir); the run folder keeps its own")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint for `uri`")
    profile: str | None = Field(None, description="AWS profile for `uri` (empty: data.profile, so sync and "
                                                  "upload use the same credentials)")
    trackers: list[Tracker] = Field(default_factory=list, max_length=2, description=
                                                       "Experiment trackers to log the run to (credentials from "
                                                       "the environment where the flow runs)")
    tracker_project: str = Field("gpt-pretrain", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                 description="W&B project or MLflow experiment")


# The pretrain flow's form, in its order: what the flow's signature takes (a test holds them equal),
# what the UI renders, and what the command line's flags are made from (flows.flags).
FORM: dict[str, Any] = {"model": ModelName, "data": DataParams, "tokenizer": TokenizerParams,
                        "training": TrainingParams, "cluster": ClusterParams, "output": OutputParams,
                        "budget": BudgetParams, "evaluation": EvaluationParams, "phases": list[PhaseParams],
                        "dry_run": bool}
