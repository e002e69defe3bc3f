"""A full disk or a read-only folder: one-line errors naming the path and what to do, and nothing
half-written left behind (the run folder's records, the export, the index), on real small tmpfs mounts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt.data import IndexedDatasetWriter
from gpt.export import export
from gpt.files import WriteError, write_json
from gpt.metrics import MetricsWriter
from tests.fixtures_disk import read_only

ROOT = Path(__file__).resolve().parent.parent


def fill(folder: Path, leave: int = 0) -> None:
    """Take all but ``leave`` bytes of the free space of ``folder``'s file system."""
    st = os.statvfs(folder)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(folder / "filler", "wb") as f:
        try:
            while size > 0:
                size -= f.write(b"\0" * min(size, 1 << 20))
        except OSError:
            pass


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.timeout(30)
def test_a_json_record_on_a_full_disk_keeps_the_old_one_and_leaves_nothing(disk):
    d = disk("2m")
    path = d / "state.json"
    write_json(path, {"iteration": 1})
    fill(d)
    with pytest.raises(WriteError) as e:
        write_json(path, {"iteration": 2, "notes": "x" * 200_000})
    assert str(e.value) == (f"cannot write {path}: no space left on the device: free space in {d} "
                            "(or write elsewhere) and run it again")
    assert json.loads(path.read_text()) == {"iteration": 1}
    assert entries(d) == ["filler", "state.json"]


@pytest.mark.timeout(30)
def test_a_json_record_in_a_read_only_folder_names_it(disk):
    d = disk("2m")
    path = d / "state.json"
    write_json(path, {"iteration": 1})
    read_only(d)
    with pytest.raises(WriteError, match=rf"cannot write {path}: {d} is on a read-only file system: make it writable"):
        write_json(path, {"iteration": 2})
    assert json.loads(path.read_text()) == {"iteration": 1}


@pytest.mark.timeout(30)
def test_metrics_stop_at_a_whole_record_when_the_disk_fills(disk):
    d = disk("2m")
    metrics = MetricsWriter(str(d / "run"), enabled=True)
    metrics.valid(0, 0, 9.0)
    fill(d)
    with pytest.raises(WriteError) as e:
        for i in range(1, 100_000):
            metrics.valid(i, i * 8, 9.0 - i * 1e-5)
    path = d / "run" / "metrics.jsonl"
    assert str(e.value).startswith(f"cannot write {path}: no space left on the device: free space in {d / 'run'}")
    text = path.read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]          # no record cut short
    assert [r["iteration"] for r in records] == list(range(len(records))) and len(records) > 1


@pytest.mark.timeout(30)
def test_metrics_in_a_read_only_run_folder_name_it(disk):
    d = disk("2m")
    (d / "run").mkdir()
    read_only(d)
    with pytest.raises(WriteError, match=rf"cannot write {d}/run/metrics.jsonl: {d}/run is on a read-only file system"):
        MetricsWriter(str(d / "run"), enabled=True)


@pytest.mark.timeout(60)
def test_an_export_onto_a_full_disk_keeps_the_previous_export_and_leaves_nothing(small_run, disk):
    d = disk("2m")
    out = export(small_run, d / "hf")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    fill(d, leave=16 << 10)
    with pytest.raises(WriteError) as e:
        export(small_run, out)
    assert str(e.value) == (f"cannot write {out}: no space left on the device: free space in {d} "
                            "(or write elsewhere) and run it again")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert entries(d) == ["filler", "hf"]

    result = subprocess.run([sys.executable, "-m", "gpt.export", str(small_run), str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert one_line_error(result) == f"error: {e.value}"
    assert entries(d) == ["filler", "hf"]


@pytest.mark.timeout(60)
def test_an_export_into_a_read_only_folder_names_it(small_run, disk):
    d = disk("2m")
    read_only(d)
    result = subprocess.run([sys.executable, "-m", "gpt.export", str(small_run), str(d / "hf")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert one_line_error(result) == (f"error: cannot write {d}/hf: {d} is on a read-only file system: "
                                      "make it writable (or write elsewhere) and run it again")
    assert entries(d) == []


@pytest.mark.timeout(60)
def test_the_export_stage_in_a_read_only_run_folder_names_it(small_run, disk):
    from gpt.tokenizer import Tokenizer
    from tasks.export import export_run

    d = disk("8m")
    run = Path(shutil.copytree(small_run, d / "run"))
    tokenizer = Tokenizer.in_folder(small_run / "tokenizer")
    read_only(d)
    with pytest.raises(WriteError, match=rf"cannot write {run}/tokenizer/vocab.json: {run}/tokenizer is on a read-only"):
        export_run(str(run), tokenizer)
    assert not (run / "hf").exists()


@pytest.mark.timeout(60)
def test_the_index_stage_on_a_full_disk_names_the_file_and_leaves_no_partial_one(tmp_path, disk):
    from tasks.index import build_indices

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "c_text_document", np.uint16) as w:
        for _ in range(200):
            w.add_document(rng.integers(0, 1000, rng.integers(50, 400)))
    d = disk("2m")
    out = d / "index"
    out.mkdir()
    fill(d, leave=8 << 10)
    with pytest.raises(WriteError, match=rf"cannot write {out}/\S+\.npy: no space left on the device: free space in {out}"):
        build_indices([str(tmp_path / "c_text_document")], seq_length=16, seed=1,
                      num_samples={"train": 200_000, "valid": 100, "test": 100}, out_dir=str(out))
    assert not [n for n in entries(out) if ".tmp-" in n]


@pytest.mark.timeout(60)
def test_training_a_bpe_on_a_full_disk_names_the_vocabulary_and_leaves_nothing(shakespeare_jsonl, disk):
    from tasks.tokenize.bpe import TokenizeError
    from tasks.tokenize.stage import tokenize

    d = disk("1m")
    out = d / "data"
    out.mkdir()
    fill(d, leave=8 << 10)
    with pytest.raises(TokenizeError, match=rf"training a BPE: cannot write {out}/vocab.json: no space left on the "
                                            rf"device: free space in {out}"):
        tokenize([str(shakespeare_jsonl)], str(out / "c"), train_vocab_size=2000, train_bytes=1 << 20)
    assert entries(out) == []


@pytest.mark.timeout(10)
def test_a_denied_read_elsewhere_is_not_blamed_on_the_output(tmp_path):
    from gpt.files import storage_error

    out, tmp = tmp_path / "run" / "hf", tmp_path / "run" / ".hf.tmp-1"
    reading = PermissionError(13, "Permission denied", str(tmp_path / "run" / "checkpoints" / "iter_0000008" / "0.distcp"))
    assert storage_error(reading, out, [tmp]) is None
    writing = PermissionError(13, "Permission denied", str(tmp / "model.safetensors"))
    assert str(storage_error(writing, out, [tmp])) == (f"cannot write {out}: permission denied: make {out.parent} "
                                                       "writable for this user (or write elsewhere) and run it again")


@pytest.mark.timeout(60)
def test_a_sync_that_the_destination_cannot_hold_is_refused_before_copying(disk, tmp_path):
    from tasks.sync import SyncError, sync

    source = tmp_path / "corpus"
    source.mkdir()
    (source / "a.jsonl").write_bytes(b'{"text": "x"}\n' * 250_000)      # 3.5 MB
    dest = disk("2m")
    with pytest.raises(SyncError, match=rf"1 files \(3.5 MB\) to copy into {dest}, which has .* free: free space"):
        sync([str(source)], str(dest))
    assert [p.name for p in dest.rglob("*") if p.is_file()] == []
