"""Text from a trained model, streamed as it is written.

    python -m gpt.generate RUN_DIR_OR_EXPORT --prompt "To be, or not" [--max-new-tokens 64]
        [--temperature 0.8 --top-k 50 --seed 1 | --greedy]

RUN_DIR_OR_EXPORT is a run folder (its newest checkpoint and ``tokenizer/``), a checkpoint
folder, or a folder written by ``gpt.export``. Keys and values of the tokens so far are kept per
layer (KVCache), so each new token costs one token's forward pass, not the whole prefix again.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from gpt.export import find_checkpoint, load_checkpoint, load_hf, weight_files
from gpt.model import GPT, KVCache
from gpt.tokenizer import Tokenizer


def load(source: str | Path) -> tuple[GPT, Tokenizer]:
    """The model and its tokenizer, from an export or from a run folder or checkpoint."""
    source = Path(source)
    if weight_files(source):
        return load_hf(source).eval(), Tokenizer.in_folder(source)
    checkpoint, config = find_checkpoint(source)
    return load_checkpoint(checkpoint, config), Tokenizer.in_folder(checkpoint.parent.parent / "tokenizer")


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             greedy: bool = False, seed: int = 0, stop: int | None = None) -> Iterator[int]:
    """New token ids one by one. ``greedy`` takes the most likely token; otherwise tokens are sampled
    (``temperature``, ``top_k``) from a generator seeded with ``seed``, so a seed repeats a text."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    limit = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed the model's "
                         f"{limit} positions; shorten one")
    rng = torch.Generator().manual_seed(seed)
    cache = [KVCache() for _ in model.h]
    logits = model(torch.tensor([prompt]), cache=cache)[0, -1]
    for _ in range(max_new_tokens):
        if greedy:
            token = int(logits.argmax())
        else:
            scores = logits.float() / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=rng))
        if token == stop:
            return
        yield token
        logits = model(torch.tensor([[token]]), cache=cache)[0, -1]


def complete(model: GPT, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, **kwargs) -> Iterator[str]:
    """The continuation of ``prompt`` as text pieces: each piece is what the new token adds to the
    decoded text (a character split over several byte tokens appears once it is whole)."""
    stop = tokenizer.eod_id
    tokenizer = tokenizer.load()
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    new: list[int] = []
    shown = ""
    for token in generate(model, ids, max_new_tokens, stop=stop, **kwargs):
        new.append(token)
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpt.generate", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a run folder, a checkpoint folder or a gpt.export folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    a = p.parse_args(argv)
    model, tokenizer = load(a.source)
    sys.stdout.write(a.prompt)
    for piece in complete(model, tokenizer, a.prompt, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                          greedy=a.greedy, seed=a.seed):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
