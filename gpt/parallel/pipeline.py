"""Pipeline parallelism on torch.distributed.pipelining: the blocks split evenly into stages, each
rank of the ``pp`` mesh dimension holding one stage, or ``virtual_pipeline_stages`` of them
(interleaved: stage s on pipeline rank s mod pp), run by one of torch's schedules.

The embedding goes with the first stage; the final norm, the output layer and the chunked loss with
the last. With the output layer tied, the last holds its own copy of the embedding as
``lm_head.weight``: both start equal (initialised by the same name) and the two gradients are summed
after each backward, as Megatron does, so they stay equal; untied, it is a layer of its own. Each rank keeps one GPT of its layers under their global names ("h.7"),
which the optimizer and the checkpoints see as they see a whole model; its stages are views of it
that share its layers. Data and tensor parallel apply inside each stage (gpt.parallel.build): FSDP2
shards each stage; as DDP, the gradients are averaged after the schedule
(gpt.parallel.dims.ParallelDims.gradient_replicas).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from gpt.config import Config
from gpt.model import GPT, tied
from gpt.parallel.dims import ParallelDims

# torch.distributed.pipelining, which brings TorchDynamo (a second per process), and the layouts
# (DTensor's operators, about one more) are imported by the runs that build a pipeline only: the flow reads
# bubble_fraction here
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "interleaved-zb": "ScheduleInterleavedZeroBubble"}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")      # one stage per rank; the others loop over several


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each stage: equal runs of consecutive blocks."""
    per = num_layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages a pipeline rank runs, in order: one per round of the loop over the ranks."""
    return [pp_rank + v * pp for v in range(virtual)]


def bubble_fraction(schedule: str, pp: int, virtual: int, micro_batches: int) -> float:
    """The idle share of a step, (pp - 1) / (virtual x micro-batches + pp - 1): the fill and drain
    of the pipeline, shortened by interleaving (Narayanan et al., 2021). Zero-bubble schedules fill
    it with the weight-gradient work, in the ideal case entirely."""
    if pp == 1 or schedule == "interleaved-zb":
        return 0.0
    return (pp - 1) / (virtual * micro_batches + pp - 1)


@dataclass
class Pipeline:
    """This rank's stages and the schedules that run them over a step's micro-batches, one per count
    of micro-batches (a batch-size ramp-up changes the count)."""

    model: GPT                              # this rank's layers, under their global names
    new_schedule: Callable[[int], object]   # a schedule for this many micro-batches
    size: int
    pp_group: dist.ProcessGroup
    tied: nn.Parameter | None               # this rank's embedding (first stage) or its copy (last)
    tied_group: dist.ProcessGroup | None    # the first and last stage of this data/tensor-parallel slot
    loss_scale: torch.Tensor | None = None  # fp16: the loss function scales by it
    schedules: dict[int, object] = dataclasses.field(default_factory=dict)

    def schedule(self, micro_batches: int) -> object:
        if micro_batches not in self.schedules:
            self.schedules[micro_batches] = self.new_schedule(micro_batches)
        return self.schedules[micro_batches]

    @property
    def is_last(self) -> bool:
        return self.model.lm_head is not None

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the sum of their mean losses on the last
        stage (zero elsewhere). Gradients are left as the mean over the micro-batches, summed over the
        tied embedding's two copies (FSDP has reduced them over the data-parallel ranks)."""
        self.loss_scale = scale
        total = self._run(batches, partial(self.schedule(len(batches)).step, return_outputs=False))
        self._sum_tied_gradients()
        return total

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        self.loss_scale = None
        return self._run(batches, self.schedule(len(batches)).eval)

    def _run(self, batches, run) -> torch.Tensor:
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        losses: list[torch.Tensor] = []
        run(*([x] if self.model.wte is not None else []), target=y, losses=losses)
        total = torch.zeros((), device=x.device)
        for loss in losses:
            total += loss.detach().float() / (1.0 if self.loss_scale is None else self.loss_scale)
        return total

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function, on the last stage."""
        loss = self.model.loss(hidden, targets)
        return loss if self.loss_scale is None else loss * self.loss_scale

    def _sum_tied_gradients(self) -> None:
        if self.tied_group is None or self.tied is None:
            return
        grad = self.tied.grad
        if grad is None:  # a stage that computed no gradient for it still takes part in the sum
            grad = self.tied.grad = torch.zeros_like(self.tied)
        if hasattr(grad, "placements") and grad.placements != self.tied.placements:
            # the embedding's gradient may come out of backward replicated; hold it as the weight is
            grad = self.tied.grad = grad.redistribute(grad.device_mesh, self.tied.placements)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.tied_group)

    def norm_parameters(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters the gradient norm counts: the last stage's copy of the embedding once only,
        on the first stage."""
        if self.is_last and self.model.wte is None and self.tied is not None:
            return [p for p in parameters if p is not self.model.lm_head.weight]
        return parameters


