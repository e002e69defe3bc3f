"""The pretrain command line's flags, made from the flow's form (flows.plan.params.FORM): every field
of every group is ``--group.field``, typed, limited to its choices and described as the form is, and
today's short flags (``--tp``, ``--source``, ``--set``; Megatron-LM's own, through
flows.megatron_flags) are aliases of those fields. A field added to the form is a flag at once, and
reaches the training job's Config when it names one of its fields (flows.plan.job.config_fields).

What the flags give is checked as the form checks it (pydantic), and every problem is a line naming
the field, as the plan names it."""
from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError

from flows.plan.params import ParameterError, parameter_errors
from gpt.config.overrides import parse_overrides, split_assignment
from tasks.cluster.config import ClusterConfig

# Today's flags, each an alias of one field of the form (a list field's alias adds one item each time).
ALIASES: dict[str, str] = {
    "--source": "data.sources", "--json-key": "data.json_keys", "--split": "data.split",
    "--endpoint-url": "data.endpoint_url",
    "--vocab-file": "tokenizer.vocab_file", "--merge-file": "tokenizer.merge_file",
    "--tokenizer-model": "tokenizer.tokenizer_model", "--train-vocab-size": "tokenizer.train_vocab_size",
    "--add-bos-token": "tokenizer.add_bos_token",
    "--train-iters": "training.train_iters", "--train-samples": "training.train_samples",
    "--micro-batch-size": "training.micro_batch_size", "--global-batch-size": "training.global_batch_size",
    "--seq-length": "training.seq_length", "--tp": "training.tensor_parallel", "--pp": "training.pipeline_parallel",
    "--cp": "training.context_parallel",
    "--dp": "training.data_parallel", "--device": "training.device", "--precision": "training.precision",
    "--compile": "training.compile", "--benchmark": "training.benchmark", "--seed": "training.seed",
    "--init-from": "training.init_from", "--init-from-optimizer": "training.init_from_optimizer",
    "--set": "training.overrides",
    "--cluster": "cluster.preset", "--cluster-set": "cluster.overrides",
    "--root": "output.root", "--run-name": "output.run_name", "--output-uri": "output.uri",
    "--tensorboard-dir": "output.tensorboard_dir",
    "--output-endpoint-url": "output.endpoint_url", "--tracker": "output.trackers",
    "--budget-node-hours": "budget.node_hours", "--budget-cost": "budget.cost",
    "--eval-task": "evaluation.tasks", "--eval-task-files": "evaluation.task_files",
    "--eval-every": "evaluation.every", "--eval-limit": "evaluation.limit",
    "--model": "model", "--dry-run": "dry_run", "--phase": "phases",
}
# Two values that make one item of a list of records: --prefix WEIGHT PREFIX, --eval-set NAME SOURCE
# (a set of several sources is --evaluation.sets JSON).
PAIRS: dict[str, tuple[str, tuple[str, str]]] = {
    "--prefix": ("data.prefixes", ("WEIGHT", "PREFIX")),
    "--eval-set": ("evaluation.sets", ("NAME", "SOURCE")),
}
# KEY=VALUE fields, and the fields their keys name (None: the training job's Config's).
KEY_VALUES: dict[str, Mapping[str, Any] | None] = {
    "training.overrides": None,
    "cluster.overrides": {name: field.annotation for name, field in ClusterConfig.model_fields.items()},
}


def parser(form: Mapping[str, Any]) -> argparse.ArgumentParser:
    """The flags of ``form`` (parameter name -> a pydantic group, or a plain type)."""
    aliases: dict[str, list[str]] = {}
    for alias, path in ALIASES.items():
        aliases.setdefault(path, []).append(alias)
    p = _Parser(prog="python -m flows.pretrain", argument_default=argparse.SUPPRESS,
                                description="Pretrain a GPT: the pretrain flow, run here. Every field of the form "
                                            "is a flag --GROUP.FIELD; the short flags are aliases of them.")
    for path, annotation, description in _fields(form):
        _add(p, [*aliases.get(path, []), *([f"--{path}"] if "." in path else [])], path, annotation, description)
    for flag, (path, names) in PAIRS.items():
        p.add_argument(flag, nargs=2, action="append", metavar=names, dest=f"pair:{path}",
                       help=f"one item of --{path}: {' '.join(names)} (repeatable)")
    return p


