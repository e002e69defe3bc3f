"""gpt.bench runs real training steps and reports its figures."""
import json
import subprocess
import sys

import pytest
import torch

from gpt import bench
from tests.fixtures_gpt import ROOT


def test_run_reports_throughput_and_memory():
    r = bench.run(model="tiny", micro_batch=2, grad_accum=2, steps=2, warmup=1, seq_length=32, vocab_size=256, device="cpu")
    h = 128  # tiny: 4 layers of 12h² + 13h, token and position embeddings, final LayerNorm
    assert (r["device"], r["precision"], r["params"]) == ("cpu", "fp32", 4 * (12 * h * h + 13 * h) + 256 * h + 32 * h + 2 * h)
    assert r["tokens_per_s"] == 4 * 32 / (r["step_time_ms"] / 1000)
    assert r["peak_memory_bytes"] > 0 and r["mfu"] is None  # no CPU peak in the table
    assert 4.0 < r["final_loss"] < 7.0
    with_peak = bench.run(model="tiny", micro_batch=2, steps=1, warmup=0, seq_length=32, vocab_size=256,
                          device="cpu", peak_flops=1e12)
    assert 0 < with_peak["mfu"] < 1


def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "gpt.bench", "--model", "tiny", "--micro-batch", "1", "--steps", "1",
                          "--warmup", "0", "--seq-length", "16", "--vocab-size", "128", "--device", "cpu"],
                         capture_output=True, text=True, cwd=ROOT, check=True, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert json.loads(out.stdout)["steps"] == 1


@pytest.mark.timeout(120)
def test_huggingface_peer_row_with_its_memory_and_ratio():
    r = bench.run(model="tiny", micro_batch=2, steps=2, warmup=1, seq_length=32, vocab_size=256, device="cpu", peer=True)
    assert "eager" not in r and r["compile"] is False
    hf = r["hf"]
    assert hf["tokens_per_s"] > 0 and hf["peak_memory_bytes"] > 0 and 4.0 < hf["final_loss"] < 7.0
    assert r["ours_vs_hf_tokens_per_s"] == r["tokens_per_s"] / hf["tokens_per_s"]


@pytest.mark.timeout(240)
def test_compare_eager_measures_the_compiled_model_against_the_eager_one():
    r = bench.run(model="tiny", micro_batch=2, steps=2, warmup=1, seq_length=32, vocab_size=256, device="cpu",
                  compare_eager=True, compile_scope="model")
    assert (r["compile"], r["compile_scope"], r["eager"]["compile"]) == (True, "model", False)
    assert r["peak_memory_bytes"] > 0 and r["eager"]["peak_memory_bytes"] > 0
    assert r["ours_vs_eager_tokens_per_s"] == r["tokens_per_s"] / r["eager"]["tokens_per_s"]
    assert r["final_loss"] == pytest.approx(r["eager"]["final_loss"], rel=1e-4)   # the same model, the same steps


@pytest.mark.timeout(150)
@pytest.mark.parametrize("start", [4, 64])
def test_find_micro_batch_doubles_or_halves_to_the_largest_under_the_cap(start):
    """tiny at sequence 128, 8192-entry vocabulary: a training step of micro-batch 16 holds about
    0.22 GB, 32 about 0.43 GB; the cap lies between them."""
    cap_gib = 0.3
    r = bench.run(model="tiny", micro_batch=start, steps=1, warmup=1, vocab_size=8192, device="cpu",
                  find_micro_batch=True, memory_cap_gib=cap_gib)
    search = r["micro_batch_search"]
    peaks = {int(k): v for k, v in search["peak_memory_bytes"].items()}
    assert r["micro_batch"] == search["largest"] == 16
    assert sorted(peaks) == ([4, 8, 16, 32] if start == 4 else [16, 32, 64])
    assert peaks[16] <= cap_gib * 2 ** 30 < peaks[32]
    assert r["tokens_per_s"] > 0


