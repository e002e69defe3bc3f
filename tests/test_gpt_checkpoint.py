"""Checkpoints: stop on SIGTERM/SIGUSR2, a save killed half-way, bitwise-exact resume."""
import json
import os
import re
import subprocess
import time

import pytest

from gpt.config import Config
from gpt.optim import lr_at
from gpt.train import EXIT_INTERRUPTED
from tests.fixtures_gpt import SMALL, read_metrics

SIGNAL_AT = """
import os, signal, gpt.metrics as _m
_train = _m.MetricsWriter.train
def _signal_then_record(self, record):
    if record["iteration"] == {iteration} and os.environ["RANK"] == "{rank}":
        os.kill(os.getpid(), signal.{signal})
    _train(self, record)
_m.MetricsWriter.train = _signal_then_record
"""

KILL_WHILE_SAVING_4 = """
import os, signal, gpt.checkpoint as _ck
_mark = _ck._write_marker
def _die_before_marker(folder, content):
    if content["iteration"] == 4:
        os.kill(os.getpid(), signal.SIGKILL)  # every shard is written, the save is not complete
    _mark(folder, content)
_ck._write_marker = _die_before_marker
"""


def _losses(run_dir, kind="train"):
    key = "lm_loss" if kind == "train" else "valid_loss"
    return {r["iteration"]: r[key] for r in read_metrics(run_dir, kind)}


def _summary(out):
    return json.loads(out.strip().splitlines()[-1])


def test_sigterm_then_killed_save_then_exact_resume(gpt_launcher, tmp_path):
    config = {**SMALL, "keep_last": 2}
    reference = tmp_path / "reference"
    gpt_launcher.run({**config, "run_dir": str(reference)})

    run = tmp_path / "run"
    cfg = {**config, "run_dir": str(run)}
    out = gpt_launcher.run(cfg, prelude=SIGNAL_AT.format(iteration=3, rank=0, signal="SIGTERM"), expect_rc=EXIT_INTERRUPTED)
    summary = _summary(out)
    assert (summary["status"], summary["iteration"]) == ("interrupted", 3)
    assert (run / "checkpoints" / "iter_0000003" / "COMPLETE").is_file()

    out = gpt_launcher.run(cfg, prelude=KILL_WHILE_SAVING_4, expect_rc=-9)
    assert "resumed from" in out and "at iteration 3" in out
    (killed,) = (run / "checkpoints").glob("iter_0000004.tmp-*")      # named after the job that wrote it
    assert (killed / ".metadata").is_file()
    assert not (run / "checkpoints" / "iter_0000004").exists()

    out = gpt_launcher.run(cfg)
    assert re.search(r"resumed from \S+iter_0000003 at iteration 3", out)
    assert _summary(out)["status"] == "completed"
    assert _losses(run) == _losses(reference)  # bitwise: exact float equality at every iteration
    assert _losses(run, "valid") == _losses(reference, "valid")
    records = read_metrics(run)
    assert [r["iteration"] for r in records] == list(range(1, 9))  # no duplicates from the repeated iterations
    c = Config(**{k: v for k, v in cfg.items()})
    assert [r["lr"] for r in records] == [lr_at(c, i) for i in range(1, 9)]
    # keep_last=2, the killed save's remains are gone.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000004", "iter_0000008"]


@pytest.mark.parametrize("damage", ["truncated shard", "missing metadata"])
def test_a_damaged_newest_checkpoint_falls_back_then_is_set_aside_when_training_passes_it(gpt_launcher, tmp_path,
                                                                                          damage):
    config = {**SMALL, "keep_last": 3, "save_interval": 2}
    reference = tmp_path / "reference"
    gpt_launcher.run({**config, "run_dir": str(reference)})
    run = tmp_path / "run"
    cfg = {**config, "run_dir": str(run)}
    gpt_launcher.run(cfg, prelude=SIGNAL_AT.format(iteration=4, rank=0, signal="SIGTERM"), expect_rc=EXIT_INTERRUPTED)
    newest = run / "checkpoints" / "iter_0000004"        # a save point: training saves there again
    if damage == "truncated shard":
        shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        (newest / ".metadata").unlink()
    out = gpt_launcher.run(cfg)
    assert f"checkpoint {newest} is damaged (" in out and "falling back" in out
    assert re.search(r"resumed from \S+iter_0000002 at iteration 2", out)
    assert _losses(run) == _losses(reference)
    # The save at iteration 4 went through; the damaged folder is kept, under a name no resume takes.
    (kept,) = (run / "checkpoints").glob("iter_0000004.damaged-*")
    assert (kept / "COMPLETE").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_???????")) == \
        ["iter_0000004", "iter_0000006", "iter_0000008"]
    out = gpt_launcher.run({**cfg, "train_iters": 10, "lr_decay_iters": 8})
    assert re.search(r"resumed from \S+iter_0000008 at iteration 8", out) and "falling back" not in out


