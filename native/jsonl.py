"""The tokenize stage's JSON lines reader in C++ (native._jsonl): the text fields of the lines it is
sure of, read with the GIL released; every other line is left to the caller."""
from __future__ import annotations

from native._jsonl import read

DOCUMENT, BLANK, DEFER = 0, 1, 2

__all__ = ["BLANK", "DEFER", "DOCUMENT", "read"]
