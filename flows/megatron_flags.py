"""Megatron-LM's `pretrain_gpt.py` flags, as a Megatron user writes them, for `python -m flows.pretrain`.

    python -m flows.pretrain --tensor-model-parallel-size 8 --num-layers 36 --hidden-size 4096 \\
        --num-attention-heads 32 --seq-length 2048 --micro-batch-size 1 --global-batch-size 512 \\
        --lr 1.2e-4 --lr-decay-samples 126953125 --data-path 0.7 corpus_a 0.3 corpus_b --bf16

``translate`` rewrites them into this command's own flags (``--tp``, ``--prefix``, ``--set FIELD=VALUE``)
before they are parsed, so both spellings give the same run. Without ``--model``, the preset of the
shape the flags give is chosen. A Megatron flag this project does not support is refused by name;
one that a run's folder or cluster preset decides here is refused naming what does it instead.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from gpt.config import ARCHITECTURE, Config, ConfigError, nearest_preset
from gpt.config.overrides import split_assignment
from gpt.config.presets import GPT3_BLOCK, PRESETS

# Megatron flag -> this command's flag taking the same value.
SAME_VALUE = {
    "--tensor-model-parallel-size": "--tp", "--pipeline-model-parallel-size": "--pp",
    "--context-parallel-size": "--cp",
    "--micro-batch-size": "--micro-batch-size", "--global-batch-size": "--global-batch-size",
    "--seq-length": "--seq-length", "--train-iters": "--train-iters", "--train-samples": "--train-samples",
    "--seed": "--seed", "--split": "--split", "--vocab-file": "--vocab-file", "--merge-file": "--merge-file",
    "--tokenizer-model": "--tokenizer-model",
}
# Megatron flag -> the gpt Config field of the same meaning (set with --set).
CONFIG_FIELD = {
    "--num-layers": "num_layers", "--hidden-size": "hidden_size", "--num-attention-heads": "num_attention_heads",
    "--ffn-hidden-size": "ffn_hidden_size", "--max-position-embeddings": "max_position_embeddings",
    "--num-query-groups": "num_query_groups", "--position-embedding-type": "position_embedding_type",
    "--normalization": "normalization", "--norm-epsilon": "norm_epsilon", "--rotary-base": "rotary_base",
    "--lr": "lr", "--min-lr": "min_lr", "--lr-decay-style": "lr_decay_style", "--lr-decay-iters": "lr_decay_iters",
    "--lr-decay-samples": "lr_decay_samples", "--lr-warmup-iters": "lr_warmup_iters",
    "--lr-wsd-decay-style": "lr_wsd_decay_style", "--lr-wsd-decay-iters": "lr_wsd_decay_iters",
    "--lr-wsd-decay-samples": "lr_wsd_decay_samples", "--init-method-std": "init_method_std",
    "--lr-warmup-samples": "lr_warmup_samples", "--weight-decay": "weight_decay", "--adam-beta1": "adam_beta1",
    "--adam-beta2": "adam_beta2", "--adam-eps": "adam_eps", "--clip-grad": "clip_grad",
    "--log-interval": "log_interval", "--eval-interval": "eval_interval", "--eval-iters": "eval_iters",
    "--save-interval": "save_interval",
}
# Megatron switch (no value) -> this command's flags.
SWITCHES = {
    "--bf16": ["--precision", "bf16"], "--fp16": ["--precision", "fp16"],
    "--group-query-attention": [],      # --num-query-groups gives the groups
}
# Megatron switch (no value) -> the Config field it sets, and its value.
FIELD_SWITCHES = {
    "--swiglu": ("swiglu", "true"), "--disable-bias-linear": ("add_bias_linear", "false"),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", "true"),
    "--reset-attention-mask": ("reset_attention_mask", "true"), "--reset-position-ids": ("reset_position_ids", "true"),
}
# Megatron flags whose job something else does here.
DECIDED_HERE = {
    "--distributed-backend": "the cluster preset's device decides it (NCCL on GPUs, gloo on CPUs)",
    "--data-cache-path": "the index stage keeps the sample order beside the data (--root)",
    "--exit-duration-in-mins": "the cluster preset's time limit ends a job, which saves and requeues",
}
# Megatron's choices of implementation, which change nothing of the recipe: taken, with a note.
IMPLEMENTATION = {
    "--use-mcore-models": "the model is the gpt package's",
    "--transformer-impl": "the model is the gpt package's",
    "--attention-backend": "attention is torch's scaled_dot_product_attention, which picks its kernel itself",
    "--use-flash-attn": "attention is torch's scaled_dot_product_attention, which picks the flash kernel itself",
}
TOKENIZER_TYPES = {"GPT2BPETokenizer": "--vocab-file and --merge-file",
                   "HuggingFaceTokenizer": "--tokenizer-model (a tokenizer.json)"}


class MegatronFlagError(ValueError):
    """Megatron flags that cannot be taken as written; one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def is_megatron(argv: list[str]) -> bool:
    """Whether the command line uses any flag that only Megatron-LM spells this way."""
    ours = set(SAME_VALUE.values())
    return any(_name(a) in (*SAME_VALUE, *CONFIG_FIELD, *SWITCHES, *FIELD_SWITCHES, *DECIDED_HERE, *IMPLEMENTATION,
                            "--save", "--load", "--data-path", "--rampup-batch-size",
                            "--tokenizer-type", "--lr-warmup-fraction") and _name(a) not in ours
               for a in argv)


