"""The plan as the run's first artifact (``pretrain-plan``): what the run will do, decided before
any stage runs, shown again once the data stages have run and once the estimate is known."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prefect.artifacts import create_table_artifact

from gpt.config import Config, model_name
from gpt.export import SHARD_BYTES, ExportError, export_bytes, export_precision, family
from gpt.memory import GIB, rank_memory
from gpt.parallel.context import ring_bytes
from gpt.parallel.pipeline import bubble_fraction
from tasks.cluster.config import ClusterConfig

if TYPE_CHECKING:
    from flows.plan.build import Plan


def parallel_layout(c: Config, world_size: int) -> str:
    """The mesh, and with pipeline stages their schedule and its idle share."""
    dp = world_size // (c.tensor_parallel * c.pipeline_parallel * c.context_parallel)
    mesh = f"pp {c.pipeline_parallel} x dp {dp} ({c.data_parallel_mode}) x tp {c.tensor_parallel}"
    if c.context_parallel > 1:
        mesh += (f" x cp {c.context_parallel} (each rank {c.seq_length // c.context_parallel} tokens of a sequence; "
                 f"the ring passes {ring_bytes(c, world_size) / GIB:,.2f} GiB per rank per step)")
    if c.pipeline_parallel == 1:
        return mesh
    micro = c.global_batch_size // (c.micro_batch_size * dp)
    bubble = bubble_fraction(c.pipeline_schedule, c.pipeline_parallel, c.virtual_pipeline_stages, micro)
    return (f"{mesh}; schedule {c.pipeline_schedule}, {c.pipeline_parallel * c.virtual_pipeline_stages} stages of "
            f"{c.num_layers // (c.pipeline_parallel * c.virtual_pipeline_stages)} layers, {micro} micro-batches per "
            f"step, bubble {bubble:.1%}")


def ramp_words(c: Config) -> str:
    """The batch-size ramp-up, in words: its steps and where it ends."""
    if c.ramp is None:
        return ""
    start, increment, samples = c.ramp
    steps = next((i for i in range(1, c.total_iters + 1) if c.batch_of(i) == c.global_batch_size), c.total_iters)
    return (f", ramped up from {start} by {increment} over the first {samples:,} samples (iterations 1-{steps - 1}, "
            f"{c.samples_after(steps - 1):,} samples)")


def data_stages(k: ClusterConfig) -> str:
    """Where sync and tokenize run."""
    if not k.data_jobs:
        return "sync and tokenize in the flow's process"
    job = k.data_job()
    return (f"jobs on partition {job.partition or '(the default)'}: sync as one job, tokenize as an array of "
            f"{k.data_tasks} tasks" + (f", {job.cpus_per_task} CPUs each" if job.cpus_per_task else "")
            + (f", mem {job.mem}" if job.mem else ""))


def export_row(config: Config) -> str:
    """What the HuggingFace export will write, how big, and from where."""
    try:
        architecture = family(config)
    except ExportError:
        return "none: no HuggingFace architecture computes this block"
    weights, layer = export_bytes(config)
    files = max(1, math.ceil(weights / SHARD_BYTES))
    return (f"{architecture}, {weights / GIB:,.2f} GiB of {export_precision(config)} weights in {files} file(s) of at "
            f"most {SHARD_BYTES / 10**9:g} GB, read from the checkpoint by the flow's process one layer "
            f"({layer / GIB:,.2f} GiB in fp32) at a time")


def phase_rows(plan: Plan) -> list[tuple[str, str]]:
    """Each phase of a run that declares more than one: its iterations, blend, sequence length and
    learning rate, what it will consume, and the phase this leg starts in."""
    if not plan.phases:
        return []
    c, done = plan.config, plan.outlook().done
    starts = [0, *(p.start for p in plan.phases)]
    ends = [*starts[1:], c.total_iters]
    rows = []
    for n, (start, end) in enumerate(zip(starts, ends), start=1):
        phase = plan.phases[n - 2] if n > 1 else None
        seq = (phase.seq_length if phase else None) or c.seq_length
        named = [f"{p.weight:g} {p.prefix}" for p in phase.prefixes] if phase else []
        named += [f"{phase.weight:g} {', '.join(phase.sources)} (tokenized)"] if phase and phase.sources else []
        blend = ", ".join(named) or ("the run's data" if n == 1 else "the blend of the phase before")
        samples = c.samples_after(end) - c.samples_after(start)
        here = "; this leg starts here" if start <= done < end else ("; trained" if done >= end else "")
        rows.append((f"phase {n}", f"iterations {start + 1}-{end}: {blend}; sequence {seq}; learning rate "
                                   f"{phase.lr if phase else 'schedule'}; {samples:,} samples, {samples * seq:,} tokens{here}"))
    return rows


def plan_rows(plan: Plan, outlook: str, warnings: list[str] = (),
              estimate: list[tuple[str, str]] = ()) -> list[dict[str, str]]:
    """What the run will do, decided before any stage runs (flows.plan.build.Plan), what its folder says
    will happen (flows.plan.outlook), what the data stages found worth a warning, and what the run will
    take (flows.plan.estimate)."""
    c, k = plan.config, plan.cluster
    where = (f"{k.name} ({k.kind}, {k.nodes} x {k.tasks_per_node} tasks" + (f", {k.accelerator}" if k.accelerator else "")
             + (f", {k.spare_nodes} spare node(s) to restart on" if k.spare_nodes else "")
             + (f", excluding {k.exclude}" if k.exclude else "") + ")")
    set_by_run = ", ".join(f"{name}={value}" for name, value in sorted(plan.cluster_set.items()))
    where += (f"; the run set {set_by_run}, the rest is the operator's preset" if set_by_run
              else "; as the operator's preset says")
    called = model_name(c)
    rows = [("model", called if called == c.model else f"{called} (the other fields from preset {c.model})"),
            ("run folder", str(plan.run_dir) + (f"; TensorBoard's events also in {c.tensorboard_dir}"
                                                if c.tensorboard_dir else "")), ("cluster", where),
            *([("container", k.container.describe())] if k.container else []),
            ("device", f"{c.device} (from the cluster preset)"), ("precision", c.precision),
            ("parallel", parallel_layout(c, plan.world_size)), ("memory per rank", rank_memory(c, plan.world_size).arithmetic()),
            ("device memory", plan.device_memory),
            ("batch", f"micro {c.micro_batch_size}, global {c.global_batch_size}{ramp_words(c)}, sequence {c.seq_length}"),
            ("vocabulary", plan.vocabulary),
            ("schedule", f"{c.train_iters} iterations" if c.train_iters else f"{c.train_samples:,} samples"),
            *phase_rows(plan),
            ("data stages", data_stages(k)), ("compile", str(c.compile)), ("export", export_row(c)),
            ("what happens", outlook)]
    rows += [("warning", w) for w in warnings]
    rows += list(estimate)
    return [{"item": item, "value": value} for item, value in rows]


def dry_run_rows(plan: Plan) -> list[dict[str, str]]:
    """The plan as a dry run shows it: what its folder says will happen, what it could not check on
    this machine (a warning each), and the estimate of time and cost, with the vocabulary as far as
    the plan can tell (the row says how)."""
    outlook = plan.outlook()
    return plan_rows(plan, f"dry run, nothing synced, tokenized or submitted; a run would: {outlook.message}",
                     warnings=list(plan.warnings), estimate=plan.estimate(outlook).rows())


def dry_run_table(plan: Plan) -> list[dict[str, str]]:
    """The dry run's plan as the run's artifact; its rows."""
    rows = dry_run_rows(plan)
    create_table_artifact(rows, key="pretrain-plan", description="The run's plan, a dry run: nothing ran")
    return rows


def plan_table(plan: Plan, outlook: str, warnings: list[str] = (), estimate: list[tuple[str, str]] = (),
               key: str = "pretrain-plan") -> None:
    create_table_artifact(plan_rows(plan, outlook, warnings, estimate), key=key,
                          description="The run's plan, decided once before any stage ran")
