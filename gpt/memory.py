"""What one rank of a training layout holds at its peak, estimated from the configuration alone:
its share of the model state, its activations for the micro-batches in flight, and the output
layer with the chunked loss. The plan (flows.plan.build) checks it against the device's memory before
anything is queued; ``python -m gpt.memory`` prints it beside what gpt.bench measures.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpt.config import Config
from gpt.config.overrides import parse_overrides
from gpt.model import parameters
from gpt.parallel.context import SCORES_PER_TILE, held_keys

GIB = 1 << 30
STATE_BYTES = 16               # per parameter: fp32 weight, gradient and AdamW's two moments


@dataclass(frozen=True)
class RankMemory:
    """What one rank of a layout holds at its peak, in bytes, on its heaviest pipeline stage."""
    stage: str                 # "the only stage", "the first stage", "the last stage"
    parameters: int            # parameters this rank holds (its stage's, its tensor-parallel share)
    model_state: int           # fp32 weights, gradients and AdamW's two moments (sharded under FSDP)
    unsharded: int             # FSDP: gathered whole with their gradients, one block and the stage's own layers
    activations: int           # kept for the backward pass, for every micro-batch in flight
    in_flight: float           # micro-batches whose activations the stage holds at once
    loss: int                  # the output layer's gathered weight, gradient and one chunk of logits
    attention: int = 0         # one layer's attention work space: context parallel's ring (keys and values
                               # held and arriving, their gradients, a tile of scores) or a document mask
    buckets: int = 0           # torch's DDP module: its gradient buckets, a second fp32 copy of the gradients

    @property
    def total(self) -> int:
        return self.model_state + self.unsharded + self.activations + self.loss + self.attention + self.buckets

    def arithmetic(self) -> str:
        gib = lambda n: f"{n / GIB:,.2f}"  # noqa: E731
        return (f"{gib(self.total)} GiB on {self.stage}: model state {gib(self.model_state)} ({self.parameters:,} "
                f"parameters x {STATE_BYTES} B{', sharded over data parallel' if self.unsharded else ''})"
                + (f" + gathered whole (one block, embedding and norm) {gib(self.unsharded)}" if self.unsharded else "")
                + f" + activations {gib(self.activations)} ({self.in_flight:g} micro-batch(es) in flight)"
                + f" + output layer and loss {gib(self.loss)}"
                + (f" + attention work space {gib(self.attention)}" if self.attention else "")
                + (f" + DDP's gradient buckets {gib(self.buckets)}" if self.buckets else ""))


# Activations kept per layer for one micro-batch, in units of sequence x micro-batch x hidden x 2 bytes
# (Korthikanti et al., 2022, without dropout masks, and without attention scores, which flash
# attention never stores). For GPT-3's block: 8 held whole on every tensor-parallel rank, 24 split
# over them; of the 32, the attention's are 10 and the MLP's 18 (the norms' 4 stay). Of the split
# ones, the MLP's 16 are its two inner tensors (4 x hidden each), and the attention's 8 hold q, k and
# v (2 each) and its output: grouped K/V shrinks k and v, SwiGLU keeps four inner tensors of
# ffn_hidden_size (gate, up, SiLU and product).
_ACTIVATION_WHOLE = 8


def _split_activations(config: Config) -> tuple[float, float]:
    """The attention's and the MLP's activations split over tensor-parallel ranks, in those units."""
    h, groups, heads = config.hidden_size, config.num_query_groups, config.num_attention_heads
    attention = 8 - 4 * (1 - groups / heads)
    mlp = 16 * config.ffn_hidden_size / (4 * h) * (2 if config.swiglu else 1)
    return attention, mlp


def attention_space(config: Config) -> int:
    """Bytes one layer's attention uses while it runs beyond what it keeps: under context parallel
    the ring's keys and values (held and arriving, with their fp32 gradients in the backward pass),
    the fp32 output and query gradient, and a tile of fp32 scores with its probabilities and their
    gradient (gpt.parallel.context); with document masking and no ring, the mask of each sample."""
    t, cp, b, s = config.tensor_parallel, config.context_parallel, config.micro_batch_size, config.seq_length
    heads = config.num_attention_heads // t
    head_dim, element = config.hidden_size // config.num_attention_heads, 4 if config.precision == "fp32" else 2
    if cp == 1:
        return b * s * s if config.reset_attention_mask else 0
    local = b * (s // cp)
    keys = held_keys(config)
    tile = min(SCORES_PER_TILE, b * heads * (s // cp) * (s // (2 * cp)))
    return keys * (2 * element + 2 * 4) + 2 * local * heads * head_dim * 4 + 3 * tile * 4


def rank_memory(config: Config, world_size: int) -> RankMemory:
    """One rank's peak memory for this layout (pipeline x data x context x tensor parallel, the
    micro-batch, the activation-checkpointing scope, the pipeline schedule), on the stage that needs
    the most. Context parallel divides each sequence, and so the activations, over its ranks."""
    t, pp, v, cp = config.tensor_parallel, config.pipeline_parallel, config.virtual_pipeline_stages, config.context_parallel
    dp = max(1, world_size // (t * pp * cp))
    h, s, b = config.hidden_size, config.seq_length // cp, config.micro_batch_size
    vocab = config.padded_vocab_size()
    layers = config.num_layers // pp
    held = parameters(config, t)
    block = held.block
    element = 4 if config.precision == "fp32" else 2
    micro_batches = max(1, config.global_batch_size // (b * dp))
    if pp == 1:
        first_in_flight = last_in_flight = 1.0
    elif config.pipeline_schedule == "gpipe":      # every forward before any backward, on every stage
        first_in_flight = last_in_flight = float(micro_batches)
    else:   # 1F1B: the first stage holds pp micro-batches (interleaving adds (pp - 1) / (pp x v)), the last one
        first_in_flight = min(micro_batches, pp) * (1 + ((pp - 1) / (pp * v) if v > 1 else 0))
        last_in_flight = 1.0
    attention_split, mlp_split = _split_activations(config)
    units = _ACTIVATION_WHOLE + (attention_split + mlp_split) / t
    per_layer = s * b * h * units * element / 2
    checkpointed = config.activation_checkpointing
    scope_saves = {"attention": (2 + attention_split / t) / units, "mlp": (2 + mlp_split / t) / units}
    saved = scope_saves.get(config.activation_checkpointing_scope, 0) if checkpointed else 0

    def activations(in_flight: float) -> int:
        if checkpointed and config.activation_checkpointing_scope == "block":
            return int(layers * s * b * h * 4 * in_flight + per_layer)   # block inputs, one block recomputed
        return int(layers * per_layer * (1 - saved) * in_flight)

    # The loss: the output weight's fp32 gradient, its copy in the autocast dtype and, under tensor
    # parallel, gathered whole; one chunk's logits (fp32, with the autocast matmul's output and the
    # gradient in that dtype beside them); the gradient of the hidden states.
    chunk_tokens = min(s * b, max(1, 2 ** 27 // vocab))
    sixteen_bit = element < 4
    loss = (vocab * h * (4 + (element if sixteen_bit else 0) + (4 if t > 1 else 0))
            + chunk_tokens * vocab * (4 + (2 * element if sixteen_bit else 0)) + s * b * h * 4)
    embedding = held.embedding
    fsdp = config.data_parallel_mode == "fsdp"

    def stage(name: str, extra: int, in_flight: float, loss: int) -> RankMemory:
        params = layers * block + extra
        # FSDP2 gathers each block's weights (and its gradient before the reduce-scatter) while it runs,
        # and the stage's own layers (embedding, final norm) for the whole step: it does not reshard the root.
        gathered = 8 * (block + extra) if fsdp and dp * cp > 1 else 0
        # torch's DDP module wraps a whole model without DTensors (gpt.parallel.data.wrap); elsewhere
        # the replicas average the gradients in place.
        buckets = 4 * params if not fsdp and dp * cp > 1 and pp == 1 and t == 1 else 0
        return RankMemory(name, params, STATE_BYTES * params // (dp * cp if fsdp else 1), gathered,
                          activations(in_flight), in_flight, loss, attention_space(config), buckets)

    if pp == 1:
        return stage("the only stage", embedding + held.positions + held.final_norm + held.output, 1.0, loss)
    return max(stage("the first stage", embedding + held.positions, first_in_flight, 0),
               stage("the last stage", embedding + held.final_norm, last_in_flight, loss), key=lambda m: m.total)


def _model_parallel(config: Config) -> list[tuple[int, int, int]]:
    """(pipeline, context, tensor) degrees to try, the fewest more ranks per replica first: more
    stages or sequence splits, and for a sequence split, tensor-parallel ranks given over to it."""
    raised = lambda now: sorted({now, *(n for n in (2, 4, 8, 16, 32) if n > now)})  # noqa: E731
    t = config.tensor_parallel
    tps = [t, *(t // d for d in (2, 4, 8, 16) if t % d == 0)]
    layouts = {(pp, cp, tp) for pp in raised(config.pipeline_parallel) for cp in raised(config.context_parallel)
               for tp in tps if tp == t or cp * tp >= config.context_parallel * t}
    return sorted(layouts, key=lambda layout: (layout[0] * layout[1] * layout[2], -layout[2]))


def fitting_layout(config: Config, world_size: int, limit: int) -> str | None:
    """A change to the layout that fits in ``limit`` bytes per rank, named by its fields, or None:
    activation checkpointing, then sharded data parallel, then more pipeline stages or ranks splitting
    each sequence (context parallel), the fewest first."""
    for ac in dict.fromkeys((config.activation_checkpointing, True)):
        for mode in dict.fromkeys((config.data_parallel_mode, "fsdp")):
            for pp, cp, tp in _model_parallel(config):
                if world_size % (tp * pp * cp) or config.num_layers % pp:
                    continue
                change = {"activation_checkpointing": ac, "data_parallel_mode": mode, "pipeline_parallel": pp,
                          "context_parallel": cp, "tensor_parallel": tp}
                candidate = dataclasses.replace(config, **change, activation_checkpointing_scope="block"
                                                if ac and not config.activation_checkpointing else
                                                config.activation_checkpointing_scope)
                if dataclasses.replace(candidate, mock_data=True, data_index=None).problems(world_size):
                    continue
                if rank_memory(candidate, world_size).total <= limit:
                    said = [f"{k}={v}" for k, v in change.items() if getattr(config, k) != v]
                    return ", ".join(said) if said else None
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m gpt.memory --world-size N --set FIELD=VALUE ...``: the estimate, as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m gpt.memory", description=main.__doc__)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    fields, problems = parse_overrides(args.set)
    if problems:
        parser.error("; ".join(message for _, message in problems))
    config = Config.from_dict({"mock_data": True, **fields})
    estimate = rank_memory(config, args.world_size)
    print(json.dumps({**dataclasses.asdict(estimate), "total": estimate.total, "arithmetic": estimate.arithmetic()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