class Translated(NamedTuple):
    argv: list[str]                 # this command's flags; those that could not be translated left out
    problems: list[str]             # one line per flag that cannot be taken as written
    notes: list[str]                # flags taken that change nothing here, and why


def translate(argv: list[str]) -> Translated:
    """``argv`` with Megatron's flags rewritten as this command's, every flag that cannot be named
    at once. Flags that are this command's own pass unchanged."""
    out: list[str] = []
    problems: list[str] = []
    notes: list[str] = []
    fields: dict[str, str] = {}
    warmup_fraction: str | None = None
    folders: dict[str, str] = {}                # --save, --load -> the folder named
    given: dict[str, tuple[str, str]] = {}      # what a value is for -> the flag that gave it, and the value
    i = 0
    while i < len(argv):
        start, (flag, inline) = i, _split(argv[i])
        values, i = _values(argv, i, inline)
        contradicts = [f"{given[target][0]} and {shown} give {target} two values; keep one"
                       for target, value, shown in _targets(flag, values) if target in given and given[target][1] != value]
        if contradicts:         # said once, here: the flag goes no further
            problems += contradicts
            continue
        for target, value, shown in _targets(flag, values):
            given.setdefault(target, (shown, value))
        if flag in SAME_VALUE:
            out += [SAME_VALUE[flag], *_one(flag, values, problems)]
        elif flag in CONFIG_FIELD:
            for value in _one(flag, values, problems):
                fields[CONFIG_FIELD[flag]] = value
        elif flag in SWITCHES or flag in FIELD_SWITCHES:
            out += SWITCHES.get(flag, [])
            fields.update([FIELD_SWITCHES[flag]] if flag in FIELD_SWITCHES else [])
            if values:
                problems.append(f"{flag}: takes no value (got {' '.join(values)})")
        elif flag in DECIDED_HERE:
            problems.append(f"{flag}: not used here: {DECIDED_HERE[flag]}")
        elif flag in IMPLEMENTATION:
            notes.append(f"{' '.join([flag, *values])}: taken, and changes nothing: {IMPLEMENTATION[flag]}")
        elif flag == "--data-path":
            out += _data_path(values, problems)
        elif flag == "--tokenizer-type":
            for value in _one(flag, values, problems):
                if value not in TOKENIZER_TYPES:
                    problems.append(f"--tokenizer-type {value}: not supported; use "
                                    + " or ".join(f"{k} ({v})" for k, v in TOKENIZER_TYPES.items()))
        elif flag == "--lr-warmup-fraction":
            warmup_fraction = next(iter(_one(flag, values, problems)), None)
        elif flag == "--rampup-batch-size":
            fields.update(_rampup(values, problems))
        elif flag in ("--save", "--load"):
            folders.update((flag, value) for value in _one(flag, values, problems))
        else:
            out += argv[start:i]         # this command's own flag, as it was written
    if warmup_fraction is not None:
        fields.update(_warmup_from_fraction(warmup_fraction, fields, out, problems))
    out += _checkpoint_folders(folders, notes)
    if "--model" not in out and any(f in ARCHITECTURE for f in fields):
        try:
            out += ["--model", preset_of_shape(fields)]
        except MegatronFlagError as e:
            problems += e.problems
    return Translated(out + [a for name, value in fields.items() for a in ("--set", f"{name}={value}")], problems,
                      notes)


