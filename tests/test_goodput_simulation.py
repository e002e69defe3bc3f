"""benchmarks.goodput's simulation against the renewal-reward formula it must agree with, and the
order of its answers (spares and a quarantine never cost goodput below their break-even)."""
import random

import pytest

from benchmarks.goodput import FAULTS_PER_NODE_HOUR, Setting, simulate, table

pytestmark = pytest.mark.timeout(120)


def test_resubmit_with_a_quarantine_is_the_renewal_reward_formula():
    """Faults arrive at rate r while training; each costs the work since the checkpoint (c / 2 on
    average) and the time to train again D: goodput = (1/r - c/2) / (1/r + D)."""
    s = Setting()
    rate = s.nodes * FAULTS_PER_NODE_HOUR
    down = (s.hang_share * s.hang_timeout_h + (1 - s.hang_share) * s.exit_detection_h + s.requeue_hold_h
            + s.queue_wait_h + s.job_start_h)
    want = (1 / rate - s.checkpoint_interval_h / 2) / (1 / rate + down)
    rng = random.Random(3)
    got = sum(simulate(s, 0, False, True, rng) for _ in range(400)) / 400
    assert got == pytest.approx(want, abs=0.01)


def test_spares_and_a_quarantine_raise_goodput_where_the_queue_is_slow():
    rows = {(r["restart"], r["spares"], r["quarantine"]): r["goodput"] for r in table(Setting(), 100, 1)}
    assert rows[("in the allocation", 8, True)] > rows[("in the allocation", 1, True)] > rows[("resubmit", 0, True)]
    assert rows[("resubmit", 0, True)] > rows[("resubmit", 0, False)]
    # With no queue to wait in, a spare held all month costs more than the restarts it saves.
    quick = {(r["restart"], r["spares"]): r["goodput"] for r in table(Setting(queue_wait_h=0.0), 100, 1)
             if r["quarantine"]}
    assert quick[("in the allocation", 16)] < quick[("resubmit", 0)]
