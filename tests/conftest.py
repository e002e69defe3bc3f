"""Shared test setup. Fixture modules per area live in tests/fixtures_*.py."""
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# What the operator allows runs to read and write (flows.boundary): the checkout and the temporary
# folders tests work in. Tests of the boundary itself set their own.
_ALLOWED = f"{ROOT}:{tempfile.gettempdir()}"
os.environ.setdefault("GPT_INPUT_ROOTS", _ALLOWED)
os.environ.setdefault("GPT_OUTPUT_ROOTS", _ALLOWED)

pytest_plugins = [f"tests.{p.stem}" for p in sorted((ROOT / "tests").glob("fixtures_*.py"))]
