"""The house's rules that a reader can check, checked on the code itself: one owner per fact
(what an S3 URI is, GPT-2's vocabulary size), interfaces rather than private names, no import
circle (imports for type checking and inside functions included)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "tasks", "gpt", "native", "benchmarks", "deployments")


def _sources() -> dict[str, Path]:
    """The project's modules (tests aside) by dotted name."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py"], capture_output=True, text=True,
                           check=True).stdout.split()
    return {f[:-3].replace("/", ".").removesuffix(".__init__"): ROOT / f for f in files if f.split("/")[0] in PACKAGES}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) of every ``from module import name`` of the project's in ``path``; a name
    that is itself a module is recorded as (that module, "")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, "") if sub in modules else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(m, n) for m, n in found if m in modules]


def test_one_owner_for_what_an_s3_uri_is_and_for_gpt2s_vocabulary_size():
    for name, path in _sources().items():
        text = path.read_text()
        if name != "tasks.common.uri":
            assert 'startswith("s3://")' not in text and "[5:]" not in text, f"{path}: use tasks.common.uri"
        if name != "gpt.tokenizer":
            assert "50257" not in text, f"{path}: use gpt.tokenizer.GPT2_VOCAB_SIZE"


def test_no_module_imports_another_ones_private_names():
    modules = _sources()
    private = [f"{path.relative_to(ROOT)}: from {module} import {name}" for path in modules.values()
               for module, name in _imports(path, modules) if name.startswith("_") and not name.startswith("__")]
    assert private == []


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """The nodes of ``graph`` (each with the nodes it points to) that a path leads back to."""
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            node = todo.pop()
            if node == start:
                circles.append(start)
                break
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
    return circles


def test_no_import_circle():
    modules = _sources()
    assert _circles({name: {m for m, _ in _imports(path, modules) if m != name} for name, path in modules.items()}) == []


def test_one_tokenizer_type_and_one_reader_of_tokenizer_files():
    """gpt.tokenizer.Tokenizer is the only type that stands for a run's tokenizer, and only
    gpt/tokenizer.py reads a vocab.json or builds a tokenizers.Tokenizer from files."""
    for name, path in _sources().items():
        if name == "gpt.tokenizer":
            continue
        tree = ast.parse(path.read_text())
        classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name.endswith("Tokenizer")]
        assert classes == [], f"{path}: use gpt.tokenizer.Tokenizer"
        text = path.read_text()
        assert "BPE.from_file" not in text and "Tokenizer.from_file" not in text, f"{path}: use gpt.tokenizer"


def test_every_stage_retries_by_the_one_rule():
    """tasks.common.retry.worth_retrying is every task's retry condition, and the errors say whether
    running again helps."""
    from gpt.files import WriteError
    from tasks.cluster.jobs import FlowRunCancelled, JobError
    from tasks.cluster.run_owner import RunBusy
    from tasks.common.retry import transient
    from tasks.sync.remote import SyncError, TransientSyncError
    from tasks.tokenize.bpe import TokenizeError
    from tasks.train.stage import FaultedTwice

    conditions = [(path, line) for path in _sources().values() for line in path.read_text().splitlines()
                  if "retry_condition_fn=" in line]
    assert conditions and all("retry_condition_fn=worth_retrying" in line for _, line in conditions), conditions
    again = [JobError("job failed"), TransientSyncError("reset"), ConnectionResetError("reset")]
    never = [TokenizeError("bad line"), SyncError("access denied"), WriteError("disk full"), RunBusy("busy"),
             FlowRunCancelled("cancelled"), FaultedTwice("hung twice"), RuntimeError("a bug")]
    assert [transient(e) for e in again] == [True] * 3 and [transient(e) for e in never] == [False] * 7


def test_pyproject_names_every_package_the_code_imports():
    import sys

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower()
             for d in [*project["dependencies"], *sum(project.get("optional-dependencies", {}).values(), [])]}
    distribution = {"yaml": "pyyaml", "lm_eval": "lm-eval"}     # import name -> distribution name, where they differ
    imported = set()
    for name, path in _sources().items():
        if name.split(".")[0] in ("flows", "tasks", "deployments"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - set(PACKAGES) - {"gpt"}
    assert {distribution.get(m, m).lower() for m in third_party} - named == set()


# The floors of the house, top down: a module imports only its own floor and those below it.
FLOORS = {"deployments": 5, "flows": 4, "benchmarks": 3, "tasks": 2, "gpt": 1, "native": 1}


def _room(module: str) -> str:
    """A room of the house: a package's own module, or a package below it (``tasks.train``,
    ``tasks.index``, ``flows.plan``, ``gpt.config``)."""
    return ".".join(module.split(".")[:2])


def test_no_import_runs_back_up_the_house_and_no_two_rooms_import_each_other():
    """Imports inside functions and for type checking included: a lower floor never imports a higher
    one (the command line, in flows, no deployment), and the rooms' imports make no circle, so that
    each room has its place above the rooms it uses."""
    modules = _sources()
    up = sorted(f"{name} -> {m}" for name, path in modules.items() for m, _ in _imports(path, modules)
                if FLOORS[m.split(".")[0]] > FLOORS[name.split(".")[0]])
    assert up == []
    rooms: dict[str, set[str]] = {}
    for name, path in modules.items():
        rooms.setdefault(_room(name), set()).update(_room(m) for m, _ in _imports(path, modules)
                                                    if _room(m) != _room(name))
    assert _circles(rooms) == []


def test_no_module_over_500_lines_and_no_function_over_60():
    """Outside the tests and the benchmarks: a module holds one job, a function one step of it."""
    long_modules, long_functions = [], []
    for name, path in _sources().items():
        if name.startswith("benchmarks"):
            continue
        text = path.read_text()
        if sum(1 for line in text.splitlines() if line.strip()) > 500:
            long_modules.append(name)
        long_functions += [f"{name}.{node.name}" for node in ast.walk(ast.parse(text))
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and node.end_lineno - node.lineno + 1 > 60]
    assert long_modules == [] and long_functions == []
