"""Where a new run starts from, checked before anything runs: another run or one of its
checkpoints (``training.init_from``), or a HuggingFace model folder (``init_from_hf``), each of this
model's shape and loadable in this run's layout."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flows.plan.boundary import Boundary, refused
from flows.plan.identity import differences, recorded
from flows.plan.layout import Layout
from flows.plan.outlook import cannot_load
from flows.plan.output import RUN_NAME
from flows.plan.params import Problems, TrainingParams
from gpt.checkpoint import MARKER, damage, newest_intact
from gpt.config import Config, ConfigError, shape_differences
from tasks.sync import local_path


def start_from(training: TrainingParams, layout: Layout, boundary: Boundary, config: Config,
               errors: Problems) -> str | None:
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
        (errors.append if where.exists() else errors.not_here)(
            f"training.init_from: {given!r} ({where}) is neither a run with an intact checkpoint nor a checkpoint "
            "folder (iter_NNNNNNN with COMPLETE); name a run under output.root or a checkpoint")
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


def branch_point(training: TrainingParams, layout: Layout, boundary: Boundary, identity: dict[str, Any],
                 config: Config, errors: Problems) -> Path | None:
    """The checkpoint a new run branches from (training.branch_from: RUN/iter_NNNNNNN under the
    output root, or a checkpoint folder): intact, loadable in this layout, and of a run of this
    recipe (its identity, any branch of its own aside)."""
    given = training.branch_from
    if given is None:
        return None
    name, _, checkpoint = given.partition("/")
    where = (layout.run(name) / "checkpoints" / checkpoint if RUN_NAME.fullmatch(name) and checkpoint
             and "/" not in checkpoint else Path(local_path(given)))
    problem = boundary.local_input(str(where), layout.root)
    if problem:
        errors.append(f"training.branch_from: {problem}")
        return None
    if not (where / MARKER).is_file():
        (errors.append if where.exists() else errors.not_here)(
            f"training.branch_from: {given!r} ({where}) is not a complete checkpoint folder (iter_NNNNNNN with "
            "COMPLETE); name one as RUN/iter_NNNNNNN")
        return None
    problem = damage(where) or cannot_load(where, config)
    if problem:
        errors.append(f"training.branch_from: checkpoint {where}: {problem}")
        return None
    source = where.parent.parent
    theirs, ours = (None if i is None else {**i, "training": {k: v for k, v in i["training"].items() if k != "branch_from"}}
                    for i in (recorded(source), identity))
    if theirs != ours:
        changed = "; ".join(differences(theirs, ours)) if theirs else f"{source} holds no run.json"
        errors.append(f"training.branch_from: run {source.name} is another recipe ({changed}): a branch goes on with "
                      "the recipe of its run, and changes what follows through its phases")
    return where


def check_start(config: Config, boundary: Boundary, root: Path, errors: Problems) -> None:
    """A HuggingFace folder to start from is readable and holds a GPT-2 or Llama of this model's shape."""
    if not config.init_from_hf:
        return
    from gpt.export import INDEX, WEIGHTS, ExportError, config_from_hf, hf_weight_problems, weight_files

    field = "training.overrides.init_from_hf"
    folder = Path(local_path(config.init_from_hf))
    problem = boundary.local_input(str(folder), root)
    if problem:
        errors.append(f"{field}: {problem}")
        return
    if not folder.exists():
        errors.not_here(f"{field}: {folder} does not exist; give a folder written by gpt.export or save_pretrained")
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
    except ExportError as e:
        errors.append(f"{field}: {folder}: {e}")
        return
    except (ValueError, TypeError) as e:
        errors.append(f"{field}: {folder}/config.json: {e}")
        return
    differ = shape_differences(theirs, config)
    if differ:
        errors.append(f"{field}: the model in {folder} has another shape ({'; '.join(differ)})")
        return
    try:
        problems = hf_weight_problems(folder, theirs)
    except (OSError, ValueError) as e:
        problems = [str(e)]
    if problems:
        errors.append(f"{field}: the weights in {folder} do not load into its config.json's model: "
                      f"{'; '.join(problems)}; export the model again")
