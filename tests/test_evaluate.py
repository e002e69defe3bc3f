"""The evaluate flow in-process (prefect_test_harness) on a run the pretrain flow trained with an
evaluation: set perplexities as the gpt package computes them, lm-eval's accuracy as its own
command line reports it, results beside the run, and bad evaluation input refused by name."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flows.plan.boundary import Boundary
from flows.plan.evaluation import check_evaluation
from flows.plan.params import ClusterParams, EvalSet, EvaluationParams, OutputParams, ParameterError, TrainingParams
from tasks.evaluate import EvaluationSpec, results
from tests.run_folder import job_records

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
    """The embedded default, 20 iterations, checkpoints at 10 and 20, with a held-out set and a task."""
    from flows.pretrain import pretrain

    work = tmp_path_factory.mktemp("evaluation")
    tasks = write_task(work / "tasks")
    out = pretrain(
        training=TrainingParams(train_iters=20, save_interval=10, eval_interval=10, eval_iters=1, compile=False),
        cluster=ClusterParams(preset="local"), output=OutputParams(root=str(work / "runs")),
        evaluation=EvaluationParams(sets=[EvalSet(name="held", sources=[str(write_held_out(work / "held.jsonl"))])],
                                    tasks=[TASK], task_files=[str(tasks)]))
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
    out = evaluate(str(run_dir), 10)
    assert out["iteration"] == 10 and (run_dir / "eval" / "iter_0000010.json").is_file()
    assert not list((run_dir / "eval").glob("hf-iter_*"))           # the export is removed once scored
    assert [j["executor"] for j in job_records(run_dir / "eval")] == ["local"]

    # The set's perplexity, computed here from the checkpoint's logits.
    checkpoint = run_dir / "checkpoints" / "iter_0000010"
    config = Config.load(run_dir / "config.json")
    model = load_checkpoint(checkpoint, config)
    data = MMapIndexedDataset(spec.sets["held"])
    stream = torch.from_numpy(np.memmap(data.bin_path, dtype=data.dtype, mode="r").astype(np.int64))
    T = config.seq_length
    windows = (len(stream) - 1) // T
    with torch.no_grad():
        rows = torch.stack([stream[i * T: i * T + T + 1] for i in range(windows)])
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).item()
    assert out["sets"]["held"]["tokens"] == windows * T
    assert out["sets"]["held"]["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)

    # lm-eval's own command line on an export of the same checkpoint.
    hf = export(checkpoint, tmp_path / "hf", dtype="fp32", **spec.tokenizer)
    cli = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                          f"pretrained={hf},dtype=float32", "--tasks", TASK, "--include_path", str(work / "tasks"),
                          "--device", "cpu", "--batch_size", "8", "--output_path", str(tmp_path / "lm-eval")],
                         cwd=work / "tasks", capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    (written,) = (tmp_path / "lm-eval").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"][TASK]
    assert out["tasks"][TASK]["acc"] == theirs["acc,none"]

    # Again: the evaluation written for that checkpoint is the answer, and no job runs.
    again = evaluate(str(run_dir), 10)
    assert again["sets"] == out["sets"] and len(job_records(run_dir / "eval")) == 1
    assert [r.iteration for r in results(run_dir)] == [10]


def test_a_checkpoint_that_is_not_kept_is_refused_with_those_that_are(evaluated_run):
    from flows.evaluate import evaluate

    _, run_dir = evaluated_run
    with pytest.raises(ParameterError, match=r"iteration: no complete checkpoint at iteration 7 .*kept: iter_0000010, "
                                             r"iter_0000020\): give one of those"):
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
        check_evaluation(given, tmp_path / "runs", boundary)
    errors = e.value.errors
    assert any(m.startswith("evaluation.sets[0].sources[0]:") and "outside the folders" in m for m in errors), errors
    assert any(m.startswith("evaluation.sets[1].name: 'held' names two sets") for m in errors), errors
    assert any(m.startswith("evaluation.sets[1].prefix:") and "none.bin not found" in m for m in errors), errors
    assert any(m.startswith("evaluation.task_files[1]:") and "task.yaml line 3 does not parse as YAML" in m for m in errors), errors
    assert any(m.startswith("evaluation.task_files[2]:") and "completions.jsonl (test), which does not exist" in m
               for m in errors), errors

    unknown = EvaluationParams(tasks=["shakespeare_completio"], task_files=[str(tasks)])
    with pytest.raises(ParameterError, match=r"evaluation.tasks\[0\]: 'shakespeare_completio' is no lm-eval task.*"
                                             r"did you mean shakespeare_completion"):
        check_evaluation(unknown, tmp_path / "runs", boundary)
    check_evaluation(EvaluationParams(tasks=[TASK], task_files=[str(tasks)]), tmp_path / "runs", boundary)


def test_every_nth_save_and_the_last_are_evaluated():
    spec = EvaluationSpec(sets={}, set_tokens=1, tasks=["t"], task_paths=[], limit=None, every=3, tokenizer={},
                          cluster={})
    marked = [i for i in range(10, 101, 10) if spec.evaluates(i, 10, 100)]
    assert marked == [30, 60, 90, 100]
    assert not spec.evaluates(45, 10, 95)           # a save on the time-limit signal, between the regular ones


@pytest.mark.timeout(600)
def test_on_this_machine_an_evaluation_waits_for_the_runs_training_to_end(evaluated_run):
    from flows.evaluate import evaluate

    _, run_dir = evaluated_run
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from tasks.cluster.run_owner import RunOwner\n"
                               f"with RunOwner(Path({str(run_dir)!r})):\n    print('held', flush=True); time.sleep(8)\n"
                               "print(time.time(), flush=True)"],
                              cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    out = evaluate(str(run_dir), 20)
    released = float(holder.stdout.readline())
    holder.wait(timeout=30)
    (job,) = [j for j in job_records(run_dir / "eval") if j["name"] == "evaluate-iter_0000020"]
    assert out["iteration"] == 20 and job["submitted"] >= released
