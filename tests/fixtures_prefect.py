"""A real Prefect server (SQLite, its own PREFECT_HOME) for end-to-end tests.

`prefect_server` starts `prefect server start` on a free loopback port once per test session and
yields a `PrefectServer` whose `env` points subprocesses (the CLI, `deployments/serve.py`) at it.
`own_prefect_server` (test scope) is a `RestartablePrefectServer`, a server of the test's own that
it may stop and start again on the same port and database. `prefect_server_on_postgres` (test scope)
keeps its database in a PostgreSQL cluster of its own, as a lasting server with automations should:
on SQLite, Prefect's trigger service can drop an event's evaluation in a burst of writes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from gpt.parallel.process_group import free_port


@dataclass
class PrefectServer:
    url: str                      # UI root, e.g. http://127.0.0.1:4321
    api_url: str                  # url + "/api"
    home: Path                    # PREFECT_HOME of the server and of clients using `env`
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def api(self, path: str, body: dict | None = None, method: str | None = None, attempts: int = 10) -> object:
        """JSON from the REST API: GET without a body, POST with one (e.g. "/artifacts/filter"). A 503
        is the server's "retry": its SQLite database was busy (flows writing to it at the same time),
        and it is retried as Prefect's own client retries it."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.api_url}{path}", data=data, method=method or ("POST" if data else "GET"),
                                     headers={"Content-Type": "application/json"})
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return json.loads(r.read() or b"null")
            except urllib.error.HTTPError as e:
                if e.code != 503 or attempt == attempts - 1:
                    raise
                time.sleep(1 + attempt)

    def flow_run(self, run_id: str) -> dict:
        return self.api(f"/flow_runs/{run_id}")

    def task_runs(self, run_id: str) -> list[dict]:
        return self.api("/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})

    def artifacts(self, run_id: str) -> list[dict]:
        return self.api("/artifacts/filter", {"flow_runs": {"id": {"any_": [run_id]}}})

    def cli(self, *args: str, timeout: float = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run `prefect ARGS` against this server; output captured as text."""
        return subprocess.run(
            [sys.executable, "-m", "prefect", *args], env=self.env, cwd=cwd,
            capture_output=True, text=True, timeout=timeout,
        )


def prefect_env(home: Path, api_url: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
    })
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def wait_healthy(api_url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {log}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {timeout}s; see {log}")


def start_server(home: Path, port: int | None = None, database_url: str | None = None) -> tuple[PrefectServer, subprocess.Popen]:
    """A server with its database in `home` (or at `database_url`), on `port` (a free one when None)."""
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "server.log"
    env = prefect_env(home, None)
    env["PREFECT_UI_API_URL"] = f"{url}/api"
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    wait_healthy(f"{url}/api", proc, log)
    return PrefectServer(url=url, api_url=f"{url}/api", home=home, log=log,
                         env=prefect_env(home, f"{url}/api")), proc


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
    """Stop a process group started with start_new_session: `sig` first, SIGKILL after `timeout`."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """Flows run in the test's own process report to one temporary Prefect server (SQLite) that
    every such test of the session shares; tests tell their runs apart by their ids."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    server, proc = start_server(tmp_path_factory.mktemp("prefect-home"))
    try:
        yield server
    finally:
        stop(proc)


POSTGRES_BIN = Path("/usr/lib/postgresql")


def start_postgres(data: Path) -> tuple[str, subprocess.Popen]:
    """A PostgreSQL cluster in `data` (an empty folder outside pytest's private temporary folders,
    which the `postgres` user cannot reach), run as that user on a free loopback port: its
    SQLAlchemy URL for Prefect and its process."""
    versions = sorted(POSTGRES_BIN.glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not versions:
        raise RuntimeError("PostgreSQL not found: apt-get install postgresql (scripts/install does)")
    bin_dir = versions[-1].parent
    as_postgres = []
    if os.geteuid() == 0:               # PostgreSQL refuses to run as root
        shutil.chown(data, "postgres", "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_postgres, bin_dir / "initdb", "-D", data / "db", "--auth=trust", "-U", "postgres"],
                   check=True, capture_output=True, timeout=120)
    port = free_port()
    proc = subprocess.Popen([*as_postgres, bin_dir / "postgres", "-D", data / "db", "-p", str(port),
                             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={data}"],
                            stdout=open(data / "postgres.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run([bin_dir / "pg_isready", "-h", "127.0.0.1", "-p", str(port)], capture_output=True).returncode:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL did not start; see {data / 'postgres.log'}")
        time.sleep(0.2)
    return f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres", proc


@pytest.fixture
def prefect_server_on_postgres(tmp_path: Path) -> Iterator[PrefectServer]:
    """A Prefect server of this test's own whose database is PostgreSQL."""
    data = Path(tempfile.mkdtemp(prefix="prefect-postgres-"))
    try:
        database_url, postgres = start_postgres(data)
        try:
            server, proc = start_server(tmp_path / "prefect-home", database_url=database_url)
            try:
                yield server
            finally:
                stop(proc)
        finally:
            stop(postgres)
    finally:
        shutil.rmtree(data, ignore_errors=True)


class RestartablePrefectServer:
    """A server that can be stopped (SIGKILL: a crash) and started again on its port and database."""

    def __init__(self, home: Path) -> None:
        self.server, self.proc = start_server(home)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop(self.proc, sig)

    def start(self) -> None:
        if self.proc.poll() is None:
            raise RuntimeError(f"the Prefect server on {self.server.url} is still running")
        port = int(self.server.url.rsplit(":", 1)[1])
        self.server, self.proc = start_server(self.server.home, port)


@pytest.fixture
def own_prefect_server(tmp_path: Path) -> Iterator[RestartablePrefectServer]:
    """A Prefect server of this test's own, which it may stop and start again."""
    restartable = RestartablePrefectServer(tmp_path / "prefect-home")
    try:
        yield restartable
    finally:
        restartable.stop()


def screenshot(url: str, path: Path, *, wait_ms: int = 8000, size: str = "1400,1600") -> Path:
    """Open `url` in headless Debian chromium and save a PNG screenshot to `path`."""
    chromium = next((c for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)
    if chromium is None:
        raise RuntimeError("chromium not found: apt-get install chromium (scripts/install does)")
    path.unlink(missing_ok=True)  # a screenshot left from an earlier run must not pass for this one
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--disable-background-networking", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={size}",
               f"--virtual-time-budget={wait_ms}", f"--screenshot={path}", url]
        subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if not path.exists() or path.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot for {url}: {' '.join(cmd)}")
    return path
