"""benchmarks.scale at its smallest sizes: every section runs and its figures agree with each other."""
import pytest

from benchmarks import scale


@pytest.mark.timeout(120)
def test_scale_benchmark_reports_consistent_figures():
    result = scale.run(ranks=[4, 16], tokens=[10_000_000])
    assert result["benchmark"] == "scale"
    assert "slurm" not in result

    beats = result["heartbeats"]
    assert [row["ranks"] for row in beats] == [4, 16]
    for row in beats:
        assert row["files"] == row["ranks"]
        assert 200 < row["file_bytes"] < 2000
        assert row["all_files_bytes"] == pytest.approx(row["file_bytes"] * row["ranks"], abs=1)
        assert row["check_ms_median"] > 0 and row["check_ms_min"] > 0

    metrics = result["metrics"]
    assert metrics["train_record_bytes"] > 100
    assert metrics["tensorboard_bytes_per_iteration"] > 0
    assert metrics["log_line_bytes"] > 100
    records = metrics["ranks_records"]
    assert [row["ranks"] for row in records] == [4, 16]
    assert records[1]["ranks_record_bytes"] > records[0]["ranks_record_bytes"]
    assert all(row["parse_ms_median"] > 0 for row in records)
    assert metrics["resume"]["metrics_bytes"] > 100 * records[1]["ranks_record_bytes"] and metrics["resume"]["read_s"] > 0

    index = result["index"]
    (row,) = index["measured"]
    assert row["tokens"] == 10_000_000 and row["documents"] == 5_000 and row["samples"] > 0
    assert row["build_s"] > 0 and row["first_build_s"] > 0
    assert row["index_bytes"] == sum(row["index_bytes_by_kind"].values())
    # int32 document index per document, sample index (2 x int32) and shuffle index (int32) per sample
    assert row["index_bytes_by_kind"]["document_index"] >= 4 * row["documents"]
    assert row["index_bytes_by_kind"]["sample_index"] >= 8 * row["samples"]
    assert row["index_bytes_per_billion_tokens"] == pytest.approx(row["index_bytes"] * 100, rel=1e-6)
    extrapolated = index["extrapolated"]
    assert extrapolated["tokens"] == 10 ** 12 and extrapolated["through_tokens"] == [10_000_000]
    assert extrapolated["index_bytes"] == pytest.approx(row["index_bytes_per_billion_tokens"] * 1000, rel=1e-6)
    assert extrapolated["build_s"] == pytest.approx(row["build_s_per_billion_tokens"] * 1000, rel=1e-2)

    measured = result["checkpoints"]["measured"]
    assert 12 < measured["bytes_per_parameter"] < 20
    assert measured["tensor_data_bytes_per_parameter"] == pytest.approx(12.0)   # weights, exp_avg, exp_avg_sq
    assert measured["bytes"] == sum(measured["files"].values())
    assert measured["shard_files_per_rank"] == 1
    assert measured["shared_files"] == len(measured["files"]) - 1
    presets = {p["model"]: p for p in result["checkpoints"]["arithmetic"]["presets"]}
    assert set(presets) == {"gpt3-175b", "gpt-310.1b"}
    assert 1.7e11 < presets["gpt3-175b"]["parameters"] < 1.8e11
    assert presets["gpt-310.1b"]["checkpoint_bytes"] > presets["gpt3-175b"]["checkpoint_bytes"]
    for preset in presets.values():
        assert preset["checkpoint_bytes"] >= 12 * preset["parameters"]
        assert [r["ranks"] for r in preset["per_rank"]] == [1024, 8000]
        for share in preset["per_rank"]:
            assert share["bytes_per_rank"] == pytest.approx(preset["checkpoint_bytes"] / share["ranks"], abs=1)
            assert share["files"] == share["ranks"] + measured["shared_files"]
