"""A run in phases: at the train stage, two prefixes at 0.5/0.5 on two ranks, then a second phase at
0.9/0.1 on one rank with a loss spike in it rolled back, the ledger's invariants checked against the
indices (computed here); through the flow, a second leg that adds a longer-context decay phase,
and the phases it refuses by name."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from flows.plan.params import ClusterParams, DataParams, OutputParams, PhaseParams, TokenizerParams, TrainingParams
from gpt.data import DataIndex, GPTDataset
from tasks.cluster.config import load_cluster
from tasks.index import build_indices, read_left_out
from tasks.train import phases
from tasks.train.spikes import SKIPPED
from tasks.train.stage import train
from tests.fixtures_gpt import read_metrics, slow_iterations
from tests.run_folder import job_records
from tests.test_cluster_slurm import tiny
from tests.test_index import write_dataset

G = 16                      # the tiny presets' global batch
PHASE_1, END = 8, 16
SPIKED = 3 * G + 2          # phase 2's sample at its fourth iteration: iteration 12


def _cluster(tasks_per_node: int):
    return load_cluster("local", tasks_per_node=tasks_per_node, env={"OMP_NUM_THREADS": "1"})


def _drawn(index: str, positions: int) -> dict[str, np.ndarray]:
    """The documents positions [0, positions) of an order drew from, trained or skipped, per prefix."""
    dataset = GPTDataset.from_index(index, "train")
    skipped = [p for p in DataIndex.read(index).splits["train"].skipped if p < positions]
    out: dict[str, list[int]] = {}
    for i in range(positions - len(skipped)):
        prefix, docs = dataset.documents(i)
        out.setdefault(prefix, []).extend(docs)
    for s in skipped:
        part, j = dataset._part_sample(s)
        out.setdefault(part.data.prefix, []).extend(part.documents(j))
    return {p: np.unique(d) for p, d in out.items()}


def _spans(index: str, positions: int) -> dict[str, list[tuple[int, int]]]:
    """The token ranges (in each prefix's .bin, by token) that positions [0, positions) of an order
    drew as inputs, trained or skipped, per prefix."""
    dataset = GPTDataset.from_index(index, "train")
    out: dict[str, list[tuple[int, int]]] = {}
    for position in range(positions):
        part, j = dataset._part_sample(position)
        row = int(part.shuffle_index[part.first + j])
        (b, begin), (e, end) = (tuple(map(int, part.sample_index[k])) for k in (row, row + 1))
        starts = np.asarray(part.data.pointers) // part.data.dtype.itemsize
        for k in range(b, e + 1):
            doc = int(part.document_index[k])
            lo, hi = (begin if k == b else 0), (end if k == e else int(part.data.sizes[doc]))
            if hi > lo:
                out.setdefault(part.data.prefix, []).append((int(starts[doc]) + lo, int(starts[doc]) + hi))
    return out


def _overlapping(spans: list[tuple[int, int]]) -> int:
    """Tokens that more than one span holds."""
    spans, seen, twice = sorted(spans), -1, 0
    for lo, hi in spans:
        twice += max(0, min(hi, seen) - lo)
        seen = max(seen, hi)
    return twice


@pytest.mark.timeout(400)
def test_two_phases_on_two_layouts_with_a_spike_consume_every_token_once(tmp_path, monkeypatch):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, 300, 0, 512, 1)
    write_dataset(b, 300, 0, 512, 2)
    run_dir = tmp_path / "run"
    options = dict(split="98,1,1", seq_length=64, seed=5, out_dir=str(tmp_path / "index"))
    need = {"train": PHASE_1 * G, "valid": G, "test": G}
    first = build_indices([(0.5, a), (0.5, b)], num_samples=need, **options).path
    # keep_last 3: the save before the spike (10) outlives the run's last save (16), however late
    # the follower reads the spike's record on a loaded machine.
    settings = dict(mock_data=False, train_iters=END, save_interval=5, keep_last=3, spike_window=4, run_dir=str(run_dir))
    config = phases.first_phase(tiny(data_index=first, **settings), [phases.Phase(start=PHASE_1)])
    assert train(config, _cluster(2)).summary["iteration"] == PHASE_1
    one = phases.close(run_dir, 1, config, 0)
    assert one["order"] == [0, PHASE_1 * G] and one["skipped"] == []

    second = build_indices([(0.9, a), (0.1, b)], num_samples={**need, "train": (END - PHASE_1) * G},
                           leave_out=phases.left_out(run_dir, 2), **options).path
    phase = phases.Phase(start=PHASE_1, blend=((0.9, a), (0.1, b)))
    config = phases.phase_config(tiny(data_index=first, **settings), phase, END, second)
    monkeypatch.setenv("GPT_FAULT", f"{slow_iterations(0.4)},sample={SPIKED},factor=1000")
    assert train(config, _cluster(1)).summary["iteration"] == END
    (rollback,) = json.loads((run_dir / SKIPPED).read_text())["rollbacks"]
    assert rollback["iterations"] == [12] and rollback["resumed_from"] == 10 and rollback["data_offset"] == PHASE_1 * G
    assert rollback["samples"] == list(range(3 * G, 4 * G))     # ids in phase 2's order
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, END + 1))
    assert json.loads((run_dir / "config.json").read_text())["data_offset"] == PHASE_1 * G
    two = phases.close(run_dir, 2, config, PHASE_1)
    assert two["order"] == [0, (END - PHASE_1 + 1) * G] and two["skipped"] == rollback["samples"]
    assert phases.close(run_dir, 2, config, PHASE_1) == two           # written once

    # The ledger's documents are those the orders' trained and skipped samples drew from. Phase 2
    # goes on with each prefix's order where phase 1 left it: no token is drawn twice over both
    # phases, the layouts and the rollback, and phase 1's positions were all drawn.
    trained = json.loads((run_dir / "config.json").read_text())["data_index"]
    drawn = {1: _drawn(first, PHASE_1 * G), 2: _drawn(trained, two["order"][1])}
    for n, entry in ((1, one), (2, two)):
        recorded = read_left_out(str(run_dir / entry["documents"]))
        assert all(np.array_equal(recorded[p], drawn[n][p]) for p in (a, b)), n
    for p in (a, b):
        assert two["prefixes"][p]["positions"][0] == one["prefixes"][p]["positions"][1] > 0
    spans = {n: _spans(index, entry["order"][1]) for n, index, entry in ((1, first, one), (2, trained, two))}
    for p in (a, b):
        assert _overlapping(spans[1][p] + spans[2][p]) == 0, p
        assert sum(hi - lo for lo, hi in spans[1][p]) == one["prefixes"][p]["samples"] * 64
    # Tokens per prefix in phase 2 follow its weights within one global batch.
    samples = {p: two["prefixes"][p]["samples"] for p in (a, b)}
    assert sum(samples.values()) == (END - PHASE_1) * G
    assert abs(samples[a] - 0.9 * (END - PHASE_1) * G) <= G and abs(samples[b] - 0.1 * (END - PHASE_1) * G) <= G


def _leg(root, prefixes, vocab, merges, iters: int, tasks: int, phase_list=(), dry_run=False, run_name="phased",
         branch_from=None, **training):
    from flows.pretrain import pretrain

    return pretrain(model="tiny-llama",
                    data=DataParams(prefixes=[{"weight": w, "prefix": p} for w, p in prefixes], split="50,25,25"),
                    tokenizer=TokenizerParams(vocab_file=vocab, merge_file=merges),
                    training=TrainingParams(train_iters=iters, seq_length=64, eval_interval=4, eval_iters=1,
                                            log_interval=2, save_interval=4, compile=False, branch_from=branch_from,
                                            overrides={"lr_decay_style": "constant", "lr_warmup_iters": 2,
                                                       **training}),
                    cluster=ClusterParams(preset="local", overrides={"tasks_per_node": tasks}),
                    output=OutputParams(root=str(root), run_name=run_name), phases=list(phase_list),
                    dry_run=dry_run, return_state=True)


@pytest.mark.timeout(600)
def test_a_second_leg_adds_a_longer_context_decay_phase_and_phases_are_refused_by_name(
        tmp_path, bpe_vocab, prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    vocab, merges = map(str, bpe_vocab)
    a, b, c = (str(tmp_path / n) for n in "abc")
    write_dataset(a, 300, 0, 1000, 1)
    write_dataset(b, 300, 0, 1000, 2)
    write_dataset(c, 8, 0, 1000, 3)                 # used up, and repeated, by phase 1
    blend = [(0.35, a), (0.35, b), (0.3, c)]
    state = _leg(tmp_path, blend, vocab, merges, PHASE_1, 2)
    assert state.is_completed(), state.message
    run_dir = tmp_path / "phased"

    def decay(*prefixes):
        return PhaseParams(start="now", prefixes=[{"weight": w, "prefix": p} for w, p in prefixes], seq_length=128,
                           lr="decay")

    planned = _leg(tmp_path, blend, vocab, merges, END, 1, [decay((0.5, a), (0.5, c))], dry_run=True).result()
    said = [r["value"] for r in planned["plan"] if r["item"] == "warning"]
    assert any(w.startswith(f"phase 2: {c} is used up before the phase starts") for w in said), said
    state = _leg(tmp_path, blend, vocab, merges, END, 1, [decay((0.5, a), (0.5, c))])
    assert state.is_failed() and "phases[0].prefixes: " + c + " is exhausted before phase 2 can start" in state.message

    state = _leg(tmp_path, blend, vocab, merges, END, 1, [decay((0.9, a), (0.1, b))])
    assert state.is_completed(), state.message
    config = json.loads((run_dir / "config.json").read_text())
    logs = "".join(p.read_text() for p in (run_dir / "jobs").glob("*_log.out"))
    assert "checkpoints/iter_0000008 at iteration 8" in logs     # the longer context from phase 1's weights
    assert (config["seq_length"], config["data_offset"], config["lr_decay_style"]) == (128, PHASE_1 * G, "WSD")
    assert json.loads((run_dir / phases.PHASES).read_text())["phases"][0]["start"] == PHASE_1
    records = {r["iteration"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == list(range(1, END + 1))
    # Megatron's WSD with its exponential decay (the default): min + (max - min) * (2 * 0.5 ** share - 1).
    lr, min_lr = 2e-3, 2e-4
    for it in range(PHASE_1 + 1, END + 1):
        ratio = (it - PHASE_1) / (END - PHASE_1)
        want = min_lr + (lr - min_lr) * (2 * 0.5 ** ratio - 1)
        assert records[it]["lr"] == pytest.approx(want, rel=1e-4), it
    assert all(records[it]["lr"] == pytest.approx(lr) for it in range(3, PHASE_1 + 1))    # stable before it

    (one, two) = phases.ledger(run_dir)
    assert (one["seq_length"], two["seq_length"]) == (64, 128) and two["first_iteration"] == PHASE_1 + 1
    assert set(two["prefixes"]) == {a, b}
    # At another sequence length the order is new, over the documents phase 1 left.
    assert all(not set(read_left_out(str(run_dir / one["documents"]))[p])
               & set(read_left_out(str(run_dir / two["documents"]))[p]) for p in (a, b))
    assert all(two["prefixes"][p]["positions"][0] == 0 for p in (a, b))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    (mixture,) = [x for x in found if x.key == "mixture"]
    assert "data:image/png;base64," in mixture.data and f"| 2 | 9-16 | 128 | decay | `{a}` |" in mixture.data
    assert any("phase 2" in x.data and "iterations 9-16: 0.9 " + a in x.data and "this leg starts here" in x.data
               for x in found if x.key == "pretrain-plan")
    logged = {(i.step, *i.values): v for i in phases.tracker_items(run_dir) for v in i.values.values()}
    assert logged[(END, "data/a/tokens")] == one["prefixes"][a]["tokens"] + two["prefixes"][a]["tokens"]
    assert logged[(PHASE_1, "data/c/tokens")] == one["prefixes"][c]["tokens"] and (END, "data/c/tokens") not in logged

    state = _leg(tmp_path, blend, vocab, merges, END + 4, 1, [decay((0.5, a), (0.5, b))])
    assert state.is_failed() and "phases[0]: phase 2 of run phased started at iteration 8" in state.message
    state = _leg(tmp_path, blend, vocab, merges, END + 4, 1, [PhaseParams(start=PHASE_1 + 4)])
    assert state.is_failed() and "phases[0]: phase 2 of run phased started at iteration 8" in state.message
    # Declared as it was ("now" is the start it was given), the last phase extends, and its ledger entry with it.
    state = _leg(tmp_path, blend, vocab, merges, END + 4, 1, [decay((0.9, a), (0.1, b))])
    assert state.is_completed(), state.message
    assert [e["last_iteration"] for e in phases.ledger(run_dir)] == [PHASE_1, END + 4]


@pytest.mark.timeout(400)
def test_a_phase_killed_in_the_middle_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path, monkeypatch):
    """kill -9 of phase 2's rank mid-phase, then the phase again: its final model and optimizer state
    are bitwise those of phase 2 trained without the kill from the same end of phase 1."""
    import shutil
    import time

    from tests.fixtures_gpt import GPTLauncher
    from tests.uninterrupted import checkpoint_tensors

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, 200, 0, 512, 1)
    write_dataset(b, 200, 0, 512, 2)
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    options = dict(split="98,1,1", seq_length=64, seed=5, out_dir=str(tmp_path / "index"))
    first = build_indices([(0.5, a), (0.5, b)], num_samples={"train": PHASE_1 * G, "valid": G, "test": G},
                          **options).path
    base = tiny(mock_data=False, data_index=first, train_iters=END, save_interval=4, run_dir=str(run_dir))
    launcher = GPTLauncher(tmp_path)
    launcher.run(phases.first_phase(base, [phases.Phase(start=PHASE_1)]).to_dict())
    phases.close(run_dir, 1, phases.first_phase(base, [phases.Phase(start=PHASE_1)]), 0)
    shutil.copytree(run_dir, reference)
    second = build_indices([(0.8, a), (0.2, b)], num_samples={"train": (END - PHASE_1) * G, "valid": G, "test": G},
                           leave_out=phases.left_out(run_dir, 2), **options).path
    phase = phases.phase_config(base, phases.Phase(start=PHASE_1, blend=((0.8, a), (0.2, b)), lr="decay"), END, second)

    monkeypatch.setenv("GPT_FAULT", "rank=0,iteration=14,phase=data,stop=1")
    (rank,) = launcher.start(phase.to_dict())
    deadline = time.monotonic() + 200
    while "fault injected: rank 0 stops" not in (rank.log.read_text() if rank.log.exists() else ""):
        assert time.monotonic() < deadline and rank.returncode is None, "phase 2 never reached iteration 14"
        time.sleep(0.2)
    rank.kill()                                                   # SIGKILL, in the middle of phase 2
    assert rank.wait(30) != 0
    monkeypatch.delenv("GPT_FAULT")
    assert "resumed from" in launcher.run(phase.to_dict())
    launcher.run(dataclasses.replace(phase, run_dir=str(reference)).to_dict())
    got, want = checkpoint_tensors(run_dir), checkpoint_tensors(reference)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert [r["iteration"] for r in read_metrics(run_dir)] == list(range(1, END + 1))


@pytest.mark.timeout(600)
def test_phases_declared_with_the_run_go_on_with_its_own_sources_and_a_new_prefix(small_corpus, tmp_path,
                                                                                 prefect_harness):
    from flows.pretrain import pretrain

    extra = str(tmp_path / "extra")
    write_dataset(extra, 200, 0, 1000, 4)
    other = tmp_path / "other" / "other.jsonl"          # new text, tokenized with the run's tokenizer
    other.parent.mkdir()
    other.write_text("".join(small_corpus.read_text().splitlines(keepends=True)[:60]))
    state = pretrain(data=DataParams(sources=[str(small_corpus)], split="80,10,10"),
                     tokenizer=TokenizerParams(train_vocab_size=1024),
                     training=TrainingParams(train_iters=12, eval_interval=6, eval_iters=1, log_interval=3,
                                             save_interval=6, compile=False),
                     output=OutputParams(root=str(tmp_path / "runs"), run_name="declared"),
                     phases=[PhaseParams(start=6, sources=[str(small_corpus)], weight=0.5, lr="constant",
                                         prefixes=[{"weight": 0.5, "prefix": extra}]),
                             PhaseParams(start=9, sources=[str(other)])],
                     return_state=True)
    assert state.is_completed(), state.message
    run_dir = tmp_path / "runs" / "declared"
    one, two, three = phases.ledger(run_dir)
    (own,) = one["prefixes"]
    assert set(two["prefixes"]) == {own, extra}          # the run's sources are its tokenized prefix again
    (new,) = three["prefixes"]
    assert new != own and "/tokenized/" in new and three["prefixes"][new]["samples"] == 3 * 16
    assert two["prefixes"][own]["positions"][0] == one["prefixes"][own]["positions"][1] > 0   # its order goes on
    config = json.loads((run_dir / "config.json").read_text())
    records = {r["iteration"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == list(range(1, 13)) and config["lr_decay_style"] != "constant"
    assert all(records[it]["lr"] == pytest.approx(config["lr"]) for it in range(7, 10))   # phase 2's constant


def test_phases_the_plan_refuses_by_name(tmp_path, monkeypatch):
    from flows.cli import parse_args
    from flows.plan.build import make_plan
    from flows.plan.params import ParameterError

    monkeypatch.setenv("GPT_OUTPUT_ROOTS", str(tmp_path))

    def problems(model: str, phase_list: list, training=None, cluster="local") -> list[str]:
        with pytest.raises(ParameterError) as e:
            make_plan(model, DataParams(), TokenizerParams(), training or TrainingParams(train_iters=20),
                      ClusterParams(preset=cluster), OutputParams(root=str(tmp_path)), phases=phase_list, dry_run=True)
        return e.value.errors

    assert problems("tiny-llama", [PhaseParams(start=12), PhaseParams(start=8)]) == [
        "phases[1].start: 8: a phase starts after the phase before it (iteration 12) and before the run's end "
        "(training.train_iters 20)"]
    assert "has no checkpoint yet" in problems("tiny-llama", [PhaseParams(start="now")])[0]
    assert problems("tiny", [PhaseParams(start=10, seq_length=256)])[0].startswith(
        "phases[0].seq_length: tiny has learned position embeddings for 128 positions")
    assert problems("tiny-llama", [PhaseParams(start=10)], TrainingParams(train_samples=320))[0].startswith(
        "phases: phases start at iterations")
    assert problems("llama3-8b", [PhaseParams(start=10, seq_length=131072)],
                    TrainingParams(train_iters=20, overrides={"data_parallel_mode": "fsdp"}), "p5-8gpu")[0].startswith(
        "phases[0].seq_length: each rank needs an estimated")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / phases.PHASES).write_text('{"phases": [{"start": -4, "lr": "decay"}]}')
    with pytest.raises(ParameterError) as e:
        make_plan("tiny-llama", DataParams(), TokenizerParams(), TrainingParams(train_iters=20), ClusterParams(),
                  OutputParams(root=str(tmp_path), run_name="damaged"), dry_run=True)
    assert e.value.errors == [f"phases: {damaged / phases.PHASES}: phases.0.start: input should be greater than or "
                              "equal to 0 (it holds -4); restore it from a copy: a phase that has started cannot "
                              "change, and this file says which did"]
    with pytest.raises(ParameterError) as e:           # weights are positive, from the command line too
        parse_args(["--phase", '{"start": 5, "prefixes": [{"weight": 0, "prefix": "/data/a"}], "lr": "anneal"}'])
    assert e.value.errors[0].startswith("phases[0].prefixes[0].weight: Input should be greater than 0")
    assert e.value.errors[1].startswith("phases[0].lr: Input should be 'schedule', 'constant' or 'decay'")


@pytest.mark.timeout(600)
def test_decays_branched_from_two_stable_checkpoints_share_the_stable_run(tmp_path, bpe_vocab, prefect_harness):
    """A stable run (constant learning rate), and two new runs that branch from its checkpoints at 4
    and 8 with a WSD decay phase to 12: each has the stable run's iterations up to its branch (its
    checkpoint, metrics and ledger), and decays from there by Megatron's formula."""
    vocab, merges = map(str, bpe_vocab)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, 300, 0, 1000, 1)
    write_dataset(b, 300, 0, 1000, 2)
    blend = [(0.5, a), (0.5, b)]
    assert _leg(tmp_path, blend, vocab, merges, 12, 1, keep_last=5).is_completed()
    stable = {r["iteration"]: r for r in read_metrics(tmp_path / "phased")}
    decay = PhaseParams(start="now", lr="decay", prefixes=[{"weight": 0.8, "prefix": a}, {"weight": 0.2, "prefix": b}])
    branches = {}
    for at in (4, 8):
        state = _leg(tmp_path, blend, vocab, merges, 12, 1, [decay], run_name=f"decay-{at}",
                     branch_from=f"phased/iter_{at:07d}")
        assert state.is_completed(), state.message
        branches[at] = tmp_path / f"decay-{at}"
    for at, run_dir in branches.items():
        records = {r["iteration"]: r for r in read_metrics(run_dir)}
        assert sorted(records) == list(range(1, 13))
        assert all(records[it]["lm_loss"] == stable[it]["lm_loss"] for it in range(1, at + 1))   # the stable part
        for it in range(at + 1, 13):
            want = 2e-4 + (2e-3 - 2e-4) * (2 * 0.5 ** ((it - at) / (12 - at)) - 1)
            assert records[it]["lr"] == pytest.approx(want, rel=1e-4), (at, it)
        one, two = phases.ledger(run_dir)
        assert (one["last_iteration"], one["order"], two["first_iteration"]) == (at, [0, at * G], at + 1)
        assert json.loads((run_dir / phases.PHASES).read_text())["phases"][0]["start"] == at
        logs = "".join(p.read_text() for p in (run_dir / "jobs").glob("*_log.out"))
        assert f"decay-{at}/checkpoints/iter_{at:07d} at iteration {at}" in logs
        assert len(job_records(run_dir)) == 1             # the stable phase, ended by the branch point, is not run
    assert records[9]["lm_loss"] != {r["iteration"]: r for r in read_metrics(branches[4])}[9]["lm_loss"]
    assert not phases.ledger(tmp_path / "phased") and len(read_metrics(tmp_path / "phased")) == 12   # untouched
    state = _leg(tmp_path, blend, vocab, merges, 12, 1, [decay], run_name="other", branch_from="phased/iter_0000004",
                 dry_run=True, seed=7)
    assert state.is_failed() and "training.branch_from: run phased is another recipe (training.seed: 1234 -> 7)" \
        in state.message, state.message