COUNT_METADATA_READS = """
import atexit, torch.distributed.checkpoint as _dcp
_reads = []
_read_metadata = _dcp.FileSystemReader.read_metadata
def _counted(self, *args, **kwargs):
    _reads.append(self.path)
    return _read_metadata(self, *args, **kwargs)
_dcp.FileSystemReader.read_metadata = _counted
atexit.register(lambda: print(f"METADATA READS {len(_reads)}", flush=True))
"""


def test_signal_on_one_rank_stops_both_at_the_same_iteration(gpt_launcher, tmp_path):
    reference = tmp_path / "reference"
    gpt_launcher.run({**SMALL, "run_dir": str(reference)}, world_size=2)
    run = tmp_path / "run"
    cfg = {**SMALL, "run_dir": str(run)}
    results = gpt_launcher.wait(gpt_launcher.start(cfg, 2, prelude=SIGNAL_AT.format(iteration=3, rank=1, signal="SIGUSR2")))
    assert [rc for rc, _ in results] == [EXIT_INTERRUPTED, EXIT_INTERRUPTED], results[0][1][-3000:]
    assert _summary(results[0][1])["iteration"] == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000003"]
    results = gpt_launcher.wait(gpt_launcher.start(cfg, 2, prelude=COUNT_METADATA_READS))
    assert [rc for rc, _ in results] == [0, 0], results[1][1][-3000:]
    assert _losses(run) == _losses(reference)
    # Rank 0 alone read the checkpoint's metadata (and checked its files); rank 1 got it from rank 0.
    assert [re.findall(r"METADATA READS (\d+)", text) for _, text in results] == [["1"], ["0"]]


