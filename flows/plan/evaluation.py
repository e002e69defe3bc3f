"""The run's evaluation, checked before anything runs: sets readable where the operator allows,
task files that parse, and every task known to lm-evaluation-harness (its registry, or the task
files). Refused by name, like any parameter; what passes is the plan's ``EvaluationPlan``."""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from flows.plan.boundary import Boundary, check_prefix, check_source
from flows.plan.params import EvaluationParams, ParameterError, Problems
from tasks.cluster.container import Container
from tasks.common.uri import is_s3
from tasks.evaluate.job import task_manager
from tasks.sync import local_path


class _TaskYaml(yaml.SafeLoader):
    """lm-eval's task YAML: plain YAML plus ``!function module.name`` tags."""


_TaskYaml.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


@dataclass(frozen=True)
class EvaluationSet:
    name: str
    sources: tuple[str, ...]            # as given: tokenized with the run's tokenizer
    prefix: str | None                  # or tokenized already (a local path or an s3:// URI)


@dataclass(frozen=True)
class EvaluationPlan:
    """What every checkpoint the run saves (every ``every``-th, and the last) is evaluated on."""
    sets: tuple[EvaluationSet, ...]
    tasks: tuple[str, ...]              # lm-eval task names
    task_paths: tuple[str, ...]         # folders lm-eval searches for the run's own tasks
    limit: int | None
    every: int
    set_tokens: int


def task_folders(evaluation: EvaluationParams) -> list[str]:
    """The folders lm-eval searches for the run's own tasks (a file's folder when a file is given)."""
    folders = []
    for f in evaluation.task_files:
        path = Path(local_path(f)).resolve()
        folders.append(str(path if path.is_dir() else path.parent))
    return folders


def check_evaluation(evaluation: EvaluationParams, root: Path, keep_last: int, boundary: Boundary | None = None,
                     container: Container | None = None, dry_run: bool = False) -> tuple[EvaluationPlan | None, list[str]]:
    """The evaluation's plan (None: none asked) and what a dry run could not check here; raises
    ParameterError naming each field that cannot be evaluated as given (``keep_last``: the run's,
    which must leave a saved checkpoint long enough to be kept for its evaluation; ``container``:
    the cluster's, in which the evaluation jobs read the task files and sets)."""
    if evaluation == EvaluationParams():
        return None, []
    boundary = boundary or Boundary.from_env()
    errors = Problems(dry_run)
    if keep_last < 2:
        errors.append(f"training.overrides.keep_last: {keep_last} removes each checkpoint as the next one is "
                      "written, before it can be kept for its evaluation; keep 2 or more with an evaluation")
    names = [s.name for s in evaluation.sets]
    for i, s in enumerate(evaluation.sets):
        field = f"evaluation.sets[{i}]"
        if s.name in names[:i]:
            errors.append(f"{field}.name: {s.name!r} names two sets; give each set its own name")
        if bool(s.sources) == bool(s.prefix):
            errors.append(f"{field}: give sources (to tokenize with the run's tokenizer) or a prefix, one of the two")
        for j, src in enumerate(s.sources):
            check_source(f"{field}.sources[{j}]", src, root, boundary, errors)
        if s.prefix:
            check_prefix(f"{field}.prefix", s.prefix, root, boundary, errors)
    for i, f in enumerate(evaluation.task_files):
        errors += _task_file_problems(f"evaluation.task_files[{i}]", f, root, boundary)
    if container is not None:
        reads = {f"evaluation.task_files[{i}]": folder for i, folder in enumerate(task_folders(evaluation))}
        reads.update({f"evaluation.sets[{i}].prefix": local_path(s.prefix) for i, s in enumerate(evaluation.sets)
                      if s.prefix and not is_s3(s.prefix)})
        errors += container.problems(reads, {})
    if evaluation.task_files and not evaluation.tasks:
        errors.append("evaluation.tasks: name the tasks to run from evaluation.task_files")
    if not evaluation.wanted:
        errors.append("evaluation: name sets or tasks to evaluate on (every, limit and set_tokens alone evaluate "
                      "nothing)")
    if evaluation.tasks and not any(e.startswith("evaluation.task_files") for e in errors):
        errors += _unknown_tasks(evaluation)
    if errors:
        raise ParameterError(errors)
    sets = tuple(EvaluationSet(s.name, tuple(s.sources), s.prefix if not s.prefix or is_s3(s.prefix) else local_path(s.prefix))
                 for s in evaluation.sets)
    return EvaluationPlan(sets=sets, tasks=tuple(evaluation.tasks), task_paths=tuple(task_folders(evaluation)),
                          limit=evaluation.limit, every=evaluation.every, set_tokens=evaluation.set_tokens), errors.warnings


def _task_file_problems(field: str, given: str, root: Path, boundary: Boundary) -> list[str]:
    path = Path(local_path(given))
    if not path.exists():
        return [f"{field}: {given} not found; give a folder of lm-eval task YAML files (or one such file)"]
    files = sorted(path.rglob("*.yaml")) if path.is_dir() else [path]
    if not files:
        return [f"{field}: {given} holds no .yaml task file"]
    problems = []
    for f in files:
        refused = boundary.local_input(str(f), root)
        if refused:
            return [f"{field}: {refused}"]
        try:
            task = yaml.load(f.read_text(), Loader=_TaskYaml)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            problems.append(f"{field}: {f}{line} does not parse as YAML ({getattr(e, 'problem', None) or e}); fix the file")
            continue
        if not isinstance(task, dict) or not ({"task", "group", "include"} & set(task)):
            problems.append(f"{field}: {f} is no lm-eval task (no task, group or include key)")
            continue
        for split, data in _local_data_files(task, f.parent):
            if not os.path.exists(data):
                problems.append(f"{field}: {f} names data file {data} ({split}), which does not exist")
            elif refused := boundary.local_input(data, root):
                problems.append(f"{field}: {f} names data file {data} ({split}): {refused}")
    return problems


def _local_data_files(task: dict, folder: Path) -> list[tuple[str, str]]:
    """The local files a task's ``dataset_kwargs.data_files`` names, relative to its folder."""
    files = ((task.get("dataset_kwargs") or {}).get("data_files")) or {}
    if isinstance(files, str):
        files = {"data": files}
    out = []
    for split, names in files.items() if isinstance(files, dict) else ():
        for name in names if isinstance(names, list) else [names]:
            if isinstance(name, str) and "://" not in name:
                out.append((split, str(folder / name) if not os.path.isabs(name) else name))
    return out


def _unknown_tasks(evaluation: EvaluationParams) -> list[str]:
    """Tasks neither in the task files nor in lm-eval's registry (indexed only when needed: it reads
    thousands of files)."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return ["evaluation.tasks: lm-evaluation-harness is not installed where the flow runs: pip install "
                "'gpt-pretrain[evaluation]' (or requirements.txt), or name no tasks"]
    folders = task_folders(evaluation)
    known = set(task_manager(list(evaluation.tasks), folders).all_tasks)
    errors = []
    for i, name in enumerate(evaluation.tasks):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            errors.append(f"evaluation.tasks[{i}]: {name!r} is no lm-eval task (its registry"
                          f"{' or evaluation.task_files' if folders else ''})"
                          + (f"; did you mean {', '.join(close)}?" if close else "; check its name with `lm-eval ls tasks`"))
    return errors
