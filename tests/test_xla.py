"""The Trainium (torch-neuronx) code path, run on XLA:CPU in the XLA venv (``GPT_INSTALL_XLA=1 bash
scripts/install``): torch 2.9 and torch_xla 2.9, the lazy-tensor path torch-neuronx 2.9 uses, with
XLA:CPU in place of the Neuron compiler. tests/xla_probe.py runs there once and reports what it
measured; each test checks one property. Without the venv these tests are skipped, except in CI
(CI=true), where a missing venv fails them.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("GPT_XLA_VENV", ROOT / ".venv-xla"))
pytestmark = pytest.mark.timeout(480)


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    python = VENV / "bin" / "python"
    if not python.exists():
        missing = f"no XLA venv at {VENV}: build it with GPT_INSTALL_XLA=1 bash scripts/install"
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(missing)
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("xla")
    # XLA:CPU compiles each graph with LLVM; its optimisation passes are most of the probe's time and
    # none of what it measures (graphs, compilations, transfers, losses to 1e-5) depends on them.
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    env.pop("XLA_USE_BF16", None)
    done = subprocess.run([str(python), str(ROOT / "tests" / "xla_probe.py"), str(work)], env=env, cwd=work,
                          capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_neuron_device_is_the_xla_path(probe):
    assert probe["kind"] == "xla"


def test_losses_and_grad_norms_equal_the_cpu_path(probe):
    xla, cpu = probe["xla"], probe["cpu"]
    assert xla["loss"] == pytest.approx(cpu["loss"], rel=1e-5)
    assert xla["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-5)
    assert cpu["loss"][-1] != cpu["loss"][0]  # the steps changed the model
    assert all(xla["stepped"])


def test_one_graph_per_step_and_no_compilation_after_the_third(probe):
    steps = probe["xla"]["per_step"]
    assert steps[-1]["compiles"] == steps[2]["compiles"], steps
    executions = [b["executions"] - a["executions"] for a, b in zip(steps, steps[1:])]
    assert executions == [1] * (len(steps) - 1), steps
    assert all(s["transfers"] == 0 for s in steps), "a step read a value from the device"
    # The figures of all steps come back together, in one transfer and no extra graph.
    assert probe["xla"]["read"] == {"compiles": 0, "executions": 0, "transfers": 1}


def test_no_cpu_fallback_ops(probe):
    assert probe["xla"]["per_step"][-1]["fallbacks"] == {}


def test_a_checkpoint_save_is_one_transfer(probe):
    save = probe["checkpoint"]["save"]
    assert probe["checkpoint"]["tensors"] > 100
    assert (save["executions"], save["transfers"]) == (0, 1), save
    assert probe["checkpoint"]["loaded_equal"]


def test_stopped_and_resumed_run_gives_the_whole_run_losses(probe):
    run = probe["resume"]
    assert (run["first"]["status"], run["first"]["iteration"]) == ("interrupted", 4)
    assert run["second"]["status"] == "completed" and run["whole"]["status"] == "completed"
    assert run["resumed_losses"] == run["whole_losses"]
    assert len(run["whole_losses"]) == 8


def test_bf16_is_in_the_lowered_graph_not_in_the_environment(probe):
    assert probe["bf16_in_graph"] == {"bf16": True, "fp32": False}
    assert probe["xla_use_bf16"] is None


def test_gradients_are_reduced_before_the_norm_clip_and_skip(probe):
    """With a stand-in peer in the all-reduce, the norm is that of the reduced gradients, and a
    non-finite gradient on the peer skips the step here too."""
    finite, nan = probe["peer"]["finite"], probe["peer"]["nan"]
    assert finite["norm"] == pytest.approx(2 * finite["local_norm"], rel=1e-6)
    assert finite["stepped"] and not finite["params_unchanged"]
    assert math.isnan(nan["norm"]) and not nan["stepped"] and nan["params_unchanged"]


def test_torch_compile_is_refused_with_the_reason(probe):
    assert "torch.compile does not apply on xla" in probe["compile_refused"]


def test_tensor_parallel_layers_run_in_the_step_graph(probe):
    """gpt.parallel.xla's split layers over a group of one: their collectives are in the graph
    (one all-reduce per split lookup and output projection, one all-gather for the output layer),
    the losses are those without them, and a step is still one graph with no CPU fallback."""
    tp, plain = probe["tensor_parallel"], probe["xla"]
    assert (tp["all_reduce"], tp["all_gather"]) == (1 + 2 * 2, 1)
    assert "wte.weight" in tp["split"] and "h.1.mlp.c_fc.weight" in tp["split"] and "h.0.ln_1.weight" not in tp["split"]
    assert tp["train"]["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert tp["train"]["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6)
    steps = tp["train"]["per_step"]
    assert [b["executions"] - a["executions"] for a, b in zip(steps, steps[1:])] == [1] * (len(steps) - 1)
    assert steps[-1]["compiles"] == steps[2]["compiles"]
    # XLA's counters run from the start of the process: nothing is added to them by these steps.
    assert steps[-1]["fallbacks"] == tp["fallbacks_before"]
    assert len({s["transfers"] for s in steps}) == 1, "a step read a value from the device"


def test_the_llama_block_is_one_graph_a_step_with_the_cpu_paths_losses(probe):
    """Rotary positions, RMSNorm, SwiGLU, grouped K/V and an untied output layer on the XLA path:
    the losses and norms of the CPU path, one graph per step, nothing falling back to the CPU;
    split over a group of one, the gate and the output layer are split too and change nothing."""
    xla, cpu, tp = probe["llama"]["xla"], probe["llama"]["cpu"], probe["llama"]["tensor_parallel"]
    assert xla["loss"] == pytest.approx(cpu["loss"], rel=1e-5)
    assert xla["grad_norm"] == pytest.approx(cpu["grad_norm"], rel=1e-5)
    assert cpu["loss"][-1] != cpu["loss"][0] and all(xla["stepped"])
    steps = xla["per_step"]
    assert [b["executions"] - a["executions"] for a, b in zip(steps, steps[1:])] == [1] * (len(steps) - 1)
    assert steps[-1]["compiles"] == steps[2]["compiles"]
    assert len({s["transfers"] for s in steps}) == 1, "a step read a value from the device"
    assert steps[-1]["fallbacks"] == probe["llama"]["fallbacks_before"]
    assert {"h.0.mlp.c_gate.weight", "h.0.mlp.c_fc.weight", "lm_head.weight"} <= set(tp["split"])
    assert tp["train"]["loss"] == pytest.approx(xla["loss"], rel=1e-6)
    assert tp["train"]["grad_norm"] == pytest.approx(xla["grad_norm"], rel=1e-6)
    assert tp["train"]["per_step"][-1]["fallbacks"] == tp["fallbacks_before"]
