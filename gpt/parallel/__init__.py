"""Parallelism applied to a plain GPT from outside the model, as torchtitan does; gpt/model.py holds
only the math.

- ``dims``: where a rank sits: the degrees, the mesh (or XLA group), the replicas its gradients are
  averaged over and their global norm;
- ``build``: the order every job applies them in, float8 linears (torchao) -> tensor parallel ->
  context parallel -> activation checkpointing -> compile -> data parallel, then the weights, initialised whole and
  kept as this rank's part, so that they are the same whatever the layout;
- ``tensor``: Megatron's split of attention, MLP and vocabulary as DTensor plans (eager devices);
- ``context``: every sequence split over ranks, attention around a ring of them (context parallel);
- ``xla``: the same split with explicit collectives, for XLA's lazy tensors (Trainium);
- ``data``: FSDP2 or DDP over the data-parallel ranks, and the replicas that average gradients
  where no DDP module applies;
- ``pipeline``: stages on torch.distributed.pipelining and their schedules;
- ``gradients``: averaging the gradients over the replicas where no DDP or FSDP module does, the
  global gradient norm over every shard and stage, clipping.
- ``process_group``: the process group a job's ranks join, and the small collectives the
  training loop calls (sums and gathers of values, the barrier).
"""
