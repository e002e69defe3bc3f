"""Shared test setup. Fixture modules per area live in tests/fixtures_*.py."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins = [f"tests.{p.stem}" for p in sorted((ROOT / "tests").glob("fixtures_*.py"))]
