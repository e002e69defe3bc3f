"""Shared test setup. Fixture modules per area live in tests/fixtures_*.py."""
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The temporary Prefect server of a flow run from the command line may start slowly while other
# tests keep the cores busy.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# `pytest -n auto` runs one worker per core: each process (the worker, its flows, its jobs' ranks)
# computes on one thread, where torch's default of every core would have them wait on each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
WORKER = os.environ.get("PYTEST_XDIST_WORKER")       # set under `pytest -n N`
if WORKER:                                           # each worker's flows keep their own Prefect database
    os.environ.setdefault("PREFECT_HOME", os.path.join(tempfile.gettempdir(), f"prefect-{WORKER}"))
# What the operator allows runs to read and write (flows.plan.boundary): the checkout and the temporary
# folders tests work in. Tests of the boundary itself set their own.
_ALLOWED = f"{ROOT}:{tempfile.gettempdir()}"
os.environ.setdefault("GPT_INPUT_ROOTS", _ALLOWED)
os.environ.setdefault("GPT_OUTPUT_ROOTS", _ALLOWED)

pytest_plugins = [f"tests.{p.stem}" for p in sorted((ROOT / "tests").glob("fixtures_*.py"))]

# Tiers: e2e (marked by its modules), integration (real servers: the local SLURM cluster, the S3
# server, a Prefect server the test starts or shares), unit (everything else).
SERVER_FIXTURES = {"prefect_harness", "prefect_server", "own_prefect_server", "prefect_server_on_postgres", "s3_server", "own_s3_server", "slurm_cluster"}


@pytest.hookimpl(tryfirst=True)     # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))
        if item.get_closest_marker("e2e"):
            continue
        servers = SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slurm") \
            or item.get_closest_marker("integration")
        if not servers:
            item.add_marker("unit")
        elif not item.get_closest_marker("integration"):
            item.add_marker("integration")
    # The longest groups first, so that none is left for the tail: the SLURM cluster's, then the
    # others by the time limits their tests declare (a test that says nothing takes seconds).
    weight: dict[str, float] = {}
    for item in items:
        limit = item.get_closest_marker("timeout")
        weight[_worker_group(item)] = weight.get(_worker_group(item), 0.0) + (limit.args[0] if limit and limit.args else 5)
    items.sort(key=lambda item: (_worker_group(item) != "slurm", -weight[_worker_group(item)]))


def _worker_group(item) -> str:
    """Which tests `pytest -n N` (pyproject: --dist loadgroup) runs on one worker, one after another:
    those of the local SLURM cluster, as it is one per machine and some of them take its nodes down;
    otherwise a module's tests, so that its module fixtures are built once."""
    if "slurm_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slurm"):
        return "slurm"
    return item.module.__name__


@pytest.hookimpl(hookwrapper=True, tryfirst=True)    # outside pytest-timeout's: waiting is not the test's time
def pytest_runtest_protocol(item):
    """Under `pytest -n N`, a test marked `alone` (it compares timings) runs while no other test
    does: it takes the machine exclusively, every other test shares it. The turnstile keeps tests
    that start later from overtaking an `alone` test that waits. A test's time limit starts once it
    holds its share, so the minutes another test runs alone are not counted against it."""
    if not WORKER:
        yield
        return
    folder = Path(tempfile.gettempdir())
    with open(folder / "gpt-tests-turnstile.lock", "a") as turnstile, open(folder / "gpt-tests-machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        alone = item.get_closest_marker("alone") is not None
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
