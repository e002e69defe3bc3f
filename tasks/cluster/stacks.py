"""Every rank's Python stack when a job hangs: asked of the rank itself (SIGUSR1: faulthandler
writes every thread's stack), and, for a rank that gives none (a stopped process, or one stuck in
native code where Python's signal handler cannot run), read from outside the process by py-spy on
the rank's node; a rank neither way reaches is named in the report with why."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpt import heartbeat
from tasks.cluster.processes import STATE_WORDS, process_state

STACK_WAIT_S = 3.0       # for the ranks to write their stacks after the signal
OUTSIDE_TIMEOUT_S = 60.0


def save_stacks(ask: Callable[[list[int]], None], ranks: list[dict[str, Any]], run_dir: Path, folder: Path,
                slurm_job: str | None) -> dict[int, str]:
    """``rank-<r>-stacks.txt`` in ``folder`` for each rank of ``ranks`` (their heartbeats), and how
    each was taken: "signal", "py-spy", or "none: <why>". ``ask(pids)`` sends the ranks the stack
    signal; on SLURM (``slurm_job``) py-spy runs on the rank's node as a step of that job."""
    sizes = {b["rank"]: _size(_own(run_dir, b)) for b in ranks}
    ask([b["pid"] for b in ranks])
    time.sleep(STACK_WAIT_S)
    how: dict[int, str] = {}
    for b in ranks:
        own, copy = _own(run_dir, b), folder / f"rank-{b['rank']}-stacks.txt"
        if _size(own) > sizes[b["rank"]]:
            with contextlib.suppress(OSError):
                shutil.copyfile(own, copy)
            how[b["rank"]] = "signal"
            continue
        text, why = _from_outside(b, slurm_job)
        state = _process_state(b)
        said = (f"# rank {b['rank']} (pid {b['pid']} on {b['node']}{state}) wrote no stack within "
                f"{STACK_WAIT_S:g} s of {heartbeat.STACK_SIGNAL.name}")
        copy.write_text(f"{said}; read from outside the process by py-spy:\n{text}" if text is not None
                        else f"{said}, and py-spy could not read it from outside: {why}\n")
        how[b["rank"]] = "py-spy" if text is not None else f"none: {why}"
    return how


def _own(run_dir: Path, beat: dict[str, Any]) -> Path:
    return run_dir / heartbeat.FOLDER / f"stacks-rank-{beat['rank']}.txt"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _from_outside(beat: dict[str, Any], slurm_job: str | None) -> tuple[str | None, str]:
    """The rank's stack as py-spy reads it without stopping the process (None and why, if not)."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        return None, "py-spy is not installed beside the flow's Python (pip install py-spy)"
    command = [spy, "dump", "--nonblocking", "--pid", str(beat["pid"])]
    if slurm_job is not None:
        command = ["srun", f"--jobid={slurm_job}", "--overlap", "--nodes=1", "--ntasks=1",
                   f"--nodelist={beat['node']}", "--quiet", *command]
    try:
        r = subprocess.run(command, capture_output=True, text=True, timeout=OUTSIDE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{' '.join(command[:2])}: {e}"
    if r.returncode != 0 or not r.stdout.strip():
        return None, " ".join((r.stderr or r.stdout).split())[:300] or f"py-spy exited with status {r.returncode}"
    return r.stdout, ""


def _process_state(beat: dict[str, Any]) -> str:
    """", stopped" and the like, where the rank's process is on this host (the local executor)."""
    if beat.get("host") != socket.gethostname() or "pid" not in beat:
        return ""
    word = STATE_WORDS.get(process_state(beat["pid"]) or "")
    return f", {word}" if word else ""
