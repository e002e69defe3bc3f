"""flows/plan/estimate.py, flows/plan/approval.py and flows/plan/provenance.py on their own: the arithmetic of the
plan's estimate, which figure it rests on, when a budget asks for approval, what a run folder
records of how it was made."""
from __future__ import annotations

import json
import subprocess

import pytest

from flows.plan import approval, estimate, provenance
from flows.plan.params import BudgetParams
from gpt.config import Config
from gpt.metrics import flops_per_token
from gpt.model import param_count
from tasks import benchmark_history
from tasks.benchmark_history import machine_facts
from tasks.cluster.config import load_cluster
from tests.fixtures_gpt import ROOT

pytestmark = pytest.mark.timeout(120)


def _bench_record(machine: dict, model: str, tokens_per_s: float, time: str = "2026-11-01T00:00:00+00:00",
                  precision: str = "bf16", device: str = "NVIDIA H100 80GB HBM3") -> dict:
    shape = Config(model=model)
    return {"time": time, "machine": machine,
            "results": {f"train-{model}": {"model": model, "params": param_count(shape), "seq_length": shape.seq_length,
                                           "tokens_per_s": tokens_per_s, "precision": precision, "device": device}}}


H100 = {"gpu": "NVIDIA H100 80GB HBM3", "key": "x|16|NVIDIA H100 80GB HBM3|1|0"}


def test_without_a_benchmark_a_gpu_cluster_assumes_the_stated_mfu_and_prices_its_node_hours():
    cluster = load_cluster("p4d-8gpu")                    # 16 x 8 A100, 32.77 USD a node-hour
    config = Config(model="gpt3-1.3b", train_iters=1000, global_batch_size=512, micro_batch_size=4, seq_length=2048)
    e = estimate.estimate(config, cluster, 0, [])
    per_token = flops_per_token(config, param_count(config))
    assert e.tokens == 1000 * 512 * 2048 and e.flops == pytest.approx(e.tokens * per_token)
    assert e.tokens_per_s_per_device == pytest.approx(0.35 * 312e12 / per_token)
    assert e.hours == pytest.approx(e.tokens / (e.tokens_per_s_per_device * 128) / 3600)
    assert e.node_hours == pytest.approx(16 * e.hours) and e.cost == pytest.approx(32.77 * e.node_hours)
    rows = dict(e.rows())
    assert "35% MFU" in rows["throughput"] and "USD" in rows["cost"]
    resumed = estimate.estimate(config, cluster, 750, [])      # a resume trains what is left
    assert resumed.tokens == e.tokens // 4 and resumed.cost == pytest.approx(e.cost / 4)


def test_a_measured_figure_of_the_same_accelerator_carries_over_to_another_model_by_flops_per_token():
    cluster = load_cluster("p4d-8gpu").model_copy(update={"accelerator": "h100"})
    config = Config(model="gpt3-1.3b", train_iters=10)
    other_gpu = {"gpu": "NVIDIA A10G", "key": "other"}
    history = [_bench_record(H100, "gpt3-125m", 437_700), _bench_record(other_gpu, "gpt3-1.3b", 1_000)]
    e = estimate.estimate(config, cluster, 0, history)
    small = Config(model="gpt3-125m")
    expected = 437_700 * flops_per_token(small, param_count(small)) / flops_per_token(config, param_count(config))
    assert e.tokens_per_s_per_device == pytest.approx(expected) and "gpt3-125m at 437,700 tokens/s" in e.source
    # The same model measured later on the same hardware is preferred over a newer one of another model.
    history.append(_bench_record(H100, "gpt3-1.3b", 57_800, time="2026-10-01T00:00:00+00:00"))
    history.append(_bench_record(H100, "gpt3-2.7b", 30_000, time="2026-11-20T00:00:00+00:00"))
    assert estimate.estimate(config, cluster, 0, history).tokens_per_s_per_device == pytest.approx(57_800)


def test_cpu_ranks_use_this_machines_own_benchmark_and_have_no_figure_without_one():
    cluster = load_cluster("local")
    config = Config(model="tiny", train_iters=300, precision="fp32")
    cpu = {"precision": "fp32", "device": "cpu"}
    e = estimate.estimate(config, cluster, 0, [_bench_record({"key": "another machine"}, "tiny", 9_000, **cpu)])
    assert e.tokens_per_s_per_device is None and e.hours is None and "benchmark flow" in e.source
    e = estimate.estimate(config, cluster, 0, [_bench_record(machine_facts(), "tiny", 9_000, **cpu)])
    assert e.tokens_per_s_per_device == pytest.approx(9_000) and e.hours is not None


