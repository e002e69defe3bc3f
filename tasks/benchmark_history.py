"""Benchmark history: JSON lines in a local folder or an S3 prefix, machine facts, comparisons.

One line per benchmark run: `{"time", "flow_run_id", "machine", "params", "results", "metrics",
"errors"}` where `metrics` maps `<benchmark>.<metric>` to a number. Comparisons use only earlier
lines from a machine with the same hardware (`machine.key`), so a laptop never regresses a GPU node.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tasks.common.figures import png_bytes, pyplot
from tasks.common.uri import bucket_and_key, is_s3

HISTORY_FILE = "history.jsonl"
# Figures measured on hardware CI does not have (GPUs), shipped with the code: the estimate uses them
# and the benchmark flow compares a run on the same hardware against them.
REFERENCE = Path(__file__).resolve().parent.parent / "benchmarks" / "reference.jsonl"
# Metric name fragments that say which direction is better.
HIGHER = ("per_s", "mfu", "throughput", "speedup", "mb_s", "gb_s", "tflops", "bandwidth", "goodput")
LOWER_SUFFIX = ("_s", "_ms", "_mb", "_gb", "_gib", "_mib", "_bytes")
LOWER = ("seconds", "time", "latency", "memory")


def direction(metric: str) -> int:
    """+1 when higher is better, -1 when lower is better, 0 when unknown (never flagged)."""
    name = metric.rsplit(".", 1)[-1].lower()
    if any(h in name for h in HIGHER):
        return 1
    if name.endswith(LOWER_SUFFIX) or any(s in name for s in LOWER):
        return -1
    return 0


def flatten(results: dict[str, dict], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested result dicts as `a.b.c -> value` (booleans and NaN left out)."""
    out: dict[str, float] = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def _run(cmd: list[str]) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def machine_facts(repo: str | Path | None = None) -> dict[str, Any]:
    """CPU, memory, GPU model and driver, Neuron devices, torch/python versions and the git commit."""
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    gpu_names = [g.split(",")[0].strip() for g in gpus.splitlines()] if gpus else []
    driver = gpus.splitlines()[0].split(",")[1].strip() if gpus else None
    import torch
    repo = Path(repo or Path(__file__).resolve().parent.parent)
    facts = {
        "host": socket.gethostname(), "cpu": cpu, "cpu_count": os.cpu_count(), "memory_gib": mem_gib,
        "gpu": gpu_names[0] if gpu_names else None, "gpu_count": len(gpu_names), "gpu_driver": driver,
        "neuron_devices": len(list(Path("/dev").glob("neuron*"))),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "platform": platform.platform(),
        **git_state(repo),
    }
    facts["key"] = "|".join(str(facts[k]) for k in ("cpu", "cpu_count", "gpu", "gpu_count", "neuron_devices"))
    return facts


def git_state(repo: Path) -> dict[str, Any]:
    """The commit checked out at ``repo`` and whether tracked files differ from it (None: not a
    git checkout, or no git)."""
    commit = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"]) if commit else None
    return {"git_commit": commit, "git_dirty": None if commit is None else bool(dirty)}


class History:
    """`<location>/history.jsonl`; location is a folder or s3://bucket/prefix."""

    def __init__(self, location: str, *, endpoint_url: str | None = None) -> None:
        self.location = location.rstrip("/")
        self.endpoint_url = endpoint_url
        self.remote = is_s3(location)

    @property
    def uri(self) -> str:
        return f"{self.location}/{HISTORY_FILE}"

    def _s3(self) -> tuple[Any, str, str]:
        import boto3
        bucket, prefix = bucket_and_key(self.location)
        key = f"{prefix}/{HISTORY_FILE}" if prefix else HISTORY_FILE
        return boto3.Session().client("s3", endpoint_url=self.endpoint_url), bucket, key

    def _read_text(self) -> str:
        if not self.remote:
            path = Path(self.uri)
            return path.read_text() if path.exists() else ""
        client, bucket, key = self._s3()
        try:
            return client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
        except client.exceptions.NoSuchKey:
            return ""

    def read(self) -> list[dict]:
        return _records(self._read_text(), self.uri)


    def append(self, record: dict) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        if not self.remote:
            path = Path(self.uri)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:  # one write of one line: appends from several runs do not interleave
                f.write(line)
            return
        client, bucket, key = self._s3()
        client.put_object(Bucket=bucket, Key=key, Body=(self._read_text() + line).encode())


def reference() -> list[dict]:
    """The shipped reference records (REFERENCE), oldest first."""
    return _records(REFERENCE.read_text(), str(REFERENCE))


def same_hardware(a: dict, b: dict) -> bool:
    """Whether two records' machines are the same hardware: the same GPU model and count where they
    have GPUs (what a GPU benchmark measures), else the same CPU, core count and devices."""
    if a.get("gpu") or b.get("gpu"):
        return (a.get("gpu"), a.get("gpu_count")) == (b.get("gpu"), b.get("gpu_count"))
    return a.get("key") == b.get("key")


def _records(text: str, where: str) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{n}: not a JSON line ({e}); fix or delete that line") from e
    return records


def compare(record: dict, history: list[dict], threshold: float) -> list[dict]:
    """Rows for each metric of `record`: value, previous, best, changes, and a regression flag.

    Only earlier records from the same hardware count. A regression is a change against the
    previous value worse than `threshold` (a fraction) in the metric's known direction.
    """
    same = [h for h in history if same_hardware(h.get("machine", {}), record["machine"])]
    rows = []
    for metric, value in sorted(record["metrics"].items()):
        past = [h["metrics"][metric] for h in same if metric in h.get("metrics", {})]
        sign = direction(metric)
        prev = past[-1] if past else None
        best = (max(past) if sign >= 0 else min(past)) if past else None

        vs_prev, vs_best = _change(value, prev), _change(value, best)
        regression = bool(sign and vs_prev is not None and sign * vs_prev < -threshold)
        rows.append({"metric": metric, "value": value, "previous": prev, "best": best,
                     "change_vs_previous": vs_prev, "change_vs_best": vs_best,
                     "better": {1: "higher", -1: "lower", 0: "?"}[sign], "regression": regression})
    return rows


def _change(value: float, ref: float | None) -> float | None:
    return None if ref in (None, 0) else (value - ref) / abs(ref)


def table_rows(rows: list[dict]) -> list[dict[str, str]]:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:+.1f}%"

    return [{"metric": r["metric"], "value": num(r["value"]), "previous": num(r["previous"]),
             "vs previous": pct(r["change_vs_previous"]), "best": num(r["best"]),
             "vs best": pct(r["change_vs_best"]), "better": r["better"],
             "flag": "REGRESSION" if r["regression"] else ""} for r in rows]


def trend_png(records: list[dict], metrics: list[str], *, max_plots: int = 24) -> bytes | None:
    """One small line plot per metric over the runs in `records` (oldest first)."""
    metrics = metrics[:max_plots]
    if not metrics:
        return None
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = pyplot().subplots(rows, cols, figsize=(4.2 * cols, 2.6 * rows), dpi=80, squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        points = [(i, r["metrics"][metric]) for i, r in enumerate(records) if metric in r.get("metrics", {})]
        if points:
            ax.plot(*zip(*points), "o-", markersize=3)
        ax.set_title(metric, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.supxlabel("run", fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