def build_pipeline(config: Config, env: ParallelDims, device: torch.device) -> Pipeline:
    """This rank's stages of the GPT, with data and tensor parallel inside each, weights initialised
    as the whole model's, and the schedule."""
    from torch.distributed import pipelining

    from gpt.parallel.build import apply_layers, materialise

    pp, virtual = config.pipeline_parallel, config.virtual_pipeline_stages
    stages = pp * virtual
    held = stages_of_rank(env.pp_rank, pp, virtual)
    layers = stage_layers(config.num_layers, stages)
    with torch.device("meta"):
        model = GPT(config)
    _keep(model, [i for s in held for i in layers[s]], first=0 in held, last=stages - 1 in held)
    apply_layers(model, config, env, device)
    views = [_view(model, layers[s], first=s == 0, last=s == stages - 1) for s in held]
    parts = materialise(model, views, config, env, device)
    pp_group = env.mesh["pp"].get_group()
    pipe_stages = [pipelining.PipelineStage(part, s, stages, device, group=pp_group) for part, s in zip(parts, held)]
    kind = getattr(pipelining.schedules, SCHEDULES[config.pipeline_schedule])
    single = config.pipeline_schedule in SINGLE_STAGE_SCHEDULES
    pipeline = Pipeline(model, lambda n: kind(pipe_stages[0] if single else pipe_stages, n_microbatches=n,
                                              loss_fn=pipeline.loss, scale_grads=True),
                        pp, pp_group, _tied(model), _tied_group(env) if tied(config) else None)
    return pipeline


def _keep(model: GPT, keys: list[int], first: bool, last: bool) -> None:
    """Remove from a (meta) model what this rank's stages do not hold."""
    model.h = nn.ModuleDict({str(i): model.h[str(i)] for i in keys})
    if last and not first and tied(model.config):  # the output layer's own copy of the embedding
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.wte.weight))
    if not first:
        model.wte, model.wpe = None, None
    if not last:
        model.ln_f, model.lm_head = None, None
    model.emits_hidden = True


def _view(model: GPT, layers: range, first: bool, last: bool) -> GPT:
    """One stage: a GPT over the rank's modules for ``layers`` (shared, not copied)."""
    view = GPT.__new__(GPT)
    nn.Module.__init__(view)
    view.config, view.vocab_size, view.emits_hidden = model.config, model.vocab_size, True
    view.whole_output = model.whole_output
    view.wte, view.wpe = (model.wte, model.wpe) if first else (None, None)
    view.h = nn.ModuleDict({str(i): model.h[str(i)] for i in layers})
    view.ln_f, view.lm_head = (model.ln_f, model.lm_head) if last else (None, None)
    return view


def _tied(model: GPT) -> nn.Parameter | None:
    if not tied(model.config):
        return None
    if model.wte is not None:
        return model.wte.weight
    return model.lm_head.weight if model.lm_head is not None else None


def _tied_group(env: ParallelDims) -> dist.ProcessGroup | None:
    """This rank's pair of first and last stage (same data- and tensor-parallel index); every rank
    creates every pair's group, as dist.new_group requires."""
    mine = None
    ranks = env.mesh.mesh  # (pp, dp, tp) -> global rank
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(pair)
            if env.rank in pair:
                mine = group
    return mine
