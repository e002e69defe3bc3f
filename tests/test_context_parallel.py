"""Context parallelism (every sequence split over ranks, attention around a ring) and document
masking, on real gloo ranks running gpt.train: the losses, gradient norms and weights of one
process, and each document of a packed sample attending only to itself."""
import json

import numpy as np
import pytest
import torch

from gpt.config import Config
from gpt.data import IndexedDatasetWriter
from gpt.export import find_checkpoint, load_checkpoint
from gpt.model import GPT, Packing
from tasks.index import build_indices
from tests.fixtures_gpt import SMALL, curve, read_metrics, trained_alone

pytestmark = pytest.mark.timeout(300)

# tiny-llama's block (rotary positions, grouped K/V, SwiGLU) at a length where the ring has work.
LONG = {**SMALL, "model": "tiny-llama", "num_layers": 2, "num_query_groups": 2, "ffn_hidden_size": 64,
        "seq_length": 512, "train_iters": 10, "lr_warmup_iters": 2, "eval_interval": 5, "save_interval": 5}


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_checkpoint(*find_checkpoint(run_dir)).state_dict()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return trained_alone(tmp_path_factory, LONG)


@pytest.mark.parametrize("world, layout", [
    (2, {"context_parallel": 2}),
    (4, {"context_parallel": 2}),
    (4, {"context_parallel": 2, "tensor_parallel": 2}),
    (4, {"context_parallel": 2, "data_parallel_mode": "fsdp"}),
], ids=["cp2", "cp2-dp2", "cp2-tp2", "cp2-fsdp2"])
def test_layouts_with_context_parallel_train_as_one_process(world, layout, one_process, gpt_launcher, tmp_path):
    """Each rank holds a chunk from each end of every sequence and attends around the ring: the
    losses, gradient norms, validation losses and final weights of one process."""
    run_dir = tmp_path / "run"
    out = gpt_launcher.run({**LONG, **layout, "run_dir": str(run_dir)}, world_size=world)
    assert json.loads(out.strip().splitlines()[-1])["status"] == "completed"
    assert len(curve(run_dir)) == LONG["train_iters"]
    for kind, key in (("train", "lm_loss"), ("train", "grad_norm"), ("valid", "valid_loss")):
        assert curve(run_dir, kind, key) == pytest.approx(curve(one_process, kind, key), rel=1e-5), key
    ours, theirs = _weights(run_dir), _weights(one_process)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("world, layout", [(1, {}), (2, {"tensor_parallel": 2})], ids=["one-process", "tp2"])
def test_a_run_saved_under_context_parallel_resumes_under_other_layouts(world, layout, one_process, gpt_launcher,
                                                                        tmp_path):
    run_dir = tmp_path / "run"
    gpt_launcher.run({**LONG, "context_parallel": 2, "train_iters": 5, "lr_decay_iters": 10,
                      "run_dir": str(run_dir)}, world_size=2)
    out = gpt_launcher.run({**LONG, **layout, "run_dir": str(run_dir)}, world_size=world)
    assert "at iteration 5" in out
    assert curve(run_dir) == pytest.approx(curve(one_process), rel=1e-5)


# -- document masking -------------------------------------------------------------------------
def _three_documents() -> tuple[Config, GPT, list[torch.Tensor]]:
    config = Config.from_dict({**LONG, "seq_length": 64, "reset_attention_mask": True, "reset_position_ids": True})
    torch.manual_seed(0)
    model = GPT(config).eval()
    lengths = (20, 31, 13)
    return config, model, [torch.randint(0, 256, (n,)) for n in lengths]


def test_each_document_of_a_packed_sample_gets_the_logits_it_gets_alone():
    """Three documents packed into one sample: with reset_attention_mask and reset_position_ids each
    gets the logits of that document run alone; without them, every document after the first does not."""
    config, model, documents = _three_documents()
    packed = torch.cat(documents)[None]
    which = torch.cat([torch.full((len(d),), i) for i, d in enumerate(documents)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in documents])[None]
    with torch.no_grad():
        masked = model(packed, packing=Packing(torch.arange(64), positions, which))
        plain = model(packed)
        alone = [model(d[None]) for d in documents]
    start = 0
    for i, (document, logits) in enumerate(zip(documents, alone)):
        rows = slice(start, start + len(document))
        torch.testing.assert_close(masked[:, rows], logits, rtol=1e-5, atol=1e-5)
        assert i == 0 or not torch.allclose(plain[:, rows], logits, atol=1e-3)
        start += len(document)


@pytest.fixture(scope="module")
def packed_index(tmp_path_factory):
    """Documents of 5 to 90 tokens, so that every sample of 64 packs several, each counting up from
    a token of its own (what a model learns within a document and cannot carry across one)."""
    out = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(out / "docs"), np.uint16) as writer:
        for _ in range(400):
            writer.add_document((rng.integers(0, 256) + np.arange(rng.integers(5, 90))) % 256)
    index = build_indices([str(out / "docs")], split="98,1,1", seq_length=64, seed=1,
                          num_samples={"train": 10 * 8, "valid": 8, "test": 8}, out_dir=str(out / "index"))
    return index.path


