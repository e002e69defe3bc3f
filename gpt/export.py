"""A trained run as a HuggingFace GPT-2 or Llama folder, and such a folder back as our model.

    python -m gpt.export RUN_DIR_OR_CHECKPOINT OUT_DIR [--vocab-file F --merge-file F]
                         [--dtype bf16] [--max-shard-size 5GB]

writes ``config.json`` (GPT2LMHeadModel for GPT-3's block, LlamaForCausalLM for Llama's), the
weights (the real vocabulary only, no padding rows; q, k and v apart as both architectures keep
them; rotary positions in HuggingFace Llama's convention, which ours is, so the weights are the same
numbers) in the run's training precision: ``model.safetensors``, or shards of at most 5 GB with
``model.safetensors.index.json`` as HuggingFace writes them, read from the checkpoint one layer at a
time so that the exporting process holds a layer and a shard whatever the model's size;
``generation_config.json``
and the tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer.json``, ``tokenizer_config.json``),
which ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load with no code of
ours. The checkpoint may have been saved under any parallel layout (DDP, FSDP2, tensor parallel):
torch.distributed.checkpoint reads each layer whole, in one process, on the CPU.
``load_hf`` reads such a folder back, and ``load_hf_weights`` gives each rank its share of it
(``Config.init_from_hf`` starts training from it).

Every export also holds ``export.json``, naming this tool and the checkpoint it was made from (every
export this tool ever wrote has one). OUT_DIR is written beside itself and replaced only when it is
absent, an empty folder, or an export: a folder with ``export.json`` and none but an export's files.
Anything else, such as a HuggingFace folder without ``export.json`` (``save_pretrained``'s, a
download) or a folder with other files, is refused and left as it is, and so are the run folder,
its checkpoints and the folders holding them; inside the run folder only ``<run>/hf`` is written.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from gpt.checkpoint import Checkpointer, load_whole_model
from gpt.config import Config, ConfigError, block_family, model_name, shape_differences
from gpt.config.presets import GPT3_BLOCK
from gpt.files import NotReplaceable, WriteError, as_os_error, replaced_folder
from gpt.model import (
    GPT,
    LLAMA_NAMES,
    hf_llama_to_ours,
    hf_to_ours,
    param_count,
    parameters,
    plain_name,
    split_qkv,
    tied,
)
from gpt.tokenizer import EOD, Tokenizer, TokenizerFileError, byte_level_bpe

TOOL = "python -m gpt.export"
MARKER = "export.json"
WEIGHTS = "model.safetensors"                  # the weights in one file, or ...
INDEX = "model.safetensors.index.json"         # ... the map of the shards that hold them
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SHARD_BYTES = 5 * 10**9                        # HuggingFace's default largest shard ("5GB")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EXPORT_FILES = frozenset({"config.json", WEIGHTS, INDEX, "generation_config.json", "vocab.json", "merges.txt",
                          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", MARKER})


class ExportError(ValueError):
    """The run cannot be exported as asked; the message says why and what to do."""


# ---------------------------------------------------------------- our names <-> GPT-2's

def family(config: Config) -> str:
    """The HuggingFace architecture that computes this model's block: "gpt2" or "llama"."""
    if all(getattr(config, name) == value for name, value in GPT3_BLOCK.items()) and \
            config.ffn_hidden_size == 4 * config.hidden_size and config.num_query_groups == config.num_attention_heads:
        return "gpt2"
    if block_family(config) == "llama":
        return "llama"
    raise ExportError(f"no HuggingFace architecture computes this block (position_embedding_type="
                      f"{config.position_embedding_type}, normalization={config.normalization}, swiglu={config.swiglu}, "
                      "...): GPT-2's is learned_absolute + LayerNorm + GELU, Llama's rope + RMSNorm + SwiGLU")


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The HuggingFace architecture's tensors for our model (see ``family``)."""
    return to_hf_tensors({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.config)


def to_hf_tensors(ours: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """The HuggingFace tensors that ``ours`` (all of a model's tensors, or some of its layers, or the
    tensors outside its layers) make, under HuggingFace's names."""
    hf = _llama_tensors(ours, config) if family(config) == "llama" else _gpt2_tensors(ours, config)
    return {k: v.contiguous() for k, v in hf.items()}


def _layers(ours: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in ours if k.startswith("h.")})


def _llama_tensors(ours: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's tensors: q, k and v projections apart; no lm_head where it is tied."""
    vocab, heads, groups = config.vocab_size, config.num_attention_heads, config.num_query_groups
    hf = {}
    if "wte.weight" in ours:
        hf["model.embed_tokens.weight"] = ours["wte.weight"][:vocab]
    if "ln_f.weight" in ours:
        hf["model.norm.weight"] = ours["ln_f.weight"]
    if "lm_head.weight" in ours and not tied(config):
        hf["lm_head.weight"] = ours["lm_head.weight"][:vocab]
    for i in _layers(ours):
        o, h = f"h.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            if o + f"attn.qkv.{kind}" in ours:
                for name, t in zip("qkv", split_qkv(ours[o + f"attn.qkv.{kind}"], heads, groups)):
                    hf[h + f"self_attn.{name}_proj.{kind}"] = t
            for name, theirs in LLAMA_NAMES.items():
                if o + f"{name}.{kind}" in ours:
                    hf[h + f"{theirs}.{kind}"] = ours[o + f"{name}.{kind}"]
    return hf


def _gpt2_tensors(ours: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (HF's Conv1D keeps weights as (in, out); all of q, then k, then v)."""
    vocab, heads = config.vocab_size, config.num_attention_heads
    hf = {}
    if "wte.weight" in ours:
        hf["transformer.wte.weight"] = ours["wte.weight"][:vocab]
    for name in ("wpe.weight", "ln_f.weight", "ln_f.bias"):
        if name in ours:
            hf["transformer." + name] = ours[name]
    for i in _layers(ours):
        o, h = f"h.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            hf[h + ln + ".weight"], hf[h + ln + ".bias"] = ours[o + ln + ".weight"], ours[o + ln + ".bias"]
        hf[h + "attn.c_attn.weight"] = torch.cat([t.t() for t in split_qkv(ours[o + "attn.qkv.weight"], heads)], dim=1)
        hf[h + "attn.c_attn.bias"] = torch.cat(split_qkv(ours[o + "attn.qkv.bias"], heads))
        for layer in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            hf[h + layer + ".weight"] = ours[o + layer + ".weight"].t()
            hf[h + layer + ".bias"] = ours[o + layer + ".bias"]
    return hf


def hf_config(config: Config, eod_id: int | None, dtype: str = "fp32") -> dict:
    """The HuggingFace configuration of our model (see ``family``), its weights stored in ``dtype``."""
    if family(config) == "llama":
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups, "head_dim": config.hidden_size // config.num_attention_heads,
            "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.norm_epsilon, "rope_theta": float(config.rotary_base), "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rotary_base)},
            "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear,
            "tie_word_embeddings": tied(config), "initializer_range": config.init_method_std, "attention_dropout": 0.0,
            "pretraining_tp": 1, "use_cache": True, "bos_token_id": eod_id, "eos_token_id": eod_id,
            "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."),
        }
    return {**gpt2_config(config, eod_id), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch.")}


def gpt2_config(config: Config, eod_id: int | None) -> dict:
    """GPT2Config fields for our configuration (GELU with the tanh approximation is GPT-2's gelu_new)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_positions": config.max_position_embeddings, "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": 4 * config.hidden_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "initializer_range": config.init_method_std, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0, "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eod_id, "eos_token_id": eod_id, "torch_dtype": "float32",
    }


def config_from_hf(hf: dict) -> Config:
    """Our Config for a GPT2Config or a LlamaConfig; refuses what our model does not compute the same way."""
    if not isinstance(hf, dict):
        raise ExportError(f"config.json holds a {type(hf).__name__}, not a model's configuration (a JSON object)")
    if hf.get("model_type") == "llama":
        return llama_config_from_hf(hf)
    problems = []
    if hf.get("model_type") != "gpt2":
        problems.append(f"model_type={hf.get('model_type')!r} (only GPT-2 and Llama folders)")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={hf['activation_function']!r} (ours is GELU, tanh approximation)")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        problems.append(f"n_inner={hf['n_inner']} (ours is 4 x n_embd)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings=false (ours ties the output layer to the embedding)")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        problems.append("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
    if problems:
        raise ExportError("this GPT-2 folder uses what our model does not compute: " + "; ".join(problems))
    return Config(model="tiny", vocab_size=hf["vocab_size"], num_layers=hf["n_layer"], hidden_size=hf["n_embd"],
                  num_attention_heads=hf["n_head"], seq_length=hf["n_positions"],
                  max_position_embeddings=hf["n_positions"], mock_data=True, device="cpu", precision="fp32")


def llama_config_from_hf(hf: dict) -> Config:
    """Our Config for a LlamaConfig; refuses what our model does not compute the same way."""
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (ours is SwiGLU: SiLU)")
    rope = hf.get("rope_parameters") or {}            # transformers 5; rope_theta and rope_scaling before
    scaling = hf.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling:
        problems.append(f"rope scaling {scaling!r} (ours rotates by the plain rope_theta frequencies)")
    if hf.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim={hf['head_dim']} (ours is hidden_size / num_attention_heads = {hidden // heads})")
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']}")
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        problems.append("attention_bias and mlp_bias differ (ours has biases in every linear layer or in none)")
    if problems:
        raise ExportError("this Llama folder uses what our model does not compute: " + "; ".join(problems))
    positions = hf.get("max_position_embeddings", 8192)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise ExportError(f"rope_theta={theta}: ours takes a whole number (rotary_base)")
    return Config(model="tiny-llama", vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"],
                  hidden_size=hidden, num_attention_heads=heads,
                  num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
                  rotary_base=int(theta), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
                  untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                  add_bias_linear=bool(hf.get("attention_bias", False)), seq_length=positions,
                  max_position_embeddings=positions, mock_data=True, device="cpu", precision="fp32")


def load_hf(folder: str | os.PathLike) -> GPT:
    """Our GPT with the weights of a HuggingFace GPT-2 or Llama folder (config.json and its weights)."""
    folder = Path(folder)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    model = GPT(config)
    model.load_state_dict(ours_from_hf(hf_weights(folder), config))
    return model


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a HuggingFace folder: ``model.safetensors``, or the shards its
    index names; empty where it has neither."""
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        return [folder / WEIGHTS] if (folder / WEIGHTS).is_file() else []
    index = json.loads((folder / INDEX).read_text())
    names = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(names, dict) or not all(isinstance(n, str) and "/" not in n for n in names.values()):
        raise ExportError(f"{folder / INDEX}: weight_map must map each tensor's name to a file of this folder")
    return [folder / name for name in sorted(set(names.values()))]


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes of a safetensors file's tensors, read from its header alone, and checked
    to lie within the file (a truncated copy is refused)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 2 <= length <= size - 8:
            raise ExportError(f"{path}: not a safetensors file (its header length is {length} bytes of {size})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ExportError(f"{path}: its header holds no table of tensors")
    header.pop("__metadata__", None)
    try:
        shapes = {name: tuple(int(d) for d in entry["shape"]) for name, entry in header.items()}
        end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ExportError(f"{path}: a tensor's entry in the header is malformed ({e!r})") from None
    if 8 + length + end > size:
        raise ExportError(f"{path}: truncated ({size} bytes where its header needs {8 + length + end})")
    return shapes


def hf_weight_problems(folder: Path, config: Config) -> list[str]:
    """What keeps ``folder``'s weights from loading into ``config``'s model: a weight file missing or
    damaged, a tensor missing, or one of another shape; from the files' headers, no tensor read."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in to_hf_tensors(GPT(config).state_dict(), config).items()}
    found: dict[str, tuple[int, ...]] = {}
    for path in weight_files(folder):
        if not path.is_file():
            return [f"{path.name} is missing ({INDEX} names it); copy the whole folder again"]
        found.update({name.removeprefix("transformer."): shape for name, shape in tensor_shapes(path).items()})
    problems = []
    for name, shape in expected.items():
        got = found.get(name.removeprefix("transformer."))
        if got is None:
            problems.append(f"{name} is in no weight file")
        elif got != shape:
            problems.append(f"{name} is {list(got)} where config.json makes {list(shape)}")
    return problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else [])


def hf_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a HuggingFace folder, one file or its shards, in fp32."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        weights.update({name: tensor.float() for name, tensor in load_file(str(path)).items()})
    return weights


def ours_from_hf(weights: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """A HuggingFace state dict of ``config``'s architecture under our names, the vocabulary padded."""
    if family(config) == "llama":
        return hf_llama_to_ours(weights, config.padded_vocab_size(), config)
    return hf_to_ours(weights, config.padded_vocab_size(), config.num_attention_heads)


def load_hf_weights(model: torch.nn.Module, config: Config) -> None:
    """Every rank loads the whole HuggingFace state dict and keeps its own shard of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from gpt.parallel.xla import sharded_names

    folder = Path(config.init_from_hf)
    theirs = config_from_hf(json.loads((folder / "config.json").read_text()))
    differ = shape_differences(theirs, config, also=("vocab_size",))
    if differ:
        raise ConfigError(f"init_from_hf={folder}: the model there has another shape ({'; '.join(differ)})")
    weights = ours_from_hf(hf_weights(folder), config)
    split = {plain_name(name): shard for name, shard in sharded_names(model).items()}
    weights = {key: split[key].cut(value) if key in split else value for key, value in weights.items()}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------- reading a run

def find_checkpoint(path: str | os.PathLike) -> tuple[Path, Config]:
    """The checkpoint folder and the run's Config, given a run folder or a checkpoint folder."""
    path = Path(path).resolve()
    if (path / "checkpoints").is_dir():
        run_dir, checkpoint = path, Checkpointer(path / "checkpoints", 1, 0).latest()
        if checkpoint is None:
            raise ExportError(f"{path}/checkpoints holds no complete checkpoint: train first (or give a checkpoint)")
    elif (path / ".metadata").is_file():
        run_dir, checkpoint = path.parent.parent, path
    else:
        raise ExportError(f"{path}: neither a run folder (with checkpoints/) nor a checkpoint (with .metadata)")
    if not (run_dir / "config.json").is_file():
        raise ExportError(f"{run_dir}/config.json not found: the run's configuration is needed to rebuild the model")
    return checkpoint, Config.load(run_dir / "config.json")


def load_checkpoint(checkpoint: Path, config: Config) -> GPT:
    """A plain fp32 GPT on the CPU holding the checkpoint's weights, whatever layout saved them."""
    # tensor_parallel stays: the embedding keeps the rows the run padded it to (a multiple of 128 x tp).
    plain = Config(**{**config.to_dict(), "device": "cpu", "precision": "fp32",
                      "compile": False, "activation_checkpointing": False})
    model = GPT(plain)
    try:
        model.load_state_dict(load_whole_model(checkpoint, model.state_dict()))
    except ValueError as e:
        raise ExportError(str(e)) from e
    return model.eval()


def export(source: str | os.PathLike, out_dir: str | os.PathLike, *, vocab_file: str | None = None,
           merge_file: str | None = None, tokenizer_file: str | None = None, dtype: str | None = None,
           shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the HuggingFace folder for a run or a checkpoint; returns the folder. The tokenizer files
    (GPT-2's pair, or a HuggingFace ``tokenizer_file``) default to those in ``<run>/tokenizer/``. Written to a temporary folder beside ``out_dir`` and renamed onto
    it when complete; ``out_dir`` must be new, empty or an earlier export (ExportError otherwise), and a
    full or read-only disk raises WriteError naming it. Either way nothing is left half-written.
    The weights are stored in ``dtype`` (default: the run's training precision, ``export_precision``)
    in files of at most ``shard_bytes`` (``write_weights``)."""
    checkpoint, config = find_checkpoint(source)
    run_dir = checkpoint.parent.parent
    tokenizer = _tokenizer(run_dir / "tokenizer", vocab_file, merge_file, tokenizer_file)
    if tokenizer.vocab_size != config.vocab_size:
        raise ExportError(f"the tokenizer has {tokenizer.vocab_size} entries but the run's vocab_size is "
                          f"{config.vocab_size}: give the tokenizer the run was tokenized with")
    eod = tokenizer.eod_id
    out = Path(out_dir).resolve()
    check_out_dir(out, run_dir, checkpoint)
    try:
        with replaced_folder(out, foreign_to_export, TOOL) as tmp:
            precision = dtype or export_precision(config)
            write_weights(checkpoint, config, tmp, DTYPES[precision], shard_bytes)
            (tmp / "config.json").write_text(json.dumps(hf_config(config, eod, precision), indent=2) + "\n")
            (tmp / "generation_config.json").write_text(json.dumps(
                {"bos_token_id": eod, "eos_token_id": eod, "max_length": config.max_position_embeddings}, indent=2) + "\n")
            write_tokenizer(tmp, tokenizer, config.max_position_embeddings)
            (tmp / MARKER).write_text(json.dumps(
                {"tool": TOOL, "checkpoint": str(checkpoint), "model": model_name(config)}, indent=2) + "\n")
    except NotReplaceable as e:
        raise ExportError(str(e)) from None
    return out


def export_bytes(config: Config, dtype: str | None = None) -> tuple[int, int]:
    """How large an export of this model is (bytes of weights) and the most one layer holds (the
    exporting process reads a layer in fp32 at a time), before any checkpoint exists."""
    size = DTYPES[dtype or export_precision(config)].itemsize
    return param_count(config) * size, parameters(config).block * 4


def export_precision(config: Config) -> str:
    """What an export stores the weights in: the precision the run trained in (bf16 for fp8 runs,
    whose float8 matmuls keep bf16 weights)."""
    return "bf16" if config.precision == "fp8" else config.precision


def write_weights(checkpoint: Path, config: Config, folder: Path, dtype: torch.dtype, shard_bytes: int) -> list[str]:
    """The checkpoint's weights as HuggingFace tensors in ``dtype``: ``model.safetensors``, or shards
    of at most ``shard_bytes`` each (a larger tensor alone in its shard) with their index. Read part
    by part (the tensors outside the layers, then one layer after another), so that the process
    holds one layer and one shard at a time, whatever the model's size. Returns the files."""
    from safetensors.torch import save_file

    plain = Config(**{**config.to_dict(), "device": "cpu", "precision": "fp32", "compile": False,
                      "activation_checkpointing": False})
    with torch.device("meta"):
        template = GPT(plain).state_dict()
    groups = [[k for k in template if not k.startswith("h.")]]
    groups += [[k for k in template if k.startswith(f"h.{i}.")] for i in range(config.num_layers)]
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    total = 0

    def write() -> None:
        path = folder / f"part-{len(shards):05d}.safetensors"
        with as_os_error(path):
            save_file(shard, str(path), metadata={"format": "pt"})
        shards.append(list(shard))

    for group in groups:
        try:
            ours = load_whole_model(checkpoint, {k: template[k] for k in group})
        except ValueError as e:
            raise ExportError(str(e)) from e
        for name, tensor in to_hf_tensors(ours, config).items():
            tensor = tensor.to(dtype).contiguous()
            if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > shard_bytes:
                write()
                shard = {}
            shard[name] = tensor
            total += tensor.nbytes
        del ours
    if shard:
        write()
    if len(shards) == 1:
        os.rename(folder / "part-00000.safetensors", folder / WEIGHTS)
        return [WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        os.rename(folder / f"part-{i:05d}.safetensors", folder / name)
    weight_map = {tensor: name for name, tensors in zip(names, shards) for tensor in tensors}
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return [*names, INDEX]


def check_out_dir(out: Path, run_dir: Path, checkpoint: Path) -> None:
    """Refuse an output folder that is, holds or lies in what the export reads: the run folder, the
    checkpoint, or (other than ``<run>/hf``) a folder inside the run."""
    for what, path in (("the run folder", run_dir), ("the checkpoint", checkpoint)):
        if out == path or path.is_relative_to(out):
            raise ExportError(f"{out} is or holds {what} {path}: give a new folder for the export, "
                              f"such as {run_dir / 'hf'}")
    if out.is_relative_to(run_dir) and out != run_dir / "hf":
        raise ExportError(f"{out} is inside the run folder {run_dir}: give {run_dir / 'hf'} or a folder outside the run")


def foreign_to_export(folder: Path) -> Iterable[str]:
    """The entries of ``folder`` that this tool did not write: all of them when it holds no
    ``export.json`` of this tool's (one written before the marker named the tool names only the
    checkpoint), else those that are not an export's files."""
    names = [p.name for p in folder.iterdir()]
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return names
    if not isinstance(marker, dict) or "checkpoint" not in marker or marker.get("tool", TOOL) != TOOL:
        return names
    return [n for n in names if n not in EXPORT_FILES and not SHARD.fullmatch(n)]


def _tokenizer(folder: Path, vocab_file: str | None, merge_file: str | None, tokenizer_file: str | None) -> Tokenizer:
    """The tokenizer named, else the one in the run's ``tokenizer/`` folder."""
    try:
        if tokenizer_file is not None:
            return Tokenizer.from_json(tokenizer_file)
        if vocab_file is None and not (folder / "vocab.json").is_file() and (folder / "tokenizer.json").is_file():
            return Tokenizer.from_json(folder / "tokenizer.json")
        return Tokenizer.gpt2(vocab_file or str(folder / "vocab.json"), merge_file or str(folder / "merges.txt"),
                              eod_required=False)
    except TokenizerFileError as e:
        raise ExportError(f"{e}; give the tokenizer the run was tokenized with") from None


def write_tokenizer(folder: Path, tokenizer: Tokenizer, max_length: int) -> None:
    """The tokenizer as transformers loads it: a tokenizer.json copied with the tokenizer_config.json
    beside it (else one naming its end-of-text token); GPT-2's pair with a tokenizer.json made from it."""
    if tokenizer.tokenizer_file is None:
        write_gpt2_tokenizer(folder, tokenizer.vocab_file, tokenizer.merge_file, max_length)  # type: ignore[arg-type]
        return
    for src, name in tokenizer.named_files():
        shutil.copyfile(src, folder / name)
    if not (folder / "tokenizer_config.json").is_file():
        eos = tokenizer.load().id_to_token(tokenizer.eod_id)
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "eos_token": eos},
            indent=2) + "\n")


def write_gpt2_tokenizer(folder: Path, vocab_file: str, merge_file: str, max_length: int) -> None:
    """GPT-2's byte-level BPE as transformers loads it: the two files plus tokenizer.json."""
    from tokenizers import processors

    shutil.copyfile(vocab_file, folder / "vocab.json")
    shutil.copyfile(merge_file, folder / "merges.txt")
    try:
        tok = byte_level_bpe(vocab_file, merge_file)
    except TokenizerFileError as e:
        raise ExportError(f"{e}: not a byte-level BPE vocabulary and its merges; give the files the run was "
                          "tokenized with") from None
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([EOD])
    with as_os_error(folder / "tokenizer.json"):
        tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length, "bos_token": EOD, "eos_token": EOD,
        "unk_token": EOD, "add_prefix_space": False, "add_bos_token": False}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": EOD, "eos_token": EOD, "unk_token": EOD}, indent=2) + "\n")


def shard_size(text: str) -> int:
    """A size in bytes as HuggingFace writes ``max_shard_size``: a number of bytes, or with KB, MB, GB."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(|B|KB|MB|GB)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 5GB, 500MB or a number of bytes")
    size = int(float(match.group(1)) * {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[match.group(2)])
    if size < 10**6:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1MB (each file holds at least one whole tensor; "
                                         "HuggingFace's default is 5GB)")
    return size


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.export", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a run folder (its newest checkpoint) or a checkpoint folder")
    p.add_argument("out_dir", help="the HuggingFace folder to write")
    p.add_argument("--vocab-file", help="default: <run>/tokenizer/vocab.json")
    p.add_argument("--merge-file", help="default: <run>/tokenizer/merges.txt")
    p.add_argument("--tokenizer-file", help="a HuggingFace tokenizer.json instead (default: <run>/tokenizer/"
                                            "tokenizer.json when the run has no vocab.json)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="what the weights are stored in (default: the run's "
                                                          "training precision; bf16 for fp8 runs)")
    p.add_argument("--max-shard-size", type=shard_size, default=SHARD_BYTES, metavar="SIZE",
                   help="the largest weights file, as HuggingFace's max_shard_size: 5GB (the default), 500MB, ...")
    a = p.parse_args(argv)
    try:
        out = export(a.source, a.out_dir, vocab_file=a.vocab_file, merge_file=a.merge_file,
                     tokenizer_file=a.tokenizer_file, dtype=a.dtype, shard_bytes=a.max_shard_size)
    except (ExportError, WriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ExportError) else 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
