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


def _servers(home: Path, marks: tuple[str, ...] = SERVER_MARKS) -> dict[int, int]:
    """pid -> parent pid of every Prefect server process (or any process, with ``marks`` empty)
    whose PREFECT_HOME is ``home``."""
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
        if f"PREFECT_HOME={home}".encode() in environ and (not marks or any(m in cmdline for m in marks)) and state[0] != "Z":
            found[int(entry.name)] = int(state[1])
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return f"{pid} (gone)"


def _start_flow(tmp_path: Path, *args: str, iters: str = "2") -> tuple[subprocess.Popen, Path, Path]:
    home, log = tmp_path / "prefect-home", tmp_path / "flow.log"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PYTHONPATH=str(ROOT), GPT_INPUT_ROOTS=f"{tmp_path}:{ROOT}",
               GPT_OUTPUT_ROOTS=str(tmp_path), OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        flow = subprocess.Popen([sys.executable, "-m", "flows.pretrain", "--train-iters", iters, "--no-compile",
                                 "--root", str(tmp_path / "runs"), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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


@pytest.mark.timeout(240)
def test_ctrl_c_during_training_cancels_the_job_and_answers_one_line(tmp_path):
    """The terminal's Ctrl-C (SIGINT to the flow's whole process group) while the job trains: the flow
    cancels its job and says so in one line, exit status 130, no traceback; nothing is left running."""
    flow, home, log = _start_flow(tmp_path, iters="100000")
    try:
        wait_until(lambda: list((tmp_path / "runs").glob("*/metrics.jsonl")) or flow.poll() is not None, 180,
                   "training to begin")
        assert flow.poll() is None, log.read_text(errors="replace")[-3000:]
        os.killpg(flow.pid, signal.SIGINT)
        assert flow.wait(timeout=60) == 130, log.read_text(errors="replace")[-3000:]
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        assert text.rstrip().endswith("pretrain interrupted (Ctrl-C): its jobs were cancelled; the same command "
                                      "resumes it from its last checkpoint"), text[-1000:]
        try:
            wait_until(lambda: not _servers(home, marks=()), 30, "the job and the server to end")
        except AssertionError as e:
            raise AssertionError(f"{e}: {[_command(pid) for pid in _servers(home, marks=())]}") from None
    finally:
        _cleanup(flow, home)


@pytest.mark.timeout(200)
def test_a_server_slower_than_its_startup_timeout_is_waited_for_and_one_that_dies_is_one_line(tmp_path):
    """A busy machine: the server takes longer than Prefect's startup timeout (1 s here) and is
    waited for while it lives; a server that dies before it answers ends the command in one line."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), GPT_OUTPUT_ROOTS=str(tmp_path),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    code = "import httpx; from flows.local_server import ensure_api; print(httpx.get(ensure_api() + '/health').status_code)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "200", out.stderr[-3000:]
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{tmp_path}/no-such-folder/prefect.db"
    out = subprocess.run([sys.executable, "-m", "flows.pretrain", "--root", str(tmp_path / "runs"), "--train-iters", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.rstrip().splitlines()[-1].startswith(
        "error: ServerDied: the temporary Prefect server exited with code 3 before it answered (its output is above): "
        "run again, or set PREFECT_API_URL to a running server"), out.stderr[-3000:]
