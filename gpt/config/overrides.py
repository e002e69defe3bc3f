"""``KEY=VALUE`` overrides typed by the field they name: the one reading of ``--set`` (gpt.train,
gpt.memory, the pretrain command line) and of ``--cluster-set``."""
from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from gpt.config import Config

_NULL = ("", "null", "none", "~")


def split_assignment(text: str) -> tuple[str, str | None]:
    """``name=value`` as (name, value); (text, None) where there is no ``=``. The one reading of an
    assignment: ``--set KEY=VALUE``, ``--cluster-set``, and long options written ``--flag=value``."""
    name, sep, value = text.partition("=")
    return (name, value) if sep else (text, None)


def parse_overrides(items: Iterable[str], fields: Mapping[str, Any] | None = None,
                    flag: str = "--set") -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """``KEY=VALUE`` texts (``--set lr=3e-4``) as values typed by their field: a number for a numeric
    field, true or false for a boolean, the text for a text field, JSON for a list or a mapping,
    ``null`` (or nothing) for an optional one. ``fields`` maps names to types (default: Config's).
    A name that is no field keeps its text, for the checks that list unknown fields. Returns the
    values and the problems as (field, message) pairs; the message names ``flag``."""
    fields = config_field_types() if fields is None else fields
    values: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for item in items:
        key, text = split_assignment(item)
        key = key.strip()
        if text is None or not key:
            problems.append(("", f"{flag} {item!r}: expected KEY=VALUE"))
            continue
        try:
            values[key] = typed_value(text, fields[key]) if key in fields else text
        except ValueError as e:
            problems.append((key, f"{key}={text!r}: {e}"))
    return values, problems


def typed_value(text: str, kind: Any) -> Any:
    """``text`` as a value of type ``kind``; ValueError says what was expected."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in _NULL:
            return None
        (kind, *rest) = [a for a in args if a is not type(None)]
        if rest:
            return text
    if kind is bool:
        try:
            return {"true": True, "false": False}[text.strip().lower()]
        except KeyError:
            raise ValueError("expected true or false") from None
    if kind in (int, float):
        try:
            number = float(text)
        except ValueError:
            raise ValueError("expected a whole number" if kind is int else "expected a number") from None
        if not math.isfinite(number):
            raise ValueError("must be a finite number")
        if kind is int and number != int(number):
            raise ValueError("expected a whole number")
        return int(number) if kind is int else number
    if typing.get_origin(kind) in (list, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"expected JSON ({e.msg})") from None
        if not isinstance(value, typing.get_origin(kind)):
            raise ValueError(f"expected a JSON {'list' if typing.get_origin(kind) is list else 'object'}")
        return value
    return text


def config_field_types() -> dict[str, Any]:
    """Config's fields by name, with their types."""
    return typing.get_type_hints(Config)