def _checkpoint_folders(folders: dict[str, str], notes: list[str]) -> list[str]:
    """Megatron's --save folder is this run's folder (its parent the output root, its name the run's
    name), which a run resumes from; a --load of another folder starts a new run from it, its
    optimizer state too, as Megatron loads it."""
    out = []
    save, load = folders.get("--save"), folders.get("--load")
    if save is not None:
        where = Path(save.rstrip("/"))
        out += ["--root", str(where.parent), "--run-name", where.name]
        notes.append(f"--save {save}: the run's folder ({where}); a run resumes from its own folder"
                     + (", which --load names too" if load is not None and Path(load.rstrip("/")) == where else ""))
    if load is not None and (save is None or Path(load.rstrip("/")) != Path(save.rstrip("/"))):
        out += ["--init-from", load, "--init-from-optimizer"]
        notes.append(f"--load {load}: a new run starts from that run or checkpoint, its weights and optimizer "
                     "state (--init-from, --init-from-optimizer)")
    return out


def _targets(flag: str, values: list[str]) -> list[tuple[str, str, str]]:
    """What ``flag`` gives a value to (a field of the configuration, or one of this command's flags),
    the value, and the flag as written: two flags that give one of them two values contradict."""
    one = values[0] if len(values) == 1 else None
    if flag in CONFIG_FIELD and one is not None:
        return [(CONFIG_FIELD[flag], one, f"{flag} {one}")]
    if flag in FIELD_SWITCHES:
        return [(*FIELD_SWITCHES[flag], flag)]
    if flag in SWITCHES and SWITCHES[flag]:
        return [(SWITCHES[flag][0], SWITCHES[flag][1], flag)]
    if flag in SAME_VALUE and one is not None:
        return [(SAME_VALUE[flag], one, f"{flag} {one}")]
    if flag == "--set":
        return [(name, value, f"--set {name}={value}") for name, value in map(split_assignment, values)
                if value is not None]
    if flag == "--save" and one is not None:
        where = Path(one.rstrip("/"))
        return [("--root", str(where.parent), f"--save {one}"), ("--run-name", where.name, f"--save {one}")]
    if (flag in SAME_VALUE.values() or flag in ("--precision", "--root", "--run-name")) and one is not None:
        return [(flag, one, f"{flag} {one}")]
    return []


