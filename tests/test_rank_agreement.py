"""All ranks take the same decision from the reduced gradients: a non-finite gradient on one rank
skips the step on every rank (none waits alone in a collective), and the ranks keep equal weights."""
import json
import math
import re

import pytest

from tests.fixtures_gpt import SMALL, read_metrics

# Rank 1's loss, and so its gradients, are NaN in iteration 3 (its 5th and 6th micro-batch).
NAN_ON_RANK_1_AT_3 = """
import os, torch, gpt.model as _model, gpt.checkpoint as _ckpt
_forward, _calls = _model.GPT.forward, [0]
def _nan_at_3(self, *args, **kwargs):
    out = _forward(self, *args, **kwargs)
    if self.training:
        _calls[0] += 1
        if os.environ["RANK"] == "1" and _calls[0] in (5, 6):
            out = out * float("nan")
    return out
_model.GPT.forward = _nan_at_3
_save = _ckpt.Checkpointer.save
def _save_and_print(self, iteration, model, optimizer, state):
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"weights at {iteration} on rank {os.environ['RANK']}: {total!r}", flush=True)
    return _save(self, iteration, model, optimizer, state)
_ckpt.Checkpointer.save = _save_and_print
"""


@pytest.mark.timeout(180)
def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(gpt_launcher, tmp_path):
    run = tmp_path / "run"
    results = gpt_launcher.wait(gpt_launcher.start({**SMALL, "run_dir": str(run)}, 2, prelude=NAN_ON_RANK_1_AT_3))
    assert [rc for rc, _ in results] == [0, 0], results[1][1][-3000:]
    records = {r["iteration"]: r for r in read_metrics(run)}
    assert [records[i]["skipped"] for i in range(1, 9)] == [0, 0, 1, 0, 0, 0, 0, 0]
    assert math.isnan(records[3]["grad_norm"]) and records[3]["nan"] == 1
    assert all(math.isfinite(records[i]["lm_loss"]) for i in range(4, 9))
    weights = [dict(re.findall(r"weights at (\d+) on rank \d: (\S+)", out)) for _, out in results]
    assert weights[0] == weights[1] and set(weights[0]) == {"4", "8"}
    assert json.loads(results[0][1].strip().splitlines()[-1])["status"] == "completed"
