"""precision fp8: torchao float8 linears in the blocks, refused where float8 matmuls cannot run.

No GPU here: the conversion and a few training steps run in torchao's emulation (float8 numerics
with ordinary matmuls), which is the code path of a Hopper GPU but for the matmul kernel."""
import pytest
import torch

from gpt.config import Config, ConfigError
from gpt.model import GPT
from gpt.parallel.build import convert_to_float8, require_float8_device

torchao_float8 = pytest.importorskip("torchao.float8")

_SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=300, mock_data=True)


def test_fp8_is_refused_where_float8_matmuls_cannot_run():
    for device in ("cpu", "neuron"):
        with pytest.raises(ConfigError, match=f"precision='fp8' needs an NVIDIA GPU of the Hopper generation or later.*"
                                              f"not device='{device}'"):
            Config(**_SMALL, device=device, precision="fp8").validate()
    Config(**_SMALL, device="cuda", precision="fp8").validate()       # decided on the GPU itself, below
    with pytest.raises(ConfigError, match="fp8_recipe='delayed': choose one of tensorwise, rowwise"):
        Config(**_SMALL, device="cuda", precision="fp8", fp8_recipe="delayed").validate()
    with pytest.raises(ConfigError, match="precision='fp8' needs hidden_size divisible by 16"):
        Config(**{**_SMALL, "hidden_size": 72}, device="cuda", precision="fp8").validate()
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU of the Hopper generation.*this job runs on device cpu"):
        require_float8_device(torch.device("cpu"))


def _model(recipe: str | None) -> GPT:
    """The model as build_model makes it (meta, convert, materialise, initialise by name)."""
    config = Config(**_SMALL)
    with torch.device("meta"):
        model = GPT(config)
    if recipe is not None:
        convert_to_float8(model, recipe, emulate=True)
    model.to_empty(device="cpu")
    model.lm_head.weight = model.wte.weight
    model.init_weights()
    return model


def _train(model: GPT, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 300, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linears_train_like_bf16(recipe):
    Float8Linear = torchao_float8.float8_linear.Float8Linear
    fp8 = _model(recipe)
    converted = {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"h.{i}.{layer}" for i in range(2) for layer in ("attn.qkv", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert fp8.lm_head.weight is fp8.wte.weight and type(fp8.lm_head) is torch.nn.Linear
    bf16 = _model(None)
    assert fp8.state_dict().keys() == bf16.state_dict().keys()         # checkpoints and export see the same names
    assert all(torch.equal(a, b) for a, b in zip(fp8.state_dict().values(), bf16.state_dict().values()))
    got, expected = _train(fp8, 8), _train(bf16, 8)
    assert got[-1] < got[0] - 0.5                                      # it learns
    assert got == pytest.approx(expected, rel=0.02)                    # and follows the bf16 curve
    assert got != expected                                             # with float8 numerics, not bf16's


def test_the_flow_refuses_fp8_unless_the_cluster_has_hopper_gpus_or_later(tmp_path, monkeypatch, operator_preset):
    """Decided from the cluster preset's accelerator, before anything is submitted."""
    from flows.plan.build import make_plan
    from flows.plan.params import (
        ClusterParams,
        DataParams,
        OutputParams,
        ParameterError,
        TokenizerParams,
        TrainingParams,
    )

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)      # the machine that runs the flow: no GPU

    def plan(cluster: ClusterParams):
        return make_plan(model="tiny", data=DataParams(), tokenizer=TokenizerParams(),
                         training=TrainingParams(precision="fp8"), cluster=cluster,
                         output=OutputParams(root=str(tmp_path)))

    one_gpu = {"nodes": 1, "tasks_per_node": 1, "gpus_per_node": 1}
    h100 = plan(ClusterParams(preset=operator_preset("p4d-8gpu", accelerator="h100"), overrides=one_gpu))
    assert (h100.config.device, h100.config.precision) == ("cuda", "fp8")
    for cluster, where in ((ClusterParams(preset="p4d-8gpu", overrides=one_gpu), "a100"),
                           (ClusterParams(preset="slurm-local"), "cpu"),
                           (ClusterParams(preset="trn1-32xl", overrides={"nodes": 1, "tasks_per_node": 1}), "trn1")):
        with pytest.raises(ParameterError) as e:
            plan(cluster)
        assert any(m.startswith("training.precision: fp8 needs NVIDIA GPUs of the Hopper generation or later") and
                   f"runs on {where}" in m for m in e.value.errors), e.value.errors


def test_fp8_layers_large_keeps_the_projections_too_small_to_gain_in_bf16():
    """At GPT-3 1.3B (hidden 2048) rowwise float8 gains on q/k/v (6144 x 2048) and the MLP's first
    layer (8192 x 2048), not on the 2048-wide output projections; tensorwise gains on all four."""
    from gpt.parallel.build import float8_gains

    Float8Linear = torchao_float8.float8_linear.Float8Linear
    for recipe, kept in (("rowwise", {"attn.qkv", "mlp.c_fc"}),
                         ("tensorwise", {"attn.qkv", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"})):
        with torch.device("meta"):
            model = GPT(Config(model="gpt3-1.3b", mock_data=True))
        convert_to_float8(model, recipe, "large")
        converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert converted == {f"h.{i}.{layer}" for i in range(24) for layer in kept}
    assert not float8_gains("tensorwise", 768, 100)                    # float8 shapes: multiples of 16
    assert not float8_gains("tensorwise", 1024, 4096) and float8_gains("tensorwise", 1040, 4096)
