"""The evaluate flow in-process (prefect_test_harness) on a run the pretrain flow trained with an
evaluation: set perplexities as the gpt package computes them, lm-eval's accuracy as its own
command line reports it, results beside the run, and bad evaluation input refused by name."""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flows.plan.boundary import Boundary
from flows.plan.evaluation import check_evaluation
from flows.plan.params import ClusterParams, EvalSet, EvaluationParams, OutputParams, ParameterError, TrainingParams
from tasks.evaluate.records import EvaluationSpec, results
from tests.run_folder import job_records, wait_until

TASK = "shakespeare_completion"
# Which word ends a famous line: a multiple-choice task with its data in a local file, as a
# cluster without internet provides one.
QUESTIONS = [("To be, or not to", [" be", " dog", " blue", " seven"]),
             ("All the world's a", [" stage", " spoon", " cloud", " lamp"]),
             ("A horse! a horse! my kingdom for a", [" horse", " table", " river", " cup"]),
             ("Now is the winter of our", [" discontent", " bicycle", " window", " spoon"]),
             ("Friends, Romans, countrymen, lend me your", [" ears", " shoes", " cars", " pens"]),
             ("The lady doth protest too", [" much", " green", " fast", " river"]),
             ("Something is rotten in the state of", [" Denmark", " paper", " soup", " glass"]),
             ("Parting is such sweet", [" sorrow", " cabbage", " engine", " number"])]
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: completions.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: a
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "completions.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "a": 0}) + "\n"
                                                      for q, c in QUESTIONS))
    (folder / "completions.yaml").write_text(TASK_YAML)
    return folder


def write_held_out(path: Path) -> Path:
    lines = ["Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
             "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date."]
    path.write_text("".join(json.dumps({"text": line * 3}) + "\n" for line in lines * 20))
    return path


@pytest.fixture(scope="module")
def evaluated_run(prefect_harness, tmp_path_factory) -> tuple[Path, Path]:
    """The embedded default, 30 iterations, checkpoints at 10, 20 and 30 (training keeps the last
    two), with a held-out set and a task; the flow's warnings in ``<work>/warnings.log``."""
    from flows.pretrain import pretrain

    work = tmp_path_factory.mktemp("evaluation")
    tasks = write_task(work / "tasks")
    warnings = logging.FileHandler(work / "warnings.log")
    warnings.setLevel(logging.WARNING)
    logging.getLogger("prefect").addHandler(warnings)
    try:
        out = pretrain(
            training=TrainingParams(train_iters=30, save_interval=10, eval_interval=10, eval_iters=1, compile=False),
            cluster=ClusterParams(preset="local"), output=OutputParams(root=str(work / "runs")),
            evaluation=EvaluationParams(sets=[EvalSet(name="held", sources=[str(write_held_out(work / "held.jsonl"))])],
                                        tasks=[TASK], task_files=[str(tasks)]))
    finally:
        logging.getLogger("prefect").removeHandler(warnings)
        warnings.close()
    return work, Path(out["run_dir"])


