"""What a run will take before it is submitted: its FLOPs, the tokens/s to expect, the time to
train, node-hours and cost.

The throughput comes from the benchmark flow's history (flows/benchmark.py): the newest `gpt.bench`
figure measured on this cluster's accelerator (on CPU: on this machine), as FLOP/s achieved per
device, which carries over to another model shape through FLOPs per token. Where the history has
none, a GPU or Trainium estimate assumes ASSUMED_MFU of the device's peak and says so; a CPU one has
no figure. Devices are assumed to scale perfectly, so the time is a lower bound at scale.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpt.backend import names_device, peak_flops
from gpt.config import Config, model_name
from gpt.metrics import flops_per_token
from gpt.model import param_count
from tasks.benchmark_history import History, machine_facts, reference
from tasks.cluster.config import ClusterConfig
from tasks.common.progress import human_duration
from tasks.common.run_context import run_logger

ASSUMED_MFU = 0.35
HISTORY_ENV = "GPT_BENCHMARK_HISTORY"   # the operator's history location (folder or s3:// prefix)


@dataclass(frozen=True)
class Estimate:
    tokens: int                      # tokens this start trains
    flops: float                     # training FLOPs of those tokens
    tokens_per_s_per_device: float | None
    source: str                      # where the throughput comes from
    devices: int
    nodes: int
    price_per_node_hour: float | None
    currency: str
    spare_nodes: int = 0             # allocated too, idle until a restart needs one


    @property
    def hours(self) -> float | None:
        if not self.tokens_per_s_per_device:
            return None
        return self.tokens / (self.tokens_per_s_per_device * self.devices) / 3600

    @property
    def node_hours(self) -> float | None:
        return None if self.hours is None else self.hours * (self.nodes + self.spare_nodes)

    @property
    def cost(self) -> float | None:
        if self.node_hours is None or self.price_per_node_hour is None:
            return None
        return self.node_hours * self.price_per_node_hour

    def rows(self) -> list[tuple[str, str]]:
        """The arithmetic, line by line, for the plan artifact and the approval form."""
        rows = [("tokens to train", f"{self.tokens:,}"), ("training FLOPs", f"{self.flops:.3g}"),
                ("throughput", f"{self.tokens_per_s_per_device:,.0f} tokens/s per device ({self.source})"
                 if self.tokens_per_s_per_device else f"unknown ({self.source})")]
        if self.hours is not None:
            rows.append(("time to train", f"{human_duration(3600 * self.hours)} on {_count(self.devices, 'device')} "
                                          f"({_count(self.nodes, 'node')}"
                                          f"{f' and {self.spare_nodes} spare' if self.spare_nodes else ''}), "
                                          "scaling assumed perfect"))
            rows.append(("node-hours", _figure(self.node_hours)))
        if self.cost is not None:
            rows.append(("cost", f"{self.cost:,.2f} {self.currency} at {self.price_per_node_hour:,.2f} "
                                 f"{self.currency} per node-hour"))
        return rows


def estimate(config: Config, cluster: ClusterConfig, start_iteration: int, history: list[dict[str, Any]]) -> Estimate:
    """The estimate for training ``config`` on ``cluster`` from ``start_iteration`` to its end."""
    done = min(start_iteration, config.total_iters)
    tokens = (config.samples_after(config.total_iters) - config.samples_after(done)) * config.seq_length
    per_token = flops_per_token(config, param_count(config))
    achieved, source = device_flops(config, cluster, history)
    return Estimate(tokens=tokens, flops=tokens * per_token,
                    tokens_per_s_per_device=achieved / per_token if achieved else None, source=source,
                    devices=cluster.world_size, nodes=cluster.nodes, spare_nodes=cluster.spare_nodes,
                    price_per_node_hour=cluster.price_per_node_hour, currency=cluster.currency)


def device_flops(config: Config, cluster: ClusterConfig, history: list[dict[str, Any]]) -> tuple[float | None, str]:
    """FLOP/s one device of ``cluster`` achieves training, and what says so."""
    measured = _newest_measurement(config, cluster, history)
    if measured is not None:
        return measured
    device = cluster.accelerator or (_this_machine()["gpu"] if cluster.kind == "local" else None)
    peak = peak_flops(device, config.precision)
    if cluster.job_device in ("cuda", "neuron") and peak:
        return ASSUMED_MFU * peak, (f"no {config.precision} benchmark of a {device} in the history: {ASSUMED_MFU:.0%} "
                                    f"MFU of its {peak / 1e12:,.0f} TFLOP/s assumed")
    what = f"a {device}" if device else f"{cluster.job_device} ranks on this machine"
    return None, f"no benchmark of {what} in the history; run the benchmark flow there first"


def _newest_measurement(config: Config, cluster: ClusterConfig,
                        history: list[Any]) -> tuple[float, str] | None:
    """The newest `gpt.bench` figure at this precision from matching hardware, the same model
    preferred; records that do not read as one are passed over."""
    found = []
    for record in history:
        machine = record.get("machine") if isinstance(record, dict) else None
        if not isinstance(machine, dict) or not _same_hardware(machine, cluster):
            continue
        results = record.get("results")
        for label, r in (results.items() if isinstance(results, dict) else ()):
            try:
                if r["precision"] != config.precision or (r.get("device") == "cpu") != (cluster.job_device == "cpu"):
                    continue
                shape = Config(model=r["model"], seq_length=r.get("seq_length"))
                achieved = float(r["tokens_per_s"]) * flops_per_token(shape, int(r["params"]))
            except (KeyError, TypeError, ValueError, AttributeError):   # another version's record, or not one
                continue
            if achieved > 0:
                found.append((r["model"] == model_name(config), str(record.get("time") or ""), label, r, achieved))
    if not found:
        return None
    _, when, label, r, achieved = max(found, key=lambda f: (f[0], f[1]))
    return achieved, f"benchmark {label}" + (f" of {when[:10]}" if when else "") + \
        f": {r['model']} at {r['tokens_per_s']:,.0f} tokens/s"


def _same_hardware(machine: dict[str, Any], cluster: ClusterConfig) -> bool:
    if cluster.kind == "local":                       # the job runs here, whatever its device
        return machine.get("key") == _this_machine()["key"]
    if cluster.job_device == "cuda":
        return bool(cluster.accelerator and isinstance(machine.get("gpu"), str)
                    and names_device(machine["gpu"], cluster.generation))
    if cluster.job_device == "neuron":
        return bool(machine.get("neuron_devices"))
    return False


@functools.lru_cache(maxsize=1)
def _this_machine() -> dict[str, Any]:
    return machine_facts()


def read_history(root: Path) -> list[dict[str, Any]]:
    """The shipped reference figures (measured on GPUs), then the benchmark history the operator names
    (GPT_BENCHMARK_HISTORY), else the benchmark flow's default beside the runs, <root>/benchmarks;
    one that cannot be read is a warning, and only the shipped figures count."""
    history = History(os.environ.get(HISTORY_ENV) or str(root / "benchmarks"))
    try:
        return reference() + history.read()
    except Exception as e:  # unreadable file, unreachable store: the estimate says it has no figure
        run_logger().warning("warning: benchmark history %s not read (%s); the estimate uses the shipped figures only",
                             history.uri, e)
        return reference()


def _figure(value: float) -> str:
    return f"{value:,.1f}" if value >= 100 else f"{value:.3g}"


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}" + ("" if n == 1 else "s")


