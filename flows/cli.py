"""`python -m flows.pretrain`: the pretrain flow's parameters from command-line flags, and what
the run produced, printed at the end."""
from __future__ import annotations

import inspect
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from prefect.exceptions import CancelledRun

from flows import flags, megatron_flags
from flows.plan.build import Plan
from flows.plan.params import FORM, ParameterError, failure_message


def parse_args(argv: list[str] | None = None, form: Mapping[str, Any] = FORM) -> dict[str, Any]:
    """Flow parameters from command-line flags (unset flags keep the flow's defaults; Megatron-LM's
    flags are taken as flows.megatron_flags translates them). Raises ParameterError naming every bad
    flag value, in the plan's format."""
    argv = sys.argv[1:] if argv is None else argv
    problems: list[str] = []
    if megatron_flags.is_megatron(argv):
        argv, problems, notes = megatron_flags.translate(argv)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    try:        # every problem at once: the Megatron flags', then those of the rest of the line
        params = flags.parameters(flags.parser(form).parse_args(argv), form)
    except ParameterError as e:
        raise ParameterError(problems + e.errors) from None
    if problems:
        raise ParameterError(problems)
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


def exit_status(what: str, run: Callable[[], int], failure: Callable[[Exception], str] | None = None) -> int:
    """How a command line of the flows (``what`` it runs) ends: ``run``'s own status; input refused
    (ParameterError) as its block of lines and 2; a cancelled run, or any other failure, as one line
    and 1 (``failure`` says it; the traceback stays in the run's log, or where ``failure`` keeps it)."""
    try:
        return run()
    except ParameterError as e:
        print(e, file=sys.stderr)
        return 2
    except CancelledRun as e:
        print(f"{what} cancelled: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{what} interrupted (Ctrl-C): its jobs were cancelled; the same command resumes it from its last "
              "checkpoint", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a failed run is one line here, its traceback where the run keeps it
        print(failure(e) if failure else f"error: {failure_message(e)}", file=sys.stderr)
        return 1


def main(pretrain: Callable[..., dict], argv: list[str] | None = None) -> int:
    """Run the pretrain flow with the parameters the flags give, and print what it produced."""
    # Without PREFECT_API_URL, Prefect starts a temporary server for this run; keep it quiet.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    where: list[Path] = []       # the run folder, once the plan names it: a failure's traceback goes there
    return exit_status("pretrain", lambda: _run(pretrain, argv, where),
                       lambda e: _failed(e, where[0]) if where else f"error: {failure_message(e)}")


def _run(pretrain: Callable[..., dict], argv: list[str] | None, where: list[Path]) -> int:
    params = parse_args(argv)
    plan = refuse_before_prefect(pretrain, params)
    if params.get("dry_run"):               # the plan is all: no Prefect server, nothing run
        from flows.plan.artifact import dry_run_rows

        for row in dry_run_rows(plan):
            print(f"{row['item']:>16}: {row['value']}")
        return 0
    where.append(plan.run_dir)
    from flows.heartbeats import heartbeats_from_this_process
    from flows.local_server import ensure_api, lasting_api
    ensure_api()        # without PREFECT_API_URL: a temporary server that ends with this process
    heartbeats_from_this_process(server_outlives_it=lasting_api() is not None)
    _console_without_tracebacks()
    started = time.perf_counter()
    out = pretrain(**params)
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
