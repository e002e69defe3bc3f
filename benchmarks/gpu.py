"""One GPU session's measurements in one command: several `gpt.bench` cases, one process each, in
order, within a deadline, every case's JSON kept as it finishes and a table printed at the end.

    python -m benchmarks.gpu --out DIR [--deadline-s 540] [--only NAME ...]

A case that fails, runs out of memory or would outlast the deadline is recorded as such and the
next one runs: what was measured comes back even when the session's device time runs out. Ratios
(fp8 against bf16, a variant against its baseline) are taken between cases of the same run, on the
same device. DIR/summary.json holds every case's figures, the device and the date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    params: dict[str, Any]       # keyword arguments of gpt.bench.run
    baseline: str | None = None  # the case whose tokens/s this one is compared with
    profile: bool = False        # then a few steps under torch.profiler: device time by kind of kernel

    def args(self) -> list[str]:
        """The same case as gpt.bench's command line."""
        args = []
        for key, value in self.params.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        return args + (["--profile", f"/tmp/profile-{self.name}"] if self.profile else [])


_TIMED = {"steps": 10, "warmup": 2, "compile": True}
_1_3B = {"model": "gpt3-1.3b", "micro_batch": 8, **_TIMED}
_2_7B = {"model": "gpt3-2.7b", "micro_batch": 8, **_TIMED}

CASES = (
    Case("gpu-1.3b-bf16", {**_1_3B, "precision": "bf16"}, profile=True),
    Case("gpu-1.3b-fp8-tensorwise", {**_1_3B, "precision": "fp8", "fp8_recipe": "tensorwise"}, "gpu-1.3b-bf16",
         profile=True),
    Case("gpu-1.3b-fp8-rowwise", {**_1_3B, "precision": "fp8", "fp8_recipe": "rowwise"}, "gpu-1.3b-bf16"),
    Case("gpu-125m-bf16-mb64", {"model": "gpt3-125m", "micro_batch": 64, **_TIMED, "precision": "bf16"}),
    Case("gpu-2.7b-bf16", {**_2_7B, "precision": "bf16"}),
    Case("gpu-2.7b-fp8-tensorwise", {**_2_7B, "precision": "fp8", "fp8_recipe": "tensorwise"}, "gpu-2.7b-bf16"),
    Case("gpu-1.3b-fp8-rowwise-large", {**_1_3B, "precision": "fp8", "fp8_recipe": "rowwise", "fp8_layers": "large"},
         "gpu-1.3b-bf16"),
)


def run_case(case: Case, out: Path, timeout_s: float) -> dict[str, Any]:
    """One case in its own process: its JSON, or why there is none."""
    cmd = [sys.executable, "-m", "gpt.bench", *case.args()]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        (out / f"{case.name}.log").write_text(stderr[-20000:])
        return {"error": f"timed out after {timeout_s:.0f} s"}
    (out / f"{case.name}.log").write_text(done.stderr[-20000:])
    if done.returncode != 0:
        last = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": last[-1] if last else f"exit status {done.returncode}"}
    result = json.loads(done.stdout)
    result["wall_s"] = time.monotonic() - start
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'case':30} {'tokens/s':>10} {'MFU':>6} {'peak GB':>8} {'warmup s':>9} {'vs base':>8}"]
    for case in CASES:
        r = results.get(case.name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{case.name:30} {r['error'][:80]}")
            continue
        base = results.get(case.baseline or "", {})
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if "tokens_per_s" in base else ""
        lines.append(f"{case.name:30} {r['tokens_per_s']:10.0f} {100 * (r['mfu'] or 0):5.1f}% "
                     f"{r['peak_memory_bytes'] / 1e9:8.1f} {r['warmup_s']:9.1f} {ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for each case's JSON and log, and summary.json")
    p.add_argument("--deadline-s", type=float, default=540.0, help="no case runs past this many seconds from start")
    p.add_argument("--only", nargs="*", help="run only these cases (names as in the table)")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + a.deadline_s
    results: dict[str, dict[str, Any]] = {}
    for case in CASES:
        if a.only and case.name not in a.only:
            continue
        left = end - time.monotonic()
        if left < 30:
            results[case.name] = {"error": "not run: the deadline came first"}
            continue
        results[case.name] = run_case(case, out, left)
        (out / f"{case.name}.json").write_text(json.dumps(results[case.name], indent=2))
        shown = ("tokens_per_s", "mfu", "warmup_s", "error")
        print(f"{case.name}: {json.dumps({k: results[case.name].get(k) for k in shown})}", flush=True)
        if "profile" in results[case.name]:
            print(f"  device ms per step by kind: {results[case.name]['profile']['device_ms_per_step_by_kind']}")
    summary = {"date": datetime.date.today().isoformat(), "host_cpus": os.cpu_count(),
               "cases": {c.name: {"params": c.params, "baseline": c.baseline} for c in CASES}, "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
