"""torch.compile with a cache directory: a precompile run fills it, the training run loads it."""
import json

import pytest

from tests.fixtures_gpt import SMALL, read_metrics


def test_precompile_fills_cache_that_training_loads(gpt_launcher, tmp_path):
    cache = tmp_path / "cache"
    base = {**SMALL, "compile": True, "compile_cache_dir": str(cache)}
    out = gpt_launcher.run({**base, "precompile": True, "run_dir": str(tmp_path / "pre")})
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["status"], summary["iteration"]) == ("completed", 3)  # precompile_iters
    assert summary["compile_cache_hit"] is False
    assert (cache / "artifacts-rank0.bin").stat().st_size > 0
    assert not (tmp_path / "pre" / "metrics.jsonl").exists() and not (tmp_path / "pre" / "checkpoints").exists()

    run_dir = tmp_path / "run"
    out = gpt_launcher.run({**base, "run_dir": str(run_dir)})
    assert json.loads(out.strip().splitlines()[-1])["compile_cache_hit"] is True
    eager = tmp_path / "eager"
    gpt_launcher.run({**SMALL, "run_dir": str(eager)})
    assert [r["lm_loss"] for r in read_metrics(run_dir)] == pytest.approx(
        [r["lm_loss"] for r in read_metrics(eager)], rel=1e-4)
