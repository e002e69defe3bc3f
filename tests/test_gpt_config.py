"""Config presets, validation errors, parameter counts and learning-rate schedules."""
import json
import math
import re

import pytest

from gpt.config import Config, ConfigError
from gpt.config.presets import PRESETS
from gpt.model import param_count
from gpt.optim import lr_at


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("gpt")])   # Llama's: tests/test_llama.py
def test_param_count_matches_preset_name(name):
    size, unit = re.fullmatch(r"gpt3?-([\d.]+)([mb])", name).groups()
    expected = float(size) * (1e6 if unit == "m" else 1e9)
    assert abs(param_count(Config(model=name)) - expected) / expected < 0.05


def test_presets_follow_the_tables():
    c = Config(model="gpt3-13b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length) == (40, 5120, 40, 2048)
    c = Config(model="gpt-310.1b")
    assert (c.num_layers, c.hidden_size, c.num_attention_heads) == (96, 16384, 128)
    c = Config(model="gpt3-1.3b", num_layers=2)  # explicit fields win over the preset
    assert (c.num_layers, c.hidden_size) == (2, 2048)


def test_padded_vocab_like_megatron():
    c = Config()
    assert c.padded_vocab_size() == 50304
    assert c.padded_vocab_size(tp=2) == 50432
    assert Config(vocab_size=256, tensor_parallel=2).padded_vocab_size() == 256


def test_roundtrip_json_yaml_and_unknown_field(tmp_path):
    c = Config.from_preset("gpt3-125m", mock_data=True, micro_batch_size=4)
    c.save(tmp_path / "c.json")
    assert Config.load(tmp_path / "c.json") == c
    (tmp_path / "c.yaml").write_text("model: tiny\nmock_data: true\nhidden_size: 64\n")
    assert Config.load(tmp_path / "c.yaml").hidden_size == 64
    (tmp_path / "bad.json").write_text(json.dumps({"modle": "tiny"}))
    with pytest.raises(ConfigError, match=r"bad\.json.*modle"):
        Config.load(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{\n  \"model\": \n")
    with pytest.raises(ConfigError, match=r"broken\.json.*line 3"):
        Config.load(tmp_path / "broken.json")


def test_schedule_defaults():
    c = Config(model="gpt3-125m")
    assert (c.train_samples, c.lr_warmup_samples, c.lr_decay_samples, c.train_iters) == (146484375, 183105, 126953125, None)
    c = Config(model="gpt3-125m", train_iters=1000)  # an iteration schedule replaces the preset's samples
    assert (c.train_samples, c.lr_warmup_samples, c.lr_decay_iters, c.lr_warmup_iters) == (None, None, 1000, 0)
    c = Config(train_iters=1000)  # tiny keeps its warmup, decays over the run
    assert (c.lr_warmup_iters, c.lr_decay_iters) == (30, 1000)
    c = Config(train_iters=50)  # a warmup of at most a tenth of a short run
    assert (c.lr_warmup_iters, c.lr_decay_iters) == (5, 50)
    c = Config(model="gpt3-125m", train_samples=1_000_000)
    assert (c.lr_warmup_samples, c.lr_decay_samples) == (100_000, 1_000_000)


def test_num_samples_megatron_formula():
    c = Config(mock_data=True, train_iters=250, global_batch_size=16, eval_interval=100, eval_iters=10)
    assert c.num_samples() == {"train": 4000, "valid": 3 * 10 * 16, "test": 160}


VALID = dict(mock_data=True, precision="fp32")
ERRORS = [
    (dict(model="gpt4"), 1, "model='gpt4'"),
    (dict(precision="fp4"), 1, "precision"),
    (dict(device="tpu"), 1, "device"),
    (dict(data_parallel_mode="zero"), 1, "data_parallel_mode"),
    (dict(lr_decay_style="step"), 1, "lr_decay_style"),
    (dict(micro_batch_size=0), 1, "micro_batch_size"),
    (dict(hidden_size=130), 1, "hidden_size=130 is not divisible by num_attention_heads"),
    (dict(tensor_parallel=3), 3, "num_attention_heads=4 is not divisible by tensor_parallel=3"),
    (dict(tensor_parallel=2), 3, "world size 3 is not divisible by tensor_parallel=2"),
    (dict(global_batch_size=20), 2, "global_batch_size=20 is not divisible by micro_batch_size=8 x data-parallel size 2"),
    (dict(seq_length=256, max_position_embeddings=128), 1, "seq_length=256 is longer than max_position_embeddings"),
    (dict(train_iters=10, train_samples=160), 1, "exactly one of train_iters and train_samples"),
    (dict(train_iters=10, lr_warmup_samples=16), 1, "lr_warmup_samples is set but the schedule counts by train_iters"),
    (dict(train_samples=160, lr_decay_iters=5), 1, "lr_decay_iters is set but the schedule counts by train_samples"),
    (dict(train_samples=8), 1, "train_samples=8 is less than one global batch"),
    (dict(train_iters=100, lr_warmup_iters=50, lr_decay_iters=20), 1, "lr_warmup_iters=50 is longer than lr_decay_iters=20"),
    (dict(lr=1e-4, min_lr=1e-3), 1, "min_lr"),
    (dict(mock_data=False), 1, "no training data"),
    (dict(data_index="/nonexistent/index.json", mock_data=False), 1, "data_index='/nonexistent/index.json': no such file"),
    (dict(data_index=__file__), 1, "both data_index and mock_data"),
    (dict(device="neuron", data_parallel_mode="fsdp"), 2, "device='neuron' trains data parallel as data_parallel_mode='ddp'"),
    (dict(precompile=True, compile=True), 1, "precompile=True needs compile_cache_dir"),
    (dict(clip_grad=-1.0), 1, "clip_grad"),
    (dict(peak_flops=0.0), 1, "peak_flops"),
]


@pytest.mark.parametrize("overrides,world,message", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_validation_errors(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Config(**{**VALID, **overrides}).validate(world)


def test_valid_layouts_pass():
    Config(**VALID).validate(1)
    Config(**VALID, global_batch_size=16, micro_batch_size=8).validate(2)
    Config(**VALID, tensor_parallel=2).validate(2)
    Config(**VALID, tensor_parallel=2, data_parallel_mode="fsdp", global_batch_size=16).validate(4)


def test_lr_schedule_by_iterations():
    c = Config(mock_data=True, lr=1e-3, min_lr=1e-4, train_iters=120, lr_warmup_iters=10, lr_decay_iters=110)
    assert lr_at(c, 5) == pytest.approx(5e-4)
    assert lr_at(c, 10) == pytest.approx(1e-3)
    assert lr_at(c, 60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(c, 35) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert lr_at(c, 110) == pytest.approx(1e-4)
    assert lr_at(c, 120) == pytest.approx(1e-4)
    linear = Config(**{**c.to_dict(), "lr_decay_style": "linear"})
    assert lr_at(linear, 35) == pytest.approx(1e-3 - 0.9e-3 * 0.25)
    constant = Config(**{**c.to_dict(), "lr_decay_style": "constant"})
    assert lr_at(constant, 100) == pytest.approx(1e-3)


def _megatron_wsd_lr(num_steps: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int,
                     wsd_decay_steps: int, style: str) -> float:
    """Megatron's OptimizerParamScheduler.get_lr for --lr-decay-style WSD, written out here from its
    definition: steps count samples (an iteration is global_batch_size of them), init_lr is 0."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * num_steps / warmup_steps
    if num_steps > decay_steps:
        return min_lr
    anneal_start = decay_steps - wsd_decay_steps
    if num_steps <= anneal_start:
        coeff = 1.0
    else:
        r = (num_steps - anneal_start) / wsd_decay_steps
        coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                 "exponential": 2.0 * math.pow(0.5, r) - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[style]
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["exponential", "linear", "cosine", "minus_sqrt"])
@pytest.mark.parametrize("warmup, decay, wsd", [(10, 110, 20), (10, 120, 120), (0, 120, 1)])
def test_wsd_schedule_is_megatrons_for_the_same_flags(style, warmup, decay, wsd):
    """Every iteration's learning rate, scheduled by iterations and by samples, against Megatron's
    formula for the same flags (a decay as long as the whole schedule included)."""
    gbs = 8
    by_iters = Config(mock_data=True, lr=1e-3, min_lr=1e-5, global_batch_size=gbs, train_iters=120,
                      lr_warmup_iters=warmup, lr_decay_iters=decay, lr_decay_style="WSD", lr_wsd_decay_style=style,
                      lr_wsd_decay_iters=wsd)
    by_samples = Config(mock_data=True, lr=1e-3, min_lr=1e-5, global_batch_size=gbs, train_samples=120 * gbs,
                        lr_warmup_samples=warmup * gbs, lr_decay_samples=decay * gbs, lr_decay_style="WSD",
                        lr_wsd_decay_style=style, lr_wsd_decay_samples=wsd * gbs)
    for iteration in range(1, 121):
        theirs = _megatron_wsd_lr(iteration * gbs, 1e-3, 1e-5, warmup * gbs, decay * gbs, wsd * gbs, style)
        assert lr_at(by_iters, iteration) == pytest.approx(theirs, rel=1e-12, abs=1e-15), iteration
        assert lr_at(by_samples, iteration) == pytest.approx(theirs, rel=1e-12, abs=1e-15), iteration
    stable = [lr_at(by_iters, i) for i in range(warmup + 1, decay - wsd + 1)]
    assert stable == [1e-3] * len(stable)


@pytest.mark.parametrize("fields, says", [
    (dict(lr_decay_style="WSD"), "lr_decay_style=WSD decays over the last lr_wsd_decay_iters"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=200), "lr_wsd_decay_iters=200: the decay "
                                                          "lies within lr_decay_iters=120"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=0), "lr_wsd_decay_iters=0"),
    (dict(lr_wsd_decay_iters=20), "lr_wsd_decay_iters is set but lr_decay_style=cosine"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_samples=20), "lr_wsd_decay_samples is set but the schedule counts by "
                                                           "train_iters"),
    (dict(lr_decay_style="WSD", lr_wsd_decay_iters=20, lr_wsd_decay_style="step"), "lr_wsd_decay_style"),
])
def test_a_wsd_schedule_that_cannot_be_is_refused_by_field(fields, says):
    with pytest.raises(ConfigError) as e:
        Config(mock_data=True, train_iters=120, **fields).validate(1)
    assert says in str(e.value), str(e.value)


def test_lr_schedule_by_samples():
    c = Config(mock_data=True, lr=1e-3, min_lr=1e-4, global_batch_size=8, train_samples=960,
               lr_warmup_samples=80, lr_decay_samples=880)
    assert c.total_iters == 120
    assert lr_at(c, 5) == pytest.approx(5e-4)          # 40 of 80 warmup samples
    assert lr_at(c, 10) == pytest.approx(1e-3)
    assert lr_at(c, 60) == pytest.approx(5.5e-4)       # 480 samples: half way through the decay
    assert lr_at(c, 110) == pytest.approx(1e-4)
    # The same schedule given in iterations gives the same rates.
    by_iters = Config(mock_data=True, lr=1e-3, min_lr=1e-4, global_batch_size=8, train_iters=120,
                      lr_warmup_iters=10, lr_decay_iters=110)
    assert [lr_at(c, i) for i in range(1, 121)] == pytest.approx([lr_at(by_iters, i) for i in range(1, 121)])


def test_one_key_value_rule_types_each_value_by_its_field():
    """gpt.config.overrides.parse_overrides is the one reading of KEY=VALUE: the flow's command line, gpt.train
    and gpt.memory give one text one value."""
    from flows.cli import parse_args
    from gpt.config.overrides import parse_overrides

    items = ["lr=3e-4", "compile=False", "lr_decay_iters=null", "train_iters=20", "run_dir=1e3", "model=gpt3-125m"]
    values, problems = parse_overrides(items)
    assert problems == []
    assert values == {"lr": 3e-4, "compile": False, "lr_decay_iters": None, "train_iters": 20, "run_dir": "1e3",
                      "model": "gpt3-125m"}
    assert type(values["train_iters"]) is int and type(values["lr"]) is float
    assert parse_args([arg for item in items for arg in ("--set", item)])["training"].overrides == values
    _, problems = parse_overrides(["train_iters=1.5", "compile=yes", "seed", "lr=inf"])
    assert problems == [("train_iters", "train_iters='1.5': expected a whole number"),
                        ("compile", "compile='yes': expected true or false"),
                        ("", "--set 'seed': expected KEY=VALUE"), ("lr", "lr='inf': must be a finite number")]


def test_problems_name_their_field_so_the_plan_never_parses_a_message():
    from gpt.config import Config

    found = Config(model="tiny", lr=1e-3, min_lr=1.0, train_iters=10, train_samples=100, mock_data=True).problems()
    assert ("min_lr", "min_lr=1.0 must lie between 0 and lr=0.001") in found
    assert any(field == "" and message.startswith("set exactly one of train_iters") for field, message in found)
    with pytest.raises(ConfigError) as e:
        Config(model="tiny", micro_batch_size="lots")
    assert e.value.field == "micro_batch_size"


def test_every_field_is_in_one_section_under_its_own_name():
    import dataclasses

    from gpt.config import SECTIONS, RunSection

    c = Config.from_preset("gpt3-1.3b", tensor_parallel=2, lr=1e-4)
    owned = [f.name for section in SECTIONS.values() for f in dataclasses.fields(section)]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(Config)) and len(owned) == len(set(owned))
    assert c.section("model")["hidden_size"] == 2048 and c.section("parallel")["tensor_parallel"] == 2
    assert c.section("schedule")["lr"] == c.lr == 1e-4 and "lr" not in c.section("run")
    assert c.schedule.lr == 1e-4 and c.parallel.tensor_parallel == 2 and c.architecture.hidden_size == 2048
    assert isinstance(c.run, RunSection) and not hasattr(c.run, "lr")


def test_the_initial_weights_spread_as_init_method_std_says_the_output_layers_scaled():
    import torch

    from gpt.model import GPT

    torch.manual_seed(0)
    config = Config(mock_data=True, device="cpu", precision="fp32", train_iters=1, init_method_std=0.05)
    weights = dict(GPT(config).named_parameters())
    scaled = 0.05 / math.sqrt(2 * config.num_layers)
    assert float(weights["wte.weight"].std()) == pytest.approx(0.05, rel=0.02)
    for i in range(config.num_layers):
        assert float(weights[f"h.{i}.attn.qkv.weight"].std()) == pytest.approx(0.05, rel=0.03)
        assert float(weights[f"h.{i}.mlp.c_fc.weight"].std()) == pytest.approx(0.05, rel=0.03)
        assert float(weights[f"h.{i}.attn.c_proj.weight"].std()) == pytest.approx(scaled, rel=0.03)
        assert float(weights[f"h.{i}.mlp.c_proj.weight"].std()) == pytest.approx(scaled, rel=0.03)
    assert Config.from_preset("gpt3-175b", mock_data=True).init_method_std == 0.006
    with pytest.raises(ConfigError, match="init_method_std=0.0: must lie between 0 and 1"):
        Config(mock_data=True, train_iters=1, init_method_std=0).validate(1)
