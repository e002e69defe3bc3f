"""A model you can take away: HuggingFace export from any parallel layout, import, generation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt.export import (
    ExportError,
    export,
    find_checkpoint,
    load_checkpoint,
    load_hf,
    to_hf_state_dict,
)
from gpt.generate import complete, generate, load
from tasks.index import build_indices
from tasks.tokenize.stage import tokenize

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data(shakespeare_jsonl, bpe_vocab, tmp_path_factory) -> dict:
    """The plays tokenized with the 2,000-entry BPE, and an index for 24 iterations of batch 8."""
    vocab, merges = map(str, bpe_vocab)
    out = tmp_path_factory.mktemp("data")
    m = tokenize([str(shakespeare_jsonl)], str(out / "sp"), vocab_file=vocab, merge_file=merges)
    index = build_indices([m.prefixes["text"]], seq_length=32, seed=1,
                          num_samples={"train": 24 * 8, "valid": 64, "test": 64}, out_dir=str(out / "index"))
    return {"vocab": vocab, "merges": merges, "vocab_size": m.vocab_size, "index": index.path}


def _config(data: dict, run_dir: Path, **overrides) -> dict:
    return {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "vocab_size": data["vocab_size"], "micro_batch_size": 4, "global_batch_size": 8, "train_iters": 24,
            "lr_warmup_iters": 2, "lr": 3e-3, "min_lr": 3e-4, "data_index": data["index"], "precision": "fp32",
            "device": "cpu", "log_interval": 8, "eval_interval": 12, "eval_iters": 2, "save_interval": 12,
            "run_dir": str(run_dir), **overrides}


def _tokens(data: dict, n: int = 2) -> torch.Tensor:
    from gpt.data import GPTDataset

    test = GPTDataset.from_index(data["index"], "valid")
    return torch.stack([torch.from_numpy(test[i][:-1].astype("int64")) for i in range(n)])   # 32 positions


@pytest.mark.parametrize("layout, world, extra", [
    ("single process", 1, {}),
    ("DDP", 2, {}),
    ("FSDP2", 2, {"data_parallel_mode": "fsdp"}),
    ("tensor parallel", 2, {"tensor_parallel": 2, "data_parallel_mode": "fsdp"}),
])
def test_export_of_a_trained_run_loads_in_transformers_with_our_logits_and_loss(
        gpt_launcher, data, tmp_path, layout, world, extra):
    run = tmp_path / "run"
    out = gpt_launcher.run(_config(data, run, **extra), world_size=world)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["test_loss"] is not None and summary["test_perplexity"] > 1
    (run / "tokenizer").mkdir()
    for name, src in (("vocab.json", data["vocab"]), ("merges.txt", data["merges"])):
        (run / "tokenizer" / name).write_bytes(Path(src).read_bytes())
    hf_dir = tmp_path / "hf"
    result = subprocess.run([sys.executable, "-m", "gpt.export", str(run), str(hf_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json", "export.json", "generation_config.json", "merges.txt", "model.safetensors",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf.config.vocab_size == data["vocab_size"] == len(tok)            # real vocabulary, no padding rows
    checkpoint, config = find_checkpoint(run)
    ours = load_checkpoint(checkpoint, config)
    idx = _tokens(data)
    with torch.no_grad():
        theirs = hf(idx, labels=idx)
        torch.testing.assert_close(ours(idx), theirs.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours(idx[:, :-1], targets=idx[:, 1:]), theirs.loss, atol=1e-4, rtol=0)
    prompt = tok("To be, or not to be", return_tensors="pt")
    text = tok.decode(hf.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id)[0])
    ours_text = "".join(complete(*load(hf_dir), "To be, or not to be", 12, greedy=True))
    assert text.startswith("To be, or not to be") and text == "To be, or not to be" + ours_text


def test_hf_to_ours_to_hf_is_bitwise_and_training_starts_from_it(gpt_launcher, data, tmp_path):
    hf_config = transformers.GPT2Config(vocab_size=data["vocab_size"], n_positions=32, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(hf_config)
    src = tmp_path / "hf-src"
    hf.save_pretrained(src)
    ours = load_hf(src)
    again = to_hf_state_dict(ours)
    original = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    original.pop("lm_head.weight")                                            # tied to the embedding
    assert again.keys() == original.keys()
    assert all(torch.equal(again[k], original[k]) for k in original)

    run = tmp_path / "run"
    out = gpt_launcher.run(_config(data, run, init_from_hf=str(src), train_iters=1, lr=1e-12, min_lr=0.0,
                                   lr_warmup_iters=0, save_interval=1))
    assert f"started from the HuggingFace weights in {src}" in out
    trained = load_checkpoint(*find_checkpoint(run))
    assert torch.allclose(trained.h["1"].mlp.c_fc.weight, ours.h["1"].mlp.c_fc.weight, atol=1e-6)


def test_generation_is_reproducible_and_refuses_what_does_not_fit(data, tmp_path):
    hf_config = transformers.GPT2Config(vocab_size=data["vocab_size"], n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = load_hf_folder(hf_config, tmp_path)
    a = list(generate(model, [5, 6, 7], 10, temperature=0.9, top_k=20, seed=4))
    assert a == list(generate(model, [5, 6, 7], 10, temperature=0.9, top_k=20, seed=4)) and len(a) == 10
    with pytest.raises(ValueError, match="exceed the model's 32 positions"):
        list(generate(model, [1] * 30, 5))


def load_hf_folder(hf_config, tmp_path: Path):
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(tmp_path / "m")
    return load_hf(tmp_path / "m").eval()


def test_export_errors_name_what_is_missing(tmp_path):
    with pytest.raises(ExportError, match="neither a run folder"):
        export(tmp_path, tmp_path / "out")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ExportError, match="no complete checkpoint"):
        export(tmp_path, tmp_path / "out")
    with pytest.raises(ExportError, match="activation_function"):
        from gpt.export import config_from_hf
        config_from_hf({"model_type": "gpt2", "n_embd": 8, "activation_function": "relu", "vocab_size": 10,
                        "n_layer": 1, "n_head": 2, "n_positions": 8})


# ---------------------------------------------------------------- the output folder: written beside, replaced only if ours

def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(folder: Path) -> list[str]:
    """Temporary or set-aside folders of the export beside ``folder``."""
    return [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")]


@pytest.mark.timeout(60)
def test_export_refuses_a_folder_it_did_not_write_and_leaves_it_as_it_was(small_run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match=r"mine holds what python -m gpt.export did not write \(notes.txt\)"):
        export(small_run, mine)
    assert _tree(mine) == {"notes.txt": b"keep me"} and _leftovers(mine) == []

    # A HuggingFace folder that this tool did not write (no export.json) is not replaced either.
    theirs = export(small_run, tmp_path / "theirs")
    (theirs / "export.json").unlink()
    before = _tree(theirs)
    with pytest.raises(ExportError, match="did not write"):
        export(small_run, theirs)
    assert _tree(theirs) == before and _leftovers(theirs) == []


@pytest.mark.timeout(60)
def test_export_refuses_the_run_folder_its_checkpoints_and_what_holds_them(small_run):
    before = _tree(small_run.parent)
    checkpoint, _ = find_checkpoint(small_run)
    for out in (small_run, small_run.parent, checkpoint, small_run / "checkpoints", small_run / "tokenizer",
                small_run / "exports" / "hf"):
        with pytest.raises(ExportError, match=str(out)):
            export(small_run, out)
        with pytest.raises(ExportError, match=str(out)):
            export(checkpoint, out)
    assert _tree(small_run.parent) == before


@pytest.mark.timeout(60)
def test_export_replaces_its_own_earlier_export(small_run, tmp_path):
    out = export(small_run, tmp_path / "hf")
    marker = json.loads((out / "export.json").read_text())
    checkpoint, _ = find_checkpoint(small_run)
    # The small run's shape is not the tiny preset's: the export names the model by its shape.
    assert marker == {"tool": "python -m gpt.export", "checkpoint": str(checkpoint), "model": "gpt3-2l-32h-4a"}

    earlier = checkpoint.parent / "iter_0000004"
    assert export(earlier, out) == out
    assert json.loads((out / "export.json").read_text())["checkpoint"] == str(earlier)
    # An export written before export.json named the tool (it named only the checkpoint) is one too.
    (out / "export.json").write_text(json.dumps({"checkpoint": str(earlier), "model": "tiny"}))
    export(small_run, out)
    assert json.loads((out / "export.json").read_text())["checkpoint"] == str(checkpoint)
    assert _leftovers(out) == []
    # An empty folder is written into; <run>/hf, the export stage's folder, too.
    (tmp_path / "empty").mkdir()
    assert (export(small_run, tmp_path / "empty") / "model.safetensors").is_file()
    assert (export(small_run, small_run / "hf") / "model.safetensors").is_file()
    # An export someone added a file to is no longer only ours.
    (out / "README.md").write_text("my notes")
    with pytest.raises(ExportError, match=r"\(README.md\)"):
        export(small_run, out)
    assert (out / "README.md").read_text() == "my notes"


@pytest.mark.timeout(60)
def test_a_failed_export_leaves_the_previous_export_and_no_temporary_folder(small_run, tmp_path):
    out = export(small_run, tmp_path / "hf")
    before = _tree(out)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nnot-a-merge-line\n")
    # Fails after model.safetensors was written into the temporary folder.
    with pytest.raises(ExportError, match="not a byte-level BPE"):
        export(small_run, out, vocab_file=str(small_run / "tokenizer" / "vocab.json"), merge_file=str(bad_merges))
    assert _tree(out) == before and _leftovers(out) == []
    with pytest.raises(ExportError, match="neither a run folder"):
        export(tmp_path / "no-such-run", out)
    assert _tree(out) == before and _leftovers(out) == []


@pytest.mark.timeout(60)
def test_export_command_refuses_in_one_line_with_exit_code_2(small_run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.csv").write_text("1,2\n")
    for out in (mine, small_run):
        before = _tree(out)
        result = subprocess.run([sys.executable, "-m", "gpt.export", str(small_run), str(out)], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {out}"), result.stderr
        assert _tree(out) == before
    result = subprocess.run([sys.executable, "-m", "gpt.export", str(small_run), str(tmp_path / "hf")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == str(tmp_path / "hf"), result.stderr


# A Llama-block model of 361 million parameters (1.4 GB in fp32, 0.7 GB in bf16) with random
# weights, saved as a run's checkpoint: large beside one of its layers (45 MB in fp32).
BIG = {"model": "tiny-llama", "num_layers": 32, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 2,
       "ffn_hidden_size": 2816, "vocab_size": 256, "seq_length": 64, "precision": "bf16", "device": "cpu",
       "mock_data": True}
MAKE_BIG = """
import json, sys, torch
from pathlib import Path
from gpt.checkpoint import Checkpointer
from gpt.config import Config
from gpt.model import GPT
run = Path(sys.argv[1])
config = Config(**json.loads(sys.argv[2]), run_dir=str(run))
(run / "config.json").write_text(json.dumps(config.to_dict()))
with torch.device("meta"):
    model = GPT(config)
model.to_empty(device="cpu")
torch.manual_seed(0)
for p in model.parameters():
    p.data.uniform_(-0.05, 0.05)
Checkpointer(run / "checkpoints", 1, 0).save(1, model, torch.optim.SGD(model.parameters(), lr=0.1), {"iteration": 1})
"""
EXPORT_MEASURED = """
import json, sys
from pathlib import Path
from gpt.export import export
def status(field):
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")       # the peak from here on
export(sys.argv[1], sys.argv[2], shard_bytes=int(sys.argv[3]))
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.timeout(300)
def test_a_large_model_exports_in_bf16_shards_reading_one_layer_at_a_time(small_run, tmp_path):
    from safetensors import safe_open

    from gpt.export import hf_weights, to_hf_tensors
    from gpt.model import param_count

    run, hf_dir, shard = tmp_path / "run", tmp_path / "hf", 64 * 10**6
    (run / "tokenizer").mkdir(parents=True)
    for name in ("vocab.json", "merges.txt"):
        (run / "tokenizer" / name).write_bytes((small_run / "tokenizer" / name).read_bytes())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", MAKE_BIG, str(run), json.dumps(BIG)], check=True, env=env, timeout=240)
    made = subprocess.run([sys.executable, "-c", EXPORT_MEASURED, str(run), str(hf_dir), str(shard)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert made.returncode == 0, made.stderr[-3000:]
    memory = json.loads(made.stdout.strip().splitlines()[-1])
    checkpoint, config = find_checkpoint(run)
    fp32_bytes = 4 * param_count(config)
    # The process held about a layer and a shard, never the model: a quarter of it is a generous bound.
    assert memory["peak"] - memory["before"] < fp32_bytes / 4, (memory, fp32_bytes)

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    assert len(shards) >= 10 and shards == sorted(set(index["weight_map"].values())) and not (hf_dir / "model.safetensors").exists()
    assert all((hf_dir / s).stat().st_size <= shard + 10**5 for s in shards)
    assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(hf_dir / shards[0]), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert index["metadata"]["total_size"] == 2 * sum(v.numel() for v in hf_weights(hf_dir).values())

    # Every tensor is the checkpoint's, rounded to bf16; transformers reads the shards, all of them.
    expected = to_hf_tensors(load_checkpoint(checkpoint, config).state_dict(), config)
    written = hf_weights(hf_dir)
    assert set(written) == set(expected) == set(index["weight_map"])
    assert all(torch.equal(written[k], expected[k].to(torch.bfloat16).float()) for k in expected)
    del expected
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and theirs.dtype == torch.bfloat16
    assert torch.equal(theirs.state_dict()["model.layers.31.mlp.down_proj.weight"].float(),
                       written["model.layers.31.mlp.down_proj.weight"])
