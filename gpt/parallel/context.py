"""Context parallelism: every sequence split over the ranks of the ``cp`` mesh dimension, attention
computed around a ring of them (Megatron's --context-parallel-size).

A sequence of T places is cut into 2 x cp chunks and context-parallel rank r holds chunks r and
2cp - 1 - r: one from each end, so that under the causal mask each rank has the same attention work.
Each rank computes q, k and v for its own tokens; its keys and values then go around the ring (the
process group's send and receive, on gloo as on NCCL), and each rank attends with its queries to
every block of keys it is handed, keeping a running log-sum-exp per query to merge the blocks as
flash attention merges tiles. The backward pass goes around the ring again, the gradients of each
block's keys and values travelling with it back to the rank that made them. Document masking
(gpt.model.Packing) applies inside each block, from the documents every rank shares at the start.

The block computation is written out (fp32 scores, a bounded number of query rows at a time):
it runs on every device, CPU included, and holds q, k, v, the output and the log-sum-exp for the
backward pass, as a flash kernel would.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gpt.config import Config
from gpt.model import GPT, Packing, attention_mask

# Scores held at once per tile (query rows x keys x batch x heads), in fp32: 512 MB.
SCORES_PER_TILE = 2 ** 27


def held_keys(config: Config) -> int:
    """Elements of the keys and values a rank holds for one layer and micro-batch: the block it passes
    around the ring (its share of every sequence, its tensor-parallel share of the key/value groups)."""
    head_dim = config.hidden_size // config.num_attention_heads
    return (2 * config.micro_batch_size * (config.seq_length // config.context_parallel)
            * (config.num_query_groups // config.tensor_parallel) * head_dim)


def ring_bytes(config: Config, world_size: int) -> int:
    """Bytes each rank sends to the next in one optimizer step: per layer and micro-batch, its keys and
    values passed on cp - 1 times in the forward pass (again where activation checkpointing recomputes
    attention), and in the backward pass cp - 1 times more with their fp32 gradients cp times."""
    cp, t = config.context_parallel, config.tensor_parallel
    if cp == 1:
        return 0
    element = 4 if config.precision == "fp32" else 2
    values = held_keys(config)
    recomputed = config.activation_checkpointing and config.activation_checkpointing_scope != "mlp"
    per_layer = values * element * (cp - 1) * (2 + recomputed) + values * 4 * cp
    dp = world_size // (t * config.pipeline_parallel * cp)
    return per_layer * config.num_layers * (config.global_batch_size // (config.micro_batch_size * dp))


def chunk_places(length: int, cp: int, rank: int) -> torch.Tensor:
    """The places of a sequence of ``length`` that context-parallel ``rank`` holds, in order: chunk
    ``rank`` and chunk ``2 cp - 1 - rank`` of 2 x cp."""
    size = length // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def shard(tokens: torch.Tensor, targets: torch.Tensor, packing: Packing, cp: int,
          rank: int) -> tuple[torch.Tensor, torch.Tensor, Packing]:
    """This rank's share of a micro-batch and of its packing."""
    places = chunk_places(tokens.shape[1], cp, rank).to(tokens.device)
    positions = packing.positions if packing.positions.dim() == 2 else packing.positions[None]
    documents = None if packing.documents is None else packing.documents[:, places]
    return tokens[:, places], targets[:, places], Packing(packing.index[places], positions[:, places], documents)


def apply(model: GPT, group: dist.ProcessGroup) -> None:
    """Attention of every block of a (meta) model around the ring of ``group``."""
    for block in model.h.values():
        block.attn.attend = _Ring(group)


class _Ring:
    """A block's attention over the context-parallel ranks of ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing) -> torch.Tensor:
        if isinstance(q, DTensor):
            raise TypeError("context parallel attends over local tensors (tensor parallel's ColwiseParallel gives them)")
        documents = None
        if packing.documents is not None:
            shares = [torch.empty_like(packing.documents) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(shares, packing.documents.contiguous(), group=self.group)
            documents = torch.stack(shares)
        return _RingAttention.apply(q, k, v, packing.index, documents, self.group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, index, documents, group):
        ring = _Neighbours(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        held = torch.stack([k, v])
        for step in range(ring.size):
            incoming = ring.pass_on(held, KEYS) if step < ring.size - 1 else None
            block = _Block(index, documents, ring, step)
            for rows, keys in block.tiles(q):
                _attend_tile(q, held, block, rows, keys, scale, out, lse)
            if incoming is not None:
                held = incoming.wait()
        ctx.save_for_backward(q, k, v, index, out, lse, documents)
        ctx.group, ctx.scale = group, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, index, out, lse, documents = ctx.saved_tensors
        ring = _Neighbours(ctx.group)
        grad_out = grad_out.float()
        delta = (grad_out * out).sum(-1)
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        held = torch.stack([k, v])
        grads = torch.zeros(held.shape, dtype=torch.float32, device=q.device)
        for step in range(ring.size):
            incoming = ring.pass_on(held, KEYS) if step < ring.size - 1 else None
            block = _Block(index, documents, ring, step)
            for rows, keys in block.tiles(q):
                _tile_backward(q, held, block, rows, keys, ctx.scale, (grad_out, lse, delta), grad_q, grads)
            grads = ring.pass_on(grads, GRADIENTS).wait()   # on with the keys they belong to (the last step: home)
            if incoming is not None:
                held = incoming.wait()
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None


# Tags of the two messages in flight between neighbours in the backward pass.
KEYS, GRADIENTS = 0, 1


class _Neighbours:
    """This rank's place in the ring and a send to the next rank with a receive from the one before."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _Incoming:
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                           dist.P2POp(dist.irecv, received, self.previous, self.group, tag)])
        return _Incoming(received, requests)