def parameters(given: argparse.Namespace, form: Mapping[str, Any]) -> dict[str, Any]:
    """The flow's parameters from parsed flags: each group built and checked by its model, the fields
    not given left to its defaults. Raises ParameterError naming every bad field at once, and every
    field two flags give two values (no flag silently wins over another)."""
    values = {k: v for k, v in vars(given).items() if not k.startswith(_FLAG)}
    errors: list[str] = values.pop(_TWICE, [])
    for path, fields in KEY_VALUES.items():
        if path in values:
            typed, problems = parse_overrides(values[path], fields, "--" + path)
            errors += [f"{path}.{field}: {message}" if field else f"{path}: {message}" for field, message in problems]
            errors += _set_twice(path, values[path])
            values[path] = typed
    for key in [k for k in values if k.startswith("pair:")]:
        path = key.removeprefix("pair:")
        values[path] = [*values.get(path, []), *_items(path, values.pop(key))]
    params: dict[str, Any] = {}
    for name, annotation in form.items():
        if not _is_group(annotation):
            if name in values and typing.get_origin(annotation) is list:    # records: each checked by its model
                try:
                    params[name] = TypeAdapter(annotation).validate_python(values[name])
                except ValidationError as e:
                    errors += parameter_errors(e, name)
            elif name in values:
                params[name] = values[name]
            continue
        fields = {path.split(".", 1)[1]: value for path, value in values.items() if path.split(".", 1)[0] == name}
        try:
            params[name] = annotation(**fields)
        except ValidationError as e:
            errors += parameter_errors(e, name)
    if errors:
        raise ParameterError(errors)
    return params


class _Parser(argparse.ArgumentParser):
    """Flags argparse cannot read (an unknown one, a number that is none) answer as every other bad
    input does: one line in the ``invalid parameters`` block, exit status 2, no usage screen."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ParameterError([f"{message} (python -m flows.pretrain --help lists the flags)"])


_TWICE = "flags given twice"
_FLAG = "flag of "          # the flag that gave a field its value, by the field


class _Once(argparse.Action):
    """A field's one value: a second flag that gives it another is a problem naming both."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if not hasattr(namespace, _TWICE):
            setattr(namespace, _TWICE, [])
        first = getattr(namespace, f"{_FLAG}{self.dest}", None)
        if first is not None and first[1] != values:
            getattr(namespace, _TWICE).append(
                f"{self.dest}: {first[0]} {first[1]} and {option_string} {values} give two values; keep one")
        setattr(namespace, f"{_FLAG}{self.dest}", (option_string, values))
        setattr(namespace, self.dest, values)


def _set_twice(path: str, items: list[str]) -> list[str]:
    """KEY=VALUE items that give one key two values."""
    seen: dict[str, str | None] = {}
    problems = []
    for item in items:
        key, value = split_assignment(item)
        if key in seen and seen[key] != value:
            problems.append(f"{path}.{key}: {key}={seen[key]} and {key}={value} give two values; keep one")
        seen[key] = value
    return problems


def _items(path: str, pairs: list[list[str]]) -> list[dict[str, Any]]:
    if path == "data.prefixes":
        return [{"weight": weight, "prefix": prefix} for weight, prefix in pairs]
    return [{"name": name, "sources": [source]} for name, source in pairs]     # a name twice: two sets, refused


def _fields(form: Mapping[str, Any]) -> list[tuple[str, Any, str]]:
    """(dotted path, annotation, description) of every field the flags set."""
    out = []
    for name, annotation in form.items():
        if _is_group(annotation):
            out += [(f"{name}.{field}", info.annotation, info.description or "")
                    for field, info in annotation.model_fields.items()]
        else:       # the model is checked by the plan, which names the presets
            out.append((name, str if name == "model" else annotation, ""))
    return out


def _add(p: argparse.ArgumentParser, flags: list[str], path: str, annotation: Any, description: str) -> None:
    kind, choices = _plain(annotation)
    options: dict[str, Any] = {"dest": path, "help": description or None, "metavar": path.split(".")[-1].upper()}
    if kind is bool:
        del options["metavar"]
        options["action"] = argparse.BooleanOptionalAction
    elif kind in (int, float):
        options["type"], options["action"] = kind, _Once
    elif typing.get_origin(kind) in (list, dict):
        options["action"] = "append"
        item, choices = _plain(typing.get_args(kind)[0]) if typing.get_origin(kind) is list else (str, None)
        if isinstance(item, type) and issubclass(item, BaseModel):
            options["type"], options["metavar"] = _json_object, "JSON"
        elif typing.get_origin(kind) is dict:
            options["metavar"] = "KEY=VALUE"
    if choices:
        options["choices"] = choices
        options.pop("metavar", None)
    if "action" not in options:
        options["action"] = _Once
    p.add_argument(*flags, **options)


def _plain(annotation: Any) -> tuple[Any, tuple | None]:
    """The type a field holds, an empty value aside, and its choices when it is a Literal."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str, typing.get_args(annotation)
    return annotation, None


def _is_group(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object ({e.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