def test_document_masking_trains_alike_under_context_parallel_and_differs_from_none(packed_index, gpt_launcher,
                                                                                     tmp_path):
    """The same packed samples: with masking the losses under CP 2 are one process's, and they differ
    from the losses without masking (the mask is applied)."""
    base = {**LONG, "seq_length": 64, "mock_data": False, "data_index": str(packed_index)}
    masked = {**base, "reset_attention_mask": True, "reset_position_ids": True}
    runs = {}
    for name, config, world in (("plain", base, 1), ("masked", masked, 1), ("masked-cp2", {**masked, "context_parallel": 2}, 2)):
        runs[name] = tmp_path / name
        gpt_launcher.run({**config, "run_dir": str(runs[name])}, world_size=world)
    assert curve(runs["masked-cp2"]) == pytest.approx(curve(runs["masked"]), rel=1e-5)
    assert curve(runs["masked-cp2"], "train", "grad_norm") == pytest.approx(curve(runs["masked"], "train", "grad_norm"), rel=1e-5)
    apart = max(abs(m - p) / p for m, p in zip(curve(runs["masked"]), curve(runs["plain"])))
    assert apart > 10 * 1e-5         # ten times the tolerance the equal runs above meet
    # MFU counts the attention the documents do: each token spans fewer keys than the sequence.
    spans = [r["attention_span"] for r in read_metrics(runs["masked"])]
    assert len(spans) == LONG["train_iters"] and all(0 < s < 64 for s in spans)
    assert "attention_span" not in read_metrics(runs["plain"])[0]


def test_masked_attention_counts_the_documents_squares_in_the_flops():
    from gpt.metrics import attention_span, flops_per_token
    from gpt.model import param_count

    assert attention_span([np.array([20, 31, 14])], 64) == (20 ** 2 + 31 ** 2 + 13 ** 2) / 64   # 13 inputs in the last
    assert attention_span([np.array([65])], 64) == 64
    config = Config.from_dict(LONG)
    n = param_count(config)
    assert flops_per_token(config, n) - flops_per_token(config, n, span=128) == 12 * 2 * 32 * (512 - 128)


# -- sized before the queue ---------------------------------------------------------------------
LLAMA3_8B_128K = """--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --ffn-hidden-size 14336 --position-embedding-type rope --rotary-base 500000
--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 131072
--max-position-embeddings 131072 --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 --lr 3e-4
--reset-attention-mask --reset-position-ids --bf16""".split()


def _plan(args: list[str], tmp_path, monkeypatch):
    import flows.plan.build
    from flows.cli import parse_args
    from flows.plan.build import make_plan

    monkeypatch.setattr(flows.plan.build, "disk_problem", lambda *a: None)   # an 8B checkpoint is not this disk's
    params = parse_args([*args, "--root", str(tmp_path), "--dry-run"])
    return make_plan(**{k: v for k, v in params.items() if k != "dry_run"})


def test_llama3_8b_at_128k_is_refused_naming_the_layout_that_fits_and_plans_in_it(tmp_path, monkeypatch):
    """Megatron's Llama 3 8B flags at 131072 tokens with document masking: on one p4d node (8 x A100 40 GB)
    the plan refuses the preset's layout with the arithmetic and names the context parallel that fits;
    Megatron's --context-parallel-size 8 with FSDP and activation checkpointing plans on one p5 node
    (8 x H100 80 GB), its mesh and the ring's traffic in the plan's rows."""
    from flows.plan.artifact import plan_rows
    from flows.plan.params import ParameterError

    with pytest.raises(ParameterError) as e:
        _plan([*LLAMA3_8B_128K, "--cluster", "p4d-8gpu", "--cluster-set", "nodes=1"], tmp_path, monkeypatch)
    (line,) = [m for m in e.value.errors if m.startswith("training:")]
    assert "but 40 GiB per device (accelerator a100-40gb)" in line and "context_parallel=" in line, line
    fits = dict(kv.split("=") for kv in line.split("this layout would fit: ")[1].split(" (the fields")[0].split(", "))
    assert int(fits["context_parallel"]) > 1, line
    plan = _plan([*LLAMA3_8B_128K, "--cluster", "p4d-8gpu", "--cluster-set", "nodes=1",
                  *(f"--set={k}={v}" for k, v in fits.items())], tmp_path, monkeypatch)
    assert plan.config.context_parallel == int(fits["context_parallel"])

    plan = _plan([*LLAMA3_8B_128K, "--context-parallel-size", "8", "--cluster", "p5-8gpu", "--cluster-set", "nodes=1",
                  "--set", "data_parallel_mode=fsdp", "--set", "activation_checkpointing=true"], tmp_path, monkeypatch)
    assert (plan.config.context_parallel, plan.config.seq_length, plan.config.reset_attention_mask) == (8, 131072, True)
    rows = {r["item"]: r["value"] for r in plan_rows(plan, "a new run")}
    assert rows["parallel"].startswith("pp 1 x dp 1 (fsdp) x tp 1 x cp 8 (each rank 16384 tokens of a sequence; "
                                       "the ring passes "), rows["parallel"]
    assert "attention work space" in rows["memory per rank"]


def test_a_phase_whose_longer_sequence_the_ring_cannot_split_is_refused_at_plan_time(tmp_path):
    from flows.plan.build import make_plan
    from flows.plan.params import (
        ClusterParams,
        DataParams,
        OutputParams,
        ParameterError,
        PhaseParams,
        TokenizerParams,
        TrainingParams,
    )

    with pytest.raises(ParameterError) as e:
        make_plan(model="tiny-llama", data=DataParams(), tokenizer=TokenizerParams(),
                  training=TrainingParams(context_parallel=2, train_iters=20,
                                          overrides={"max_position_embeddings": 512}),
                  cluster=ClusterParams(preset="local", overrides={"tasks_per_node": 2}),
                  output=OutputParams(root=str(tmp_path)), phases=[PhaseParams(start=10, seq_length=130)])
    assert e.value.errors == ["phases[0].seq_length: context_parallel=2 gives each rank one chunk from each end of a "
                              "sequence: seq_length=130 must be a multiple of 2 x 2 = 4"]