class _Incoming:
    def __init__(self, tensor: torch.Tensor, requests: list) -> None:
        self.tensor, self.requests = tensor, requests

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.tensor


class _Block:
    """The keys a rank holds at one step of the ring: those of the rank ``step`` places before it,
    and where they and this rank's queries sit (places, documents)."""

    def __init__(self, index: torch.Tensor, documents: torch.Tensor | None, ring: _Neighbours, step: int) -> None:
        owner = (ring.rank - step) % ring.size
        self.queries, self.keys = index, chunk_places(index.shape[0] * ring.size, ring.size, owner).to(index.device)
        self.query_documents = None if documents is None else documents[ring.rank]
        self.key_documents = None if documents is None else documents[owner]

    def tiles(self, q: torch.Tensor):
        """(query rows, key columns) of each tile with at least one allowed pair: the two chunks of
        keys apart, query rows as many as keep a tile's scores within SCORES_PER_TILE. Under the
        causal mask a key chunk later than every query is skipped: what balances the ranks' work."""
        half = self.keys.shape[0] // 2
        step = max(1, SCORES_PER_TILE // (half * q.shape[0] * q.shape[1]))
        for keys in (slice(0, half), slice(half, 2 * half)):
            for start in range(0, q.shape[2], step):
                rows = slice(start, start + step)
                if self.queries[rows].max() >= self.keys[keys].min():
                    yield rows, keys

    def allowed(self, rows: slice, keys: slice) -> torch.Tensor:
        documents = self.query_documents is not None
        return attention_mask(self.queries[rows], self.keys[keys],
                              self.query_documents[:, rows] if documents else None,
                              self.key_documents[:, keys] if documents else None)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """Masked scores (B, groups, heads per group, rows, keys) in fp32 of q (B, heads, rows, D) over k
    (B, groups, keys, D)."""
    b, heads, rows, d = q.shape
    grouped = q.float().view(b, k.shape[1], heads // k.shape[1], rows, d)
    s = torch.einsum("bgrqd,bgkd->bgrqk", grouped, k.float()) * scale
    return s.masked_fill(~allowed[:, None, None], float("-inf"))


def _attend_tile(q, held, block: _Block, rows: slice, keys: slice, scale: float, out: torch.Tensor,
                 lse: torch.Tensor) -> None:
    """Merge one tile's attention into ``out`` and ``lse`` (the running log-sum-exp of each query)."""
    k, v = held[0][:, :, keys], held[1][:, :, keys]
    s = _scores(q[:, :, rows], k, scale, block.allowed(rows, keys))
    tile_lse = torch.logsumexp(s, dim=-1)                                        # -inf where none allowed
    p = torch.exp(s - torch.nan_to_num(tile_lse, neginf=0.0)[..., None])
    tile_out = torch.einsum("bgrqk,bgkd->bgrqd", p, v.float()).flatten(1, 2)
    tile_lse = tile_lse.flatten(1, 2)
    merged = torch.logaddexp(lse[:, :, rows], tile_lse)
    keep = torch.nan_to_num(torch.exp(lse[:, :, rows] - merged))
    take = torch.nan_to_num(torch.exp(tile_lse - merged))
    out[:, :, rows] = out[:, :, rows] * keep[..., None] + tile_out * take[..., None]
    lse[:, :, rows] = merged


def _tile_backward(q, held, block: _Block, rows: slice, keys: slice, scale: float,
                   saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor], grad_q: torch.Tensor,
                   grads: torch.Tensor) -> None:
    """Add one tile's share to the gradient of q and to its keys' and values' (``grads``)."""
    grad_out, lse, delta = saved
    k, v = held[0][:, :, keys], held[1][:, :, keys]
    b, heads, _, d = q.shape
    groups = k.shape[1]
    s = _scores(q[:, :, rows], k, scale, block.allowed(rows, keys))
    p = torch.exp(s - lse[:, :, rows].view(s.shape[:-1])[..., None])
    g = grad_out[:, :, rows].view(b, groups, heads // groups, -1, d)
    grads[1][:, :, keys] += torch.einsum("bgrqk,bgrqd->bgkd", p, g)
    dp = torch.einsum("bgrqd,bgkd->bgrqk", g, v.float())
    ds = p * (dp - delta[:, :, rows].view(s.shape[:-1])[..., None]) * scale
    grad_q[:, :, rows] += torch.einsum("bgrqk,bgkd->bgrqd", ds, k.float()).flatten(1, 2)
    grads[0][:, :, keys] += torch.einsum("bgrqk,bgrqd->bgkd", ds, q[:, :, rows].float().view(b, groups, heads // groups, -1, d))
