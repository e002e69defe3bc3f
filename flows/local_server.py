"""A temporary Prefect server for one command-line run, that ends with the process that runs the flow.

Without ``PREFECT_API_URL`` Prefect starts a server of its own for the run (``SubprocessASGIServer``)
and stops it at exit, but only at a normal exit: when the flow's process is killed, that server
lives on. Here the command line starts the same ephemeral server itself, through this module, which
asks the kernel to kill it when the process that started it ends (``PR_SET_PDEATHSIG``), before it
serves anything; then it points ``PREFECT_API_URL`` at it, so Prefect starts none of its own. A normal
end or an exception stops it as Prefect stops its own (SIGTERM at exit, after Prefect's log and
event workers have drained); SIGTERM or SIGKILL of the flow's process kills it with that process.

    python -m flows.local_server PARENT_PID FD   (started by ``ensure_api``, not by hand)
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
TEMPORARY_API = "GPT_TEMPORARY_PREFECT_API"     # the API address ensure_api started, for this process's own use
STOP_TIMEOUT_S = 5.0


def ensure_api() -> str | None:
    """Start a temporary server and point this process (and its children) at it, unless
    ``PREFECT_API_URL`` is set or Prefect's ephemeral mode is off; returns its API address, or None."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        server = subprocess.Popen([sys.executable, "-m", "flows.local_server", str(os.getpid()), str(sock.fileno())],
                                  pass_fds=[sock.fileno()], env=env, start_new_session=True)  # not the terminal's Ctrl-C
    atexit.register(_stop, server)
    print(f"Started a temporary Prefect server for this run at {url} (it ends with the run; "
          "set PREFECT_API_URL to use your own)", file=sys.stderr, flush=True)
    _wait_healthy(server, url, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    os.environ["PREFECT_API_URL"] = url
    os.environ[TEMPORARY_API] = url
    refresh_global_settings_context()
    return url


def lasting_api() -> str | None:
    """The Prefect API this process reports to, unless it is a temporary server (ensure_api's, or
    Prefect's own): links to it would be dead once the run ends."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    return url if url and url != os.environ.get(TEMPORARY_API) else None


class ServerDied(RuntimeError):
    """The temporary server ended before it answered; the message says what to do."""


def _wait_healthy(server: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Until the server answers, for as long as it lives: a busy machine may take long to start it
    (said every ``timeout_s``), a server that dies is said in one line."""
    import httpx

    started = next_note = time.monotonic()
    with httpx.Client(timeout=10) as client:
        while True:
            if server.poll() is not None:
                raise ServerDied(f"the temporary Prefect server exited with code {server.returncode} before it "
                                 "answered (its output is above): run again, or set PREFECT_API_URL to a running "
                                 "server (prefect server start)")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > next_note + timeout_s:
                next_note = time.monotonic()
                print(f"the temporary Prefect server is still starting ({next_note - started:.0f} s): waiting for it",
                      file=sys.stderr, flush=True)
            time.sleep(0.1)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (its whole process:
    ``ensure_api`` runs on the main thread); exit at once if that already happened."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        sys.exit(0)


def main(argv: list[str]) -> None:
    parent, fd = int(argv[0]), int(argv[1])
    if sys.platform.startswith("linux"):
        _die_with(parent)
    import uvicorn
    from prefect.server.api.server import create_app

    app = create_app(ephemeral=True, final=True)
    uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on")).run(sockets=[socket.socket(fileno=fd)])


if __name__ == "__main__":
    main(sys.argv[1:])