def test_find_micro_batch_refusals():
    with pytest.raises(ValueError, match="find_micro_batch on cpu needs memory_cap_gib"):
        bench.run(model="tiny", micro_batch=2, steps=1, seq_length=16, vocab_size=256, device="cpu", find_micro_batch=True)
    with pytest.raises(ValueError, match="micro-batch 1 does not fit"):
        bench.run(model="tiny", micro_batch=2, steps=1, vocab_size=8192, device="cpu", find_micro_batch=True,
                  memory_cap_gib=1e-6)


@pytest.mark.timeout(120)
def test_auto_compile_scope_is_the_whole_model_for_one_cuda_process_and_blocks_otherwise():
    from gpt.config import Config
    from gpt.parallel.build import build_model, compile_scope
    from gpt.parallel.dims import ParallelDims

    auto = Config(model="tiny")
    assert auto.compile_scope == "auto"
    assert compile_scope(auto, torch.device("cuda"), 1) == "model"
    assert compile_scope(auto, torch.device("cuda"), 8) == "blocks"
    assert compile_scope(auto, torch.device("cpu"), 1) == "blocks"
    assert compile_scope(Config(model="tiny", compile_scope="model"), torch.device("cpu"), 4) == "model"
    # build_model applies the decision: on CPU, each block is compiled and the model is not.
    model = build_model(Config(model="tiny", compile=True, device="cpu", precision="fp32"), ParallelDims(0, 1, 0, None),
                        torch.device("cpu"))
    assert model.h["0"]._compiled_call_impl is not None and model._compiled_call_impl is None
    whole = build_model(Config(model="tiny", compile=True, compile_scope="model", device="cpu", precision="fp32"),
                        ParallelDims(0, 1, 0, None), torch.device("cpu"))
    assert whole._compiled_call_impl is not None and whole.h["0"]._compiled_call_impl is None


@pytest.mark.timeout(240)
def test_profile_writes_a_trace_and_sorts_kernels_by_kind(tmp_path):
    r = bench.run(model="tiny", micro_batch=2, steps=1, warmup=1, seq_length=32, vocab_size=256, device="cpu",
                  profile_dir=str(tmp_path), profile_steps=2)
    p = r["profile"]
    assert p["steps"] == 2 and p["wall_ms_per_step"] > 0
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    assert bench.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    assert bench.kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert bench.kernel_kind("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>") == "optimizer"
    assert bench.kernel_kind("triton_red_fused_native_layer_norm_backward_9") == "triton"
    assert bench.kernel_kind("triton_tem_fused_mm_3") == "matmul" and bench.kernel_kind("scatter_add_kernel") == "other"


@pytest.mark.timeout(180)
def test_pipeline_row_trains_the_same_model_in_stages_with_each_stages_memory():
    r = bench.run(model="tiny", micro_batch=2, grad_accum=4, steps=2, warmup=1, seq_length=32, vocab_size=256,
                  device="cpu", pipeline_parallel=2)
    pipe = r["pipeline"]
    assert (pipe["pipeline_parallel"], pipe["schedule"], pipe["micro_batches"]) == (2, "1f1b", 4)
    assert pipe["bubble_fraction"] == pytest.approx(1 / 5)   # (pp - 1) / (micro-batches + pp - 1)
    assert len(pipe["peak_memory_bytes_per_stage"]) == 2 and min(pipe["peak_memory_bytes_per_stage"]) > 0
    assert pipe["tokens_per_s"] == 8 * 32 / (pipe["step_time_ms"] / 1000)
    assert r["ours_vs_pipeline_tokens_per_s"] == r["tokens_per_s"] / pipe["tokens_per_s"]
    assert pipe["final_loss"] == pytest.approx(r["final_loss"], rel=1e-4)   # the same model, the same steps
    with pytest.raises(ValueError, match="pipeline_parallel"):
        bench.run(model="tiny", micro_batch=2, grad_accum=1, steps=1, warmup=0, seq_length=32, vocab_size=256,
                  device="cpu", pipeline_parallel=2)