@pytest.mark.timeout(900)
def test_a_checkpoint_scores_as_the_gpt_package_and_lm_evals_command_line_score_it(evaluated_run, tmp_path):
    from flows.evaluate import evaluate
    from gpt.config import Config
    from gpt.data import MMapIndexedDataset
    from gpt.export import export, load_checkpoint

    work, run_dir = evaluated_run
    spec = EvaluationSpec.read(run_dir)
    assert spec is not None and spec.tasks == [TASK] and set(spec.sets) == {"held"}
    # Training kept its last two checkpoints; every save was kept for its evaluation, and the run
    # said that nothing on this server evaluates them, and that it keeps more than keep_last.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_0000020", "iter_0000030"]
    pinned = run_dir / "eval" / "pinned" / "iter_0000010" / "checkpoints" / "iter_0000010"
    assert sorted(p.name for p in (run_dir / "eval" / "pinned").iterdir()) == ["iter_0000010", "iter_0000020",
                                                                                "iter_0000030"]
    said = (work / "warnings.log").read_text()
    assert ("warning: evaluation: nothing on this Prefect server evaluates the saves (no automation reacts to "
            "gpt.checkpoint.saved): each save to evaluate is kept until it is evaluated; evaluate them with "
            f"`python -m flows.evaluate {run_dir} --iteration N`") in said, said
    assert (f"{run_dir / 'eval' / 'pinned'} keeps 3 saves for their evaluation (iter_0000010, iter_0000020, "
            "iter_0000030), more than keep_last=2: nothing on this Prefect server evaluates them") in said, said

    # The set's perplexity, computed here from the checkpoint's logits.
    config = Config.load(run_dir / "config.json")
    model = load_checkpoint(pinned, config)
    data = MMapIndexedDataset(spec.sets["held"])
    stream = torch.from_numpy(np.memmap(data.bin_path, dtype=data.dtype, mode="r").astype(np.int64))
    T = config.seq_length
    windows = (len(stream) - 1) // T
    with torch.no_grad():
        rows = torch.stack([stream[i * T: i * T + T + 1] for i in range(windows)])
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()

    # lm-eval's own command line on an export of the same checkpoint.
    hf = export(pinned, tmp_path / "hf", dtype="fp32", **spec.tokenizer)
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                          f"pretrained={hf},dtype=float32", "--tasks", TASK, "--include_path", str(work / "tasks"),
                          "--device", "cpu", "--batch_size", "8", "--output_path", str(tmp_path / "lm-eval")],
                         cwd=work / "tasks", capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    (written,) = (tmp_path / "lm-eval").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"][TASK]

    out = evaluate(str(run_dir), 10)
    assert out["iteration"] == 10 and (run_dir / "eval" / "iter_0000010.json").is_file()
    assert [j["executor"] for j in job_records(run_dir / "eval")] == ["local"]
    assert out["sets"]["held"]["tokens"] == windows * T
    assert out["sets"]["held"]["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
    assert out["tasks"][TASK]["acc"] == theirs["acc,none"]
    # Scored: its pin is let go, and nothing of the export is left in the run folder.
    assert sorted(p.name for p in (run_dir / "eval" / "pinned").iterdir()) == ["iter_0000020", "iter_0000030"]
    assert not [p for p in run_dir.rglob("model.safetensors") if not p.is_relative_to(run_dir / "hf")]

    # Again: the evaluation written for that checkpoint is the answer, and no job runs.
    again = evaluate(str(run_dir), 10)
    assert again["sets"] == out["sets"] and len(job_records(run_dir / "eval")) == 1
    assert [r.iteration for r in results(run_dir)] == [10]


def test_a_checkpoint_that_is_not_kept_is_refused_with_those_that_are(evaluated_run):
    from flows.evaluate import evaluate

    _, run_dir = evaluated_run
    with pytest.raises(ParameterError, match=r"iteration: no complete checkpoint at iteration 7 \(kept: "
                                             r"iter_0000020, iter_0000030\): give one of those"):
        evaluate(str(run_dir), 7)


def test_bad_evaluation_input_is_refused_by_name(tmp_path):
    allowed = tmp_path / "allowed"
    tasks = write_task(allowed / "tasks")
    broken = allowed / "broken"
    broken.mkdir()
    (broken / "task.yaml").write_text('task: broken\ndoc_to_text: "{{q}}"\n  metric: [acc\n')
    missing_data = write_task(allowed / "missing")
    (missing_data / "completions.jsonl").unlink()
    outside = write_held_out(tmp_path / "elsewhere.jsonl")
    boundary = Boundary(input_roots=(allowed,), output_roots=(tmp_path,), s3=None, endpoints=())
    given = EvaluationParams(
        sets=[EvalSet(name="held", sources=[str(outside)]), EvalSet(name="held", prefix=str(allowed / "none"))],
        tasks=[TASK], task_files=[str(tasks), str(broken), str(missing_data)])
    with pytest.raises(ParameterError) as e:
        check_evaluation(given, tmp_path / "runs", 1, boundary)
    errors = e.value.errors
    assert any(m.startswith("training.overrides.keep_last: 1 ") for m in errors), errors
    assert any(m.startswith("evaluation.sets[0].sources[0]:") and "outside the folders" in m for m in errors), errors
    assert any(m.startswith("evaluation.sets[1].name: 'held' names two sets") for m in errors), errors
    assert any(m.startswith("evaluation.sets[1].prefix:") and "none.bin not found" in m for m in errors), errors
    assert any(m.startswith("evaluation.task_files[1]:") and "task.yaml line 3 does not parse as YAML" in m for m in errors), errors
    assert any(m.startswith("evaluation.task_files[2]:") and "completions.jsonl (test), which does not exist" in m
               for m in errors), errors

    unknown = EvaluationParams(tasks=["shakespeare_completio"], task_files=[str(tasks)])
    with pytest.raises(ParameterError, match=r"evaluation.tasks\[0\]: 'shakespeare_completio' is no lm-eval task.*"
                                             r"did you mean shakespeare_completion"):
        check_evaluation(unknown, tmp_path / "runs", 2, boundary)
    check_evaluation(EvaluationParams(tasks=[TASK], task_files=[str(tasks)]), tmp_path / "runs", 2, boundary)


def test_every_nth_save_and_the_last_are_evaluated():
    spec = EvaluationSpec(sets={}, set_tokens=1, tasks=["t"], task_paths=[], limit=None, every=3, tokenizer={},
                          cluster={"preset": "local"})
    marked = [i for i in range(10, 101, 10) if spec.evaluates(i, 10, 100)]
    assert marked == [30, 60, 90, 100]
    assert not spec.evaluates(45, 10, 95)           # a save on the time-limit signal, between the regular ones


@pytest.mark.timeout(600)
def test_on_this_machine_an_evaluation_waits_for_the_runs_training_to_end(evaluated_run, tmp_path):
    import threading

    from flows.evaluate import evaluate

    _, run_dir = evaluated_run
    release = tmp_path / "release"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from tasks.cluster.run_owner import RunOwner\n"
                               f"with RunOwner(Path({str(run_dir)!r})):\n    print('held', flush=True)\n"
                               f"    while not Path({str(release)!r}).exists(): time.sleep(0.1)\n"
                               "print(time.time(), flush=True)"],
                              cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out: dict = {}
        evaluating = threading.Thread(target=lambda: out.update(evaluate(str(run_dir), 20)))
        evaluating.start()
        # The evaluation's task starts, then waits: no job while the run folder is held.
        wait_until(lambda: (run_dir / "eval" / "jobs.json").is_file(), 60, "the first evaluation's job record")
        time.sleep(5)
        assert [j["name"] for j in job_records(run_dir / "eval")] == ["evaluate-iter_0000010"] and evaluating.is_alive()
        release.touch()
        released = float(holder.stdout.readline())
        evaluating.join(timeout=300)
    finally:
        release.touch()
        holder.wait(timeout=30)
    (job,) = [j for j in job_records(run_dir / "eval") if j["name"] == "evaluate-iter_0000020"]
    assert out["iteration"] == 20 and job["submitted"] >= released


