"""The Trainium (torch-neuronx) code path on XLA:CPU, measured: run by tests/test_xla.py with the
XLA venv's python and PJRT_DEVICE=CPU, it prints one JSON object that the test asserts on.

    PJRT_DEVICE=CPU .venv-xla/bin/python tests/xla_probe.py WORK_DIR
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime

import gpt.metrics
from gpt.backend import Backend, get_backend
from gpt.checkpoint import Checkpointer
from gpt.config import Config, ConfigError
from gpt.data import MockGPTDataset
from gpt.optim import LossScaler, build_optimizer, lr_at
from gpt.parallel import xla
from gpt.parallel.build import build_model
from gpt.parallel.dims import ParallelDims
from gpt.train import main, micro_batches, train_step

SMALL = {"model": "tiny", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
         "vocab_size": 256, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 8,
         "lr_warmup_iters": 2, "lr": 3e-3, "min_lr": 3e-4, "mock_data": True, "precision": "fp32",
         "log_interval": 4, "eval_interval": 100, "eval_iters": 1, "save_interval": 4}
# The Llama block at the same size: rotary positions, RMSNorm, SwiGLU, two key/value groups for
# four heads, an untied output layer, no biases (the tiny-llama preset fills the rest).
LLAMA = {"model": "tiny-llama", "num_query_groups": 2, "ffn_hidden_size": 88}
STEPS = 6
ONE = ParallelDims(0, 1, 0, None)


def counters() -> dict[str, Any]:
    """XLA's own counters once the device is idle: compilations, graph executions, transfers to the
    host, and aten:: operations that fell back to the CPU."""
    xm.wait_device_ops()
    def samples(name: str) -> int:
        data = met.metric_data(name)
        return data[0] if data else 0
    return {"compiles": met.counter_value("UncachedCompile") or 0, "executions": samples("ExecuteTime"),
            "transfers": samples("TransferFromDeviceTime"),
            "fallbacks": {n: met.counter_value(n) for n in met.counter_names() if n.startswith("aten::")}}


def setup(device: str, env: ParallelDims = ONE, **overrides: Any) -> tuple[Config, Backend, torch.device, torch.nn.Module, Any, LossScaler]:
    config = Config.from_dict({**SMALL, "device": device, **overrides})
    backend = get_backend(config.device)
    where = backend.device(0)
    torch.manual_seed(config.seed)
    model = build_model(config, env, where)
    return config, backend, where, model, build_optimizer(model, config, backend), LossScaler(False, where)


def train(device: str, count_each_step: bool, env: ParallelDims = ONE, **overrides: Any) -> dict[str, Any]:
    """STEPS iterations through gpt.train.train_step, the figures read once at the end."""
    config, backend, where, model, optimizer, scaler = setup(device, env, **overrides)
    data = MockGPTDataset(STEPS * config.global_batch_size, config.seq_length, config.vocab_size, config.seed)
    held, per_step = [], []
    for it in range(1, STEPS + 1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, it)
        batches = micro_batches(data, (it - 1) * config.global_batch_size, config.global_batch_size, config, ONE, where)
        loss, norm, stepped = train_step(model, optimizer, batches, backend=backend, precision="fp32",
                                         clip_grad=config.clip_grad, scaler=scaler, dims=env)
        held += [loss, norm, stepped]
        if count_each_step:
            per_step.append(counters())
    before_read = counters() if count_each_step else None
    values = backend.read(held)
    return {"loss": values[0::3], "grad_norm": values[1::3], "stepped": values[2::3], "per_step": per_step,
            "read": _delta(before_read, counters()) if count_each_step else None}


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("compiles", "executions", "transfers")}


def checkpoint(work: Path) -> dict[str, Any]:
    """What one save costs on the device, and that a load gives back the same parameters."""
    config, backend, where, model, optimizer, scaler = setup("neuron")
    data = MockGPTDataset(config.global_batch_size, config.seq_length, config.vocab_size, config.seed)
    batches = micro_batches(data, 0, config.global_batch_size, config, ONE, where)
    train_step(model, optimizer, batches, backend=backend, precision="fp32", clip_grad=1.0, scaler=scaler)
    ckpt = Checkpointer(work / "ckpt", 2, 0, to_host=backend.to_host)
    before = counters()
    ckpt.save(1, model, optimizer, {"iteration": 1})
    cost = _delta(before, counters())
    tensors = len(model.state_dict()) + sum(len(s) for s in optimizer.state.values())
    _, _, _, fresh, fresh_optimizer, _ = setup("neuron", seed=99)
    ckpt.load(ckpt.latest(), fresh, fresh_optimizer, {})
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    return {"save": cost, "tensors": tensors, "loaded_equal": same}


def bf16_in_graph() -> dict[str, bool]:
    """Whether the lowered forward graph computes in bf16, per precision."""
    found = {}
    for precision in ("bf16", "fp32"):
        config, backend, where, model, _, _ = setup("neuron", precision=precision)
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1)).to(where)
        with backend.autocast(precision):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        found[precision] = "bf16" in torch_xla._XLAC._get_xla_tensors_hlo([loss])
        torch_xla.sync()
    return found


def peer_reduction() -> dict[str, Any]:
    """A stand-in peer for the gradient all-reduce (XLA:CPU has no collectives): the norm, the clip
    and the skip must see the reduced gradients, so all ranks decide alike."""
    results = {}
    for peer, label in ((lambda g: 3 * g, "finite"), (lambda g: g * float("nan"), "nan")):
        _, backend, where, model, optimizer, scaler = setup("neuron", clip_grad=0.0)
        local = _one_step_norm(model, optimizer, backend, where, scaler, reduce=False)
        _, backend, where, model, optimizer, scaler = setup("neuron", clip_grad=0.0)
        before = [p.detach().cpu().clone() for p in model.parameters()]
        world, reduce = torch_xla.runtime.world_size, xm.all_reduce

        def all_reduce(kind: str, inputs: list[torch.Tensor], scale: float = 1.0, **_: Any) -> None:
            for g in inputs:
                g.copy_((g + peer(g)) * scale)  # noqa: B023 - called within this iteration

        torch_xla.runtime.world_size, xm.all_reduce = (lambda: 2), all_reduce
        try:
            norm, stepped = _one_step_norm(model, optimizer, backend, where, scaler, reduce=True)
        finally:
            torch_xla.runtime.world_size, xm.all_reduce = world, reduce
        after = [p.detach().cpu() for p in model.parameters()]
        results[label] = {"local_norm": local[0], "norm": norm, "stepped": stepped,
                          "params_unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}
    return results


def _one_step_norm(model, optimizer, backend, where, scaler, reduce: bool) -> tuple[float, bool]:
    config = Config.from_dict({**SMALL, "device": "neuron"})
    data = MockGPTDataset(config.global_batch_size, config.seq_length, config.vocab_size, config.seed)
    batches = micro_batches(data, 0, config.global_batch_size, config, ONE, where)
    _, norm, stepped = train_step(model, optimizer, batches, backend=backend, precision="fp32", clip_grad=0.0,
                                  scaler=scaler)
    norm_value, stepped_value = backend.read([norm, stepped])
    return norm_value, bool(stepped_value)


def resume(work: Path) -> dict[str, Any]:
    """gpt.train.main on XLA: a whole run, and one stopped by SIGUSR2 at iteration 4 then resumed."""
    whole = {**SMALL, "device": "neuron", "run_dir": str(work / "whole")}
    before = counters()
    summary = main(Config.from_dict(whole))
    cost = _delta(before, counters())
    stopped = {**whole, "run_dir": str(work / "stopped")}
    record = gpt.metrics.MetricsWriter.train

    def signal_at_4(self: gpt.metrics.MetricsWriter, r: dict[str, Any]) -> None:
        record(self, r)
        if r["iteration"] == 4:
            os.kill(os.getpid(), signal.SIGUSR2)

    gpt.metrics.MetricsWriter.train = signal_at_4
    try:
        first = main(Config.from_dict(stopped))
    finally:
        gpt.metrics.MetricsWriter.train = record
    second = main(Config.from_dict(stopped))
    return {"whole": summary, "whole_cost": cost, "first": first, "second": second,
            "whole_losses": _losses(work / "whole"), "resumed_losses": _losses(work / "stopped")}


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm_loss"] for r in records if r["kind"] == "train"}


def tensor_parallel_in_one_graph(**overrides: Any) -> dict[str, Any]:
    """The split layers of gpt.parallel.xla over a group of one rank, their all-reduces and
    all-gather in the graph (XLA:CPU runs no collective across processes; tests/test_tensor_parallel.py
    runs the layers on real ranks)."""
    os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"  # torch_xla leaves them out for one rank otherwise
    try:
        env = ParallelDims(0, 1, 0, None, xla.Group(0, 1, [[0]], lazy=True))
        config, backend, where, model, _, _ = setup("neuron", env, **overrides)
        tokens = torch.randint(0, config.vocab_size, (2, config.seq_length + 1)).to(where)
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([model(tokens[:, :-1], tokens[:, 1:])])
        torch_xla.sync()
        split = sorted(name for name, p in model.named_parameters() if hasattr(p, "tp_shard"))
        before = counters()["fallbacks"]
        return {"train": train("neuron", count_each_step=True, env=env, **overrides), "fallbacks_before": before,
                "split": split, "all_reduce": hlo.count("all-reduce("), "all_gather": hlo.count("all-gather(")}
    finally:
        del os.environ["XLA_ALWAYS_ALLREDUCE"]


def llama_block() -> dict[str, Any]:
    """The Llama block on the XLA path and the CPU path, and split over a group of one."""
    before = counters()["fallbacks"]
    return {"fallbacks_before": before, "xla": train("neuron", count_each_step=True, **LLAMA),
            "cpu": train("cpu", count_each_step=False, **LLAMA), "tensor_parallel": tensor_parallel_in_one_graph(**LLAMA)}


def compile_refused() -> str:
    try:
        setup("neuron", compile=True)
    except ConfigError as e:
        return str(e)
    return ""


def run(work: Path) -> dict[str, Any]:
    return {"kind": get_backend("neuron").kind.device_type, "xla_use_bf16": os.environ.get("XLA_USE_BF16"),
            "xla": train("neuron", count_each_step=True), "cpu": train("cpu", count_each_step=False),
            "checkpoint": checkpoint(work), "bf16_in_graph": bf16_in_graph(), "peer": peer_reduction(),
            "resume": resume(work), "compile_refused": compile_refused(),
            "tensor_parallel": tensor_parallel_in_one_graph(),
            "llama": llama_block()}


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]))))
