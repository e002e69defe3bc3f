"""A run folder's records read back: each is checked against its schema and its ranges when read,
and a damaged one is refused in one line that names the file, the field and what to do, before
anything acts on it (a negative sample id in skipped.json would put a rolled-back sample back into
the order; a truncated file would fail a stage later with no file named)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError


class DamagedRecord(ValueError):
    """A record of the run folder that does not hold what its writer writes."""


def read_record(path: Path, schema: Any, remedy: str, default: Any = None) -> Any:
    """The JSON ``path`` holds, checked against ``schema`` (a type pydantic validates: a model, a
    list or dict of them); ``default`` where the file is absent. ``remedy`` says what to do when it
    is damaged. The JSON is returned as written, so a record's writer keeps its own shape."""
    if not path.exists():
        return default
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DamagedRecord(f"{path}: not UTF-8 text; {remedy}") from None
    except json.JSONDecodeError as e:
        raise DamagedRecord(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); {remedy}") from None
    try:
        TypeAdapter(schema).validate_python(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "the top level"
        shown = json.dumps(first.get("input"), default=str)
        raise DamagedRecord(f"{path}: {field}: {first['msg'].lower()} (it holds {shown[:80]}); {remedy}") from None
    return raw


Count = Annotated[int, Field(strict=True, ge=0)]        # an iteration, a sample id, a step: never negative
Seconds = Annotated[float, Field(ge=0)]                 # a time.time() or a duration