def test_records_of_another_precision_or_another_gpu_or_no_shape_at_all_are_passed_over():
    cluster = load_cluster("p4d-8gpu").model_copy(update={"accelerator": "a10"})
    config = Config(model="gpt3-125m", train_samples=1_000_000)
    a100 = {"gpu": "NVIDIA A100-SXM4-80GB", "key": "a100 box"}
    bad = [None, [1, 2], {"machine": None}, {"machine": a100, "results": None},
           {"machine": {"gpu": "NVIDIA A10"}, "results": {"x": {"model": "gpt3-9000b", "params": 1, "tokens_per_s": 5,
                                                               "precision": "bf16"}}},
           {"machine": {"gpu": "NVIDIA A10"}, "results": {"y": "not a result"}},
           _bench_record({"gpu": "NVIDIA A10"}, "gpt3-125m", 50_000, precision="fp32"),
           _bench_record(a100, "gpt3-125m", 100_000)]           # an A100 is no A10
    e = estimate.estimate(config, cluster, 0, bad)
    assert "no benchmark of a a10" in e.source and e.tokens_per_s_per_device is None   # no A10 peak known
    assert e.tokens == config.total_iters * config.global_batch_size * config.seq_length   # a run counted in samples
    assert abs(e.tokens - 1_000_000 * config.seq_length) < config.global_batch_size * config.seq_length
    good = estimate.estimate(config, cluster, 0, [*bad, _bench_record({"gpu": "NVIDIA A10"}, "gpt3-125m", 20_000)])
    assert good.tokens_per_s_per_device == pytest.approx(20_000)


def test_a_local_gpu_run_uses_this_machines_benchmark_and_its_gpus_peak(monkeypatch):
    here = {"key": "this box", "gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(estimate, "_this_machine", lambda: here)
    cluster = load_cluster("local").model_copy(update={"device": "cuda"})
    config = Config(model="gpt3-125m", train_iters=100, precision="bf16", device="cuda")
    assert estimate.estimate(config, cluster, 0, [_bench_record(here, "gpt3-125m", 367_500)]).tokens_per_s_per_device \
        == pytest.approx(367_500)
    assumed = estimate.estimate(config, cluster, 0, [])
    assert "35% MFU of its 989 TFLOP/s" in assumed.source


def test_the_operators_caps_bound_every_runs_budget():
    caps = {"GPT_BUDGET_NODE_HOURS": "100", "GPT_BUDGET_COST": "5000"}
    assert approval.with_operator_caps(BudgetParams(), caps) == BudgetParams(node_hours=100, cost=5000)
    assert approval.with_operator_caps(BudgetParams(node_hours=10, cost=9e9), caps).model_dump() == \
        {"node_hours": 10, "cost": 5000, "wait_hours": 24}
    assert approval.with_operator_caps(BudgetParams(node_hours=10), {}) == BudgetParams(node_hours=10)
    from flows.plan.params import ParameterError

    with pytest.raises(ParameterError, match="GPT_BUDGET_COST='lots' where the flow runs is not a positive number"):
        approval.with_operator_caps(BudgetParams(), {"GPT_BUDGET_COST": "lots"})


def test_a_budget_asks_for_approval_only_above_it_or_when_nothing_can_be_estimated():
    config = Config(model="gpt3-1.3b", train_iters=1000, global_batch_size=512, micro_batch_size=4, seq_length=2048)
    e = estimate.estimate(config, load_cluster("p4d-8gpu"), 0, [])
    assert approval.over_budget(e, BudgetParams()) is None
    assert approval.over_budget(e, BudgetParams(node_hours=e.node_hours * 1.01, cost=e.cost * 1.01)) is None
    assert "node-hours estimated" in approval.over_budget(e, BudgetParams(node_hours=e.node_hours * 0.99))
    assert "USD estimated" in approval.over_budget(e, BudgetParams(cost=e.cost * 0.99))
    unpriced = estimate.estimate(config, load_cluster("p4d-8gpu").model_copy(update={"price_per_node_hour": None}), 0, [])
    assert "no price_per_node_hour" in approval.over_budget(unpriced, BudgetParams(cost=1e9))
    unknown = estimate.estimate(Config(model="tiny", train_iters=300, precision="fp32"), load_cluster("local"), 0, [])
    assert "no estimate of node-hours" in approval.over_budget(unknown, BudgetParams(node_hours=1e9))
    trained = estimate.estimate(config, load_cluster("p4d-8gpu"), 1000, [])
    assert approval.over_budget(trained, BudgetParams(node_hours=1e-9)) is None   # nothing left to train
    form = approval.approval_form(e, "too much")
    assert "**Over budget:** too much." in form and "| node-hours |" in form


def test_the_price_is_the_operators_not_the_forms():
    from tasks.cluster.config import ClusterError

    with pytest.raises(ClusterError, match="price_per_node_hour is set only by the operator"):
        load_cluster("p4d-8gpu", price_per_node_hour=0.01)


def test_an_unreadable_history_is_a_warning_and_only_the_shipped_figures_count(tmp_path, monkeypatch, caplog):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "history.jsonl").write_text("{not json\n")
    monkeypatch.delenv(estimate.HISTORY_ENV, raising=False)
    assert estimate.read_history(tmp_path) == benchmark_history.reference()
    assert "history.jsonl:1" in caplog.text