def test_a_pin_replaces_an_earlier_pin_whole_and_leaves_a_folder_it_did_not_write(tmp_path):
    from gpt.checkpoint import MARKER
    from gpt.files import NotReplaceable
    from tasks.evaluate.records import pin

    run_dir = tmp_path / "run"
    saved = run_dir / "checkpoints" / "iter_0000004"
    saved.mkdir(parents=True)
    (saved / MARKER).write_text("{}")
    (saved / "0.distcp").write_bytes(b"new")
    (run_dir / "config.json").write_text("{}")
    earlier = run_dir / "eval" / "pinned" / "iter_0000004" / "checkpoints" / "iter_0000004"
    earlier.mkdir(parents=True)
    (earlier / "0.distcp").write_bytes(b"saved before a rollback")
    assert pin(run_dir, 4) == earlier and (earlier / "0.distcp").read_bytes() == b"new"
    assert sorted(p.name for p in earlier.parent.parent.parent.iterdir()) == ["iter_0000004"]   # no temporary left
    assert (earlier / "0.distcp").stat().st_ino == (saved / "0.distcp").stat().st_ino            # a link, no copy

    notes = earlier.parent.parent / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(NotReplaceable, match="notes.txt"):
        pin(run_dir, 4)
    assert notes.read_text() == "mine"
    assert pin(run_dir, 8) is None                    # gone already
