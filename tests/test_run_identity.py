"""A run is what it trains, not where it runs: the plan names the run folder by the fields that
define the model trained, says what will happen there, and refuses a changed defining field under
an existing run's name (flows.plan.identity, flows.plan.outlook, flows.plan.build)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.plan.build import make_plan
from flows.plan.identity import RECORD, record
from flows.plan.params import ClusterParams, DataParams, OutputParams, ParameterError, TokenizerParams, TrainingParams
from tests.fixtures_gpt import SMALL


def _plan(root: Path, training: TrainingParams | None = None, cluster: ClusterParams | None = None, **output):
    return make_plan("tiny", DataParams(), TokenizerParams(), training or TrainingParams(),
                     cluster or ClusterParams(), OutputParams(root=str(root), **output))


@pytest.mark.parametrize("change", [
    {"cluster": ClusterParams(preset="slurm-local")},
    {"cluster": ClusterParams(preset="slurm-local", overrides={"nodes": 1, "tasks_per_node": 2})},
    {"training": TrainingParams(micro_batch_size=4)},
    {"training": TrainingParams(data_parallel_mode="fsdp", activation_checkpointing=True, compile=False)},
    {"training": TrainingParams(log_interval=5, eval_interval=50, save_interval=25, overrides={"keep_last": 5})},
    {"training": TrainingParams(train_iters=600)},
    {"training": TrainingParams(precision="bf16")},
], ids=["slurm-2-nodes", "1-node-2-tasks", "micro-batch", "fsdp", "intervals", "longer", "precision"])
def test_fields_that_do_not_define_the_run_keep_its_folder(tmp_path, change):
    assert _plan(tmp_path, **change).run_dir == _plan(tmp_path).run_dir


@pytest.mark.parametrize("training", [
    TrainingParams(seed=7), TrainingParams(lr=1e-3), TrainingParams(global_batch_size=32),
    TrainingParams(seq_length=64), TrainingParams(overrides={"weight_decay": 0.0}),
    TrainingParams(overrides={"lr_decay_iters": 1000}), TrainingParams(init_from="other"),
], ids=["seed", "lr", "global-batch", "seq-length", "weight-decay", "fixed-decay", "init-from"])
def test_fields_that_define_the_run_name_another_folder(tmp_path, training):
    if training.init_from:
        _train_a_little(tmp_path / "other")
    assert _plan(tmp_path, training).run_dir != _plan(tmp_path).run_dir


def test_a_shape_of_its_own_is_named_by_it_and_keeps_the_presets_names_for_the_presets_shape(tmp_path):
    """Architecture fields that differ from the preset's give a model named by its block and shape,
    in the run folder, the identity and the plan; the preset's own shape keeps the preset's name
    and the identity it always had."""
    preset = _plan(tmp_path)
    same = _plan(tmp_path, TrainingParams(overrides={"num_layers": 4, "hidden_size": 128}))
    assert same.run_dir == preset.run_dir and preset.run_dir.name.startswith("tiny-") and "shape" not in preset.identity
    two = _plan(tmp_path, TrainingParams(overrides={"num_layers": 2}))
    assert two.run_dir.name.startswith("gpt3-2l-128h-4a-") and two.identity["model"] == "gpt3-2l-128h-4a"
    assert two.identity["shape"]["preset"] == "tiny" and two.identity["shape"]["num_layers"] == 2
    assert two.config.num_layers == 2 and two.config.model == "tiny"
    wider = _plan(tmp_path, TrainingParams(overrides={"num_layers": 2, "ffn_hidden_size": 384}))
    assert wider.run_dir.name.startswith("gpt3-2l-128h-4a-384f-") and wider.run_dir != two.run_dir
    llama = make_plan("tiny-llama", DataParams(), TokenizerParams(), TrainingParams(overrides={"num_query_groups": 4}),
                      ClusterParams(), OutputParams(root=str(tmp_path)))
    assert llama.run_dir.name.startswith("llama-4l-128h-4a-352f-")


def _train_a_little(run_dir: Path, **config) -> None:
    """A real run folder of the tiny preset, trained by the train stage on the local executor: its
    config.json, a checkpoint and the summary of a run trained to its length."""
    from gpt.config import Config
    from tasks.cluster.config import load_cluster
    from tasks.train.stage import train

    fields = {**SMALL, "num_layers": 4, "hidden_size": 128, "seq_length": 128, "train_iters": 2, "save_interval": 2,
              "run_dir": str(run_dir), **config}
    assert train(Config(**fields), load_cluster("local")).summary["status"] == "completed"


def test_a_changed_defining_field_under_an_existing_run_name_is_refused_naming_it(tmp_path):
    plan = _plan(tmp_path, run_name="mine")
    _train_a_little(plan.run_dir)
    record(plan.run_dir, plan.identity)
    assert _plan(tmp_path, TrainingParams(micro_batch_size=4), run_name="mine").run_dir == plan.run_dir
    with pytest.raises(ParameterError) as e:
        _plan(tmp_path, TrainingParams(seed=7, lr=1e-3), run_name="mine")
    (line,) = e.value.errors
    assert line.startswith("output.run_name: run mine was started with other defining fields")
    assert "training.seed: 1234 -> 7" in line and "training.lr: 0.002 -> 0.001" in line
    assert "training.init_from=mine" in line
    assert json.loads((plan.run_dir / RECORD).read_text())["identity"] == plan.identity


def test_the_plan_says_what_will_happen(tmp_path):
    plan = _plan(tmp_path, TrainingParams(train_iters=2))
    assert plan.outlook().kind == "new" and plan.outlook().message == f"new run {plan.run_dir.name}, 2 iterations"
    _train_a_little(plan.run_dir)
    assert plan.outlook().kind == "trained" and "already trained to iteration 2 (2 asked): nothing to train" \
        in plan.outlook().message
    longer = _plan(tmp_path, TrainingParams(train_iters=5), ClusterParams(preset="slurm-local"))
    assert longer.run_dir == plan.run_dir
    assert longer.outlook().message == (f"resumes run {plan.run_dir.name} from iteration 2 of 5 (saved by 1 x 1 "
                                        "ranks, TP 1; now 2 x 1, TP 1); train_iters 2 -> 5: the LR decay follows "
                                        "the new length")


def test_init_from_names_a_run_and_starts_from_its_newest_intact_checkpoint(tmp_path):
    _train_a_little(tmp_path / "source")
    plan = _plan(tmp_path, TrainingParams(init_from="source", init_from_optimizer=True))
    assert plan.config.init_from == str(tmp_path / "source" / "checkpoints" / "iter_0000002")
    assert plan.config.init_from_optimizer and plan.outlook().message.startswith("new run")
    assert f"from {plan.config.init_from}" in plan.outlook().message
    with pytest.raises(ParameterError, match=r"training.init_from: 'nowhere' .* is neither a run"):
        _plan(tmp_path, TrainingParams(init_from="nowhere"))
    _train_a_little(tmp_path / "wide", hidden_size=64)
    with pytest.raises(ParameterError, match=r"training.init_from: .* holds another model \(hidden_size: 64 there, "
                                             r"128 here; ffn_hidden_size: 256 there, 512 here\)"):
        _plan(tmp_path, TrainingParams(init_from="wide"))


def test_every_config_field_either_defines_the_run_or_may_change_and_the_readme_says_which():
    import dataclasses

    from flows.plan import identity
    from flows.plan.build import FLOW_DECIDED
    from gpt.config import ARCHITECTURE, Config  # the architecture is the preset's: a run is named after it

    classified = {*identity.DEFINING, *identity.SCHEDULE, *identity.START, *identity.PACKING, *identity.MAY_CHANGE, *FLOW_DECIDED,
                  *ARCHITECTURE, "precompile_iters", "compile_cache_dir"}
    assert {f.name for f in dataclasses.fields(Config)} - classified == set()
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme[readme.index("| define the run"):readme.index("The list lives in `flows/plan/identity.py`")]
    for name in (*identity.DEFINING, *identity.START, *identity.PACKING,
                 *(n for n in identity.MAY_CHANGE if n != "cluster.*")):
        assert f"`{name}`" in table, name