def test_a_full_disk_fails_the_save_naming_the_folder_and_leaves_nothing_half_written(gpt_launcher, disk):
    run = disk("200k")
    cfg = {**SMALL, "run_dir": str(run)}
    ((rc, out),) = gpt_launcher.wait(gpt_launcher.start(cfg))
    assert rc != 0
    assert re.search(r"checkpoint iteration 4: cannot write \S+iter_0000004\.tmp-\S+: No space left on device; "
                     rf"free space in {run / 'checkpoints'}", out), out[-3000:]
    assert not list((run / "checkpoints").iterdir())           # no partial save, nothing to resume from
    subprocess.run(["mount", "-o", "remount,size=16m", str(run)], check=True)
    out = gpt_launcher.run(cfg)
    assert _summary(out)["status"] == "completed" and "resumed from" not in out


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint_and_drops_a_torn_line(tmp_path):
    from gpt.metrics import MetricsWriter

    writer = MetricsWriter(str(tmp_path), True, 0)
    for i in range(1, 6):
        writer.train({"iteration": i, "consumed_samples": 8 * i, "lm_loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
                      "loss_scale": 1.0, "elapsed_ms": 10.0, "tokens_per_s": 1.0, "mfu": None, "skipped": 0, "nan": 0})
        writer.ranks(i, 1, [1.0] * 1000, ["node-1"] * 1000)
    writer.valid(4, 32, 5.1)
    writer.close()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"kind": "train", "iteration": 2, "lm_l')        # a write cut short by a kill
    MetricsWriter(str(tmp_path), True, 3).close()                  # resumes from iteration 3
    kept = [(r["kind"], r["iteration"]) for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert kept == [(kind, i) for i in (1, 2, 3) for kind in ("train", "ranks")]
    from gpt.metrics import _iteration
    assert _iteration(b'{"iteration": 7, "kind": "other"}\n') == 7 and _iteration(b'not a record\n') == float("inf")


def test_training_goes_on_while_a_checkpoint_is_written_and_the_next_save_waits_for_it(gpt_launcher, tmp_path):
    reference = tmp_path / "reference"
    gpt_launcher.run({**SMALL, "async_save": False, "run_dir": str(reference)}, world_size=2)
    run = tmp_path / "run"
    # Rank 0's write of iteration 4 ends 3 s late: its folder is not complete until then.
    os.environ["GPT_FAULT"] = "rank=0,phase=write,iteration=4,seconds=3"
    try:
        procs = gpt_launcher.start({**SMALL, "run_dir": str(run)}, 2)
    finally:
        del os.environ["GPT_FAULT"]
    results = gpt_launcher.wait(procs)
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saves = {r["iteration"]: r for r in records if r["kind"] == "save"}
    assert sorted(saves) == [4, 8]
    assert saves[4]["background_s"] >= 3 > saves[4]["blocking_s"]
    # Iterations 5 to 8 trained while iteration 4 was being written; the save at 8 waited for it.
    written = records.index(saves[4])
    assert [r["iteration"] for r in records[:written] if r["kind"] == "train"] == list(range(1, 9))
    assert records.index(saves[8]) > written
    assert re.search(r"saved checkpoint at iteration 4 \| training waited \d+\.\d\d s, written in [3-9]\.\d\d s more "
                     r"while it went on", results[0][1])
    assert _losses(run) == _losses(reference) and _losses(run, "valid") == _losses(reference, "valid")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000004", "iter_0000008"]
    # What an asynchronous save wrote resumes exactly as a synchronous one.
    out = gpt_launcher.run({**SMALL, "run_dir": str(run), "train_iters": 12, "lr_decay_iters": 8}, world_size=2)
    longer = gpt_launcher.run({**SMALL, "async_save": False, "run_dir": str(reference), "train_iters": 12,
                               "lr_decay_iters": 8}, world_size=2)
    assert "resumed from" in out and "resumed from" in longer
    assert _losses(run) == _losses(reference)


def test_a_stop_signal_during_a_background_write_waits_for_it_then_saves_and_stops(gpt_launcher, tmp_path):
    reference = tmp_path / "reference"
    gpt_launcher.run({**SMALL, "run_dir": str(reference)}, world_size=2)
    run = tmp_path / "run"
    # Rank 0's write of iteration 4 ends 3 s late; SLURM's time-limit signal reaches rank 1 at 5.
    os.environ["GPT_FAULT"] = "rank=0,phase=write,iteration=4,seconds=3"
    try:
        procs = gpt_launcher.start({**SMALL, "run_dir": str(run)}, 2,
                                   prelude=SIGNAL_AT.format(iteration=5, rank=1, signal="SIGUSR2"))
    finally:
        del os.environ["GPT_FAULT"]
    results = gpt_launcher.wait(procs)
    assert [rc for rc, _ in results] == [EXIT_INTERRUPTED, EXIT_INTERRUPTED], results[0][1][-3000:]
    saves = [r for r in _records(run) if r["kind"] == "save"]
    assert [s["iteration"] for s in saves] == [4, 5] and saves[0]["background_s"] >= 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000004", "iter_0000005"]
    assert all((run / "checkpoints" / name / "COMPLETE").is_file() for name in ("iter_0000004", "iter_0000005"))
    gpt_launcher.run({**SMALL, "run_dir": str(run)}, world_size=2)
    assert _losses(run) == _losses(reference)


def test_a_job_killed_while_its_checkpoint_is_written_resumes_from_the_previous_one(gpt_launcher, tmp_path):
    reference = tmp_path / "reference"
    config = {**SMALL, "train_iters": 12, "keep_last": 3}
    gpt_launcher.run({**config, "run_dir": str(reference)})
    run = tmp_path / "run"
    os.environ["GPT_FAULT"] = "rank=0,phase=write,iteration=8,seconds=600"
    try:
        (proc,) = gpt_launcher.start({**config, "run_dir": str(run)})
    finally:
        del os.environ["GPT_FAULT"]
    # training went on past the save while its write, metadata written, never got its marker
    deadline = time.monotonic() + 120
    while not (any(r["iteration"] >= 10 for r in _records(run))
               and any((run / "checkpoints").glob("iter_0000008.tmp-*/.metadata"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    (killed,) = (run / "checkpoints").glob("iter_0000008.tmp-*")
    assert (killed / ".metadata").is_file() and not (killed / "COMPLETE").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_???????")) == ["iter_0000004"]
    out = gpt_launcher.run({**config, "run_dir": str(run)})
    assert re.search(r"resumed from \S+iter_0000004 at iteration 4", out)
    assert _losses(run) == _losses(reference)


def _records(run_dir):
    try:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []
