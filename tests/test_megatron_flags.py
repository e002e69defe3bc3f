"""Megatron-LM's pretrain_gpt.py flags as a Megatron user pastes them: the same flow parameters
(and so the same run) as this command's own flags; what is not supported is refused by name."""
from __future__ import annotations

import subprocess
import sys

import pytest

from flows.cli import parse_args
from flows.plan.params import ParameterError
from tests.fixtures_gpt import ROOT

# A GPT-3-style sbatch's arguments (Megatron's scaling-table 7.5B: 36 layers, 4096 hidden, 32 heads).
GPT3_MEGATRON = """--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 --num-layers 36 --hidden-size 4096
--num-attention-heads 32 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 512
--train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105 --lr 1.2e-4 --min-lr 1.2e-5
--lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0
--init-method-std 0.02 --data-path 0.7 /data/a_text_document 0.3 /data/b_text_document --split 969,30,1
--tokenizer-type GPT2BPETokenizer --vocab-file /data/gpt2-vocab.json --merge-file /data/gpt2-merges.txt --bf16
--log-interval 10 --eval-interval 1000 --eval-iters 10 --save-interval 1000 --seed 1234""".split()
GPT3_OURS = """--model gpt-7.5b --tp 4 --pp 1 --seq-length 2048 --micro-batch-size 1 --global-batch-size 512
--train-samples 146484375 --prefix 0.7 /data/a_text_document --prefix 0.3 /data/b_text_document --split 969,30,1
--vocab-file /data/gpt2-vocab.json --merge-file /data/gpt2-merges.txt --precision bf16 --seed 1234
--set num_layers=36 --set hidden_size=4096 --set num_attention_heads=32 --set max_position_embeddings=2048
--set lr_decay_samples=126953125 --set lr_warmup_samples=183105 --set lr=1.2e-4 --set min_lr=1.2e-5
--set lr_decay_style=cosine --set weight_decay=0.1 --set adam_beta1=0.9 --set adam_beta2=0.95 --set adam_eps=1e-8
--set clip_grad=1.0 --set log_interval=10 --set eval_interval=1000 --set eval_iters=10
--set save_interval=1000 --set init_method_std=0.02""".split()

# Llama 3 8B as Megatron writes it.
LLAMA_MEGATRON = """--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --ffn-hidden-size 14336 --position-embedding-type rope --rotary-base 500000
--normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear --seq-length 8192
--micro-batch-size 1 --global-batch-size 512 --train-iters 1000 --lr 3e-4 --lr-warmup-fraction 0.01
--tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/llama3/tokenizer.json --data-path /data/c_text_document
--bf16""".split()


def _resolved(params: dict) -> dict:
    """The parameters with the overrides as a mapping (the order flags came in does not matter)."""
    return {**params, "training": params["training"].model_dump()}


def test_a_gpt3_sbatchs_megatron_flags_give_the_parameters_of_our_own():
    assert _resolved(parse_args(GPT3_MEGATRON)) == _resolved(parse_args(GPT3_OURS))


def test_llama3_8b_in_megatrons_flags_is_the_llama3_8b_preset():
    params = parse_args(LLAMA_MEGATRON)
    assert params["model"] == "llama3-8b"
    overrides = params["training"].overrides
    assert overrides["lr_warmup_iters"] == 10 and overrides["num_query_groups"] == 8 and overrides["swiglu"] is True
    assert params["tokenizer"].tokenizer_model == "/data/llama3/tokenizer.json"
    assert [(p.weight, p.prefix) for p in params["data"].prefixes] == [(1.0, "/data/c_text_document")]


@pytest.mark.parametrize("flag, message", [
    (["--distributed-backend", "nccl"], "--distributed-backend: not used here: the cluster preset's device"),
    (["--exit-duration-in-mins", "230"], "--exit-duration-in-mins: not used here: the cluster preset's time limit"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type SentencePieceTokenizer: not supported"),
    (["--lr-warmup-fraction", "0.01"], "--lr-warmup-fraction: give --lr-decay-iters or --train-iters"),
    (["--data-path", "0.5", "a", "b"], "--data-path 0.5 a b: expected one prefix, or weight and prefix pairs"),
])
def test_what_cannot_be_taken_as_written_is_refused_by_name(flag, message):
    with pytest.raises(ParameterError) as e:
        parse_args(["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", *flag])
    assert any(line.startswith(message) for line in e.value.errors), e.value.errors


@pytest.mark.parametrize("args, message", [
    (["--fp16", "--bf16"], "--fp16 and --bf16 give --precision two values; keep one"),
    (["--tensor-model-parallel-size", "2", "--tp", "1"],
     "--tensor-model-parallel-size 2 and --tp 1 give --tp two values; keep one"),
    (["--num-layers", "2", "--set", "num_layers=6"], "--num-layers 2 and --set num_layers=6 give num_layers two values"),
    (["--num-layers", "2", "--num-layers", "3"], "--num-layers 2 and --num-layers 3 give num_layers two values"),
    (["--train-iters", "2", "--train-iters", "3"], "training.train_iters: --train-iters 2 and --train-iters 3 give two "
                                                   "values; keep one"),
    (["--set", "lr=1", "--set", "lr=2"], "training.overrides.lr: lr=1 and lr=2 give two values; keep one"),
    (["--train-iters", "nan", "--lr-warmup-fraction", "0.1"],
     "--lr-warmup-fraction 0.1: the warmup is a fraction of the decay, whose length 'nan' is no whole number"),
    (["--train-iters", "abc"], "argument --train-iters/--training.train_iters: invalid int value: 'abc'"),
    (["--eval-set", "held", "a.jsonl", "--eval-set", "held", "b.jsonl"], None),
])
def test_two_values_for_one_field_are_refused_naming_both(args, message):
    """Two flags (or one flag twice) for one field are refused naming both, whichever spelling each
    is in; the same value twice is taken; two sets of one name are two sets (the plan refuses them)."""
    if message is None:
        sets = parse_args(args)["evaluation"].sets
        assert [(s.name, s.sources) for s in sets] == [("held", ["a.jsonl"]), ("held", ["b.jsonl"])]
        return
    with pytest.raises(ParameterError) as e:
        parse_args(args)
    assert any(message in line for line in e.value.errors), e.value.errors
    assert sum("two values" in line for line in e.value.errors) <= 1, e.value.errors      # said once
    assert parse_args(["--tp", "2", "--tensor-model-parallel-size", "2"])["training"].tensor_parallel == 2


def test_megatrons_wsd_flags_are_the_wsd_schedule():
    args = parse_args(["--train-iters", "1000", "--lr-warmup-iters", "10", "--lr-decay-style", "WSD",
                       "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-iters", "200"])
    overrides = args["training"].overrides
    assert (overrides["lr_decay_style"], overrides["lr_wsd_decay_style"], overrides["lr_wsd_decay_iters"]) == \
        ("WSD", "minus_sqrt", 200)


def test_a_shape_no_preset_has_takes_the_rest_from_the_nearest_preset_of_its_block():
    args = parse_args(["--num-layers", "7", "--hidden-size", "768", "--num-attention-heads", "12"])
    assert args["model"] == "gpt3-125m" and args["training"].overrides["num_layers"] == 7
    llama = parse_args(["--num-layers", "20", "--hidden-size", "4096", "--num-attention-heads", "32",
                        "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
                        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"])
    assert llama["model"] == "llama3-8b" and llama["training"].overrides["num_layers"] == 20


@pytest.mark.timeout(120)
def test_an_unsupported_megatron_flag_is_one_line_from_the_command():
    """From the command line: one line naming the flag, no traceback, nothing run."""
    run = subprocess.run([sys.executable, "-m", "flows.pretrain", "--tensor-model-parallel-size", "2",
                          "--data-cache-path", "/cache"], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert run.returncode != 0 and "Traceback" not in run.stderr + run.stdout
    assert "--data-cache-path: not used here: the index stage keeps the sample order" in run.stdout + run.stderr


def test_megatrons_save_is_the_runs_folder_and_another_load_a_start(capsys):
    """--save names the run's folder (a run resumes from it: --load of the same folder says nothing
    more); a --load of another folder starts a new run from it, optimizer state included."""
    same = parse_args(["--num-layers", "12", "--save", "/fsx/runs/gpt-a/", "--load", "/fsx/runs/gpt-a"])
    assert (same["output"].root, same["output"].run_name, same["training"].init_from) == ("/fsx/runs", "gpt-a", None)
    other = parse_args(["--num-layers", "12", "--save", "/fsx/runs/gpt-b", "--load", "/fsx/runs/gpt-a"])
    assert (other["output"].run_name, other["training"].init_from, other["training"].init_from_optimizer) == \
        ("gpt-b", "/fsx/runs/gpt-a", True)
    assert "note: --load /fsx/runs/gpt-a: a new run starts from that run or checkpoint" in capsys.readouterr().err
    with pytest.raises(ParameterError) as e:
        parse_args(["--num-layers", "12", "--save", "/fsx/runs/gpt-b", "--root", "/other"])
    assert e.value.errors == ["--save /fsx/runs/gpt-b and --root /other give --root two values; keep one"]


# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, its arrays as they are (paths filled in).
GPT3_175B_EXAMPLE = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size 1536
--rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6
--lr-warmup-fraction .001 --lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path /fsx/data/gpt3_text_document --vocab-file /fsx/gpt2-vocab.json --merge-file /fsx/gpt2-merges.txt
--split 949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 --save /fsx/ckpt --load /fsx/ckpt
--eval-iters 10 --tensorboard-dir /fsx/tb""".split()


# A GPT-3 6.7B recipe as a Megatron user's sbatch writes it (Megatron's scaling-table shape, GPT-3's
# batch of 1024 x 2048 tokens ramped up from 32 over the first 4B tokens, its learning rate and init).
GPT3_6_7B = """--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048
--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1024 --rampup-batch-size 32 32 1953125
--train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105 --lr 1.2e-4 --min-lr 1.2e-5
--lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.009
--clip-grad 1.0 --bf16 --tensor-model-parallel-size 8 --use-mcore-models --transformer-impl local
--attention-backend auto --data-path /fsx/data/gpt3_text_document --vocab-file /fsx/gpt2-vocab.json
--merge-file /fsx/gpt2-merges.txt --split 949,50,1 --log-interval 100 --save-interval 10000
--eval-interval 1000 --eval-iters 10 --save /fsx/runs/gpt3-6.7b --load /fsx/runs/gpt3-6.7b
--tensorboard-dir /fsx/tb/gpt3-6.7b""".split()


@pytest.mark.parametrize("args", [GPT3_175B_EXAMPLE, GPT3_6_7B], ids=["gpt3-175b-example", "gpt3-6.7b"])
def test_megatron_recipes_pasted_as_written_plan(args, tmp_path, monkeypatch, capsys):
    """Megatron-LM's GPT-3 175B example and a 6.7B sbatch's arguments, unchanged, with a cluster added:
    a dry run plans each (exit 0), the batch ramp-up and the TensorBoard copy in its rows; the same
    with two flags no one supports is one message naming both."""
    from flows.cli import main
    from flows.pretrain import pretrain

    monkeypatch.setenv("GPT_INPUT_ROOTS", "/fsx")
    monkeypatch.setenv("GPT_OUTPUT_ROOTS", "/fsx")
    monkeypatch.chdir(tmp_path)
    assert main(pretrain, [*args, "--cluster", "p5-8gpu", "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "what happens: dry run" in out.out and "ramped up from" in out.out, out.out[-3000:]
    assert "TensorBoard's events also in /fsx/tb" in out.out
    assert "note: --attention-backend auto: taken, and changes nothing" in out.err
    assert main(pretrain, [*args, "--cluster", "p5-8gpu", "--fp8-margin", "0", "--no-such-flag", "--dry-run"]) != 0
    said = capsys.readouterr()
    assert "--fp8-margin" in said.out + said.err and "--no-such-flag" in said.out + said.err


def test_the_175b_examples_recipe_is_taken_whole():
    params = parse_args(GPT3_175B_EXAMPLE)
    overrides = params["training"].overrides
    assert params["model"] == "gpt3-175b" and params["training"].precision == "fp16"
    assert (params["output"].root, params["output"].run_name) == ("/fsx", "ckpt")
    assert params["output"].tensorboard_dir == "/fsx/tb"
    assert (overrides["init_method_std"], overrides["lr_decay_iters"], overrides["lr_warmup_iters"]) == (0.006, 430000, 430)
    assert overrides["rampup_batch_size"] == [16, 16, 5859375]
