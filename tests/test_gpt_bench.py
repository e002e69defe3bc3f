"""gpt.bench runs real training steps and reports its figures."""
import json
import subprocess
import sys

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