def preset_of_shape(fields: dict[str, str]) -> str:
    """The preset whose architecture is the one the fields give (the fields it leaves out as the
    preset has them); for a shape no preset has, the preset of its block nearest to it in size,
    whose learning rate, batch and schedule fill what the flags leave out (the run is named by its
    shape, gpt.config.model_name). MegatronFlagError when several presets have it."""
    given = {name: value for name, value in fields.items() if name in ARCHITECTURE}
    matches = []
    for name in PRESETS:
        preset = Config(model=name, mock_data=True)
        try:
            shaped = Config(**{**preset.to_dict(), **{k: v for k, v in given.items()}})
        except ConfigError:
            continue
        if all(getattr(shaped, n) == getattr(preset, n) for n in ARCHITECTURE):
            matches.append(name)
    if len(matches) > 1:        # the block's flags left out are Megatron's defaults: GPT-3's block
        matches = [name for name in matches if all(getattr(Config(model=name, mock_data=True), field) == value
                                                   for field, value in GPT3_BLOCK.items() if field not in given)] or matches
    if len(matches) == 1:
        return matches[0]
    shape = ", ".join(f"{k}={v}" for k, v in given.items())
    if matches:
        raise MegatronFlagError([f"several presets have this shape ({shape}): {', '.join(matches)}; choose one with --model"])
    try:
        return nearest_preset(Config(**{**Config(mock_data=True).to_dict(), **given}))
    except ConfigError as e:
        raise MegatronFlagError([f"this shape ({shape}) is no model: {e}"]) from None


def _warmup_from_fraction(fraction: str, fields: dict[str, str], out: list[str], problems: list[str]) -> dict[str, str]:
    """Megatron's warmup as a fraction of the decay: the warmup in the decay's unit."""
    for unit in ("iters", "samples"):
        decay = fields.get(f"lr_decay_{unit}") or _flag_value(out, f"--train-{unit}")
        if decay is not None:
            number, length = _number(fraction), _number(decay)
            if number is None or not 0 <= number <= 1:
                problems.append(f"--lr-warmup-fraction {fraction}: expected a number between 0 and 1")
                return {}
            if length is None or not math.isfinite(length) or length != int(length) or length < 1:
                problems.append(f"--lr-warmup-fraction {fraction}: the warmup is a fraction of the decay, whose "
                                f"length {decay!r} is no whole number of {unit}; give a whole number")
                return {}
            return {f"lr_warmup_{unit}": str(int(number * int(length)))}
    problems.append("--lr-warmup-fraction: give --lr-decay-iters or --train-iters (or their samples) with it, of "
                    "which it is a fraction")
    return {}


def _rampup(values: list[str], problems: list[str]) -> dict[str, str]:
    """--rampup-batch-size START INCREMENT SAMPLES as the rampup_batch_size field."""
    if len(values) != 3 or any(not v.isdigit() for v in values):
        problems.append(f"--rampup-batch-size {' '.join(values)}: expected three whole numbers: the first global "
                        "batch, the increment, and the samples over which the batch grows")
        return {}
    return {"rampup_batch_size": f"[{', '.join(values)}]"}


def _data_path(values: list[str], problems: list[str]) -> list[str]:
    """--data-path PREFIX, or WEIGHT PREFIX pairs, as --prefix pairs."""
    if len(values) == 1:
        return ["--prefix", "1", values[0]]
    if not values or len(values) % 2 or any(_number(w) is None for w in values[::2]):
        problems.append(f"--data-path {' '.join(values)}: expected one prefix, or weight and prefix pairs")
        return []
    return [a for w, prefix in zip(values[::2], values[1::2]) for a in ("--prefix", w, prefix)]


def _flag_value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def _one(flag: str, values: list[str], problems: list[str]) -> list[str]:
    if len(values) != 1:
        problems.append(f"{flag}: expected one value (got {len(values)})")
        return []
    return values


def _values(argv: list[str], i: int, inline: str | None) -> tuple[list[str], int]:
    """The values after argv[i] up to the next flag (or its ``=value``), and the index after them."""
    if inline is not None:
        return [inline], i + 1
    j = i + 1
    while j < len(argv) and not (argv[j].startswith("--") and len(argv[j]) > 2):
        j += 1
    return argv[i + 1:j], j


def _split(arg: str) -> tuple[str, str | None]:
    flag, value = split_assignment(arg)
    return (flag, value) if flag.startswith("--") else (arg, None)


def _name(arg: str) -> str:
    return _split(arg)[0]


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