def test_the_shipped_gpu_figures_are_the_estimate_of_a_cluster_of_that_gpu(tmp_path, monkeypatch):
    """benchmarks/reference.jsonl: what benchmarks/gpu.py measured on an H200; an H200 cluster's
    estimate rests on it, and the benchmark flow compares an H200 node's run with it."""
    monkeypatch.delenv(estimate.HISTORY_ENV, raising=False)
    history = estimate.read_history(tmp_path)
    shipped = {label: r for record in history for label, r in record["results"].items()}
    assert shipped["gpu-1.3b-bf16"]["device"] == "NVIDIA H200" and shipped["gpu-1.3b-bf16"]["tokens_per_s"] > 0
    config = Config(model="gpt3-1.3b", train_iters=10)
    e = estimate.estimate(config, load_cluster("p4d-8gpu").model_copy(update={"accelerator": "h200"}), 0, history)
    assert e.tokens_per_s_per_device == pytest.approx(shipped["gpu-1.3b-bf16"]["tokens_per_s"])
    assert "benchmark gpu-1.3b-bf16 of 2026-11-26" in e.source
    h200_node = {"gpu": "NVIDIA H200", "gpu_count": 1, "key": "another cpu|64|NVIDIA H200|1|0"}
    record = {"machine": h200_node, "metrics": {"gpu-1.3b-bf16.tokens_per_s": 30_000.0}}
    (row,) = benchmark_history.compare(record, history, 0.1)
    assert row["previous"] == shipped["gpu-1.3b-bf16"]["tokens_per_s"] and row["regression"]
    (row,) = benchmark_history.compare({**record, "machine": {**h200_node, "gpu_count": 8}}, history, 0.1)
    assert row["previous"] is None                                   # eight GPUs are other hardware


def test_the_run_folder_records_each_start_with_the_commit_and_the_package_versions(tmp_path):
    provenance.record(tmp_path, "run-1", {"model": "tiny"})
    provenance.record(tmp_path, "run-2", {"model": "tiny"})
    starts = json.loads((tmp_path / "provenance.json").read_text())["starts"]
    assert [s["flow_run_id"] for s in starts] == ["run-1", "run-2"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert starts[0]["git_commit"] == head and isinstance(starts[0]["git_dirty"], bool)
    assert {"torch", "prefect", "gpt-core"} <= set(starts[0]["packages"]) and starts[0]["parameters"] == {"model": "tiny"}


def test_training_progress_shows_the_time_left_and_the_cost_so_far():
    from tasks.train.watch import eta_and_cost

    priced = load_cluster("p4d-8gpu")                       # 16 nodes at 32.77 USD
    assert eta_and_cost(600, 300.0, 1800.0, priced) == "ETA 3 min, 262.16 USD so far"
    assert eta_and_cost(10_000, 50.0, 10.0, load_cluster("local")) == "ETA 8 min"
