"""`python -m flows.pretrain`: the pretrain flow's parameters from command-line flags, and what
the run produced, printed at the end."""
from __future__ import annotations

import argparse
import inspect
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from prefect.exceptions import CancelledRun
from pydantic import ValidationError

from flows import megatron_flags
from flows.plan.build import Plan
from flows.plan.params import (
    SAMPLE_VOCAB_SIZE,
    BudgetParams,
    ClusterParams,
    DataParams,
    EvaluationParams,
    OutputParams,
    ParameterError,
    TokenizerParams,
    TrainingParams,
    failure_message,
    parameter_errors,
)
from gpt.config import parse_overrides
from gpt.tokenizer import GPT2_VOCAB_SIZE
from tasks import trackers
from tasks.cluster.config import ClusterConfig

# The cluster fields --cluster-set may name, with their types.
CLUSTER_FIELDS = {name: field.annotation for name, field in ClusterConfig.model_fields.items()}


def _key_values(items: list[str], fields: dict[str, Any] | None, flag: str, group: str,
                errors: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` flags typed by their fields (gpt.config.parse_overrides); each problem a line
    naming the flag's group and field."""
    values, problems = parse_overrides(items, fields, flag)
    errors += [f"{group}.{field}: {message}" if field else f"{group}: {message}" for field, message in problems]
    return values


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Flow parameters from command-line flags (unset flags keep the flow's defaults; Megatron-LM's
    flags are taken as flows.megatron_flags translates them). Raises ParameterError naming every bad
    flag value, in the plan's format."""
    argv = sys.argv[1:] if argv is None else argv
    if megatron_flags.is_megatron(argv):
        try:
            argv = megatron_flags.translate(argv)
        except megatron_flags.MegatronFlagError as e:
            raise ParameterError(e.problems) from None
    p = argparse.ArgumentParser(prog="python -m flows.pretrain", description="Pretrain a GPT: the pretrain flow, run here.")
    p.add_argument("--model", help="preset name, e.g. tiny, gpt3-125m, gpt3-1.3b, tiny-llama, llama3-8b "
                                   "(Megatron-LM's pretrain_gpt.py flags work too: README)")
    p.add_argument("--source", action="append", default=[], help="JSONL or Parquet input: s3:// URI, path or glob "
                                                                 "(repeatable)")
    p.add_argument("--prefix", nargs=2, action="append", default=[], metavar=("WEIGHT", "PREFIX"),
                   help="already tokenized .bin/.idx prefix with its blend weight (repeatable)")
    p.add_argument("--json-key", action="append", help="JSON field with the text (repeatable; default text)")
    p.add_argument("--split", help="train,valid,test proportions of documents (default 969,30,1)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for sources and tokenizer files")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--tokenizer-model", help="a HuggingFace tokenizer.json (path or s3:// URI) instead of "
                                             "--vocab-file and --merge-file")
    p.add_argument("--train-vocab-size", type=int, help="entries of the BPE trained when no vocab file or "
                   f"tokenizer.json is given (default {GPT2_VOCAB_SIZE}, or {SAMPLE_VOCAB_SIZE} for the bundled sample corpus)")
    p.add_argument("--add-bos-token", action="store_true", default=None,
                   help="with --tokenizer-model: begin each document with the tokenizer's beginning-of-text token")
    p.add_argument("--train-iters", type=int, help="iterations; more than a run reached extends it")
    p.add_argument("--train-samples", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--tp", type=int, dest="tensor_parallel")
    p.add_argument("--pp", type=int, dest="pipeline_parallel", help="pipeline stages")
    p.add_argument("--dp", type=int, dest="data_parallel")
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "neuron"])
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16", "fp8"])
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile with a precompile stage first (default on)")
    p.add_argument("--benchmark", action="store_true", default=None)
    p.add_argument("--seed", type=int)
    p.add_argument("--init-from", help="start a new run from this run (name or folder) or checkpoint")
    p.add_argument("--init-from-optimizer", action="store_true", default=None,
                   help="with --init-from: its optimizer state too, not only its weights")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="any gpt Config field, e.g. --set lr_warmup_iters=50 (repeatable)")
    p.add_argument("--cluster", help="cluster preset name or YAML path (default local)")
    p.add_argument("--cluster-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="cluster field, e.g. --cluster-set partition=gpu --cluster-set nodes=2")
    p.add_argument("--root", help="folder for data, indices, caches and runs (default ./runs)")
    p.add_argument("--run-name")
    p.add_argument("--output-uri", help="s3://bucket/prefix to upload the run folder to")
    p.add_argument("--output-endpoint-url")
    p.add_argument("--tracker", action="append", default=[], choices=trackers.NAMES,
                   help="log the run to this experiment tracker (repeatable; credentials from the environment)")
    p.add_argument("--budget-node-hours", type=float, help="above this estimate, wait for approval in the Prefect UI")
    p.add_argument("--budget-cost", type=float, help="the same for the estimated cost (the cluster preset's currency)")
    p.add_argument("--eval-set", nargs=2, action="append", default=[], metavar=("NAME", "SOURCE"),
                   help="evaluate every checkpoint's perplexity on this JSONL/Parquet source (repeatable; a NAME "
                        "given twice gathers its sources)")
    p.add_argument("--eval-task", action="append", default=[], help="an lm-evaluation-harness task to run on every "
                                                                     "checkpoint (repeatable)")
    p.add_argument("--eval-task-files", action="append", default=[], help="a folder of lm-eval task YAMLs with local "
                                                                          "data (repeatable)")
    p.add_argument("--eval-every", type=int, help="evaluate every Nth checkpoint saved (default 1); the last always")
    p.add_argument("--eval-limit", type=int, help="lm-eval: at most this many examples per task")
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="print the plan (layout, memory per rank, time and cost) and stop: nothing is synced, "
                        "tokenized or submitted")
    a = p.parse_args(argv)

    def pick(**kw: Any) -> dict:
        return {k: v for k, v in kw.items() if v is not None and v != []}

    errors: list[str] = []

    def group(name: str, model: type, **fields: Any) -> Any:
        try:
            return model(**fields)
        except ValidationError as e:
            errors.extend(parameter_errors(e, name))
            return None

    params: dict[str, Any] = pick(model=a.model, dry_run=a.dry_run)
    params["data"] = group("data", DataParams, **pick(
        sources=a.source, json_keys=a.json_key, endpoint_url=a.endpoint_url, split=a.split,
        prefixes=[{"weight": w, "prefix": pr} for w, pr in a.prefix]))
    params["tokenizer"] = group("tokenizer", TokenizerParams, **pick(vocab_file=a.vocab_file, merge_file=a.merge_file,
                                tokenizer_model=a.tokenizer_model, add_bos_token=a.add_bos_token,
                                train_vocab_size=a.train_vocab_size))
    params["training"] = group("training", TrainingParams, **pick(
        train_iters=a.train_iters, train_samples=a.train_samples, micro_batch_size=a.micro_batch_size,
        global_batch_size=a.global_batch_size, seq_length=a.seq_length, tensor_parallel=a.tensor_parallel,
        pipeline_parallel=a.pipeline_parallel,
        data_parallel=a.data_parallel, device=a.device, precision=a.precision, compile=a.compile,
        benchmark=a.benchmark, seed=a.seed, init_from=a.init_from, init_from_optimizer=a.init_from_optimizer,
        overrides=_key_values(a.set, None, "--set", "training.overrides", errors)))
    params["cluster"] = group("cluster", ClusterParams, **pick(
        preset=a.cluster, overrides=_key_values(a.cluster_set, CLUSTER_FIELDS, "--cluster-set", "cluster.overrides", errors)))
    params["output"] = group("output", OutputParams, **pick(root=a.root, run_name=a.run_name, uri=a.output_uri,
                                                            endpoint_url=a.output_endpoint_url, trackers=a.tracker))
    if a.eval_set or a.eval_task or a.eval_task_files:
        sets: dict[str, list[str]] = {}
        for name, source in a.eval_set:
            sets.setdefault(name, []).append(source)
        params["evaluation"] = group("evaluation", EvaluationParams, **pick(
            sets=[{"name": n, "sources": s} for n, s in sets.items()], tasks=a.eval_task,
            task_files=a.eval_task_files, every=a.eval_every, limit=a.eval_limit))
    if a.budget_node_hours is not None or a.budget_cost is not None:
        params["budget"] = group("budget", BudgetParams, **pick(node_hours=a.budget_node_hours, cost=a.budget_cost))
    if errors:
        raise ParameterError(errors)
    return params


def refuse_before_prefect(pretrain: Callable[..., dict], params: dict[str, Any]) -> Plan:
    """The flow's own plan-time checks, made before a Prefect server starts for the run, so that a
    mistake is answered at once; the flow makes them again (its parameters may come from elsewhere).
    Returns the plan."""
    from flows.plan.build import make_plan

    given = inspect.signature(getattr(pretrain, "fn", pretrain)).bind(**params)
    given.apply_defaults()
    return make_plan(**given.arguments)


class _WithoutTraceback(logging.Formatter):
    """A console formatter's lines without the tracebacks of the records (the run's log keeps them)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        kept = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = kept


def _console_without_tracebacks() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    for logger in (logging.getLogger(), logging.getLogger("prefect")):
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _WithoutTraceback):
                handler.setFormatter(_WithoutTraceback(handler.formatter))


def _failed(error: Exception, run_dir: Path) -> str:
    """The line a failed run answers with; its traceback goes to ``run_dir``/traceback.txt."""
    where = run_dir / "traceback.txt"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(error)))
        kept = f" (traceback in {where})"
    except OSError:
        kept = ""
    return f"error: {failure_message(error)}{kept}"


def main(pretrain: Callable[..., dict], argv: list[str] | None = None) -> int:
    """Run the pretrain flow with the parameters the flags give, and print what it produced."""
    # Without PREFECT_API_URL, Prefect starts a temporary server for this run; keep it quiet.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        params = parse_args(argv)
        plan = refuse_before_prefect(pretrain, params)
    except ParameterError as e:
        print(e, file=sys.stderr)
        return 2
    if params.get("dry_run"):               # the plan is all: no Prefect server, nothing run
        from flows.plan.artifact import dry_run_rows

        for row in dry_run_rows(plan):
            print(f"{row['item']:>16}: {row['value']}")
        return 0
    run_dir = plan.run_dir
    from flows.heartbeats import heartbeats_from_this_process
    from flows.local_server import ensure_api, lasting_api
    ensure_api()        # without PREFECT_API_URL: a temporary server that ends with this process
    heartbeats_from_this_process(server_outlives_it=lasting_api() is not None)
    _console_without_tracebacks()
    started = time.perf_counter()
    try:
        out = pretrain(**params)
    except ParameterError as e:
        print(e, file=sys.stderr)
        return 2
    except CancelledRun as e:
        print(f"pretrain cancelled: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a failed run is one line here, its traceback in the run folder
        print(_failed(e, run_dir), file=sys.stderr)
        return 1
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
