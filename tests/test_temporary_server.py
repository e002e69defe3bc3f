"""`python -m flows.pretrain` without PREFECT_API_URL: the temporary Prefect server it runs ends with the
flow's process, however that process ends."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_folder import wait_until

pytestmark = pytest.mark.integration  # starts servers of its own

ROOT = Path(__file__).resolve().parent.parent
SERVER_MARKS = ("flows.local_server", "prefect.server.api.server")   # ours, or one Prefect started itself


def _servers(home: Path) -> dict[int, int]:
    """pid -> parent pid of every Prefect server process whose PREFECT_HOME is ``home``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if f"PREFECT_HOME={home}".encode() in environ and any(m in cmdline for m in SERVER_MARKS) and state[0] != "Z":
            found[int(entry.name)] = int(state[1])
    return found


def _start_flow(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    home, log = tmp_path / "prefect-home", tmp_path / "flow.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), GPT_INPUT_ROOTS=f"{tmp_path}:{ROOT}",
               GPT_OUTPUT_ROOTS=str(tmp_path), OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        flow = subprocess.Popen([sys.executable, "-m", "flows.pretrain", "--train-iters", "2", "--no-compile",
                                 "--root", str(tmp_path / "runs"), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return flow, home, log


def _cleanup(flow: subprocess.Popen, home: Path) -> None:
    if flow.poll() is None:
        flow.kill()
        flow.wait()
    for pid in _servers(home):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_the_temporary_server_dies_with_a_killed_flow_process(tmp_path, sig):
    flow, home, log = _start_flow(tmp_path)
    try:
        servers = wait_until(lambda: _servers(home), 60, "the temporary server to start")
        assert list(servers.values()) == [flow.pid], f"one server, a child of the flow's process: {servers}"
        wait_until(lambda: "Beginning flow run" in log.read_text(errors="replace") or flow.poll() is not None,
                   60, "the flow run to begin")
        assert flow.poll() is None, log.read_text(errors="replace")[-3000:]
        os.kill(flow.pid, sig)
        flow.wait(timeout=30)
        wait_until(lambda: not _servers(home), 5, f"the server to end after the flow's {sig.name}", every=0.1)
    finally:
        _cleanup(flow, home)


@pytest.mark.timeout(120)
def test_the_temporary_server_ends_when_the_run_ends(tmp_path):
    """A run that ends by itself (its source fails the tokenize stage, after the server started)."""
    damaged = tmp_path / "corpus.parquet"
    damaged.write_bytes(b"not a parquet file")
    flow, home, log = _start_flow(tmp_path, "--source", str(damaged))
    try:
        rc = flow.wait(timeout=90)
        assert "Started a temporary Prefect server" in log.read_text(errors="replace"), f"exit code {rc}"
        assert not _servers(home), "the server outlived the run"
    finally:
        _cleanup(flow, home)
